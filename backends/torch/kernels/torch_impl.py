"""Pure-torch (vectorised, no Triton) implementations of the bucket kernels.

These run wherever Triton cannot (CPU without ``TRITON_INTERPRET=1``) and serve as a second, independent
formulation in the tests. Memory is O(B·T·K) at most; no ``[B, T, T]`` tensor is ever formed.

Semantics are those of :func:`pcaf_core.routing.route_context` under the ``recent`` and ``first``
policies: query t may read records s < t with ``a_s == a_t``; ``recent`` keeps the K largest such s,
most recent first, ``first`` the K smallest, earliest first; empty slots hold -1 and come last.
"""

from __future__ import annotations

import torch

from backends.torch.kernels._common import (
    bucket_of,
    check_addresses,
    check_num_buckets,
    check_policy,
    check_top_k,
)


def candidates_nt_torch(
    addresses: torch.Tensor, top_k: int, policy: str, *, num_buckets: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token candidates: the query is position T-1, the records are 0..T-2.

    Args:
        addresses: ``[B, T]`` integer bucket addresses, or context hashes when ``num_buckets`` is given.
        top_k: K >= 1 slots.
        policy: ``recent`` or ``first``.
        num_buckets: if given, ``addresses`` are non-negative context hashes and are bucketed with
            ``(h·1_000_003 + 97_531) mod num_buckets`` first.
    Returns:
        ``index [B, 1, K]`` int64 record positions (-1 = empty) and ``valid [B, 1, K]`` bool.
    """
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    a = check_addresses(addresses)
    if num_buckets is not None:
        a = bucket_of(a, num_buckets)
    B, T = a.shape
    n_rec = T - 1
    pos = torch.arange(n_rec, device=a.device, dtype=torch.int64)
    match = a[:, :n_rec] == a[:, n_rec:]  # [B, T-1], O(T) per sequence
    if policy == "recent":
        # Visit records latest first, so the running match count is the slot under `recent`.
        match = match.flip(-1)
        pos = pos.flip(-1)
    slot = match.to(torch.int64).cumsum(-1) - 1
    keep = match & (slot < top_k)
    # Records that are not kept land in a spare column K, dropped afterwards.
    slot = torch.where(keep, slot, top_k)
    index = torch.full((B, top_k + 1), -1, dtype=torch.int64, device=a.device)
    index.scatter_(1, slot, torch.where(keep, pos.expand(B, n_rec), -1))
    index = index[:, :top_k].unsqueeze(1).contiguous()
    return index, index >= 0


def _sorted_segments(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of each row by address: equal addresses form contiguous segments, in position order."""
    sorted_addr, perm = torch.sort(a, dim=-1, stable=True)
    return sorted_addr, perm


def candidates_ar_torch(
    addresses: torch.Tensor, top_k: int, policy: str, *, num_buckets: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-autoregressive candidates: every position t is a query over records s < t.

    After a stable sort by address, the records that query t may read are exactly the entries before t
    in its segment. ``recent`` takes the K entries just before it; ``first`` the first K of the segment,
    bounded by t's own sorted position. The rows are then scattered back to original positions.

    Args:
        addresses: ``[B, T]`` integer addresses (context hashes when ``num_buckets`` is given).
        top_k: K >= 1.
        policy: ``recent`` or ``first``.
        num_buckets: see :func:`candidates_nt_torch`.
    Returns:
        ``index [B, T, K]`` int64 (-1 = empty) and ``valid [B, T, K]`` bool.
    """
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    a = check_addresses(addresses)
    if num_buckets is not None:
        a = bucket_of(a, num_buckets)
    B, T = a.shape
    sorted_addr, perm = _sorted_segments(a)
    p = torch.arange(T, device=a.device, dtype=torch.int64)[:, None]  # [T, 1] sorted position
    j = torch.arange(top_k, device=a.device, dtype=torch.int64)[None, :]  # [1, K] slot
    if policy == "recent":
        src = p - 1 - j  # [T, K]: the K sorted entries just before each query
        src_c = src.clamp(min=0).expand(B, T, top_k).reshape(B, T * top_k)
        same = torch.gather(sorted_addr, 1, src_c).view(B, T, top_k) == sorted_addr[:, :, None]
        ok = (src >= 0) & same  # segments are contiguous: equal address <=> same segment
    else:
        # Segment start of every sorted position: first index holding the same address (binary search).
        seg_start = torch.searchsorted(sorted_addr, sorted_addr, side="left")  # [B, T]
        src = seg_start[:, :, None] + j  # [B, T, K]: the segment's first K entries
        ok = src < p  # ...that precede the query
        src_c = torch.minimum(src, p).reshape(B, T * top_k)
    cand = torch.gather(perm, 1, src_c)
    cand = torch.where(ok, cand.view(B, T, top_k), -1)
    index = torch.empty_like(cand)
    # perm is a permutation of 0..T-1: every output row is written exactly once.
    index.scatter_(1, perm[:, :, None].expand(B, T, top_k), cand)
    return index, index >= 0


def bucket_table_torch(
    records: torch.Tensor, num_buckets: int, top_k: int, policy: str, *, hash_input: bool = False
) -> torch.Tensor:
    """Per-sequence bucket table: the K records each bucket keeps, in policy order.

    Args:
        records: ``[B, N]`` integer bucket ids of the records (context hashes if ``hash_input``).
        num_buckets: number of buckets; ids outside ``[0, num_buckets)`` are not stored.
        top_k: K slots per bucket.
        policy: ``recent`` (slot 0 = latest record) or ``first`` (slot 0 = earliest).
        hash_input: apply the second hash to ``records`` first.
    Returns:
        ``[B, num_buckets, K]`` int32 record positions, -1 = empty.
    """
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    a = check_addresses(records, min_len=0)
    if hash_input:
        a = bucket_of(a, num_buckets)
    B, N = a.shape
    table = torch.full((B, num_buckets * top_k + 1), -1, dtype=torch.int32, device=a.device)
    if N == 0:
        return table[:, :-1].view(B, num_buckets, top_k)
    sorted_addr, perm = _sorted_segments(a)
    p = torch.arange(N, device=a.device, dtype=torch.int64)[:, None]
    step = torch.arange(1, top_k + 1, device=a.device, dtype=torch.int64)[None, :]
    # Rank inside the bucket, saturated at K: only the K neighbours on the policy's side matter.
    nbr = p + step if policy == "recent" else p - step  # [N, K]
    inb = (nbr >= 0) & (nbr < N)
    nbr_c = nbr.clamp(0, N - 1).reshape(1, N * top_k).expand(B, N * top_k)
    same = torch.gather(sorted_addr, 1, nbr_c).view(B, N, top_k) == sorted_addr[:, :, None]
    rank = (same & inb).sum(-1)  # [B, N]
    keep = (rank < top_k) & (sorted_addr >= 0) & (sorted_addr < num_buckets)
    flat = torch.where(keep, sorted_addr * top_k + rank, num_buckets * top_k)
    table.scatter_(1, flat, torch.where(keep, perm, -1).to(torch.int32))
    return table[:, :-1].reshape(B, num_buckets, top_k)


def lookup_bucket_table(table: torch.Tensor, query_addresses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one bucket per sequence from a table built by ``build_bucket_table``.

    Args:
        table: ``[B, num_buckets, K]`` int32 table.
        query_addresses: ``[B]`` bucket id of each sequence's query, in ``[0, num_buckets)``.
    Returns:
        ``index [B, 1, K]`` int64 (-1 = empty) and ``valid [B, 1, K]`` bool.
    """
    if table.dim() != 3 or query_addresses.shape != table.shape[:1]:
        raise ValueError(
            f"expected table [B, num_buckets, K] and query_addresses [B], got {tuple(table.shape)} "
            f"and {tuple(query_addresses.shape)}"
        )
    rows = torch.arange(table.shape[0], device=table.device)
    index = table[rows, query_addresses.to(torch.int64)].to(torch.int64).unsqueeze(1)
    return index, index >= 0
