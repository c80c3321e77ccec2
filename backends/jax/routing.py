"""Candidate selection in jnp, equal to :mod:`pcaf_core.routing` slot for slot (mirrors :mod:`backends.torch.routing`).

All shapes are static: ``top_k``, ``policy``, ``strategy``, ``sparse_window``, ``chunk_elements`` and
``target_leak`` are Python values, the sequence length and the number of queries come from the array
shapes, so every function traces once under ``jax.jit``. ``rho`` may be a traced scalar (a parameter).
Candidate indices are int32.

The routes follow the backends' strategy that :mod:`pcaf_core.routing` states ("How the backends avoid T×T";
docs/KERNELS.md, "`topk_score` without T×T, and why it is exact"), with the keyword arguments listed there; the
JAX form (docs/JAX.md, "Routing with static shapes"):

* the layout comes from one stable two-key sort per sequence by ``(address, position)`` (:func:`bucket_layout`);
* if the ``topk_score`` proof fails for any query, ``jax.lax.cond`` runs a dense pass over all T records for
  exactly those queries, compacted into fixed-size chunks (a loop of ceil(n/chunk) steps; at most
  ``chunk_elements`` scores at a time);
* selection inputs pass through ``jax.lax.stop_gradient``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from backends.jax.ops import (
    argmax_last,
    banded_dot,
    batch_gather,
    chunk_elements_for,
    gather_dot,
    map_query_chunks,
    query_chunk,
)
from pcaf_core.config import CANDIDATE_POLICIES
from pcaf_core.routing import SEMANTIC_TIE_BREAK, BucketLayout, Candidates, SelectionInputs, topk_sparse_window

TOPK_STRATEGIES = ("auto", "dense")
_FALLBACK_CHUNK = 32  # queries per step of the dense topk_score fallback
_HIGHEST = jax.lax.Precision.HIGHEST


def _work_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """Selection precision: at least float32, since bf16/fp16 rounding would swamp the proof's margins."""
    return jnp.promote_types(dtype, jnp.float32)


def _exact_selection(select: SelectionInputs) -> SelectionInputs:
    work = _work_dtype(jnp.result_type(select.query))
    q, k, r = (jax.lax.stop_gradient(jnp.asarray(a, work)) for a in (select.query, select.keys, select.recency))
    return SelectionInputs(q, k, r, jax.lax.stop_gradient(jnp.asarray(select.rho, work)))


def _as_int32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.int32)


def bucket_layout(addresses: jax.Array) -> BucketLayout:
    """The :class:`BucketLayout` of ``[B, T]`` non-negative addresses: one two-key sort per sequence by
    ``(address, position)`` (positions are unique) rather than a combined ``address·T + position`` key, which
    would overflow int32 for large bucket counts.
    """
    addr = _as_int32(addresses)
    B, T = addr.shape
    pos = jnp.arange(T, dtype=jnp.int32)
    sorted_addr, order = jax.lax.sort((addr, jnp.broadcast_to(pos, (B, T))), dimension=1, num_keys=2)
    rank = jax.vmap(lambda o: jnp.zeros(T, jnp.int32).at[o].set(pos, unique_indices=True))(order)
    is_start = jnp.concatenate([jnp.ones((B, 1), bool), sorted_addr[:, 1:] != sorted_addr[:, :-1]], axis=1)
    seg_start = jax.lax.cummax(jnp.where(is_start, pos, 0), axis=1)
    return BucketLayout(order=order, rank=rank, seg_start=seg_start)


