"""Bucket kernels vs the spec: identical candidates (index and valid) from the Triton kernels (run under
``TRITON_INTERPRET=1`` without a GPU) and from the pure-torch path, on awkward shapes.

Interpreted grids stay at a handful of programs per call (the interpreter costs milliseconds per
program), so every case here is small in B and at most T = 500 long.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.torch.kernels import torch_impl, triton_impl
from backends.torch.kernels.torch_impl import lookup_bucket_table
from pcaf_core.hashing import addresses as spec_addresses
from pcaf_core.hashing import bucket_of, context_hash
from pcaf_core.routing import route_context

POLICIES = ("recent", "first")

NT_IMPLS = {"triton": triton_impl.candidates_nt_triton, "torch": torch_impl.candidates_nt_torch}
AR_IMPLS = {"triton": triton_impl.candidates_ar_triton, "torch": torch_impl.candidates_ar_torch}
TABLE_IMPLS = {"triton": triton_impl.bucket_table_triton, "torch": torch_impl.bucket_table_torch}


# Compiled Triton kernels take CUDA tensors; under the interpreter (no CUDA) they take CPU tensors. Every
# case below runs on this device, so a CUDA machine runs the same cases through the compiled kernels.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_device(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).to(DEVICE)


def test_kernels_run_interpreted_on_this_machine() -> None:
    """Without CUDA the conftest turns the interpreter on, so the Triton cases below really run Triton."""
    assert triton_impl.INTERPRETED or torch.cuda.is_available()


def _case(name: str) -> tuple[np.ndarray, int, int]:
    """Addresses ``[B, T]``, num_buckets and K for one awkward case."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name == "T1":  # a lone query: no records at all
        return rng.integers(0, 3, size=(3, 1)), 3, 4
    if name == "T2_K_gt_occupancy":  # one record, five slots
        return rng.integers(0, 2, size=(3, 2)), 2, 5
    if name == "T63_B7_collisions":  # vocabulary 20 folded into 7 buckets
        return spec_addresses(rng.integers(1, 20, size=(3, 63)), 1, 7), 7, 4
    if name == "T63_order2_B3":  # order-2 hash into 3 buckets: heavy collisions
        return spec_addresses(rng.integers(1, 20, size=(2, 63)), 2, 3), 3, 6
    if name == "T500_B3_overflow":  # ~166 records per bucket, K = 16 of them kept
        return spec_addresses(rng.integers(1, 50, size=(1, 500)), 1, 3), 3, 16
    if name == "T500_sparse":  # many empty buckets, most queries see 0 or 1 record
        return spec_addresses(rng.integers(1, 5000, size=(2, 500)), 1, 32768), 32768, 3
    if name == "all_equal":  # every position shares one bucket
        return np.full((2, 40), 5, dtype=np.int64), 8, 8
    if name == "K1":
        return rng.integers(0, 4, size=(3, 30)), 4, 1
    if name == "K_gt_T":
        return rng.integers(0, 2, size=(1, 9)), 2, 33
    raise KeyError(name)


CASES = (
    "T1",
    "T2_K_gt_occupancy",
    "T63_B7_collisions",
    "T63_order2_B3",
    "T500_B3_overflow",
    "T500_sparse",
    "all_equal",
    "K1",
    "K_gt_T",
)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want_index: np.ndarray, want_valid: np.ndarray) -> None:
    index, valid = got
    assert index.dtype == torch.int64 and valid.dtype == torch.bool
    np.testing.assert_array_equal(index.cpu().numpy(), want_index)
    np.testing.assert_array_equal(valid.cpu().numpy(), want_valid)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_nt_candidates_equal_spec(case: str, policy: str, impl: str) -> None:
    a, _, k = _case(case)
    T = a.shape[1]
    want = route_context(a, np.array([T - 1]), k, policy)
    _assert_same(NT_IMPLS[impl](_on_device(a), k, policy), want.index, want.valid)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_ar_candidates_equal_spec(case: str, policy: str, impl: str) -> None:
    a, _, k = _case(case)
    T = a.shape[1]
    want = route_context(a, np.arange(T), k, policy)
    _assert_same(AR_IMPLS[impl](_on_device(a), k, policy), want.index, want.valid)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", [c for c in CASES if c != "T1"])
def test_bucket_table_lookup_equals_spec(case: str, policy: str, impl: str) -> None:
    """Build the table from records 0..T-2, read the query's bucket: the NT candidates."""
    a, nb, k = _case(case)
    T = a.shape[1]
    at = _on_device(a)
    table = TABLE_IMPLS[impl](at[:, :-1], nb, k, policy)
    assert table.shape == (a.shape[0], nb, k) and table.dtype == torch.int32
    want = route_context(a, np.array([T - 1]), k, policy)
    _assert_same(lookup_bucket_table(table, at[:, -1]), want.index, want.valid)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("policy", POLICIES)
