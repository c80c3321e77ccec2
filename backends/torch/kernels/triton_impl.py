"""Triton kernels for context-route candidate selection, and their host-side launchers.

Three kernels, all deterministic (no atomics: every output element has exactly one writer, and which
records a bucket keeps follows from positions alone, never from scheduling order):

* :func:`_nt_scan_kernel` -- next-token lookup. One program per sequence scans the record addresses
  once, compacting the positions that share the query's bucket into K slots in policy order.
* :func:`_ar_select_kernel` -- full-autoregressive selection. After a stable per-row sort by address,
  the records a query may read are the entries before it in its segment; one program per (sequence,
  block of sorted positions) gathers them and scatters each query's K-slot row to its original position.
* :func:`_bucket_table_kernel` -- bucket table build (``[B, num_buckets, K]``). Each sorted record
  derives its rank in its bucket from its K neighbours in sorted order and writes itself to slot
  ``rank`` when ``rank < K``: the deterministic counterpart of an atomic first-come table.

Index arithmetic inside the kernels is int32 (positions are < T < 2^31); row offsets that scale with B
are formed in int64 so large batches cannot overflow a pointer offset.

Kernels are created by ``triton.jit`` at import time; when ``TRITON_INTERPRET=1`` is set before that
import they run on CPU tensors through Triton's interpreter (:data:`INTERPRETED`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from backends.torch.kernels._common import (
    bucket_of,
    check_addresses,
    check_num_buckets,
    check_policy,
    check_top_k,
)
from pcaf_core.hashing import BUCKET_ADD, HASH_MULT

# Block sizes. The NT scan holds BLOCK addresses per step (1024 int64 = 8 KiB per load, 8 per thread at
# 4 warps). The AR and table kernels hold [BLOCK_P, K_PAD] tiles of ~2048 elements: at 4 warps that is
# 16 elements per thread per live tensor, ~95 registers on sm_90 with no spills, so five programs fit
# on an SM and their independent gathers overlap each other's latency. Twice that tile doubles the
# register count (~200) and cuts residency to two programs per SM.
_NT_MAX_BLOCK = 1024
_TILE_ELEMS = 2048
_MIN_BLOCK = 16


@triton.jit
def _bucket_hash(h, num_buckets, MULT: tl.constexpr, ADD: tl.constexpr):
    """The spec's second hash ``(h·MULT + ADD) mod num_buckets`` on int64 lanes (h >= 0, so the C-style
    remainder equals the spec's floor remainder)."""
    return (h * MULT + ADD) % num_buckets