def _query_slots(layout: BucketLayout, query_pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Slot, segment start and number of earlier same-bucket records of each query, each ``[B, Q]``."""
    slot = jnp.take(layout.rank, _as_int32(query_pos), axis=1)
    start = jnp.take_along_axis(layout.seg_start, slot, axis=1)
    return slot, start, slot - start


def _slots_to_candidates(layout: BucketLayout, src: jax.Array, valid: jax.Array) -> Candidates:
    B, Q, W = src.shape
    index = jnp.take_along_axis(layout.order, src.reshape(B, Q * W), axis=1).reshape(B, Q, W)
    return Candidates(jnp.where(valid, index, -1), valid)


def _recent_slots(layout: BucketLayout, slot: jax.Array, count: jax.Array, width: int) -> Candidates:
    """The ``width`` slots just before each query's slot in its segment, most recent first."""
    offs = jnp.arange(1, width + 1, dtype=jnp.int32)
    valid = offs <= count[..., None]  # [B, Q, width]
    return _slots_to_candidates(layout, jnp.maximum(slot[..., None] - offs, 0), valid)


def _first_slots(layout: BucketLayout, start: jax.Array, count: jax.Array, width: int) -> Candidates:
    """The first ``width`` slots of each query's segment that precede the query, earliest first."""
    T = layout.order.shape[1]
    offs = jnp.arange(width, dtype=jnp.int32)
    valid = offs < count[..., None]
    return _slots_to_candidates(layout, jnp.minimum(start[..., None] + offs, T - 1), valid)


def topk_rows(rank: jax.Array, valid: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per row, the k valid columns with the largest ``rank``, ties to the lower column, in that order.

    Args:
        rank: ``[..., T]`` float scores; valid: ``[..., T]`` bool.
    Returns:
        index ``[..., k]`` int32 (-1 = fewer than k valid columns) and its mask ``[..., k]`` bool.

    ``jax.lax.top_k`` returns equal values lowest index first (the spec's tie rule), so masking the
    invalid columns to -inf is all it needs; a slot is valid iff its value is finite.
    """
    T = rank.shape[-1]
    kk = min(k, T)
    masked = jnp.where(valid, rank, -jnp.inf)
    vals, idx = jax.lax.top_k(masked, kk)
    ok = vals > -jnp.inf
    index = jnp.where(ok, idx.astype(jnp.int32), -1)
    if kk < k:
        pad = [(0, 0)] * (rank.ndim - 1) + [(0, k - kk)]
        index, ok = jnp.pad(index, pad, constant_values=-1), jnp.pad(ok, pad, constant_values=False)
    return index, ok


def _dense_context_topk(
    addresses: jax.Array, query_pos: jax.Array, top_k: int, select: SelectionInputs, chunk_elements: int
) -> Candidates:
    """Spec-exact ``topk_score`` for every query, scoring all T records in chunks of queries so that at
    most ``chunk_elements`` scores (``B·chunk·T``) exist at a time."""
    B, T = addresses.shape
    Q = query_pos.shape[0]
    scale = math.sqrt(select.query.shape[-1])
    col = jnp.arange(T, dtype=jnp.int32)
    rec_term = select.rho * select.recency  # [T]
    t_all = jnp.broadcast_to(query_pos, (B, Q))
    a_all = jnp.take(addresses, query_pos, axis=1)

    def chunk(q: jax.Array, t: jax.Array, a_t: jax.Array) -> tuple[jax.Array, jax.Array]:
        score = jnp.einsum("bqd,btd->bqt", q, select.keys, precision=_HIGHEST) / scale + rec_term
        ok = (addresses[:, None, :] == a_t[..., None]) & (col < t[..., None])
        return topk_rows(score, ok, top_k)

    index, valid = map_query_chunks(chunk, Q, query_chunk(Q, B * T, chunk_elements), select.query, t_all, a_all)
    return Candidates(index, valid)


def _dense_context_topk_for(
    addresses: jax.Array,
    query_pos: jax.Array,
    top_k: int,
    select: SelectionInputs,
    dense: jax.Array,
    chunk_elements: int,
) -> Candidates:
    """Spec-exact ``topk_score`` for the queries marked in ``dense`` ``[B, Q]`` only (other slots empty).

    Per sequence, the marked queries are compacted (``jnp.nonzero`` with a static size) and scored
    against all T records in chunks of ``c`` queries (``B·c·T <= chunk_elements``) by a loop that runs
    ceil(n/c) times for n marked queries, so the cost is O(n·T), not the O(Q·T) of scoring every query.
    Selection is not differentiated, so the loop sees its inputs through ``stop_gradient``."""
    B, T = addresses.shape
    Q = query_pos.shape[0]
    # Few queries usually fail the proof (33 of 16,384 in the routing benchmark's text), and a chunk costs
    # its full c·T scores and top-k whatever its occupancy, so chunks stay small.
    c = min(query_chunk(Q, B * T, chunk_elements), _FALLBACK_CHUNK)
    padded = Q + (-Q) % c
    scale = math.sqrt(select.query.shape[-1])
    col = jnp.arange(T, dtype=jnp.int32)
    rec_term = jax.lax.stop_gradient(select.rho * select.recency)  # [T]

    def one_sequence(addr: jax.Array, query: jax.Array, keys: jax.Array, marked: jax.Array):
        order = jnp.nonzero(marked, size=padded, fill_value=Q)[0].astype(jnp.int32)  # fill Q: dropped below

        def body(i, carry):
            index, valid = carry
            qi = jax.lax.dynamic_slice(order, (i * c,), (c,))
            safe = jnp.minimum(qi, Q - 1)
            t = query_pos[safe]
            score = jnp.einsum("cd,td->ct", query[safe], keys, precision=_HIGHEST) / scale + rec_term
            ok = (addr[None, :] == addr[t][:, None]) & (col[None, :] < t[:, None])
            idx, ok_k = topk_rows(score, ok, top_k)
            return index.at[qi].set(idx, mode="drop"), valid.at[qi].set(ok_k, mode="drop")

        n_chunks = (jnp.sum(marked, dtype=jnp.int32) + c - 1) // c
        init = (jnp.full((Q, top_k), -1, jnp.int32), jnp.zeros((Q, top_k), bool))
        return jax.lax.fori_loop(0, n_chunks, body, init)

    index, valid = jax.vmap(one_sequence)(addresses, jax.lax.stop_gradient(select.query),
                                          jax.lax.stop_gradient(select.keys), dense)
    return Candidates(index, valid)


def route_context_topk_score(
    addresses: jax.Array,
    query_pos: jax.Array,
    top_k: int,
    select: SelectionInputs,
    *,
    strategy: str = "auto",
    sparse_window: int | None = None,
    layout: BucketLayout | None = None,
    chunk_elements: int | None = None,
    query_layout: str | None = None,
) -> tuple[Candidates, jax.Array]:
    """The ``topk_score`` policy of :func:`route_context` alone, with the ``[B, Q]`` bool mask of the queries
    that took the dense pass (:mod:`pcaf_core.routing`, "How the backends avoid T×T").

    ``top_k``, ``strategy``, ``sparse_window`` and ``chunk_elements`` are static. ``select`` is scored in float32
    (or wider if given wider) behind ``stop_gradient``. If any query is unproven, ``jax.lax.cond`` runs the dense
    pass over exactly those queries (:func:`_dense_context_topk_for`, O(n·T) for n of them); ``strategy="dense"``
    scores every query in fixed-size chunks.
    """
    if strategy not in TOPK_STRATEGIES:
        raise ValueError(f"topk_score strategy {strategy!r} is unknown: expected one of {list(TOPK_STRATEGIES)}")
    _check_query_layout(query_layout, query_pos, addresses)
    addresses, query_pos = _as_int32(addresses), _as_int32(query_pos)
    select = _exact_selection(select)
    chunk_elements = chunk_elements_for(chunk_elements)
    B, Q, K = addresses.shape[0], query_pos.shape[0], top_k
    if strategy == "dense":
        dense = jnp.ones((B, Q), bool)
        return _dense_context_topk(addresses, query_pos, K, select, chunk_elements), dense

    M = topk_sparse_window(K, sparse_window)
    layout = bucket_layout(addresses) if layout is None else layout
    slot, _, count = _query_slots(layout, query_pos)
    win = _recent_slots(layout, slot, count, M + 1)  # slot M: the most recent record left out
    idx_m, ok_m = win.index[..., :M], win.valid[..., :M]
    safe_m = jnp.maximum(idx_m, 0)
    d = select.query.shape[-1]
    if query_layout == "ar":
        score = banded_dot(layout.order, layout.rank, select.query, select.keys, M, precision=_HIGHEST)
    else:
        score = gather_dot(select.query, select.keys, safe_m, chunk_elements=chunk_elements, precision=_HIGHEST)
    score = jnp.where(ok_m, score / math.sqrt(d) + select.rho * select.recency[safe_m], -jnp.inf)
    # The window is most recent first; reversed, it is in ascending record index, so top_k's
    # lower-index tie rule is the spec's.
    vals, order = jax.lax.top_k(score[..., ::-1], K)
    keep = vals > -jnp.inf
    sparse = Candidates(jnp.where(keep, jnp.take_along_axis(idx_m[..., ::-1], order, axis=-1), -1), keep)

    overflow = count > M
    eps = jnp.finfo(score.dtype).eps
    rho = select.rho
    left_out = jnp.maximum(win.index[..., M], 0)
    # |q·k| <= ‖q‖·max‖k‖ (= 1 for the models' unit vectors; using the norms keeps the proof valid for
    # any inputs). The margins cover rounding of the dot products (~d·eps relative) and of ρ·r, here and
    # in the spec; they only ever send more queries to the dense path.
    dot_bound = (jnp.linalg.norm(select.query, axis=-1)
                 * jnp.max(jnp.linalg.norm(select.keys, axis=-1), axis=-1, keepdims=True))
    bound = (dot_bound * (1.0 + 4.0 * d * eps) / math.sqrt(d)
             + rho * select.recency[left_out] + 4.0 * eps * (1.0 + jnp.abs(rho)))
    # top_k's values descend, so their minimum is the K-th; reading vals[..., K-1] instead makes XLA:CPU
    # replace the top-k with a full sort (191 against 119 ms for the route's first half at T = 16,384).
    kth = jnp.min(vals, axis=-1)
    proven = (kth > bound) & (rho >= 0)
    dense = overflow & ~proven

    def with_dense() -> Candidates:
        full = _dense_context_topk_for(addresses, query_pos, K, select, dense, chunk_elements)
        pick = dense[..., None]
        return Candidates(jnp.where(pick, full.index, sparse.index), jnp.where(pick, full.valid, sparse.valid))

    out = jax.lax.cond(jnp.any(dense), with_dense, lambda: sparse)
    return out, dense


def _check_query_layout(query_layout: str | None, query_pos: jax.Array, addresses: jax.Array) -> None:
    if query_layout not in (None, "nt", "ar"):
        raise ValueError(f"query_layout {query_layout!r} is unknown: expected 'nt', 'ar' or None")
    want = {"nt": 1, "ar": addresses.shape[1]}.get(query_layout)
    if want is not None and query_pos.shape[0] != want:
        raise ValueError(f"query_layout {query_layout!r} needs {want} query positions, got {query_pos.shape[0]}")


def route_context(
    addresses: jax.Array,
    query_pos: jax.Array,
    top_k: int,
    policy: str,
    select: SelectionInputs | None = None,
    *,
    strategy: str = "auto",
    sparse_window: int | None = None,
    chunk_elements: int | None = None,
    query_layout: str | None = None,
    layout: BucketLayout | None = None,
) -> Candidates:
    """See :func:`pcaf_core.routing.route_context`; keyword arguments as listed in :mod:`pcaf_core.routing`.

    ``top_k``, ``policy`` and every keyword argument but ``layout`` are static.
    """
    if policy not in CANDIDATE_POLICIES:
        raise ValueError(f"candidate policy {policy!r} is unknown: expected one of {list(CANDIDATE_POLICIES)}")
    if policy == "topk_score":
        if select is None:
            raise ValueError("policy 'topk_score' needs select=SelectionInputs(query, keys, recency, rho)")
        return route_context_topk_score(addresses, query_pos, top_k, select, strategy=strategy,
                                        sparse_window=sparse_window, chunk_elements=chunk_elements,
                                        query_layout=query_layout, layout=layout)[0]
    _check_query_layout(query_layout, query_pos, addresses)
    layout = bucket_layout(addresses) if layout is None else layout
    slot, start, count = _query_slots(layout, query_pos)
    if policy == "recent":
        return _recent_slots(layout, slot, count, top_k)
    return _first_slots(layout, start, count, top_k)


def semantic_overlap(router_probs: jax.Array, query_pos: jax.Array) -> jax.Array:
    """See :func:`pcaf_core.routing.semantic_overlap`; computed at ``HIGHEST`` precision."""
    return jnp.einsum("bqs,bts->bqt", jnp.take(router_probs, _as_int32(query_pos), axis=1), router_probs,
                      precision=_HIGHEST)


def route_semantic_dense(
    router_probs: jax.Array,
    recency: jax.Array,
    rho: float | jax.Array,
    query_pos: jax.Array,
    top_k: int,
    *,
    target_leak: bool = False,
    chunk_elements: int | None = None,
) -> Candidates:
    """See :func:`pcaf_core.routing.route_semantic_dense` (the backends' form, from ``router_probs``).

    ``top_k``, ``target_leak`` and ``chunk_elements`` are static; ``rho`` may be a traced scalar. The inputs pass
    through ``stop_gradient``, in at least float32; the chunks run in ``jax.lax.map``.
    """
    work = _work_dtype(jnp.result_type(router_probs))
    probs = jax.lax.stop_gradient(jnp.asarray(router_probs, work))
    rec = jax.lax.stop_gradient(jnp.asarray(recency, work))
    rho = jax.lax.stop_gradient(jnp.asarray(rho, work))
    query_pos = _as_int32(query_pos)
    B, T, _ = probs.shape
    Q, K = query_pos.shape[0], top_k
    col = jnp.arange(T, dtype=jnp.int32)
    tie_break = (SEMANTIC_TIE_BREAK * rho) * rec  # same association as the spec: (1e-4·ρ)·r

    def chunk(pq: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        rank = jnp.einsum("bqs,bts->bqt", pq, probs, precision=_HIGHEST) + tie_break
        return topk_rows(rank, col < t[..., None], K)

    index, valid = map_query_chunks(chunk, Q, query_chunk(Q, B * T, chunk_elements_for(chunk_elements)),
                                    jnp.take(probs, query_pos, axis=1), jnp.broadcast_to(query_pos, (B, Q)))
    if target_leak:
        slots = jnp.arange(K, dtype=jnp.int32)
        # A query t < K holds exactly t causal picks in slots 0..t-1; the reference's masked picks fill
        # slot j >= t with record j (lax.top_k order), up to the last position T-1.
        leak = (slots >= query_pos[:, None]) & (slots < T)  # [Q, K]
        index = jnp.where(leak, slots, index)
        valid = valid | leak
    return Candidates(index, valid)


def semantic_buckets(router_probs: jax.Array) -> jax.Array:
    """See :func:`pcaf_core.routing.semantic_buckets`; int32 (:func:`argmax_last` returns the first maximum)."""
    return argmax_last(router_probs)


def route_semantic_bucketed(
    sem_buckets: jax.Array, query_pos: jax.Array, top_k: int, *, query_layout: str | None = None,
    layout: BucketLayout | None = None,
) -> Candidates:
    """See :func:`pcaf_core.routing.route_semantic_bucketed`; ``query_layout``, ``layout``: as in
    :func:`route_context`."""
    return route_context(sem_buckets, query_pos, top_k, "recent", query_layout=query_layout, layout=layout)


def combine_hybrid(context: Candidates, semantic: Candidates, *, dedup: bool) -> Candidates:
    """See :func:`pcaf_core.routing.combine_hybrid`."""
    if not dedup:
        return Candidates(jnp.concatenate([context.index, semantic.index], axis=-1),
                          jnp.concatenate([context.valid, semantic.valid], axis=-1))
    ctx_idx = jnp.where(context.valid, context.index, -2)  # -2 never matches a record
    dup = (semantic.index[..., :, None] == ctx_idx[..., None, :]).any(-1) & semantic.valid
    return Candidates(jnp.concatenate([context.index, jnp.where(dup, -1, semantic.index)], axis=-1),
                      jnp.concatenate([context.valid, semantic.valid & ~dup], axis=-1))


def gather_records(values: jax.Array, cand: Candidates) -> jax.Array:
    """See :func:`pcaf_core.routing.gather_records`."""
    return batch_gather(values, jnp.maximum(cand.index, 0))
