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

FLEX_BLOCK = 128
"""FlexAttention's default block size, which :func:`window_block_mask` uses: a query block is this many rows."""

NO_BACKWARD_DEVICES = ("cpu", "mps")
"""Device types where FlexAttention has no backward pass (torch refuses inputs that require grad there)."""


def n_global_keys(variant: str, n_global: int) -> int:
    """g: the global keys of ``variant`` (global-local only; the local variant has none)."""
    return n_global if variant == "transformer_global_local" else 0


def window_scalars(window: int, n_global: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """w and g as 0-d int32 tensors on ``device``, made once. The masks read them as tensors, not Python ints, so
    that Dynamo does not specialise on their values: every w and g (local is g = 0) share the compiled kernels of
    a shape and dtype, which keeps a process within Dynamo's recompile limit (:func:`compiled_flex_attention`)."""
    key = (window, n_global, torch.device(device))
    if key not in _SCALARS:
        _SCALARS[key] = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (window, n_global))
    return _SCALARS[key]


def query_key_row(q_idx: torch.Tensor, first: int, offset: int) -> torch.Tensor:
    """The key row of query row ``q_idx`` when the queries are the rows ``(first, last)`` of
    :func:`pcaf_core.reference.layer_rows` of n key rows: the first ``first`` rows are themselves, the others
    ``offset = n - m`` rows further on (m query rows). ``offset = 0``: the queries are every row."""
    return q_idx if offset == 0 else torch.where(q_idx < first, q_idx, q_idx + offset)


def window_mask_mod(window: int | torch.Tensor, n_global: int | torch.Tensor, first: int = 0,
                    offset: int = 0) -> Callable:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: the spec's rule, global-local with g global keys (the local
    variant is g = 0), for query rows mapped by :func:`query_key_row`."""

    def mask_mod(b, h, q_idx, kv_idx):
        t = query_key_row(q_idx, first, offset)
        return attention_allowed(t, kv_idx, "transformer_global_local", window, n_global)

    return mask_mod


def window_block_mask(seq_len: int, window: int, n_global: int, device: torch.device,
                      rows: tuple[int, int] | None = None) -> BlockMask:
    """The ``BlockMask`` of window w with g global keys (:func:`n_global_keys`) at length T on ``device``
    (128-position blocks, FlexAttention's default), built once per (T, w, g, device, rows) and kept: it depends
    on nothing else. ``rows``: the queries are those rows of the T keys (:func:`pcaf_core.reference.layer_rows`)."""
    key = (seq_len, window, n_global, torch.device(device), rows)
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        m, first, offset = query_shape(seq_len, rows)
        mask = _BLOCK_MASKS[key] = create_block_mask(
            window_mask_mod(*window_scalars(window, n_global, device), first, offset),
            None, None, m, seq_len, device=device)
    return mask


def query_shape(seq_len: int, rows: tuple[int, int] | None) -> tuple[int, int, int]:
    """``(m, first, offset)`` of query rows ``rows`` of ``seq_len`` keys (:func:`query_key_row`)."""
    if rows is None:
        return seq_len, 0, 0
    first, last = rows
    return first + last, first, seq_len - first - last


_COMPILED_FLEX: list[Callable] = []


def compiled_flex_attention() -> Callable:
    """``torch.compile(flex_attention)``, made once: the fused kernels (eager FlexAttention materialises every
    score). Inside a compiled training step (``train.compile=on``) Dynamo traces through it into the step's graph.
    A list, not ``functools.cache``: Dynamo warns on cache wrappers it traces through."""
    if not _COMPILED_FLEX:
        # Dynamo keeps one graph per shape, grad mode and score_mod. A next-token step over the layers' rows
        # (pcaf_core.reference.nt_attention_rows) has a shape per layer: with dropout's two calls and the
        # evaluation's one, 4 layers make 12 graphs, past the default limit of 8, above which FlexAttention would
        # run eagerly (every score built).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


def draw_keep(shape: tuple[int, int, int], window: int, n_global: int, p: float,
              device: torch.device, keys: int | None = None) -> torch.Tensor:
    """Dropout's keep mask ``[B, H, M, min(w, T) + g]`` bool (True with probability 1-p) of M queries over T keys
    (``keys``; default M): entry j < min(w, T) of query t belongs to key ``t - j``, entry ``min(w, T) + s`` to
    global key s (read by :func:`keep_index`)."""
    B, H, M = shape
    return torch.rand(B, H, M, min(window, M if keys is None else keys) + n_global, device=device) >= p


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
                          keep: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Windowed softmax attention ``[B, H, T, hd] x 3 -> [B, H, T, hd]`` (scale ``1/√hd``) over the
    :func:`window_block_mask` of ``variant``'s w and g; ``dropout_p`` drops attention weights (module docstring).

    ``rows``: q holds only those M rows of the T keys (:func:`pcaf_core.reference.layer_rows`), ``-> [B, H, M,
    hd]``. ``compiled``: the fused kernels of :func:`compiled_flex_attention` (False: FlexAttention's eager
    reference implementation, which builds every score: for tests). ``keep``: a given :func:`draw_keep` mask
    instead of a fresh draw (tests).
    """
    if variant not in WINDOWED_VARIANTS:
        raise ValueError(f"flex_window_attention computes {list(WINDOWED_VARIANTS)}, not {variant!r}")
    if (q.device.type in NO_BACKWARD_DEVICES and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        raise ValueError(f"model.attention_impl=banded uses FlexAttention, which has no backward pass on "
                         f"{q.device.type} (torch {torch.__version__}): train with model.attention_impl=masked "
                         "(or auto) there")
    B, H, M, _ = q.shape
    T = k.shape[2]
    m, first, offset = query_shape(T, rows)
    if m != M:
        raise ValueError(f"q has {M} rows, but rows={rows} of {T} keys are {m}")
    g = n_global_keys(variant, n_global)
    block_mask = window_block_mask(T, window, g, q.device, rows)
    attend = compiled_flex_attention() if compiled else flex_attention
    if dropout_p == 0.0:
        return attend(q, k, v, block_mask=block_mask)
    if keep is None:
        keep = draw_keep((B, H, M), window, g, dropout_p, q.device, keys=T)
    w_t, g_t = window_scalars(window, g, q.device)
    cols = keep.shape[-1] - g  # min(w, T): a Python int, like T itself a shape Dynamo specialises on

    def drop_scores(score, b, h, q_idx, kv_idx):
        t = query_key_row(q_idx, first, offset)
        return torch.where(keep[b, h, q_idx, keep_index(t, kv_idx, w_t, cols, g_t)], score, -float("inf"))

    lse_request = AuxRequest(lse=True)
    kept, kept_aux = attend(q, k, v, score_mod=drop_scores, block_mask=block_mask, return_aux=lse_request)
    full, full_aux = attend(q, k, v, block_mask=block_mask, return_aux=lse_request)
    factor = torch.exp(kept_aux.lse - full_aux.lse) / (1.0 - dropout_p)  # 0 where every key was dropped
    # `+ 0 * full` changes no value (every query sees itself, so `full` is finite) and no gradient. It is there
    # because a discarded output reaches FlexAttention's backward as a missing output gradient, which inductor's
    # lowering of that backward (torch 2.11, CUDA) cannot take: a compiled step (train.compile=on) would fail.
    return kept * factor.unsqueeze(-1).to(kept.dtype) + 0 * full
