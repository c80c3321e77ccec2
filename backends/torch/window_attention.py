"""Windowed softmax attention (``transformer_local``, ``transformer_global_local``) with FlexAttention.

The spec's rule (:func:`pcaf_core.reference.attention_allowed`: key s visible to query t when
``s <= t ∧ (t-s < w ∨ s < g)``) as the ``mask_mod`` of a ``BlockMask``: FlexAttention
(``torch.nn.attention.flex_attention``) then computes only the key blocks of each query block that hold a
visible key (its own block, the blocks ``w`` positions back, and for global-local the first block(s) holding
the g global keys), compiled into fused kernels by ``torch.compile``. No ``[T, T]`` score or mask array
exists. This is ``model.attention_impl=banded`` in the torch backend (docs/KERNELS.md, "Windowed attention").

Attention dropout. FlexAttention has no dropout, and the reference drops the attention *weights*
(``p_ts·m_ts/(1-p)`` after the softmax, m Bernoulli(1-p)). A ``score_mod`` that sends dropped scores to -inf
gives the softmax over the kept keys only, ``o' = Σ_s e^{x_s} m_s v_s / Z'`` with ``Z' = Σ_s e^{x_s} m_s``;
the dropped-weight output is ``Σ_s e^{x_s} m_s v_s / ((1-p) Z) = o' · exp(lse' - lse) / (1-p)``, with ``lse``
the log-normaliser of the full row. So a training step with dropout runs two FlexAttention calls (kept keys
with their ``lse'``, and the plain row for its ``lse``), both differentiable through their log-sum-exp; a row
whose keys are all dropped has ``lse' = -inf`` and gives 0, as dropout does. The masks come from the global
generator (``torch.rand``), one per (batch, head, query, visible offset): ``[B, H, T, min(w, T) + g]`` bools.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from pcaf_core.config import WINDOWED_VARIANTS
from pcaf_core.reference import attention_allowed

_BLOCK_MASKS: dict[tuple, BlockMask] = {}
_SCALARS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

NO_BACKWARD_DEVICES = ("cpu", "mps")
"""Device types where FlexAttention has no backward pass (torch refuses inputs that require grad there)."""


def n_global_keys(variant: str, n_global: int) -> int:
    """g: the global keys of ``variant`` (global-local only; the local variant has none)."""
    return n_global if variant == "transformer_global_local" else 0


def window_scalars(window: int, n_global: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """w and g as 0-d int32 tensors on ``device``, made once. The masks read them as tensors, not Python ints, so
    that Dynamo does not specialise on their values: every w and g (local is g = 0) share the compiled kernels of
    a shape and dtype, which keeps a process within Dynamo's recompile limit (8 graphs of one function)."""
    key = (window, n_global, torch.device(device))
    if key not in _SCALARS:
        _SCALARS[key] = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (window, n_global))
    return _SCALARS[key]


def window_mask_mod(window: int | torch.Tensor, n_global: int | torch.Tensor) -> Callable:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: the spec's rule, global-local with g global keys (the local
    variant is g = 0)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return attention_allowed(q_idx, kv_idx, "transformer_global_local", window, n_global)

    return mask_mod


