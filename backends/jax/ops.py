"""Memory-bounded gather primitives shared by routing and scoring (mirrors :mod:`backends.torch.ops`).

Scoring C candidate slots per query needs ``x_q · y_{idx[q, c]}``. Gathering ``y`` to ``[B, Q, C, d]``
at once costs ``B·Q·C·d`` elements, and reverse-mode autodiff would keep that gather as a residual for
the backward pass. :func:`gather_dot` therefore gathers a fixed-size chunk of queries at a time
(``jax.lax.map``, static shapes) under ``jax.checkpoint``, so only the inputs and the integer index are
kept and the gather is recomputed chunk by chunk in the backward pass.

Where the slots are each query's sorted predecessors in a bucket layout (the ``recent`` slots of full-AR
queries), :func:`banded_dot` computes the same products with blocked GEMMs and no row gathers at all;
:func:`band_gather_dot` does so for any slots of full-AR queries that lie within a window of sorted
predecessors (the ``topk_score`` candidates), gathering only the few that lie further back.

:func:`argmax_last` is the argmax of the routing's semantic buckets and of the models' predictions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CHUNK_ELEMENTS = 1 << 22  # elements per temporary chunk (16 MiB in float32) on a CPU
CHUNK_ELEMENTS_ACCELERATOR = 1 << 26
"""... and on a GPU or TPU (256 MiB in float32), as torch's ``CHUNK_ELEMENTS_CUDA``: chunks run one after another
(``jax.lax.map``), each a few small kernels, and an accelerator holds far more. At the paper's 41M full-AR shape
(T = 2,048, batch 8) the dense semantic route's overlaps are 33.5M: one chunk instead of eight."""


def chunk_elements_for(chunk_elements: int | None) -> int:
    """``chunk_elements``, or the default for the platform JAX computes on when None (:data:`CHUNK_ELEMENTS` on
    a CPU, :data:`CHUNK_ELEMENTS_ACCELERATOR` elsewhere). Chunking changes no value: every query is scored and
    selected on its own."""
    if chunk_elements is not None:
        return chunk_elements
    return CHUNK_ELEMENTS if jax.default_backend() == "cpu" else CHUNK_ELEMENTS_ACCELERATOR


