"""``torch.library`` custom ops over the bucket kernels, and the dispatch functions that call them.

Ops (namespace ``pcaf``):

* ``pcaf::bucket_lookup_nt(Tensor addresses, SymInt top_k, str policy, SymInt? num_buckets)
  -> (Tensor index, Tensor valid)`` -- next-token candidates, ``[B, 1, K]``;
* ``pcaf::ar_candidates(Tensor addresses, SymInt top_k, str policy, SymInt? num_buckets)
  -> (Tensor index, Tensor valid)`` -- full-autoregressive candidates, ``[B, T, K]``;
* ``pcaf::bucket_table(Tensor records, SymInt num_buckets, SymInt top_k, str policy, bool hash_input)
  -> Tensor`` -- ``[B, num_buckets, K]`` int32 table.

Each op runs the Triton kernel when :func:`triton_enabled` holds for its input (a CUDA tensor, or any
tensor while the kernels run under ``TRITON_INTERPRET=1``) and the pure-torch implementation otherwise;
both give identical results. The fake (meta) registrations give output shapes from input shapes alone,
so the ops trace under ``torch.compile`` without running a kernel.

Autograd: the outputs are integer indices and a boolean mask, which carry no gradient, so the ops
register no backward. Gradients reach the model through what the indices select -- the gathered keys,
the scores computed from them and the gate -- exactly as in the spec, where selection is a
non-differentiable choice of which records enter the softmax.
"""

from __future__ import annotations

import torch

from backends.torch.kernels import torch_impl
from backends.torch.kernels._common import (
    check_num_buckets,
    check_policy,
    check_top_k,
    validate_addresses,
)

try:
    from backends.torch.kernels import triton_impl
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton_impl = None  # type: ignore[assignment]


