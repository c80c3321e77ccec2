"""Candidate selection (docs/DESIGN.md §3.2, docs/REFERENCE_CODE.md §2.3, §3).

Every route returns :class:`Candidates`: per (sequence, query) a fixed number C of slots holding
record indices (``-1`` = empty) and a validity mask. Slot order is part of the spec, so backends
can be compared exactly:

* ``topk_score``: descending selection score, ties to the lower index (``lax.top_k`` order);
* ``recent``: most recent first; ``first``: earliest first;
* dense semantic: descending ``m + 1e-4·ρ·r``, ties to the lower index;
* empty slots last.

Selection yields integer indices only and is not differentiated; gradients flow through the scores of the
selected slots, which the caller computes (:func:`pcaf_core.mixture.candidate_scores`).

How the backends avoid T×T. The spec is written for clarity (dense loops over queries); the backends compute
the same candidates, slot for slot, without T×T tensors where the route allows it (docs/KERNELS.md, "Sparse
context routing: `recent` and `first`" and "`topk_score` without T×T, and why it is exact", gives the argument
in full):

* One sort per sequence by ``(address, position)`` lays every sequence out bucket by bucket, positions
  ascending inside a bucket (a :class:`BucketLayout`). A query's earlier same-bucket records are exactly the
  entries of its bucket segment before its own slot, so ``recent`` reads the K slots just before it and
  ``first`` the first K slots of the segment: O(T log T) for the sort, O(Q·K) for the gathers. NT (one query
  at T-1) and AR (every position) share the code, and the bucketed semantic route is the same over semantic
  buckets.
* ``topk_score`` scores only the M most recent same-bucket records of each query (:func:`topk_sparse_window`)
  and keeps their top K. That is the spec's answer whenever the bucket holds at most M earlier records, or
  when ρ >= 0 and the K-th best of the M scores strictly exceeds ``‖q‖·max‖k‖/√d + ρ·r_{s'}`` plus a rounding
  margin, where s' is the most recent record left out: every record s'' older than the window scores at most
  ``‖q‖·max‖k‖/√d + ρ·r_{s''} <= ‖q‖·max‖k‖/√d + ρ·r_{s'}`` (Cauchy-Schwarz; recency non-decreasing;
  ``‖q‖·max‖k‖ <= 1`` for the models' unit vectors), so it ranks strictly below K records of the window. The
  queries where neither holds are scored densely against all T records, in chunks of bounded size.
* The dense semantic route is O(T²) by definition (every record is compared with every query); the backends
  compute it a chunk of queries at a time.

Backend keyword arguments. The backends' routes take keyword arguments the spec does not; they change how the
candidates are computed, never which:

* ``strategy`` (``topk_score``): ``"auto"`` (the default), the sparse window above with a dense pass for the
  queries its proof does not cover; ``"dense"``, every query scored against all T records.
* ``sparse_window``: M of the ``topk_score`` window (:func:`topk_sparse_window`: default 4K, at least K).
* ``chunk_elements``: at most this many scores, overlaps or gathered elements exist at a time in a chunked
  pass; ``None``: the device's default (each backend's ``ops.chunk_elements_for``).
* ``query_layout``: ``"nt"`` states that ``query_pos`` is ``[T-1]``, ``"ar"`` that it is ``arange(T)`` (what
  ``records.query_positions`` gives for the mode), checked against the number of queries; ``None`` states
  nothing. With ``topk_score``, ``"ar"`` reads the window scores off blocked GEMMs in the sorted layout (each
  backend's ``ops.banded_dot``) instead of gathering ``[Q, M, d]`` key rows; ``None`` or ``"nt"`` gathers, right
  for any ``query_pos``.
* ``layout``: a precomputed :class:`BucketLayout` of ``addresses`` (each backend's ``bucket_layout``), read
  instead of sorting again.

The backends' context route takes ``select`` (:class:`SelectionInputs`) in place of ``select_score``; their
``route_context_topk_score`` routes the ``topk_score`` policy alone and also returns ``[B, Q]`` bool, True where
a query took the dense pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

SEMANTIC_TIE_BREAK = 1e-4  # weight of rho * recency in the dense semantic ranking


class Candidates(NamedTuple):
    """Selected records; the one container every backend uses (a NamedTuple: a JAX pytree as it is).

    index: ``[B, Q, C]`` integer record positions, -1 = empty slot (int64 in NumPy and torch, int32 in JAX).
    valid: ``[B, Q, C]`` bool; the reference's semantic leak marks some slots valid that are not
        causal (see :func:`route_semantic_dense`), otherwise ``valid == (index >= 0)``.
    """

    index: Any
    valid: Any

    @property
    def width(self) -> int:
        return self.index.shape[-1]


class SelectionInputs(NamedTuple):
    """What the ``topk_score`` policy ranks by: ``q_t·k_s/√d + ρ·r_s`` (√d with d = query width).

    query: ``[B, Q, d]`` query vectors (unit norm in the models); keys: ``[B, T, d]`` likewise;
    recency: ``[T]`` recency of each record, non-decreasing in s; rho: the recency scale ρ (a float, or
    a scalar array in JAX, possibly traced). Selection is not differentiated: backends pass detached
    tensors (torch) or stop gradients inside the routes (JAX).
    """

    query: Any
    keys: Any
    recency: Any
    rho: Any


class BucketLayout(NamedTuple):
    """Every sequence sorted bucket by bucket (positions ascending inside a bucket), as the sparse
    backends route from it.

    order: ``[B, T]`` position stored at each slot; rank: ``[B, T]`` slot of each position (the inverse
    permutation); seg_start: ``[B, T]`` first slot of the bucket segment holding each slot. Each backend's
    ``bucket_layout`` builds it from ``[B, T]`` non-negative addresses: one O(T log T) sort per sequence by
    ``(address, position)``.
    """

    order: Any
    rank: Any
    seg_start: Any


class ScoreBand(NamedTuple):
    """Where full-AR candidates lie in the sorted layout their route read, so that a backend reads their
    scores off blocked GEMMs (each backend's ``ops.banded_dot``) instead of gathered rows.

    layout: that :class:`BucketLayout`. width: None when slot c is each query's (c+1)-th sorted predecessor
    (the ``recent`` slots); else W, a Python int: the slots lie among each query's W sorted predecessors
    but for a few (the ``topk_score`` window; each backend's ``ops.band_gather_dot``). In JAX it is built
    inside traced code, never passed to ``jax.jit`` as an argument (``width`` must stay static).
    """

    layout: BucketLayout
    width: int | None = None


def topk_sparse_window(top_k: int, sparse_window: int | None = None) -> int:
    """M, the most recent same-bucket records the sparse backends' ``topk_score`` route scores for each
    query before proving that no older record enters the top K: ``sparse_window``, by default 4K, at least K."""
    return max(sparse_window if sparse_window is not None else 4 * top_k, top_k)


def _empty(batch: int, n_queries: int, width: int) -> Candidates:
    return Candidates(
        index=np.full((batch, n_queries, width), -1, dtype=np.int64),
        valid=np.zeros((batch, n_queries, width), dtype=bool),
    )


def _order_by_score(positions: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Positions sorted by descending score, ties to the lower position (stable)."""
    order = np.lexsort((positions, -score))
    return positions[order]


def route_context(
    addresses: np.ndarray,
    query_pos: np.ndarray,
    top_k: int,
    policy: str,
    select_score: np.ndarray | None = None,
) -> Candidates:
    """Context (exact-hash) route: earlier records in the query's bucket, at most K of them.

    Args:
        addresses: ``[B, T]`` int bucket address of every position (records and queries alike).
        query_pos: ``[Q]`` query positions; query t may read records s < t with ``a_s == a_t``.
        top_k: K, the number of slots.
        policy: which K a full bucket keeps: ``topk_score`` (highest ``select_score``),
            ``recent`` (largest s) or ``first`` (smallest s).
        select_score: ``[B, Q, T]`` float ranking score ``q_t·k_s/√d + ρ·r_s``; needed by ``topk_score``. The
            backends take ``select``, the :class:`SelectionInputs` it is computed from, and score only the
            records the route needs (module docstring).
    Returns:
        :class:`Candidates` of width K.
    """
    if policy == "topk_score" and select_score is None:
        raise ValueError("policy 'topk_score' needs select_score [B, Q, T]")
    if policy not in ("topk_score", "recent", "first"):
        raise ValueError(f"candidate policy {policy!r} is unknown: expected topk_score, recent or first")
    B, _ = addresses.shape
    out = _empty(B, len(query_pos), top_k)
    for b in range(B):
        for qi, t in enumerate(query_pos):
            same = np.flatnonzero(addresses[b, :t] == addresses[b, t])
            if policy == "topk_score":
                picked = _order_by_score(same, select_score[b, qi, same])[:top_k]
            elif policy == "recent":
                picked = same[::-1][:top_k]
            else:
                picked = same[:top_k]
            out.index[b, qi, : len(picked)] = picked
            out.valid[b, qi, : len(picked)] = True
    return out


def semantic_overlap(router_probs: np.ndarray, query_pos: np.ndarray) -> np.ndarray:
    """``m[b, q, s] = r̃_{t_q} · r̃_s``: ``[B, Q, T]`` from router probabilities ``[B, T, S]``."""
    return np.einsum("bqs,bts->bqt", router_probs[:, query_pos], router_probs)


def route_semantic_dense(
    overlap: np.ndarray,
    recency: np.ndarray,
    rho: float,
    query_pos: np.ndarray,
    top_k: int,
    *,
    target_leak: bool = False,
) -> Candidates:
    """Dense semantic route: the K earlier records with the largest ``m_s + 1e-4·ρ·r_s``.

    O(T²) by definition: every record is compared with every query.

    Args:
        overlap: ``[B, Q, T]`` semantic overlap m (see :func:`semantic_overlap`). The backends take the router
            distributions ``router_probs`` ``[B, T, S]`` instead and compute m a chunk of queries at a time, at
            most ``chunk_elements`` overlaps at once; ranking is not differentiated.
        recency: ``[T]`` recency of each record.
        rho: the learned recency scale ρ.
        query_pos: ``[Q]`` query positions.
        top_k: K.
        target_leak: reproduce the reference full-AR quirk (docs/REFERENCE_CODE.md §3.3): a query t < K, which has
            only t causal records, also receives the masked picks ``s = t, t+1, …, K-1`` (clipped to
            T-1), marked valid: slot j >= t holds record j, so slot t holds the target itself. Only meaningful
            in AR mode; in NT mode every query has T-1 >= K records before it unless T is tiny.
    Returns:
        :class:`Candidates` of width K.
    """
    B, Q, T = overlap.shape
    out = _empty(B, Q, top_k)
    for b in range(B):
        for qi, t in enumerate(query_pos):
            earlier = np.arange(t)
            rank = overlap[b, qi, :t] + SEMANTIC_TIE_BREAK * rho * recency[:t]
            picked = _order_by_score(earlier, rank)[:top_k]
            n = len(picked)
            out.index[b, qi, :n] = picked
            out.valid[b, qi, :n] = True
            if target_leak and n < top_k:
                leaked = np.arange(t, min(top_k, T))[: top_k - n]
                out.index[b, qi, n : n + len(leaked)] = leaked
                out.valid[b, qi, n : n + len(leaked)] = True
    return out


def semantic_buckets(router_probs: np.ndarray) -> np.ndarray:
    """``[B, T]`` int64 semantic bucket of every position: argmax of the router distribution
    (ties to the lower bucket)."""
    return np.argmax(router_probs, axis=-1).astype(np.int64)


def route_semantic_bucketed(sem_buckets: np.ndarray, query_pos: np.ndarray, top_k: int) -> Candidates:
    """Bucketed semantic route (as the paper describes it): the K most recent earlier records whose
    semantic bucket equals the query's. Causal by construction."""
    return route_context(sem_buckets, query_pos, top_k, "recent")


def combine_hybrid(context: Candidates, semantic: Candidates, *, dedup: bool) -> Candidates:
    """Hybrid route: ``[context slots, semantic slots]`` (width 2K).

    The reference concatenates without de-duplication, so a record picked by both routes gets two
    slots (double softmax mass). With ``dedup`` a semantic slot whose record is already a valid
    context slot of the same query is emptied (-1, invalid); slots keep their positions.
    """
    index = np.concatenate([context.index, semantic.index], axis=-1)
    valid = np.concatenate([context.valid, semantic.valid], axis=-1)
    if dedup:
        K = context.width
        ctx_idx = np.where(context.valid, context.index, -2)  # -2 never matches a record
        dup = (semantic.index[..., :, None] == ctx_idx[..., None, :]).any(-1) & semantic.valid
        index[..., K:] = np.where(dup, -1, semantic.index)
        valid[..., K:] = semantic.valid & ~dup
    return Candidates(index=index, valid=valid)


def gather_records(values: np.ndarray, cand: Candidates) -> np.ndarray:
    """Gather per-position arrays at candidate slots.

    values: ``[B, T, ...]``; returns ``[B, Q, C, ...]`` (empty slots read position 0; mask with ``valid``).
    """
    idx = np.clip(cand.index, 0, None)
    b = np.arange(values.shape[0])[:, None, None]
    return values[b, idx]
