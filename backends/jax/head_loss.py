"""The head's log-probability of the target (mirrors :mod:`backends.torch.head_loss`).

The one-tile form is :meth:`backends.jax.layers.Head.target_log_prob`'s ``logit_y − logsumexp(logits)`` over
the whole ``[N, V]`` logits. :func:`chunked_target_log_softmax` computes the same values without any
``[N, V]`` array: ``[P, C]`` logit tiles (``lax.map`` over position chunks, ``lax.scan`` over vocabulary
chunks), an online log-sum-exp per row, and a custom VJP that recomputes each tile in the backward pass and
accumulates the head's gradients tile by tile, the weight's in place. docs/KERNELS.md ("Chunked head
loss") has the algorithm and its cost.

Operands follow :class:`backends.jax.layers.Dense`: ``z`` and ``w`` in the compute dtype, ``b`` in the wide
dtype (at least float32); a tile's logits are the Dense output rounded to the compute dtype and widened,
exactly what :meth:`backends.jax.layers.Head.logits` gives. Products use the default matmul precision
(``train.matmul_precision`` sets it around the step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _logits(z: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """``[n, H] @ [H, c] + [c]`` as ``Dense`` computes it, rounded to the compute dtype, widened to ``b.dtype``."""
    return (jnp.matmul(z, w, preferred_element_type=b.dtype) + b).astype(z.dtype).astype(b.dtype)


def _rows(x: jax.Array, n_p: int, P: int) -> jax.Array:
    """``x [N, ...]`` zero-padded to ``n_p·P`` rows and split into ``[n_p, P, ...]`` position chunks (padded
    rows are sliced off the results; a zero cotangent gives them no gradient). A copy of O(N·H) at most."""
    pad = [(0, n_p * P - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape(n_p, P, *x.shape[1:])


def _vocab_tiles(V: int, C: int) -> tuple[jax.Array, jax.Array]:
    """``(first, start)`` ``[nC]`` each: tile i covers columns ``[start_i, start_i + C)`` of the vocabulary and
    counts those from ``first_i = i·C`` on. The last tile starts at ``V - C`` when C does not divide V, so every
    tile is read in place from the weight (no padded copy of it); its columns below ``first_i``, already
    counted by the tile before, are masked."""
    first = jnp.arange(-(-V // C), dtype=jnp.int32) * C
    return first, jnp.minimum(first, V - C)


def _tile(z, w, b, first, start, C):
    """One tile's logits ``[P, C]`` (masked columns ``-inf``) and the mask ``[C]`` of its counted columns."""
    w_t = jax.lax.dynamic_slice_in_dim(w, start, C, axis=1)
    b_t = jax.lax.dynamic_slice_in_dim(b, start, C)
    counted = start + jnp.arange(C, dtype=jnp.int32) >= first
    return jnp.where(counted, _logits(z, w_t, b_t), -jnp.inf), counted


def _target_column(y: jax.Array, start: jax.Array, counted: jax.Array) -> jax.Array:
    """``[n, C]`` bool: the target's column, where it is one of the tile's counted columns."""
    return ((y - start)[:, None] == jnp.arange(counted.shape[0], dtype=jnp.int32)[None, :]) & counted