def test_bucket_table_every_bucket(policy: str, impl: str) -> None:
    """Each bucket's row lists its records in policy order, truncated to K; untouched buckets stay empty."""
    rng = np.random.default_rng(7)
    nb, k = 9, 3
    rec = rng.integers(0, 6, size=(2, 40))  # buckets 6..8 never occur
    table = TABLE_IMPLS[impl](_on_device(rec), nb, k, policy).cpu().numpy()
    for b in range(rec.shape[0]):
        for c in range(nb):
            members = np.flatnonzero(rec[b] == c)
            ordered = members[::-1] if policy == "recent" else members
            want = np.full(k, -1)
            want[: min(k, len(ordered))] = ordered[:k]
            np.testing.assert_array_equal(table[b, c], want)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_bucket_table_ignores_out_of_range_ids(impl: str) -> None:
    rec = torch.tensor([[0, 5, -1, 0, 2]], device=DEVICE)
    table = TABLE_IMPLS[impl](rec, 3, 2, "first")
    np.testing.assert_array_equal(table[0].cpu().numpy(), [[0, 3], [-1, -1], [4, -1]])


@pytest.mark.parametrize("policy", POLICIES)
def test_context_hash_input_is_bucketed_like_the_spec(policy: str) -> None:
    """Raw context hashes with ``num_buckets``: the NT kernel hashes each load in-kernel, the AR and table
    paths bucket before their sort; all equal the spec on the spec's own bucketing."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 30, size=(2, 70))
    hashes = context_hash(tokens, 2)
    nb, k = 7, 5
    buckets = bucket_of(hashes, nb)
    ht = _on_device(hashes)
    nt = route_context(buckets, np.array([69]), k, policy)
    ar = route_context(buckets, np.arange(70), k, policy)
    for impl in ("triton", "torch"):
        _assert_same(NT_IMPLS[impl](ht, k, policy, num_buckets=nb), nt.index, nt.valid)
        _assert_same(AR_IMPLS[impl](ht, k, policy, num_buckets=nb), ar.index, ar.valid)
        table = TABLE_IMPLS[impl](ht[:, :-1], nb, k, policy, hash_input=True)
        _assert_same(lookup_bucket_table(table, _on_device(buckets[:, -1])), nt.index, nt.valid)


def test_int32_addresses_are_accepted() -> None:
    a = np.array([[3, 1, 3, 3, 1, 3]], dtype=np.int32)
    want = route_context(a.astype(np.int64), np.arange(6), 2, "recent")
    _assert_same(triton_impl.candidates_ar_triton(_on_device(a), 2, "recent"), want.index, want.valid)


def test_nt_scan_stops_early_yet_sees_every_block() -> None:
    """T = 3000 makes the NT scan walk three 1024-wide blocks; matches sit in the first and last block,
    so both early exit (recent: the last block fills K) and the full walk (first) are exercised."""
    a = np.zeros((1, 3000), dtype=np.int64)
    a[0, [5, 17, 2990, 2995, 2999]] = 1
    for policy in POLICIES:
        for k in (2, 4):
            want = route_context(a, np.array([2999]), k, policy)
            _assert_same(triton_impl.candidates_nt_triton(_on_device(a), k, policy), want.index, want.valid)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(top_k=2, policy="topk_score"), ValueError),
        (dict(top_k=0, policy="recent"), ValueError),
        (dict(top_k=2, policy="recent", num_buckets=0), ValueError),
    ],
)
@pytest.mark.parametrize("fn", [*NT_IMPLS.values(), *AR_IMPLS.values()])
def test_bad_arguments_raise(fn, kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        fn(torch.zeros(1, 4, dtype=torch.int64, device=DEVICE), **kwargs)


@pytest.mark.parametrize("fn", [*NT_IMPLS.values(), *AR_IMPLS.values()])
def test_bad_addresses_raise(fn) -> None:
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        fn(torch.zeros(4, dtype=torch.int64, device=DEVICE), 2, "recent")
    with pytest.raises(TypeError, match="integer"):
        fn(torch.zeros(1, 4, device=DEVICE), 2, "recent")
    with pytest.raises(ValueError, match="at least 1"):
        fn(torch.zeros(1, 0, dtype=torch.int64, device=DEVICE), 2, "recent")


@st.composite
def _routing_inputs(draw: st.DrawFn) -> tuple[np.ndarray, int, str]:
    batch = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 70))
    num_buckets = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, 9))
    policy = draw(st.sampled_from(POLICIES))
    flat = draw(st.lists(st.integers(0, num_buckets - 1), min_size=batch * seq_len, max_size=batch * seq_len))
    return np.array(flat, dtype=np.int64).reshape(batch, seq_len), top_k, policy


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_routing_inputs())
def test_property_triton_equals_spec(inputs: tuple[np.ndarray, int, str]) -> None:
    a, k, policy = inputs
    T = a.shape[1]
    at = _on_device(a)
    nt = route_context(a, np.array([T - 1]), k, policy)
    _assert_same(triton_impl.candidates_nt_triton(at, k, policy), nt.index, nt.valid)
    ar = route_context(a, np.arange(T), k, policy)
    _assert_same(triton_impl.candidates_ar_triton(at, k, policy), ar.index, ar.valid)


@settings(max_examples=40, deadline=None)
@given(_routing_inputs())
def test_property_torch_path_equals_spec(inputs: tuple[np.ndarray, int, str]) -> None:
    a, k, policy = inputs
    T = a.shape[1]
    at = _on_device(a)
    nt = route_context(a, np.array([T - 1]), k, policy)
    _assert_same(torch_impl.candidates_nt_torch(at, k, policy), nt.index, nt.valid)
    ar = route_context(a, np.arange(T), k, policy)
    _assert_same(torch_impl.candidates_ar_torch(at, k, policy), ar.index, ar.valid)
