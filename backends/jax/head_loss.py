"""The head's log-probability of the target (mirrors :mod:`backends.torch.head_loss`).

The one-tile form is :meth:`backends.jax.layers.Head.target_log_prob`'s ``logit_y − logsumexp(logits)`` over
the whole ``[N, V]`` logits. :func:`chunked_target_log_softmax` computes the same values without any
``[N, V]`` array: ``[P, C]`` logit tiles (``lax.map`` over position chunks, ``lax.scan`` over vocabulary
chunks), an online log-sum-exp per row, and a custom VJP that recomputes each tile in the backward pass and
accumulates the head's gradients tile by tile. docs/BACKENDS.md ("Chunked head loss") has the algorithm
and its cost.

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


def _tiles(z: jax.Array, w: jax.Array, b: jax.Array, y: jax.Array, position_chunk: int, vocab_chunk: int):
    """Inputs padded to whole tiles and split: z ``[nP, P, H]``, y ``[nP, P]``, w ``[nC, H, C]``,
    b ``[nC, C]``, each tile's first column ``[nC]``. Padded rows are zeros (sliced off afterwards); padded
    columns have bias ``-inf``, so they add nothing to a normaliser and get no gradient."""
    N, H = z.shape
    V = w.shape[1]
    P, C = min(position_chunk, N), min(vocab_chunk, V)
    n_p, n_c = -(-N // P), -(-V // C)
    zp = jnp.pad(z, ((0, n_p * P - N), (0, 0))).reshape(n_p, P, H)
    yp = jnp.pad(y, (0, n_p * P - N)).reshape(n_p, P)
    wc = jnp.pad(w, ((0, 0), (0, n_c * C - V))).reshape(H, n_c, C).transpose(1, 0, 2)
    bc = jnp.pad(b, (0, n_c * C - V), constant_values=-jnp.inf).reshape(n_c, C)
    return zp, yp, wc, bc, jnp.arange(n_c, dtype=y.dtype) * C


def _target_column(y: jax.Array, v0: jax.Array, width: int) -> jax.Array:
    """``[n, width]`` bool: the target's column, where it lies in the tile starting at ``v0``."""
    return (y - v0)[:, None] == jnp.arange(width, dtype=y.dtype)[None, :]


def _forward(z, w, b, y, position_chunk, vocab_chunk):
    N = z.shape[0]
    zp, yp, wc, bc, starts = _tiles(z, w, b, y, position_chunk, vocab_chunk)
    C = bc.shape[1]

    def rows(args):
        zr, yr = args  # [P, H], [P]

        def tile(carry, xs):
            top, total, target = carry
            w_t, b_t, v0 = xs
            logits = _logits(zr, w_t, b_t)  # [P, C]
            target = target + jnp.sum(jnp.where(_target_column(yr, v0, C), logits, 0.0), axis=1)
            new_top = jnp.maximum(top, jnp.max(logits, axis=1))
            # As logsumexp does: a row whose maximum is infinite shifts by 0, not by the infinity.
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            total = total * jnp.exp(top - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
            return (new_top, total, target), None

        acc = b.dtype
        init = (jnp.full(zr.shape[0], -jnp.inf, acc), jnp.zeros(zr.shape[0], acc), jnp.zeros(zr.shape[0], acc))
        (top, total, target), _ = jax.lax.scan(tile, init, (wc, bc, starts))
        lse = jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(total)
        return target - lse, lse

    out, lse = jax.lax.map(rows, (zp, yp))
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
    ``dw`` and ``db`` (one ``[H, C]`` and ``[C]`` accumulator per vocabulary chunk, carried over its position
    chunks); products in the compute dtype with wide accumulation, sums in the wide dtype.
    """
    return _forward(z, w, b, y, position_chunk, vocab_chunk)[0]


def _chunked_fwd(z, w, b, y, position_chunk, vocab_chunk):
    out, lse = _forward(z, w, b, y, position_chunk, vocab_chunk)
    return out, (z, w, b, y, lse)


def _chunked_bwd(position_chunk, vocab_chunk, res, g):
    z, w, b, y, lse = res
    N, H = z.shape
    V = w.shape[1]
    acc = b.dtype
    zp, yp, wc, bc, starts = _tiles(z, w, b, y, position_chunk, vocab_chunk)
    n_p, P = yp.shape
    C = bc.shape[1]
    lp = jnp.pad(lse, (0, n_p * P - N)).reshape(n_p, P)
    gp = jnp.pad(g.astype(acc), (0, n_p * P - N)).reshape(n_p, P)  # padded rows: zero cotangent

    def vocab_chunk_grads(dz, xs):
        w_t, b_t, v0 = xs

        def position_chunk_grads(carry, xs2):
            dw_t, db_t = carry
            zr, yr, lr, gr = xs2
            logits = _logits(zr, w_t, b_t)
            # d/dlogits of g·(logit_y − lse) = g·onehot(y) − g·softmax.
            dlogits = jnp.where(_target_column(yr, v0, C), gr[:, None], 0.0) - gr[:, None] * jnp.exp(
                logits - lr[:, None])
            dl = dlogits.astype(z.dtype)
            dz_r = jnp.matmul(dl, w_t.T, preferred_element_type=acc)  # [P, H]
            dw_t = dw_t + jnp.matmul(zr.T, dl, preferred_element_type=acc)  # [H, C]
            return (dw_t, db_t + jnp.sum(dlogits, axis=0)), dz_r

        (dw_t, db_t), dz_rows = jax.lax.scan(position_chunk_grads, (jnp.zeros((H, C), acc), jnp.zeros(C, acc)),
                                             (zp, yp, lp, gp))
        return dz + dz_rows, (dw_t, db_t)

    dz, (dw, db) = jax.lax.scan(vocab_chunk_grads, jnp.zeros((n_p, P, H), acc), (wc, bc, starts))
    dz = dz.reshape(-1, H)[:N].astype(z.dtype)
    dw = dw.transpose(1, 0, 2).reshape(H, -1)[:, :V].astype(w.dtype)
    return dz, dw, db.reshape(-1)[:V].astype(b.dtype), None


chunked_target_log_softmax.defvjp(_chunked_fwd, _chunked_bwd)