def _forward(z, w, b, y, position_chunk, vocab_chunk):
    N = z.shape[0]
    P, C = min(position_chunk, N), min(vocab_chunk, w.shape[1])
    n_p = -(-N // P)
    first, start = _vocab_tiles(w.shape[1], C)
    y = y.astype(jnp.int32)

    def rows(args):
        zr, yr = args  # [P, H], [P]

        def tile(carry, xs):
            top, total, target = carry
            logits, counted = _tile(zr, w, b, *xs, C)  # [P, C]
            target = target + jnp.sum(jnp.where(_target_column(yr, xs[1], counted), logits, 0.0), axis=1)
            new_top = jnp.maximum(top, jnp.max(logits, axis=1))
            # As logsumexp does: a row whose maximum is infinite shifts by 0, not by the infinity.
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            total = total * jnp.exp(top - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
            return (new_top, total, target), None

        acc = b.dtype
        init = (jnp.full(P, -jnp.inf, acc), jnp.zeros(P, acc), jnp.zeros(P, acc))
        (top, total, target), _ = jax.lax.scan(tile, init, (first, start))
        lse = jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(total)
        return target - lse, lse

    out, lse = jax.lax.map(rows, (_rows(z, n_p, P), _rows(y, n_p, P)))
    return out.reshape(-1)[:N], lse.reshape(-1)[:N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def chunked_target_log_softmax(z: jax.Array, w: jax.Array, b: jax.Array, y: jax.Array, position_chunk: int,
                               vocab_chunk: int) -> jax.Array:
    """``log_softmax(z @ w + b)[n, y_n]`` tile by tile: z ``[N, H]`` and w ``[H, V]`` in the compute dtype, b
    ``[V]`` in the wide dtype, y ``[N]`` int -> ``[N]`` in ``b.dtype``; tiles of ``position_chunk`` positions
    by ``vocab_chunk`` vocabulary entries (static ints, clipped to N and V; they need not divide them). No
    ``[N, V]`` array exists in the forward or the backward pass.

    The backward pass recomputes each tile's logits, turns them into ``g·onehot(y) − g·softmax`` and adds
    their products into ``dz`` (one ``[P, H]`` block per tile, stacked over a vocabulary chunk's positions),
    ``dw`` and ``db`` (an ``[H, C]`` and ``[C]`` accumulator per vocabulary chunk, carried over its position
    chunks and then added into its columns of the ``[H, V]`` and ``[V]`` gradients in place); products in
    the compute dtype with wide accumulation, sums in the wide dtype. Vocabulary tiles are read from ``w``
    and ``b`` in place (the last one shifted back to end at V, its repeated columns masked), so besides the
    gradients themselves only O(N·H) inputs are copied (position padding).
    """
    return _forward(z, w, b, y, position_chunk, vocab_chunk)[0]


def _chunked_fwd(z, w, b, y, position_chunk, vocab_chunk):
    out, lse = _forward(z, w, b, y, position_chunk, vocab_chunk)
    return out, (z, w, b, y, lse)


def _chunked_bwd(position_chunk, vocab_chunk, res, g):
    z, w, b, y, lse = res
    N, H = z.shape
    acc = b.dtype
    P, C = min(position_chunk, N), min(vocab_chunk, w.shape[1])
    n_p = -(-N // P)
    first, start = _vocab_tiles(w.shape[1], C)
    per_row = (_rows(z, n_p, P), _rows(y.astype(jnp.int32), n_p, P), _rows(lse, n_p, P),
               _rows(g.astype(acc), n_p, P))  # padded rows: zero cotangent

    def vocab_chunk_grads(carry, xs):
        dz, dw, db = carry
        first_i, start_i = xs

        def position_chunk_grads(carry2, xs2):
            dw_t, db_t = carry2
            zr, yr, lr, gr = xs2
            logits, counted = _tile(zr, w, b, first_i, start_i, C)
            # d/dlogits of g·(logit_y − lse) = g·onehot(y) − g·softmax (0 in masked columns: exp(-inf) = 0).
            dlogits = jnp.where(_target_column(yr, start_i, counted), gr[:, None], 0.0) - gr[:, None] * jnp.exp(
                logits - lr[:, None])
            dl = dlogits.astype(z.dtype)
            w_t = jax.lax.dynamic_slice_in_dim(w, start_i, C, axis=1)
            dz_r = jnp.matmul(dl, w_t.T, preferred_element_type=acc)  # [P, H]
            dw_t = dw_t + jnp.matmul(zr.T, dl, preferred_element_type=acc)  # [H, C]
            return (dw_t, db_t + jnp.sum(dlogits, axis=0)), dz_r

        (dw_t, db_t), dz_rows = jax.lax.scan(position_chunk_grads, (jnp.zeros((H, C), acc), jnp.zeros(C, acc)),
                                             per_row)
        # Masked columns carry zeros, so adding the whole tile into the [H, V] accumulator (updated in place
        # by XLA's loop) leaves what the tile before counted unchanged.
        dw = jax.lax.dynamic_update_slice_in_dim(dw, jax.lax.dynamic_slice_in_dim(dw, start_i, C, 1) + dw_t,
                                                 start_i, 1)
        db = jax.lax.dynamic_update_slice_in_dim(db, jax.lax.dynamic_slice_in_dim(db, start_i, C) + db_t, start_i, 0)
        return (dz + dz_rows, dw, db), None

    init = (jnp.zeros((n_p, P, H), acc), jnp.zeros(w.shape, acc), jnp.zeros(b.shape, acc))
    (dz, dw, db), _ = jax.lax.scan(vocab_chunk_grads, init, (first, start))
    return dz.reshape(-1, H)[:N].astype(z.dtype), dw.astype(w.dtype), db.astype(b.dtype), None


chunked_target_log_softmax.defvjp(_chunked_fwd, _chunked_bwd)
