"""Softmax attention without the ``[T, T]`` work it does not need: the masked form every variant reduces to
(:func:`attention`), dense causal attention in query blocks (:func:`causal_attention_in_blocks`), and windowed
attention (``transformer_local``, ``transformer_global_local``) as a blocked band (:func:`banded_attention`).

The band: the spec's rule (:func:`pcaf_core.reference.attention_allowed`: key s visible to query t when
``s <= t ∧ (t-s < w ∨ s < g)``) without a ``[T, T]`` array: queries go in blocks of b positions, and block i
is multiplied by its own key block and the ``c = ceil((w-1)/b)`` blocks before it (every key within w of a
query of the block, one batched GEMM), plus the g global keys for global-local. The scores of one block are
``[b, (c+1)·b + g]``, so the work is ``O(T·(w + b + g))`` instead of ``O(T²)``; the same idea as the routing's
banded products (:func:`backends.jax.ops.banded_dot`) and the torch backend's FlexAttention block mask
(:mod:`backends.torch.window_attention`). This is ``model.attention_impl=banded`` (docs/KERNELS.md,
"Windowed attention").

A global key that also lies in the window is read in the band and masked among the global columns, so no pair
is counted twice; padding past T and before position 0 is masked. Dropout, when given, acts on the band's
attention weights, as on the masked path's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pcaf_core.config import WINDOWED_VARIANTS
from pcaf_core.reference import attention_allowed


def attention_mask(seq_len: int, variant: str, window: int, n_global: int) -> jax.Array:
    """See :func:`pcaf_core.reference.attention_mask`; traced, so XLA builds it rather than embedding a constant."""
    pos = jnp.arange(seq_len)
    return attention_allowed(pos[:, None], pos[None, :], variant, window, n_global)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, drop: Callable[[jax.Array], jax.Array] | None = None
) -> jax.Array:
    """The softmax attention of :func:`pcaf_core.reference.attention` on split heads: q, k, v ``[B, T, H, hd]``;
    mask ``[T, T]`` bool -> ``[B, T, H, hd]`` (M query rows: q ``[B, M, H, hd]``, mask ``[M, T]``,
    ``-> [B, M, H, hd]``).

    Logits and softmax in at least float32 (exact float64 when the inputs are float64, unlike
    ``jax.nn.dot_product_attention``, whose softmax is always float32); ``drop`` acts on the weights.
    """
    work = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=work) / math.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    if drop is not None:
        probs = drop(probs)
    return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v)


CAUSAL_BLOCK = 128
"""Query rows per block of :func:`causal_attention_in_blocks` (dense attention over more rows than this runs in
blocks): the torch backend's block size; on JAX only 128 was timed (docs/KERNELS.md)."""


def causal_attention_in_blocks(q: jax.Array, k: jax.Array, v: jax.Array,
                               drop: Callable[[jax.Array], jax.Array] | None = None, *,
                               block: int = CAUSAL_BLOCK) -> jax.Array:
    """Causal softmax attention (``transformer_dense``), q, k, v ``[B, T, H, hd]`` -> ``[B, T, H, hd]``, as
    :func:`attention` over query blocks of ``block`` rows (static), each against the keys up to its last row under
    its rows of the causal mask: ``(T + block) / 2T`` of the ``[T, T]`` scores, and never the whole array at once.
    The same values as :func:`attention` up to float rounding; ``drop`` draws each block's weights on its own,
    which leaves every weight's distribution as it was (the torch backend's ``causal_attention_in_blocks``)."""
    T = q.shape[1]
    if T <= block:
        return attention(q, k, v, attention_mask(T, "transformer_dense", 0, 0), drop)
    parts = []
    for start in range(0, T, block):
        end = min(T, start + block)
        rows = attention_allowed(jnp.arange(start, end)[:, None], jnp.arange(end)[None, :], "transformer_dense", 0, 0)
        parts.append(attention(q[:, start:end], k[:, :end], v[:, :end], rows, drop))
    return jnp.concatenate(parts, axis=1)


def band_block(window: int, seq_len: int) -> int:
    """The query block b: the window (a block and the one before it then cover every visible local key), at
    most T."""
    return max(1, min(window, seq_len))