def window_block_mask(seq_len: int, window: int, n_global: int, device: torch.device) -> BlockMask:
    """The ``BlockMask`` of window w with g global keys (:func:`n_global_keys`) at length T on ``device``
    (128-position blocks, FlexAttention's default), built once per (T, w, g, device) and kept: it depends on
    nothing else."""
    key = (seq_len, window, n_global, torch.device(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        mask = _BLOCK_MASKS[key] = create_block_mask(window_mask_mod(*window_scalars(window, n_global, device)),
                                                     None, None, seq_len, seq_len, device=device)
    return mask


_COMPILED_FLEX: list[Callable] = []


def compiled_flex_attention() -> Callable:
    """``torch.compile(flex_attention)``, made once: the fused kernels (eager FlexAttention materialises every
    score). Inside a compiled training step (``train.compile=on``) Dynamo traces through it into the step's graph.
    A list, not ``functools.cache``: Dynamo warns on cache wrappers it traces through."""
    if not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


def draw_keep(shape: tuple[int, int, int], window: int, n_global: int, p: float,
              device: torch.device) -> torch.Tensor:
    """Dropout's keep mask ``[B, H, T, min(w, T) + g]`` bool (True with probability 1-p): entry j < min(w, T) of
    query t belongs to key ``t - j``, entry ``min(w, T) + s`` to global key s (read by :func:`keep_index`)."""
    B, H, T = shape
    return torch.rand(B, H, T, min(window, T) + n_global, device=device) >= p


def keep_index(q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int | torch.Tensor, cols: int | torch.Tensor,
               n_global: int | torch.Tensor) -> torch.Tensor:
    """The column of :func:`draw_keep`'s mask (``cols`` = min(w, T) window columns, then g global ones) that holds
    the (query, key) pair, clamped into range for the pairs that are not visible (the block mask drops those;
    their index must still be valid)."""
    lag = q_idx - kv_idx
    j = torch.where(lag < window, lag, cols + kv_idx)
    j = torch.where(j < 0, 0, j)
    last = cols + n_global - 1
    return torch.where(j > last, last, j)


def flex_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, window: int,
                          n_global: int, dropout_p: float = 0.0, *, compiled: bool = True,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
    """Windowed softmax attention ``[B, H, T, hd] x 3 -> [B, H, T, hd]`` (scale ``1/√hd``) over the
    :func:`window_block_mask` of ``variant``'s w and g; ``dropout_p`` drops attention weights (module docstring).

    ``compiled``: the fused kernels of :func:`compiled_flex_attention` (False: FlexAttention's eager reference
    implementation, which builds every score: for tests). ``keep``: a given :func:`draw_keep` mask instead of a
    fresh draw (tests).
    """
    if variant not in WINDOWED_VARIANTS:
        raise ValueError(f"flex_window_attention computes {list(WINDOWED_VARIANTS)}, not {variant!r}")
    if (q.device.type in NO_BACKWARD_DEVICES and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        raise ValueError(f"model.attention_impl=banded uses FlexAttention, which has no backward pass on "
                         f"{q.device.type} (torch {torch.__version__}): train with model.attention_impl=masked "
                         "(or auto) there")
    B, H, T, _ = q.shape
    g = n_global_keys(variant, n_global)
    block_mask = window_block_mask(T, window, g, q.device)
    attend = compiled_flex_attention() if compiled else flex_attention
    if dropout_p == 0.0:
        return attend(q, k, v, block_mask=block_mask)
    if keep is None:
        keep = draw_keep((B, H, T), window, g, dropout_p, q.device)
    w_t, g_t = window_scalars(window, g, q.device)
    cols = keep.shape[-1] - g  # min(w, T): a Python int, like T itself a shape Dynamo specialises on

    def drop_scores(score, b, h, q_idx, kv_idx):
        return torch.where(keep[b, h, q_idx, keep_index(q_idx, kv_idx, w_t, cols, g_t)], score, -float("inf"))

    lse_request = AuxRequest(lse=True)
    kept, kept_aux = attend(q, k, v, score_mod=drop_scores, block_mask=block_mask, return_aux=lse_request)
    full, full_aux = attend(q, k, v, block_mask=block_mask, return_aux=lse_request)
    factor = torch.exp(kept_aux.lse - full_aux.lse) / (1.0 - dropout_p)  # 0 where every key was dropped
    # `+ 0 * full` changes no value (every query sees itself, so `full` is finite) and no gradient. It is there
    # because a discarded output reaches FlexAttention's backward as a missing output gradient, which inductor's
    # lowering of that backward (torch 2.11, CUDA) cannot take: a compiled step (train.compile=on) would fail.
    return kept * factor.unsqueeze(-1).to(kept.dtype) + 0 * full
