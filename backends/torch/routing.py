"""Candidate selection in torch, equal to :mod:`pcaf_core.routing` slot for slot.

The routes follow the backends' strategy that :mod:`pcaf_core.routing` states ("How the backends avoid T×T";
docs/KERNELS.md, "Sparse context routing: `recent` and `first`" and "`topk_score` without T×T, and why it is
exact"), with the keyword arguments listed there. In torch:

* the layout comes from one sort of the unique key ``address·T + position`` (:func:`bucket_layout`); on CUDA
  tensors the Triton kernels of :mod:`backends.torch.kernels` select ``recent`` and ``first`` by default
  (``kernels=`` of :func:`route_context`);
* the ``topk_score`` dense pass loops over the unproven queries in bounded chunks and selects with
  :func:`topk_rows`;
* selection runs in at least float32 with autocast off, so bf16/fp16 rounding neither swamps the proof's
  margins nor changes the ranking.

Candidate indices are int64.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from backends.torch.ops import banded_dot, batch_gather, chunk_elements_for, gather_dot
from pcaf_core.config import CANDIDATE_POLICIES
from pcaf_core.routing import SEMANTIC_TIE_BREAK, BucketLayout, Candidates, SelectionInputs, topk_sparse_window

TOPK_STRATEGIES = ("auto", "dense")


def _exact_selection(select: SelectionInputs) -> SelectionInputs:
    """Selection inputs in at least float32: under autocast the projections arrive in bf16/fp16, whose
    rounding would swamp the proof's margins and send every query to the dense path."""
    work = torch.promote_types(select.query.dtype, torch.float32)
    return SelectionInputs(select.query.to(work), select.keys.to(work), select.recency.to(work), float(select.rho))


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Selection scores are computed in the inputs' precision, not autocast's."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _empty(batch: int, n_queries: int, width: int, device: torch.device) -> Candidates:
    return Candidates(
        index=torch.full((batch, n_queries, width), -1, dtype=torch.int64, device=device),
        valid=torch.zeros((batch, n_queries, width), dtype=torch.bool, device=device),
    )


def bucket_layout(addresses: torch.Tensor) -> BucketLayout:
    """The :class:`BucketLayout` of ``[B, T]`` non-negative addresses: one sort per sequence of the unique key
    ``address·T + position``."""
    B, T = addresses.shape
    pos = torch.arange(T, device=addresses.device)
    # address·T + position is unique per sequence, so the sort is deterministic and keeps positions
    # ascending inside each bucket; int64 holds it for any B < 2^63 / T.
    key = addresses.to(torch.int64) * T + pos
    sorted_key, order = torch.sort(key, dim=-1)
    sorted_addr = torch.div(sorted_key, T, rounding_mode="floor")
    rank = torch.empty_like(order)
    rank.scatter_(1, order, pos.expand(B, T).contiguous())
    is_start = torch.ones_like(sorted_addr, dtype=torch.bool)
    is_start[:, 1:] = sorted_addr[:, 1:] != sorted_addr[:, :-1]
    seg_start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), dim=1).values
    return BucketLayout(order=order, rank=rank, seg_start=seg_start)


