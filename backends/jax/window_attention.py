"""Windowed softmax attention (``transformer_local``, ``transformer_global_local``) as a blocked band.

The spec's rule (:func:`pcaf_core.reference.attention_allowed`: key s visible to query t when
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


def band_block(window: int, seq_len: int) -> int:
    """The query block b: the window (a block and the one before it then cover every visible local key), at
    most T."""
    return max(1, min(window, seq_len))


def banded_attention(q: jax.Array, k: jax.Array, v: jax.Array, variant: str, window: int, n_global: int,
                     drop: Callable[[jax.Array], jax.Array] | None = None, *, block: int | None = None) -> jax.Array:
    """Windowed softmax attention. q, k, v ``[B, T, H, hd]`` -> ``[B, T, H, hd]``, scale ``1/√hd``.

    Logits and softmax in at least float32 (float64 inputs stay float64), as the masked path
    (:func:`backends.jax.layers.attention`); ``drop`` acts on the weights. ``block``: b (static; default
    :func:`band_block`).
    """
    if variant not in WINDOWED_VARIANTS:
        raise ValueError(f"banded_attention computes {list(WINDOWED_VARIANTS)}, not {variant!r}")
    B, T, H, hd = q.shape
    b = band_block(window, T) if block is None else block
    nb = -(-T // b)
    c = min(-(-(window - 1) // b), nb - 1)  # key blocks before a query's own that hold keys within w of it
    g = min(n_global, T) if variant == "transformer_global_local" else 0
    pad = nb * b - T
    work = jnp.promote_types(q.dtype, jnp.float32)
    scale = 1.0 / math.sqrt(hd)

    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, nb, b, H, hd)

    def key_band(x: jax.Array) -> jax.Array:
        """``[B, T, H, hd] -> [B, nb, (c+1)·b, H, hd]``: block i's keys are positions ``(i-c)·b ..
        (i+1)·b - 1`` (c zero blocks first, so block i starts at padded block i)."""
        blocks = jnp.pad(x, ((0, 0), (c * b, pad), (0, 0), (0, 0))).reshape(B, nb + c, b, H, hd)
        return jnp.concatenate([blocks[:, j: j + nb] for j in range(c + 1)], axis=2)

    t = (jnp.arange(nb)[:, None] * b + jnp.arange(b)[None, :])[:, :, None]  # [nb, b, 1] query positions
    s = ((jnp.arange(nb)[:, None] - c) * b + jnp.arange((c + 1) * b)[None, :])[:, None, :]  # [nb, 1, (c+1)b]
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
    # Every query sees itself (padded queries past T too: their own zero key), so no row is empty.
    probs = jax.nn.softmax(logits, axis=-1)
    if drop is not None:
        probs = drop(probs)
    probs = probs.astype(v.dtype)
    width = (c + 1) * b
    out = jnp.einsum("bhnqk,bnkhd->bnqhd", probs[..., :width], key_band(v))
    if g:
        out = out + jnp.einsum("bhnqk,bkhd->bnqhd", probs[..., width:], v[:, :g])
    return out.reshape(B, nb * b, H, hd)[:, :T]