def banded_attention(q: jax.Array, k: jax.Array, v: jax.Array, variant: str, window: int, n_global: int,
                     drop: Callable[[jax.Array], jax.Array] | None = None, *, block: int | None = None,
                     rows: tuple[int, int] | None = None) -> jax.Array:
    """Windowed softmax attention. q, k, v ``[B, T, H, hd]`` -> ``[B, T, H, hd]``, scale ``1/√hd``.

    Logits and softmax in at least float32 (float64 inputs stay float64), as the masked path
    (:func:`attention`); ``drop`` acts on the weights. ``block``: b (static; default
    :func:`band_block`). ``rows`` (static): only those M query rows of the T (:func:`pcaf_core.reference.layer_rows`:
    the first ``first`` and the last ``last``), ``-> [B, M, H, hd]``; q still holds all T rows. Each of the two runs
    of consecutive positions is banded on its own, so a next-token layer computes the rows the layers above read
    and no others.
    """
    if variant not in WINDOWED_VARIANTS:
        raise ValueError(f"banded_attention computes {list(WINDOWED_VARIANTS)}, not {variant!r}")
    T = q.shape[1]
    if rows is None:
        return _band(q, k, v, 0, variant, window, n_global, drop, block)
    first, last = rows
    parts = [_band(q[:, :first], k, v, 0, variant, window, n_global, drop, block)] if first else []
    if last:
        parts.append(_band(q[:, T - last:], k, v, T - last, variant, window, n_global, drop, block))
    return jnp.concatenate(parts, axis=1)


def _band(q: jax.Array, k: jax.Array, v: jax.Array, p0: int, variant: str, window: int, n_global: int,
          drop: Callable[[jax.Array], jax.Array] | None, block: int | None) -> jax.Array:
    """:func:`banded_attention` of the queries ``q [B, m, H, hd]`` at the consecutive positions ``p0 .. p0+m-1`` (static
    p0) over all T keys, ``-> [B, m, H, hd]``."""
    B, m, H, hd = q.shape
    T = k.shape[1]
    b = band_block(window, m) if block is None else block
    nb = -(-m // b)
    # Key blocks before a query's own: enough to reach w - 1 back, and never more than reach position 0 from the
    # last block (its first query is at p0 + (nb-1)·b).
    c = min(-(-(window - 1) // b), -(-p0 // b) + nb - 1)
    g = min(n_global, T) if variant == "transformer_global_local" else 0
    work = jnp.promote_types(q.dtype, jnp.float32)
    scale = 1.0 / math.sqrt(hd)

    qb = jnp.pad(q, ((0, 0), (0, nb * b - m), (0, 0), (0, 0))).reshape(B, nb, b, H, hd)

    def key_band(x: jax.Array) -> jax.Array:
        """``[B, T, H, hd] -> [B, nb, (c+1)·b, H, hd]``: block i's keys are positions ``p0 + (i-c)·b .. p0 +
        (i+1)·b - 1`` (x padded with c·b zero rows first, so they start at padded row p0 + i·b)."""
        back = max(0, p0 + nb * b - T)
        xp = jnp.pad(x, ((0, 0), (c * b, back), (0, 0), (0, 0)))[:, p0: p0 + (nb + c) * b]
        blocks = xp.reshape(B, nb + c, b, H, hd)
        return jnp.concatenate([blocks[:, j: j + nb] for j in range(c + 1)], axis=2)

    t = p0 + (jnp.arange(nb)[:, None] * b + jnp.arange(b)[None, :])[:, :, None]  # [nb, b, 1] query positions
    s = p0 + ((jnp.arange(nb)[:, None] - c) * b + jnp.arange((c + 1) * b)[None, :])[:, None, :]  # [nb, 1, (c+1)b]
    in_band = (s >= 0) & attention_allowed(t, s, "transformer_local", window, 0)  # [nb, b, (c+1)b]
    logits = jnp.einsum("bnqhd,bnkhd->bhnqk", qb, key_band(k), preferred_element_type=work) * scale
    logits = jnp.where(in_band, logits, -jnp.inf)
    if g:
        sg = jnp.arange(g)[None, None, :]
        # Global keys outside the window: the ones inside it are already band columns.
        outside = attention_allowed(t, sg, variant, window, n_global) & ~attention_allowed(
            t, sg, "transformer_local", window, 0)  # [nb, b, g]
        glog = jnp.einsum("bnqhd,bkhd->bhnqk", qb, k[:, :g], preferred_element_type=work) * scale
        logits = jnp.concatenate([logits, jnp.where(outside, glog, -jnp.inf)], axis=-1)
    # Every query sees itself (padded queries past the run too: their own key, zero past T), so no row is empty.
    probs = jax.nn.softmax(logits, axis=-1)
    if drop is not None:
        probs = drop(probs)
    probs = probs.astype(v.dtype)
    width = (c + 1) * b
    out = jnp.einsum("bhnqk,bnkhd->bnqhd", probs[..., :width], key_band(v))
    if g:
        out = out + jnp.einsum("bhnqk,bkhd->bnqhd", probs[..., width:], v[:, :g])
    return out.reshape(B, nb * b, H, hd)[:, :m]