def _query_slots(layout: BucketLayout, query_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot, segment start and number of earlier same-bucket records of each query, each ``[B, Q]``."""
    slot = layout.rank[:, query_pos]
    start = layout.seg_start.gather(1, slot)
    return slot, start, slot - start


def _recent_slots(layout: BucketLayout, slot: torch.Tensor, count: torch.Tensor, width: int) -> Candidates:
    """The ``width`` slots just before each query's slot in its segment, most recent first."""
    B, Q = slot.shape
    offs = torch.arange(1, width + 1, device=slot.device)
    valid = offs <= count[..., None]  # [B, Q, width]
    src = (slot[..., None] - offs).clamp(min=0)
    index = layout.order.gather(1, src.reshape(B, -1)).reshape(B, Q, width)
    return Candidates(torch.where(valid, index, -1), valid)


def _first_slots(layout: BucketLayout, start: torch.Tensor, count: torch.Tensor, width: int) -> Candidates:
    """The first ``width`` slots of each query's segment that precede the query, earliest first."""
    B, Q = start.shape
    T = layout.order.shape[1]
    offs = torch.arange(width, device=start.device)
    valid = offs < count[..., None]
    src = (start[..., None] + offs).clamp(max=T - 1)
    index = layout.order.gather(1, src.reshape(B, -1)).reshape(B, Q, width)
    return Candidates(torch.where(valid, index, -1), valid)


def topk_rows(rank: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the k valid columns with the largest ``rank``, ties to the lower column, in that order.

    Args:
        rank: ``[N, T]`` float scores; valid: ``[N, T]`` bool.
    Returns:
        index ``[N, k]`` int64 (-1 = fewer than k valid columns) and its mask ``[N, k]`` bool.

    ``torch.topk`` does not specify its tie order, so it is used only for the k-th largest value;
    the columns strictly above it are all kept and the tied ones are taken lowest column first.
    """
    N, T = rank.shape
    kk = min(k, T)
    index = torch.full((N, k), -1, dtype=torch.int64, device=rank.device)
    ok = torch.zeros((N, k), dtype=torch.bool, device=rank.device)
    if N == 0 or kk == 0:
        return index, ok
    masked = rank.masked_fill(~valid, -math.inf)
    kth = torch.topk(masked, kk, dim=-1).values[:, -1:]  # [N, 1]
    above = valid & (masked > kth)
    ties = valid & (masked == kth)
    room = kk - above.sum(-1, keepdim=True)
    chosen = above | (ties & (ties.cumsum(-1) <= room))
    col = torch.arange(T, device=rank.device)
    # T - col > 0 marks a chosen column; topk of it lists the chosen columns in ascending order.
    picked = torch.topk(torch.where(chosen, T - col, torch.zeros_like(col)), kk, dim=-1).values
    got = picked > 0
    cols = torch.where(got, T - picked, torch.zeros_like(picked))
    score = masked.gather(1, cols).masked_fill(~got, -math.inf)
    # Columns are ascending, so a stable descending sort breaks score ties to the lower column.
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    got = got.gather(1, order)
    index[:, :kk] = torch.where(got, cols.gather(1, order), -1)
    ok[:, :kk] = got
    return index, ok


def _dense_context_topk(
    addresses: torch.Tensor,
    query_pos: torch.Tensor,
    top_k: int,
    select: SelectionInputs,
    pairs: torch.Tensor,
    chunk_elements: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec-exact ``topk_score`` for the ``(b, q)`` pairs ``[P, 2]``, scoring all T records per query
    in chunks of at most ``chunk_elements`` scores. Returns index/valid ``[P, K]``."""
    T = addresses.shape[1]
    scale = math.sqrt(select.query.shape[-1])
    index = torch.full((len(pairs), top_k), -1, dtype=torch.int64, device=addresses.device)
    valid = torch.zeros((len(pairs), top_k), dtype=torch.bool, device=addresses.device)
    col = torch.arange(T, device=addresses.device)
    rec_term = select.rho * select.recency
    for b in torch.unique(pairs[:, 0]).tolist():
        rows = torch.nonzero(pairs[:, 0] == b)[:, 0]
        step = max(1, chunk_elements // max(T, 1))
        for r0 in range(0, len(rows), step):
            r = rows[r0 : r0 + step]
            qi = pairs[r, 1]
            t = query_pos[qi]
            score = (select.query[b, qi] @ select.keys[b].T) / scale + rec_term
            ok = (addresses[b][None, :] == addresses[b, t][:, None]) & (col[None, :] < t[:, None])
            index[r], valid[r] = topk_rows(score, ok, top_k)
    return index, valid


def _window_topk(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's top k of each window row: ``score [B, Q, M]`` (slot j = the (j+1)-th most recent record,
    -inf = empty) -> window slots ``[B, Q, k]`` by descending score, ties to the older record (larger j, the
    lower index), and the k-th score ``[B, Q]``.

    ``torch.topk`` (unspecified tie order) picks k slots; only rows where a tie straddles the k-th place are
    picked again by a stable sort. The k picks are then put in order by one sort of a unique int64 key (the
    float32 score's order-preserving bits, then j), or, for other dtypes, by two stable sorts (torch's CPU
    sort of short rows costs about as much per call either way, so one call instead of two).
    """
    vals, j = torch.topk(score, k, dim=-1, sorted=False)
    kth = vals.amin(-1)
    straddle = ((score >= kth[..., None]).sum(-1) > k) & (kth > -math.inf)
    if bool(straddle.any()):
        b, q = torch.nonzero(straddle, as_tuple=True)
        # Reversed, the window is in ascending record index, so the stable sort breaks ties to the lower index.
        rev = torch.sort(score[b, q].flip(-1), dim=-1, descending=True, stable=True).indices[:, :k]
        j[b, q] = score.shape[-1] - 1 - rev
        vals[b, q] = score[b, q].gather(-1, j[b, q])
    if vals.dtype == torch.float32:
        bits = (vals + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, which it equals
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order = float order (-inf lowest)
        key = (ordered.to(torch.int64) << 32) | j  # unique per row: score first, then the older slot
        return j.gather(-1, torch.sort(key, dim=-1, descending=True).indices), kth
    by_age = torch.sort(j, dim=-1, descending=True, stable=True).indices  # older first
    j, vals = j.gather(-1, by_age), vals.gather(-1, by_age)
    by_score = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return j.gather(-1, by_score), kth


def route_context_topk_score(
    addresses: torch.Tensor,
    query_pos: torch.Tensor,
    top_k: int,
    select: SelectionInputs,
    *,
    strategy: str = "auto",
    sparse_window: int | None = None,
    layout: BucketLayout | None = None,
    chunk_elements: int | None = None,
    query_layout: str | None = None,
) -> tuple[Candidates, torch.Tensor]:
    """The ``topk_score`` policy of :func:`route_context` alone, with the ``[B, Q]`` bool mask of the queries
    that took the dense pass (:mod:`pcaf_core.routing`, "How the backends avoid T×T").

    ``select`` is promoted to at least float32 and scored with autocast off. The dense pass scores the unproven
    queries in chunks of at most ``chunk_elements`` scores and selects with :func:`topk_rows`.
    """
    if strategy not in TOPK_STRATEGIES:
        raise ValueError(f"topk_score strategy {strategy!r} is unknown: expected one of {list(TOPK_STRATEGIES)}")
    _check_query_layout(query_layout, query_pos, addresses)
    with _autocast_off(addresses.device):
        return _route_context_topk_score(addresses, query_pos, top_k, _exact_selection(select), strategy,
                                         sparse_window, layout, chunk_elements_for(addresses, chunk_elements),
                                         query_layout)


def max_norm_bound(rows: torch.Tensor) -> torch.Tensor:
    """An upper bound, float64, on ``max_t ‖rows[b, t]‖``: ``rows`` ``[B, T, d]`` -> ``[B, 1]``.

    The norms are taken in ``rows``' own dtype, then widened by ``1 + (d + 2)·eps``, which covers their
    rounding whatever the summation order (a sum of d products is within ``γ_{d+1}`` of exact, the square
    root within eps). Widening the whole ``[B, T, d]`` tensor to float64 first, for the exact maximum, took
    19 ms alone at B=32, T=2,048, d=128 on the 2-core CPU, and 6-10% of a next-token ``topk_score`` step;
    the bound only ever sends more queries to the dense path.
    """
    d, eps = rows.shape[-1], torch.finfo(rows.dtype).eps
    top = torch.linalg.vector_norm(rows, dim=-1).amax(-1, keepdim=True).to(torch.float64)
    return top * (1.0 + (d + 2) * eps)


def _route_context_topk_score(
    addresses: torch.Tensor,
    query_pos: torch.Tensor,
    top_k: int,
    select: SelectionInputs,
    strategy: str,
    sparse_window: int | None,
    layout: BucketLayout | None,
    chunk_elements: int,
    query_layout: str | None,
) -> tuple[Candidates, torch.Tensor]:
    B, T = addresses.shape
    Q, K = len(query_pos), top_k
    device = addresses.device
    if strategy == "dense":
        out = _empty(B, Q, K, device)
        dense = torch.ones((B, Q), dtype=torch.bool, device=device)
    else:
        M = topk_sparse_window(K, sparse_window)
        layout = bucket_layout(addresses) if layout is None else layout
        slot, _, count = _query_slots(layout, query_pos)
        ok_m = torch.arange(M, device=device) < count[..., None]  # [B, Q, M]: window slot j, most recent first
        d = select.query.shape[-1]
        if query_layout == "ar":
            dots = banded_dot(layout.order, layout.rank, select.query, select.keys, M)
            # Recency of sorted slot i - 1 - j for every slot i: a sliding view of the sorted recency.
            rec_sorted = F.pad(select.recency[layout.order], (M, 0))
            rec_m = batch_gather(rec_sorted.unfold(1, M, 1)[:, :T].flip(-1), layout.rank)
        else:
            idx_m = _recent_slots(layout, slot, count, M).index.clamp(min=0)
            dots = gather_dot(select.query, select.keys, idx_m, chunk_elements=chunk_elements)
            rec_m = select.recency[idx_m]
        score = (dots / math.sqrt(d) + select.rho * rec_m).masked_fill(~ok_m, -math.inf)
        j, kth = _window_topk(score, K)
        keep = ok_m.gather(-1, j)
        picked = layout.order.gather(1, (slot[..., None] - 1 - j).clamp(min=0).reshape(B, -1)).view(B, Q, K)
        out = Candidates(torch.where(keep, picked, -1), keep)

        overflow = count > M
        left_out = layout.order.gather(1, (slot - 1 - M).clamp(min=0))  # the most recent record left out
        eps = torch.finfo(score.dtype).eps
        rho = float(select.rho)
        # |q·k| <= ‖q‖·max‖k‖ (= 1 for the models' unit vectors; using the norms keeps the proof valid
        # for any inputs). The margins cover rounding in the dot products (~d·eps relative) and in ρ·r,
        # for this computation and the spec's alike; they only ever send more queries to the dense path.
        dot_bound = (torch.linalg.vector_norm(select.query.to(torch.float64), dim=-1)
                     * max_norm_bound(select.keys))
        bound = (dot_bound * (1.0 + 4.0 * d * eps) / math.sqrt(d)
                 + rho * select.recency.to(torch.float64)[left_out] + 4.0 * eps * (1.0 + abs(rho)))
        proven = (kth.to(torch.float64) > bound) if rho >= 0 else torch.zeros_like(overflow)
        dense = overflow & ~proven
    pairs = torch.nonzero(dense)
    if len(pairs):
        index, valid = _dense_context_topk(addresses, query_pos, K, select, pairs, chunk_elements)
        out.index[pairs[:, 0], pairs[:, 1]] = index
        out.valid[pairs[:, 0], pairs[:, 1]] = valid
    return out, dense


def route_context(
    addresses: torch.Tensor,
    query_pos: torch.Tensor,
    top_k: int,
    policy: str,
    select: SelectionInputs | None = None,
    *,
    strategy: str = "auto",
    sparse_window: int | None = None,
    chunk_elements: int | None = None,
    kernels: bool | None = None,
    query_layout: str | None = None,
    layout: BucketLayout | None = None,
) -> Candidates:
    """See :func:`pcaf_core.routing.route_context`; keyword arguments as listed in :mod:`pcaf_core.routing`.

    Args:
        kernels: select ``recent``/``first`` candidates with the Triton kernels of :mod:`backends.torch.kernels`
            (same candidates, tested); ``None`` = on CUDA tensors only (:func:`kernels_by_default`).
        query_layout: also chooses the kernel without reading ``query_pos`` back from the device; ``None``
            reads it (a device sync and, compiled, a graph break).
        layout: when given, the kernels are not used (a caller that scores the candidates off the layout's band,
            :func:`backends.torch.ops.banded_dot`, needs the layout anyway).
    """
    if policy not in CANDIDATE_POLICIES:
        raise ValueError(f"candidate policy {policy!r} is unknown: expected one of {list(CANDIDATE_POLICIES)}")
    if policy == "topk_score":
        if select is None:
            raise ValueError("policy 'topk_score' needs select=SelectionInputs(query, keys, recency, rho)")
        return route_context_topk_score(addresses, query_pos, top_k, select, strategy=strategy,
                                        sparse_window=sparse_window, layout=layout, chunk_elements=chunk_elements,
                                        query_layout=query_layout)[0]
    _check_query_layout(query_layout, query_pos, addresses)
    if layout is None and (kernels if kernels is not None else kernels_by_default(addresses)):
        picked = _kernel_candidates(addresses, query_pos, top_k, policy, query_layout)
        if picked is not None:
            return picked
    layout = bucket_layout(addresses) if layout is None else layout
    slot, start, count = _query_slots(layout, query_pos)
    if policy == "recent":
        return _recent_slots(layout, slot, count, top_k)
    return _first_slots(layout, start, count, top_k)


def kernels_by_default(addresses: torch.Tensor) -> bool:
    """Whether :func:`route_context` selects ``recent``/``first`` candidates with the Triton kernels when its
    caller does not say: on CUDA tensors."""
    return addresses.is_cuda


def _check_query_layout(query_layout: str | None, query_pos: torch.Tensor, addresses: torch.Tensor) -> None:
    if query_layout not in (None, "nt", "ar"):
        raise ValueError(f"query_layout {query_layout!r} is unknown: expected 'nt', 'ar' or None")
    want = {"nt": 1, "ar": addresses.shape[1]}.get(query_layout)
    if want is not None and len(query_pos) != want:
        raise ValueError(f"query_layout {query_layout!r} needs {want} query positions, got {len(query_pos)}")


def _kernel_candidates(
    addresses: torch.Tensor, query_pos: torch.Tensor, top_k: int, policy: str, query_layout: str | None
) -> Candidates | None:
    """The Triton kernels cover the two query layouts the models use: NT (only T-1) and AR (every t).
    A stated layout is trusted; otherwise ``query_pos`` is read back, a device sync (and, compiled, a
    graph break) on every call."""
    from backends.torch.kernels import candidates_ar, candidates_nt

    T = addresses.shape[1]
    if query_layout is None:
        if len(query_pos) == 1 and int(query_pos[0]) == T - 1:
            query_layout = "nt"
        elif len(query_pos) == T and torch.equal(query_pos.cpu(), torch.arange(T)):
            query_layout = "ar"
    if query_layout == "nt":
        return Candidates(*candidates_nt(addresses, top_k, policy))
    if query_layout == "ar":
        return Candidates(*candidates_ar(addresses, top_k, policy))
    return None


def semantic_overlap(router_probs: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """See :func:`pcaf_core.routing.semantic_overlap`."""
    return router_probs[:, query_pos] @ router_probs.transpose(1, 2)


def route_semantic_dense(
    router_probs: torch.Tensor,
    recency: torch.Tensor,
    rho: float,
    query_pos: torch.Tensor,
    top_k: int,
    *,
    target_leak: bool = False,
    chunk_elements: int | None = None,
) -> Candidates:
    """See :func:`pcaf_core.routing.route_semantic_dense` (the backends' form, from ``router_probs``).

    ``router_probs`` come detached from the caller; selection runs in at least float32 with autocast off, and
    ``rho`` is read as a Python float.
    """
    with _autocast_off(router_probs.device):
        work = torch.promote_types(router_probs.dtype, torch.float32)
        return _route_semantic_dense(router_probs.to(work), recency.to(work), float(rho), query_pos, top_k,
                                     target_leak, chunk_elements_for(router_probs, chunk_elements))


def _route_semantic_dense(
    router_probs: torch.Tensor,
    recency: torch.Tensor,
    rho: float,
    query_pos: torch.Tensor,
    top_k: int,
    target_leak: bool,
    chunk_elements: int,
) -> Candidates:
    B, T, _ = router_probs.shape
    Q, K = len(query_pos), top_k
    out = _empty(B, Q, K, router_probs.device)
    col = torch.arange(T, device=router_probs.device)
    tie_break = (SEMANTIC_TIE_BREAK * rho) * recency
    step = max(1, chunk_elements // max(B * T, 1))
    for q0 in range(0, Q, step):
        t = query_pos[q0 : q0 + step]
        rank = semantic_overlap(router_probs, t) + tie_break  # [B, q, T]
        ok = (col[None, :] < t[:, None]).expand(B, -1, -1)
        index, valid = topk_rows(rank.reshape(-1, T), ok.reshape(-1, T), K)
        out.index[:, q0 : q0 + step] = index.view(B, len(t), K)
        out.valid[:, q0 : q0 + step] = valid.view(B, len(t), K)
    if target_leak:
        slots = torch.arange(K, device=router_probs.device)
        # A query t < K holds exactly t causal picks in slots 0..t-1; the reference's masked picks
        # fill slot j >= t with record j (lax.top_k order), up to the last position T-1.
        leak = (slots[None, :] >= query_pos[:, None]) & (slots[None, :] < T)  # [Q, K]
        out.index[:] = torch.where(leak, slots, out.index)
        out.valid[:] = out.valid | leak
    return out


def semantic_buckets(router_probs: torch.Tensor) -> torch.Tensor:
    """See :func:`pcaf_core.routing.semantic_buckets` (``torch.argmax`` returns the first maximum)."""
    return torch.argmax(router_probs, dim=-1).to(torch.int64)


def route_semantic_bucketed(
    sem_buckets: torch.Tensor, query_pos: torch.Tensor, top_k: int, *, query_layout: str | None = None,
    layout: BucketLayout | None = None,
) -> Candidates:
    """See :func:`pcaf_core.routing.route_semantic_bucketed`; ``query_layout``, ``layout``: as in
    :func:`route_context`."""
    return route_context(sem_buckets, query_pos, top_k, "recent", query_layout=query_layout, layout=layout)


def combine_hybrid(context: Candidates, semantic: Candidates, *, dedup: bool) -> Candidates:
    """See :func:`pcaf_core.routing.combine_hybrid`."""
    index = torch.cat([context.index, semantic.index], dim=-1)
    valid = torch.cat([context.valid, semantic.valid], dim=-1)
    if dedup:
        K = context.width
        ctx_idx = torch.where(context.valid, context.index, -2)  # -2 never matches a record
        dup = (semantic.index[..., :, None] == ctx_idx[..., None, :]).any(-1) & semantic.valid
        index[..., K:] = torch.where(dup, -1, semantic.index)
        valid[..., K:] = semantic.valid & ~dup
    return Candidates(index, valid)


def gather_records(values: torch.Tensor, cand: Candidates) -> torch.Tensor:
    """See :func:`pcaf_core.routing.gather_records`."""
    return batch_gather(values, cand.index.clamp(min=0))