def argmax_last(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32: the first maximum, a NaN counting as larger than any number.

    On a CPU through ``jax.lax.top_k(x, 1)``, which returns the same index (lowest first among equals, NaN
    first) through XLA:CPU's TopK runtime call instead of its two-operand reduction: 2.3-2.4x faster on a
    2-core CPU over ``[32, 1024, 256]`` router probabilities (10.8 against 25.6 ms) and ``[4096, 20000]``
    log-probabilities (85 against 195 ms). Elsewhere ``jnp.argmax``."""
    if jax.default_backend() == "cpu":
        return jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32)
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


OUTSIDE_PAIRS = 4096
"""(query, slot) pairs :func:`band_gather_dot` gathers compactly when they lie outside its band; more than
this and it gathers every slot (:func:`gather_dot`)."""


def batch_gather(values: jax.Array, index: jax.Array) -> jax.Array:
    """``values[b, index[b, ...]]``: values ``[B, T, *F]``, index ``[B, *I]`` (in ``[0, T)``) -> ``[B, *I, *F]``.

    Out-of-range indices are clamped into ``[0, T)`` (an empty ``-1`` slot reads position 0; mask it).
    """
    B = values.shape[0]
    flat = index.reshape(B, -1)
    out = jax.vmap(lambda v, i: jnp.take(v, i, axis=0, mode="clip"))(values, flat)
    return out.reshape(*index.shape, *values.shape[2:])


@jax.custom_vjp
def permute_rows(values: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """``values [B, T, *F]`` with its rows permuted by ``perm [B, T]`` (``inverse``: its inverse permutation).

    The VJP gathers with the inverse: autodiff of a gather would scatter-add, which XLA:CPU runs as a
    serial loop (mirrors :func:`backends.torch.ops.permute_rows`)."""
    return batch_gather(values, perm)


def _permute_rows_fwd(values: jax.Array, perm: jax.Array, inverse: jax.Array):
    return batch_gather(values, perm), inverse


def _permute_rows_bwd(inverse: jax.Array, grad: jax.Array):
    return batch_gather(grad, inverse), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def query_chunk(n_queries: int, per_query: int, chunk_elements: int) -> int:
    """Queries per chunk so that a chunk holds at most ``chunk_elements`` (at least one query)."""
    return max(1, min(n_queries, chunk_elements // max(per_query, 1)))


def map_query_chunks(fn, n_queries: int, chunk: int, *per_query: jax.Array):
    """Apply ``fn`` to fixed-size chunks of queries and concatenate the results along the query axis.

    Args:
        fn: maps chunked arguments (query axis of length ``chunk``) to a pytree of arrays whose axis 1
            is the chunk's query axis (``[B, chunk, ...]``).
        n_queries: Q.
        chunk: queries per chunk (static).
        per_query: arrays ``[B, Q, ...]``; padded to a multiple of ``chunk`` with zeros.
    Returns:
        ``fn``'s pytree with query axes of length Q (padding dropped).

    One chunk is the whole call when ``chunk >= Q``; otherwise ``jax.lax.map`` runs the chunks in
    sequence, so only one chunk's temporaries exist at a time.
    """
    if chunk >= n_queries:
        return fn(*per_query)
    n_chunks = -(-n_queries // chunk)
    pad = n_chunks * chunk - n_queries

    def split(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(a.shape[0], n_chunks, chunk, *a.shape[2:])
        return jnp.moveaxis(a, 1, 0)  # [n_chunks, B, chunk, ...]

    out = jax.lax.map(lambda args: fn(*args), tuple(split(a) for a in per_query))

    def merge(a: jax.Array) -> jax.Array:
        a = jnp.moveaxis(a, 0, 1)  # [B, n_chunks, chunk, ...]
        return a.reshape(a.shape[0], n_chunks * chunk, *a.shape[3:])[:, :n_queries]

    return jax.tree_util.tree_map(merge, out)


def gather_dot(
    x: jax.Array,
    y: jax.Array,
    index: jax.Array,
    *,
    chunk_elements: int | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
    """``out[b, q, c] = x[b, q] · y[b, index[b, q, c]]``.

    Args:
        x: ``[B, Q, d]`` (queries, or router distributions of the queries).
        y: ``[B, T, d]`` per-position rows (keys, or router distributions).
        index: ``[B, Q, C]`` integer positions in ``[0, T)`` (clip empty slots before calling).
        chunk_elements: at most this many gathered elements (``B·chunk·C·d``) exist at a time (None: the
            platform's, :func:`chunk_elements_for`).
        precision: matmul precision of the contraction (``None`` = the context default).
    Returns:
        ``[B, Q, C]``, differentiable in ``x`` and ``y``; no ``[B, Q, C, d]`` array is kept for backward.
    """
    B, Q, C = index.shape
    d = x.shape[-1]

    @jax.checkpoint
    def chunk_dot(xc: jax.Array, ic: jax.Array) -> jax.Array:
        return jnp.einsum("bqd,bqcd->bqc", xc, batch_gather(y, ic), precision=precision)

    return map_query_chunks(chunk_dot, Q, query_chunk(Q, B * C * d, chunk_elements_for(chunk_elements)), x, index)


def banded_dot(order: jax.Array, rank: jax.Array, x: jax.Array, y: jax.Array, width: int,
               *, precision: jax.lax.PrecisionLike = None) -> jax.Array:
    """``out[b, t, j] = x[b, t] · y[b, order[b, rank[b, t] - 1 - j]]`` for j < ``width``: every position's
    products with its ``width`` predecessors in a sorted layout.

    Args:
        order: ``[B, T]`` int position stored at each sorted slot; rank: ``[B, T]`` its inverse.
        x: ``[B, T, d]`` one row per position (full-AR queries); y: ``[B, T, d]`` per-position rows.
        width: W, the predecessors per position (static).
    Returns:
        ``[B, T, W]``, differentiable in ``x`` and ``y``. Entries whose slot ``rank - 1 - j`` is negative are
        junk for the caller to mask (as are slots outside a query's bucket segment).

    In sorted order the products form a band of ``x_sorted · y_sortedᵀ``: blocks of W sorted rows of x
    are multiplied by the 2W sorted rows of y that end with their own block (one batched GEMM,
    ``2·T·2W·d`` FLOPs) and the band is read off the ``[W, 2W]`` products by a skewing reshape. The backward
    pass is the same GEMMs and the reshape's transpose; no ``[T, W, d]`` array exists in either.
    """
    B, T, d = x.shape
    W = width
    nb = -(-T // W)
    pad = nb * W - T
    xs = jnp.pad(permute_rows(x, order, rank), ((0, 0), (0, pad), (0, 0)))
    ys = jnp.pad(permute_rows(y, order, rank), ((0, 0), (W, pad), (0, 0)))  # W zero rows first
    xb = xs.reshape(B, nb, W, d)
    yb = jnp.concatenate([ys[:, : nb * W].reshape(B, nb, W, d), ys[:, W:].reshape(B, nb, W, d)], axis=2)
    prod = jnp.einsum("bnqd,bnkd->bnqk", xb, yb, precision=precision)  # [B, nb, W, 2W]
    # Row r of a block is column W + r of its y rows; its j-th predecessor is column W + r - 1 - j, i.e.
    # columns r .. r + W - 1 reversed. Row r is shifted left by r by re-reading the flat [W, 2W] block with
    # rows of 2W + 1 (a reshape, not a gather: its backward is a reshape too, not a scatter).
    flat = jnp.pad(prod.reshape(B, nb, W * 2 * W), ((0, 0), (0, 0), (0, W)))
    shifted = flat.reshape(B, nb, W, 2 * W + 1)[..., :W]  # [r, c] = prod[r, r + c]
    by_slot = shifted[..., ::-1].reshape(B, nb * W, W)[:, :T]
    return permute_rows(by_slot, rank, order)


def band_gather_dot(order: jax.Array, rank: jax.Array, x: jax.Array, y: jax.Array, index: jax.Array, width: int,
                    *, precision: jax.lax.PrecisionLike = None, outside_pairs: int = OUTSIDE_PAIRS,
                    chunk_elements: int | None = None) -> jax.Array:
    """``out[b, t, c] = x[b, t] · y[b, index[b, t, c]]`` for full-AR queries (query t at position t), read off
    :func:`banded_dot` of ``width`` W wherever ``index`` is one of t's W sorted predecessors.

    Args:
        order, rank: ``[B, T]`` the sorted layout (:class:`pcaf_core.routing.BucketLayout`).
        x: ``[B, T, d]`` queries, one per position; y: ``[B, T, d]`` per-position rows.
        index: ``[B, T, C]`` int positions, -1 = empty (its output is junk for the caller to mask).
        width: W (static); outside_pairs: how many non-empty slots further back than W sorted slots are
            gathered one pair at a time (compacted to a fixed size); when more lie outside, every slot is
            gathered with :func:`gather_dot` (same values, slower).
    Returns:
        ``[B, T, C]``, differentiable in ``x`` and ``y``.

    A slot holding position s is t's predecessor number ``rank[t] - 1 - rank[s]`` in sorted order, so its
    product is that column of the band. The ``topk_score`` route picks its candidates from exactly such a
    window, except for the queries its dense fallback routes, whose few older candidates are the pairs
    gathered here.
    """
    B, T, C = index.shape
    x, y = jnp.asarray(x), jnp.asarray(y)
    safe = jnp.maximum(index, 0)
    offset = rank[..., None] - 1 - batch_gather(rank, safe)  # [B, T, C]
    inside = (offset >= 0) & (offset < width)
    band = banded_dot(order, rank, x, y, width, precision=precision)
    from_band = jnp.take_along_axis(band, jnp.clip(offset, 0, width - 1), axis=2)
    outside = (index >= 0) & ~inside
    rest = _outside_dot(x, y, safe, outside, outside_pairs, chunk_elements_for(chunk_elements), precision)
    return jnp.where(inside, from_band, rest)


def _outside_dot_value(x: jax.Array, y: jax.Array, safe: jax.Array, outside: jax.Array, outside_pairs: int,
                       chunk_elements: int, precision: jax.lax.PrecisionLike) -> jax.Array:
    """``x[b, t] · y[b, safe[b, t, c]]`` where ``outside`` ``[B, T, C]`` holds, junk elsewhere: the marked pairs
    gathered one at a time (compacted to ``outside_pairs``), or every slot gathered when more are marked."""
    B, T, C = safe.shape
    n = B * T * C

    def compact() -> jax.Array:
        pair = jnp.nonzero(outside.reshape(n), size=outside_pairs, fill_value=n)[0]
        at = jnp.minimum(pair, n - 1)
        b, t = at // (T * C), (at // C) % T
        dots = jnp.einsum("pd,pd->p", x[b, t], y[b, safe.reshape(n)[at]], precision=precision)
        return jnp.zeros(n, dots.dtype).at[pair].set(dots, mode="drop").reshape(B, T, C)

    def every_slot() -> jax.Array:
        return gather_dot(x, y, safe, chunk_elements=chunk_elements, precision=precision)

    def none() -> jax.Array:
        return jnp.zeros((B, T, C), jnp.result_type(x, y))

    marked = jnp.sum(outside)
    return jax.lax.cond(marked == 0, none, lambda: jax.lax.cond(marked <= outside_pairs, compact, every_slot))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _outside_dot(x, y, safe, outside, outside_pairs, chunk_elements, precision):
    return _outside_dot_value(x, y, safe, outside, outside_pairs, chunk_elements, precision)


# Differentiating the conds directly would make the forward pass return the residuals of every branch, the
# untaken ones' as zeros: at T = 8,192 a 31 MB zero buffer written every step for the every-slot gather,
# while usually no pair lies outside the band at all. The backward pass here re-runs the taken branch
# instead (nothing when no pair is marked), so the only residuals are the inputs.
def _outside_dot_fwd(x, y, safe, outside, outside_pairs, chunk_elements, precision):
    return _outside_dot_value(x, y, safe, outside, outside_pairs, chunk_elements, precision), (x, y, safe, outside)


def _outside_dot_bwd(outside_pairs, chunk_elements, precision, res, grad):
    x, y, safe, outside = res

    def backward() -> tuple[jax.Array, jax.Array]:
        _, vjp = jax.vjp(lambda a, b: _outside_dot_value(a, b, safe, outside, outside_pairs, chunk_elements,
                                                         precision), x, y)
        return vjp(jnp.where(outside, grad, 0.0))

    gx, gy = jax.lax.cond(jnp.any(outside), backward, lambda: (jnp.zeros_like(x), jnp.zeros_like(y)))
    return gx, gy, None, None


_outside_dot.defvjp(_outside_dot_fwd, _outside_dot_bwd)
