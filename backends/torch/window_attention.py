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
import torch.nn.functional as F
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


_BAND_MASKS: dict[tuple, torch.Tensor] = {}


def _band_mask(T: int, p0: int, m: int, b: int, window: int, n_global: int, variant: str, heads: int,
               device: torch.device) -> torch.Tensor:
    """The ``[1, heads·nb, b, (b + w - 1) + g]`` bool mask of :func:`blocked_window_attention` for the queries at
    positions ``p0 .. p0+m-1`` of T keys in blocks of b, made once per shape. Column j < b + w - 1 of block i is
    key ``p0 + i·b - (w - 1) + j`` (masked outside ``[0, T)``), under the spec's rule; column ``b + w - 1 + c``
    is global key c, masked where the block's band already holds that key (so no pair counts twice). A padding
    row past the m queries sees its block's first key (b <= w), so no row is empty."""
    key = (T, p0, m, b, window, n_global, variant, heads, torch.device(device))
    mask = _BAND_MASKS.get(key)
    if mask is None:
        nb, L = -(-m // b), b + window - 1
        start = p0 + b * torch.arange(nb, device=device)[:, None, None]  # [nb, 1, 1]: a block's first query
        t = start + torch.arange(b, device=device)[None, :, None]  # [nb, b, 1]
        s = start - (window - 1) + torch.arange(L, device=device)[None, None, :]  # [nb, 1, L]
        band = attention_allowed(t, s, variant, window, n_global) & (s >= 0) & (s < T)
        c = torch.arange(n_global, device=device)[None, None, :]  # [1, 1, g]
        in_band = (c >= start - (window - 1)) & (c <= start + b - 1)
        glob = (c <= t) & ~in_band
        mask = torch.cat([band, glob.expand(nb, b, n_global)], dim=-1)  # [nb, b, L + g]
        mask = _BAND_MASKS[key] = mask.expand(heads, *mask.shape).reshape(1, heads * nb, b, L + n_global)
    return mask


def _blocked_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p0: int, variant: str, window: int,
                  g: int, dropout_p: float) -> torch.Tensor:
    """:func:`blocked_window_attention` of queries ``q [B, H, m, hd]`` at the consecutive positions ``p0 ..``."""
    B, H, m, hd = q.shape
    T = k.shape[2]
    b = max(1, min(window, m))
    nb, L = -(-m // b), b + window - 1
    pad_q = nb * b - m
    qb = F.pad(q, (0, 0, 0, pad_q)).reshape(B, H * nb, b, hd)

    def band(x: torch.Tensor) -> torch.Tensor:
        # Key u of the padded tensor is position u - (w - 1); block i's band starts at padded p0 + i·b.
        xp = F.pad(x, (0, 0, window - 1, max(0, p0 + nb * b - T)))
        bands = xp[:, :, p0: p0 + (nb - 1) * b + L].unfold(2, L, b).transpose(-1, -2)  # [B, H, nb, L, hd]
        if g:
            bands = torch.cat([bands, x[:, :, None, :g].expand(B, H, nb, g, hd)], dim=3)
        return bands.reshape(B, H * nb, L + g, hd)

    mask = _band_mask(T, p0, m, b, window, g, variant, H, q.device)
    o = F.scaled_dot_product_attention(qb, band(k), band(v), attn_mask=mask, dropout_p=dropout_p)
    return o.reshape(B, H, nb * b, hd)[:, :, :m]


def blocked_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, window: int,
                             n_global: int, dropout_p: float = 0.0, *,
                             rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Windowed softmax attention ``[B, H, T, hd] x 3 -> [B, H, T, hd]`` (scale ``1/√hd``) as a blocked band
    through ``scaled_dot_product_attention``: queries in blocks of b = min(w, T) positions, each block against
    its window's ``b + w - 1`` keys (a strided view of the keys, no gather) and the g global keys, under the
    spec's rule (:func:`_band_mask`). ``O(T·(b + w + g))`` work, no ``[T, T]`` array, and SDPA's fused kernels
    with its own dropout on the attention weights, as the masked path's. ``model.attention_impl=blocked``
    (docs/KERNELS.md, "Windowed attention").

    ``rows``: q holds only those M rows of the T keys (:func:`pcaf_core.reference.layer_rows`): its first
    ``first`` and last ``last`` rows, each a run of consecutive positions computed on its own, ``-> [B, H, M,
    hd]``.
    """
    if variant not in WINDOWED_VARIANTS:
        raise ValueError(f"blocked_window_attention computes {list(WINDOWED_VARIANTS)}, not {variant!r}")
    T, M = k.shape[2], q.shape[2]
    m, first, offset = query_shape(T, rows)
    if m != M:
        raise ValueError(f"q has {M} rows, but rows={rows} of {T} keys are {m}")
    g = min(n_global_keys(variant, n_global), T)
    if rows is None or first == 0:
        return _blocked_part(q, k, v, offset, variant, window, g, dropout_p)
    parts = [_blocked_part(q[:, :, :first], k, v, 0, variant, window, g, dropout_p)]
    if M > first:
        parts.append(_blocked_part(q[:, :, first:], k, v, first + offset, variant, window, g, dropout_p))
    return torch.cat(parts, dim=2)