@triton.jit
def _nt_scan_kernel(
    addr_ptr,  # [B, T] int64: bucket ids, or context hashes when HASH
    index_ptr,  # [B, K] int64 out: record positions, -1 = empty
    valid_ptr,  # [B, K] bool out
    T,  # sequence length; records are 0..T-2, the query is T-1
    K,  # slots per query
    num_buckets,  # used only when HASH
    HASH: tl.constexpr,
    RECENT: tl.constexpr,
    MULT: tl.constexpr,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """Grid ``(B,)``: program b answers sequence b's single query.

    Each step loads BLOCK consecutive record addresses (one coalesced load; under ``recent`` the window
    walks backwards from T-2, so the first hits are the most recent records). Every lane tests its
    record against the query's bucket; an inclusive prefix sum over the hit flags gives each hit its
    slot ``found + (hits in earlier lanes)``, so hits are compacted in scan order without atomics. The
    loop stops as soon as K slots are filled, so a popular bucket costs ~K/hit-rate loads, not T.
    One program per sequence is the right shape: the per-sequence work is a single pass over <= T
    int64 values, and keeping it in one program makes the running slot counter a register.
    """
    b = tl.program_id(0).to(tl.int64)
    row = addr_ptr + b * T
    out_index = index_ptr + b * K
    out_valid = valid_ptr + b * K
    n_rec = T - 1
    q = tl.load(row + n_rec)
    if HASH:
        q = _bucket_hash(q, num_buckets, MULT, ADD)
    lanes = tl.arange(0, BLOCK)
    found = 0
    start = 0
    while (start < n_rec) & (found < K):
        if RECENT:
            pos = n_rec - 1 - start - lanes
        else:
            pos = start + lanes
        inb = (pos >= 0) & (pos < n_rec)
        a = tl.load(row + pos, mask=inb, other=0)
        if HASH:
            a = _bucket_hash(a, num_buckets, MULT, ADD)
        hit = inb & (a == q)
        hit_i = hit.to(tl.int32)
        slot = found + tl.cumsum(hit_i, axis=0) - 1
        tl.store(out_index + slot, pos.to(tl.int64), mask=hit & (slot < K))
        found += tl.sum(hit_i, axis=0)
        start += BLOCK
    # Slots past the last hit are empty: -1 and invalid. The scan wrote slots < min(found, K) only,
    # so every slot has exactly one writer.
    j = tl.arange(0, K_PAD)
    tl.store(out_index + j, tl.full([K_PAD], -1, tl.int64), mask=(j >= found) & (j < K))
    tl.store(out_valid + j, j < found, mask=j < K)


@triton.jit
def _ar_select_kernel(
    saddr_ptr,  # [B, T] int64: each row's addresses, stably sorted
    perm_ptr,  # [B, T] int64: perm[b, p] = original position of sorted entry p
    index_ptr,  # [B, T, K] int64 out
    valid_ptr,  # [B, T, K] bool out
    T,
    K,
    n_search_steps,  # binary-search iterations, >= ceil(log2(T + 1)); FIRST only
    FIRST: tl.constexpr,
    BLOCK_P: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """Grid ``(B, cdiv(T, BLOCK_P))``: program (b, i) serves the queries at sorted positions
    ``i·BLOCK_P .. i·BLOCK_P + BLOCK_P - 1`` of sequence b; lane p owns one query, t = perm[p].

    Because the sort is stable, the segment of equal addresses lists the bucket's positions in
    increasing order, and the records query t may read (s < t, same address) are exactly the entries
    before p in that segment. Lane p therefore fills a K-slot row:

    * ``recent``: sorted entries p-1, p-2, ..., p-K, kept while their address equals the lane's
      (segments are contiguous, so equality means "same segment"). These reads fall in the window
      ``[i·BLOCK_P - K, (i+1)·BLOCK_P)`` shared by the whole program, so they are served from L1/L2.
    * ``first``: entries seg_start + j for j < K, kept while < p. seg_start is found by a per-lane
      binary search over the sorted row (log2 T dependent loads, L2-resident); lanes of one segment
      then read the same K entries (broadcast loads).

    The row is stored at ``[b, t, :]``: a contiguous run of K int64 (whole cache lines for K >= 16), so
    the scatter back to original order stays line-granular. Nothing of size T×T is ever formed.
    """
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = p < T
    srow = saddr_ptr + b * T
    prow = perm_ptr + b * T
    a = tl.load(srow + p, mask=live, other=0)
    t = tl.load(prow + p, mask=live, other=0).to(tl.int32)
    j = tl.arange(0, K_PAD)
    slot_ok = (j[None, :] < K) & live[:, None]
    if FIRST:
        # Lower bound of the lane's address in sorted[0:p]: the start of its segment.
        lo = tl.zeros([BLOCK_P], dtype=tl.int32)
        hi = p
        for _ in range(n_search_steps):
            active = (lo < hi) & live
            mid = (lo + hi) >> 1
            v = tl.load(srow + mid, mask=active, other=0)
            right = v < a
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & (v >= a), mid, hi)
        src = lo[:, None] + j[None, :]
        ok = slot_ok & (src < p[:, None])
    else:
        src = p[:, None] - 1 - j[None, :]
        ok = slot_ok & (src >= 0)
        neighbour = tl.load(srow + src, mask=ok, other=0)
        ok = ok & (neighbour == a[:, None])
    cand = tl.load(prow + src, mask=ok, other=-1)
    # The sequence's base offset is a scalar int64; the in-row offset t·K + j stays int32 (T·K < 2^31).
    out = t[:, None] * K + j[None, :]
    tl.store(index_ptr + b * T * K + out, cand, mask=slot_ok)
    tl.store(valid_ptr + b * T * K + out, ok, mask=slot_ok)


@triton.jit
def _bucket_table_kernel(
    saddr_ptr,  # [B, N] int64: record bucket ids, stably sorted per row
    perm_ptr,  # [B, N] int64: original record position of each sorted entry
    table_ptr,  # [B, num_buckets, K] int32, pre-filled with -1
    N,
    num_buckets,
    K,
    RECENT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """Grid ``(B, cdiv(N, BLOCK_P))``: lane p places sorted record p into its bucket's slots.

    A record's slot is its rank in the bucket under the policy: the number of bucket records before
    it (``first``) or after it (``recent``). In sorted order those are its contiguous neighbours, and
    the rank only matters while it is < K, so each lane compares its address with the K neighbours on
    the policy's side (a [BLOCK_P, K_PAD] tile of reads within the program's window) and counts the
    equal ones. That count is the exact rank when < K and saturates at K otherwise, so each table slot
    receives exactly one record: deterministic, unlike first-come atomic counters.
    """
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = p < N
    srow = saddr_ptr + b * N
    a = tl.load(srow + p, mask=live, other=-1)
    step = tl.arange(0, K_PAD) + 1
    if RECENT:
        nbr = p[:, None] + step[None, :]
    else:
        nbr = p[:, None] - step[None, :]
    inb = (nbr >= 0) & (nbr < N) & (step[None, :] <= K) & live[:, None]
    neighbour = tl.load(srow + nbr, mask=inb, other=0)
    rank = tl.sum((inb & (neighbour == a[:, None])).to(tl.int32), axis=1)
    keep = live & (rank < K) & (a >= 0) & (a < num_buckets)
    rec = tl.load(perm_ptr + b * N + p, mask=keep, other=-1).to(tl.int32)
    tl.store(table_ptr + (b * num_buckets + a) * K + rank, rec, mask=keep)


#: True when the kernels were created in interpreter mode (``TRITON_INTERPRET=1`` at import): they then
#: accept CPU tensors. Otherwise they are compiled and need CUDA tensors.
INTERPRETED: bool = isinstance(_nt_scan_kernel, InterpretedFunction)


def _tile_block(k_pad: int, n: int) -> int:
    """Lanes per program for a [BLOCK_P, K_PAD] tile: ~_TILE_ELEMS elements, no more lanes than n needs."""
    block = max(_MIN_BLOCK, min(256, _TILE_ELEMS // k_pad))
    return max(_MIN_BLOCK, min(block, triton.next_power_of_2(max(n, 1))))


def _no_records(index: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot empty: the answer when the only query is position 0 (T = 1), which has no records.
    No kernel is launched for it: besides being pointless, a launch with T = 1 and K = 1 specialises
    both to constants, a variant Triton 3.6's layout pass (TritonGPUCoalesce) aborts on."""
    return index.fill_(-1), valid.fill_(False)


def candidates_nt_triton(
    addresses: torch.Tensor, top_k: int, policy: str, *, num_buckets: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token candidates with :func:`_nt_scan_kernel` (query T-1, records 0..T-2).

    Args:
        addresses: ``[B, T]`` integer bucket addresses, or non-negative context hashes when
            ``num_buckets`` is given (the kernel then applies the second hash to every load).
        top_k: K >= 1.
        policy: ``recent`` (most recent first) or ``first`` (earliest first).
        num_buckets: see above.
    Returns:
        ``index [B, 1, K]`` int64 (-1 = empty) and ``valid [B, 1, K]`` bool; equal to
        ``pcaf_core.routing.route_context(addresses, [T-1], K, policy)``.
    """
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    a = check_addresses(addresses)
    B, T = a.shape
    index = torch.empty((B, 1, top_k), dtype=torch.int64, device=a.device)
    valid = torch.empty((B, 1, top_k), dtype=torch.bool, device=a.device)
    if B == 0 or T == 1:
        return _no_records(index, valid)
    block = max(32, min(_NT_MAX_BLOCK, triton.next_power_of_2(max(T - 1, 1))))
    _nt_scan_kernel[(B,)](
        a,
        index,
        valid,
        T,
        top_k,
        num_buckets if num_buckets is not None else 1,
        HASH=num_buckets is not None,
        RECENT=policy == "recent",
        MULT=HASH_MULT,
        ADD=BUCKET_ADD,
        BLOCK=block,
        K_PAD=triton.next_power_of_2(top_k),
    )
    return index, valid


def candidates_ar_triton(
    addresses: torch.Tensor, top_k: int, policy: str, *, num_buckets: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-autoregressive candidates with one stable sort and :func:`_ar_select_kernel`.

    Args:
        addresses: ``[B, T]`` integer addresses (context hashes when ``num_buckets`` is given; they are
            bucketed before the sort, which needs the final ids).
        top_k: K >= 1.
        policy: ``recent`` or ``first``.
        num_buckets: see :func:`candidates_nt_triton`.
    Returns:
        ``index [B, T, K]`` int64 (-1 = empty) and ``valid [B, T, K]`` bool; equal to
        ``pcaf_core.routing.route_context(addresses, arange(T), K, policy)``.
    """
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    a = check_addresses(addresses)
    if num_buckets is not None:
        a = bucket_of(a, num_buckets)
    B, T = a.shape
    if T * top_k >= 2**31:
        raise ValueError(f"T·K = {T * top_k} overflows the kernel's int32 in-row offsets")
    index = torch.empty((B, T, top_k), dtype=torch.int64, device=a.device)
    valid = torch.empty((B, T, top_k), dtype=torch.bool, device=a.device)
    if B == 0 or T == 1:
        return _no_records(index, valid)
    sorted_addr, perm = torch.sort(a, dim=-1, stable=True)
    k_pad = triton.next_power_of_2(top_k)
    block = _tile_block(k_pad, T)
    _ar_select_kernel[(B, triton.cdiv(T, block))](
        sorted_addr,
        perm,
        index,
        valid,
        T,
        top_k,
        T.bit_length(),
        FIRST=policy == "first",
        BLOCK_P=block,
        K_PAD=k_pad,
    )
    return index, valid


def bucket_table_triton(
    records: torch.Tensor, num_buckets: int, top_k: int, policy: str, *, hash_input: bool = False
) -> torch.Tensor:
    """Per-sequence bucket table with one stable sort and :func:`_bucket_table_kernel`.

    Args:
        records: ``[B, N]`` integer bucket ids of the records (context hashes if ``hash_input``).
        num_buckets: table height; ids outside ``[0, num_buckets)`` are not stored.
        top_k: K slots per bucket.
        policy: ``recent`` (slot 0 = latest record) or ``first`` (slot 0 = earliest).
        hash_input: bucket ``records`` with the spec's second hash first.
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
    table = torch.full((B, num_buckets, top_k), -1, dtype=torch.int32, device=a.device)
    if B == 0 or N == 0:
        return table
    sorted_addr, perm = torch.sort(a, dim=-1, stable=True)
    k_pad = triton.next_power_of_2(top_k)
    block = _tile_block(k_pad, N)
    _bucket_table_kernel[(B, triton.cdiv(N, block))](
        sorted_addr,
        perm,
        table,
        N,
        num_buckets,
        top_k,
        RECENT=policy == "recent",
        BLOCK_P=block,
        K_PAD=k_pad,
    )
    return table