def triton_enabled(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``'s device.

    CUDA tensors always go to Triton. CPU tensors do only when the kernels were created in interpreter
    mode, i.e. ``TRITON_INTERPRET=1`` was set before this package was imported (Triton decides
    compiled vs interpreted when a kernel is defined, not when it is launched).
    """
    if triton_impl is None:
        return False
    if tensor.device.type == "cuda":
        return True
    return tensor.device.type == "cpu" and triton_impl.INTERPRETED


def _check_common(addresses: torch.Tensor, top_k: int, policy: str, num_buckets: int | None) -> None:
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    validate_addresses(addresses)


@torch.library.custom_op("pcaf::bucket_lookup_nt", mutates_args=())
def _bucket_lookup_nt(
    addresses: torch.Tensor, top_k: int, policy: str, num_buckets: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pcaf::bucket_lookup_nt``: see :func:`candidates_nt`."""
    if triton_enabled(addresses):
        return triton_impl.candidates_nt_triton(addresses, top_k, policy, num_buckets=num_buckets)
    return torch_impl.candidates_nt_torch(addresses, top_k, policy, num_buckets=num_buckets)


@_bucket_lookup_nt.register_fake
def _bucket_lookup_nt_fake(
    addresses: torch.Tensor, top_k: int, policy: str, num_buckets: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes only: ``[B, 1, K]`` int64 and bool on the input's device."""
    shape = (addresses.shape[0], 1, top_k)
    return addresses.new_empty(shape, dtype=torch.int64), addresses.new_empty(shape, dtype=torch.bool)


@torch.library.custom_op("pcaf::ar_candidates", mutates_args=())
def _ar_candidates(
    addresses: torch.Tensor, top_k: int, policy: str, num_buckets: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pcaf::ar_candidates``: see :func:`candidates_ar`."""
    if triton_enabled(addresses):
        return triton_impl.candidates_ar_triton(addresses, top_k, policy, num_buckets=num_buckets)
    return torch_impl.candidates_ar_torch(addresses, top_k, policy, num_buckets=num_buckets)


@_ar_candidates.register_fake
def _ar_candidates_fake(
    addresses: torch.Tensor, top_k: int, policy: str, num_buckets: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes only: ``[B, T, K]`` int64 and bool on the input's device."""
    shape = (addresses.shape[0], addresses.shape[1], top_k)
    return addresses.new_empty(shape, dtype=torch.int64), addresses.new_empty(shape, dtype=torch.bool)


@torch.library.custom_op("pcaf::bucket_table", mutates_args=())
def _bucket_table(records: torch.Tensor, num_buckets: int, top_k: int, policy: str, hash_input: bool) -> torch.Tensor:
    """``pcaf::bucket_table``: see :func:`build_bucket_table`."""
    if triton_enabled(records):
        return triton_impl.bucket_table_triton(records, num_buckets, top_k, policy, hash_input=hash_input)
    return torch_impl.bucket_table_torch(records, num_buckets, top_k, policy, hash_input=hash_input)


@_bucket_table.register_fake
def _bucket_table_fake(
    records: torch.Tensor, num_buckets: int, top_k: int, policy: str, hash_input: bool
) -> torch.Tensor:
    """Shapes only: ``[B, num_buckets, K]`` int32 on the input's device."""
    return records.new_empty((records.shape[0], num_buckets, top_k), dtype=torch.int32)


def candidates_nt(
    addresses: torch.Tensor, top_k: int, policy: str, *, num_buckets: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token context-route candidates (``pcaf::bucket_lookup_nt``).

    The query is position T-1 and the records are positions 0..T-2; the query reads the records that
    share its address, at most K of them.

    Args:
        addresses: ``[B, T]`` integer bucket addresses, T >= 1. With ``num_buckets`` set they are raw
            context hashes (non-negative, as ``pcaf_core.hashing.context_hash`` produces) and are
            bucketed with ``(h·1_000_003 + 97_531) mod num_buckets``.
        top_k: K >= 1, the number of slots.
        policy: ``recent`` (the K most recent, most recent first) or ``first`` (the K earliest,
            earliest first).
        num_buckets: see ``addresses``.
    Returns:
        ``index [B, 1, K]`` int64 record positions (-1 = empty slot, empty slots last) and
        ``valid [B, 1, K]`` bool (``index >= 0``). Equal to
        ``pcaf_core.routing.route_context(addresses, [T-1], K, policy)``.
    """
    _check_common(addresses, top_k, policy, num_buckets)
    return torch.ops.pcaf.bucket_lookup_nt(addresses, top_k, policy, num_buckets)


def candidates_ar(
    addresses: torch.Tensor, top_k: int, policy: str, *, num_buckets: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-autoregressive context-route candidates (``pcaf::ar_candidates``).

    Every position t is a query over the records s < t with ``a_s == a_t``; O(B·T·K) memory, no
    ``[T, T]`` tensor.

    Args:
        addresses: ``[B, T]`` integer addresses, T >= 1 (context hashes when ``num_buckets`` is set).
        top_k: K >= 1.
        policy: ``recent`` (prev[t], prev[prev[t]], ...) or ``first`` (the bucket's first K records < t).
        num_buckets: see :func:`candidates_nt`.
    Returns:
        ``index [B, T, K]`` int64 (-1 = empty) and ``valid [B, T, K]`` bool. Equal to
        ``pcaf_core.routing.route_context(addresses, arange(T), K, policy)``.
    """
    _check_common(addresses, top_k, policy, num_buckets)
    return torch.ops.pcaf.ar_candidates(addresses, top_k, policy, num_buckets)


def build_bucket_table(
    records: torch.Tensor, num_buckets: int, top_k: int, policy: str, *, hash_input: bool = False
) -> torch.Tensor:
    """Per-sequence fixed-size bucket table (``pcaf::bucket_table``).

    Slot ``j`` of bucket ``c`` in sequence ``b`` holds the j-th record of that bucket in policy order
    (``first``: j-th earliest; ``recent``: j-th most recent), -1 when the bucket has fewer than j+1
    records. Reading the query's bucket with :func:`lookup_bucket_table` gives the NT candidates; a
    table serves any number of queries over the same records.

    Args:
        records: ``[B, N]`` integer bucket ids in ``[0, num_buckets)`` (ids outside are not stored), or
            context hashes when ``hash_input``.
        num_buckets: number of buckets (the table height).
        top_k: K >= 1 slots per bucket.
        policy: ``recent`` or ``first``.
        hash_input: apply the spec's second hash to ``records`` first.
    Returns:
        ``[B, num_buckets, K]`` int32 record positions, -1 = empty.
    """
    check_policy(policy)
    check_top_k(top_k)
    check_num_buckets(num_buckets)
    validate_addresses(records, min_len=0)
    return torch.ops.pcaf.bucket_table(records, num_buckets, top_k, policy, hash_input)


lookup_bucket_table = torch_impl.lookup_bucket_table
