"""What torch's routing alone has, against the spec: hashing and record helpers, window top-k, ``gather_dot``
paths and gradchecks, and the candidate scores' refusal of a ``topk_score`` band.

JAX's hashing is tested in ``tests/test_jax_hashing.py``; the cases both backends share in
``tests/test_routing.py`` and ``tests/test_routing_semantic.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends.torch import hashing as thash
from backends.torch import ops as tops
from backends.torch import records as trec
from backends.torch import routing as troute
from pcaf_core import hashing, records, routing
from tests.routing_adapters import (
    TorchBackend,
    band_case,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("int32", [False, True])
@pytest.mark.parametrize("num_buckets", [1, 7, 16, 32768, 2**31 - 1])
def test_torch_addresses_match_spec_bit_for_bit(order: int, int32: bool, num_buckets: int) -> None:
    rng = np.random.default_rng(order * 10 + int32)
    tok = rng.integers(0, 40000, (3, 37))
    tok[0, :5] = [0, 2**31 - 1, 2**31 - 2, 123456789, 1]  # int32 extremes
    got = thash.addresses(torch.tensor(tok), order, num_buckets, int32_wraparound=int32)
    want = hashing.addresses(tok, order, num_buckets, int32_wraparound=int32)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(
        thash.context_hash(torch.tensor(tok), order, int32_wraparound=int32).numpy(),
        hashing.context_hash(tok, order, int32_wraparound=int32))


def test_torch_int32_wraparound_differs_from_int64_for_order_two() -> None:
    tok = np.random.default_rng(0).integers(0, 40, (1, 64))
    a32 = thash.addresses(torch.tensor(tok), 2, 7, int32_wraparound=True).numpy()
    a64 = thash.addresses(torch.tensor(tok), 2, 7, int32_wraparound=False).numpy()
    assert (a32 != a64).any()  # the switch matters, so the exact match above is informative


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20), st.integers(1, 4), st.integers(1, 10**6),
       st.booleans())
def test_torch_addresses_property(tokens: list[int], order: int, num_buckets: int, int32: bool) -> None:
    tok = np.array([tokens])
    got = thash.addresses(torch.tensor(tok), order, num_buckets, int32_wraparound=int32).numpy()
    np.testing.assert_array_equal(got, hashing.addresses(tok, order, num_buckets, int32_wraparound=int32))


def test_torch_hash_argument_errors() -> None:
    with pytest.raises(ValueError, match="context order"):
        thash.context_hash(torch.zeros(1, 3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="num_buckets"):
        thash.bucket_of(torch.zeros(1, 3, dtype=torch.int64), 0)


def test_torch_records_helpers_match_spec() -> None:
    for T in (1, 2, 5):
        for mode in ("nt", "ar"):
            np.testing.assert_array_equal(trec.query_positions(T, mode).numpy(), records.query_positions(T, mode))
            np.testing.assert_array_equal(trec.recency(T, mode).numpy(), records.recency(T, mode))
            h = np.arange(2 * T * 3, dtype=np.float32).reshape(2, T, 3)
            ht = torch.from_numpy(h)
            rows = trec.query_rows(ht, mode)
            assert rows.untyped_storage().data_ptr() == ht.untyped_storage().data_ptr()  # a view, no copy
            np.testing.assert_array_equal(rows.numpy(), h[:, records.query_positions(T, mode)])
            np.testing.assert_array_equal(records.query_rows(h, mode), h[:, records.query_positions(T, mode)])
    tok = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(trec.successor_values(torch.tensor(tok)).numpy(), records.successor_values(tok))
    with pytest.raises(ValueError, match="mode"):
        trec.query_positions(3, "bidirectional")
    with pytest.raises(ValueError, match="mode"):
        trec.query_rows(torch.zeros(1, 3, 2), "bidirectional")


def test_torch_step_constants_are_made_once_outside_compile_and_inference_mode(monkeypatch) -> None:
    monkeypatch.setattr(trec, "_constants", {})
    first = trec.recency(7, "ar", torch.float32)
    assert trec.recency(7, "ar", torch.float32) is first  # kept...
    assert trec.recency(7, "nt", torch.float32) is not first  # ...per key
    assert trec.recency(7, "ar", torch.float64) is not first
    assert trec.query_positions(7, "ar") is trec.query_positions(7, "ar")
    from backends.torch.ops import row_offsets

    assert row_offsets(3, 5, torch.device("cpu")) is row_offsets(3, 5, "cpu")
    assert row_offsets(3, 5, "cpu").tolist() == [0, 5, 10] and row_offsets(2, 0, "cpu").tolist() == [0, 0]
    np.testing.assert_array_equal(trec.recency(7, "ar", torch.float64).numpy(), records.recency(7, "ar"))
    with torch.inference_mode():
        fresh = trec.recency(7, "ar", torch.float32)
    assert fresh is not first and fresh.is_inference()
    assert not trec.recency(7, "ar", torch.float32).is_inference()
    made = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert trec.step_constant(("k",), lambda: made.append(1) or torch.zeros(1)) is not None
    assert trec.step_constant(("k",), lambda: made.append(1) or torch.zeros(1)) is not None
    assert made == [1, 1] and ("k",) not in trec._constants
    monkeypatch.undo()
    monkeypatch.setattr(trec, "_constants", {})
    for T in range(trec.CONSTANTS_KEPT + 1):  # a bounded store: full, it starts again
        trec.recency(T + 1, "ar")
    assert len(trec._constants) == 1


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**16), st.floats(1e-3, 1e3), st.booleans())
@example(d=71, seed=13408, scale=930.0625, unit=False)  # the float32 norm rounded up by a whole eps here
def test_torch_max_norm_bound_holds_and_is_tight(d: int, seed: int, scale: float, unit: bool) -> None:
    """The topk_score proof's key-norm bound, from norms in the keys' own float32: never below the exact
    maximum (float64 norms of the same float32 values), and above it by at most the float32 norm's own error
    bound, (d + 1)·eps, times the widening, 1 + (d + 2)·eps."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((3, 17, d)) * scale
    if unit:  # the models' L2-normalised keys, all of norm ~1: the case the bound is tight for
        keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    k32 = torch.tensor(keys, dtype=torch.float32)
    exact = torch.linalg.vector_norm(k32.to(torch.float64), dim=-1).amax(-1, keepdim=True)
    got = troute.max_norm_bound(k32)
    assert got.dtype == torch.float64 and got.shape == (3, 1)
    assert torch.all(got >= exact)
    eps = torch.finfo(torch.float32).eps
    assert torch.all(got <= exact * (1 + (d + 1) * eps) * (1 + (d + 2) * eps))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 7), st.integers(0, 2**16),
       st.sampled_from([torch.float32, torch.float64]))
def test_torch_window_topk_matches_lexsort(n: int, M: int, k: int, seed: int, dtype: torch.dtype) -> None:
    """The k best window slots by descending score, ties to the older slot (larger j), and the k-th score,
    on rows full of exact ties and empty (-inf) slots, so that ties straddle the k-th place. Which empty
    slots fill a row with fewer than k others is left open (the route marks them empty)."""
    k = min(k, M)
    rng = np.random.default_rng(seed)
    score = rng.integers(-2, 2, (1, n, M)).astype(np.float64)  # exact in float32 too; -0.0 equals 0.0
    score[rng.random((1, n, M)) < 0.3] = -np.inf
    score[score == 0] *= np.where(rng.random(int((score == 0).sum())) < 0.5, -1.0, 1.0)
    j, kth = troute._window_topk(torch.tensor(score, dtype=dtype), k)
    straddled = 0
    for r in range(n):
        row = score[0, r]
        ref = np.lexsort((-np.arange(M), -row))[:k]  # the last key sorts first: score desc, then j desc
        got = j[0, r].numpy()
        finite = np.isfinite(row[ref])
        np.testing.assert_array_equal(got[finite], ref[finite])
        assert np.all(np.isneginf(row[got[~finite]])) and len(set(got.tolist())) == k
        assert kth[0, r].item() == row[ref[-1]]
        straddled += np.isfinite(row[ref[-1]]) and np.sum(row >= row[ref[-1]]) > k
    if n >= 20 and M >= k + 3:
        assert straddled > 0  # the re-pick of straddling rows ran (no such row: about 1e-6 here)


@pytest.mark.parametrize("path", ["sparse", "gather"])
def test_torch_gather_dot_paths(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths: the CSR products (CPU float64 here) and the chunked row gathers (CUDA, bf16, compiled);
    gradcheck, no_grad, one input differentiable, out-of-range slots, more slots than records."""
    if path == "gather":
        monkeypatch.setattr(tops, "_sparse_path", lambda x, y, index: False)
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.normal(size=(2, 5, 3)), requires_grad=True)
    y = torch.tensor(rng.normal(size=(2, 6, 3)), requires_grad=True)
    idx = torch.tensor(rng.integers(0, 6, (2, 5, 4)))  # repeated records within a query: their gradients add
    assert tops._sparse_path(x, y, idx) == (path == "sparse")
    assert any(len(set(row)) < 4 for row in idx.reshape(-1, 4).tolist())
    dense = torch.einsum("bqd,bqcd->bqc", x, y[torch.arange(2)[:, None, None], idx])
    for chunk in (1, 7, 10**6):  # chunks of one query, of a few, and all at once
        torch.testing.assert_close(tops.gather_dot(x, y, idx, chunk_elements=chunk), dense)
        with torch.no_grad():
            torch.testing.assert_close(tops.gather_dot(x, y, idx, chunk_elements=chunk), dense)
        assert torch.autograd.gradcheck(lambda a, b, c=chunk: tops.gather_dot(a, b, idx, chunk_elements=c), (x, y))
    # one input differentiable: the other gets no gradient and the first the same one
    xs = x.detach().clone().requires_grad_(True)
    tops.gather_dot(xs, y.detach(), idx).sum().backward()
    expected = torch.autograd.grad(dense.sum(), x, retain_graph=True)[0]
    torch.testing.assert_close(xs.grad, expected)
    with pytest.raises(IndexError, match="out of range"):
        tops.gather_dot(x, y, torch.full_like(idx, 6))
    # more slots than records (C > B·T, windows shorter than K): the gather path, same values
    short = torch.tensor(rng.normal(size=(1, 2, 3)), requires_grad=True)
    few = torch.tensor([[[0, 1, 1, 0, 0]]])
    assert not tops._sparse_path(x[:1, :1], short, few)
    assert torch.autograd.gradcheck(lambda a, b: tops.gather_dot(a, b, few),
                                    (x[:1, :1].detach().requires_grad_(), short))


def test_torch_gather_dot_takes_the_gather_path_in_bf16() -> None:
    x, y = torch.randn(1, 4, 8, dtype=torch.bfloat16), torch.randn(1, 6, 8, dtype=torch.bfloat16)
    idx = torch.randint(0, 6, (1, 4, 3))
    assert not tops._sparse_path(x, y, idx) and tops._sparse_path(x.float(), y.float(), idx)
    torch.testing.assert_close(tops.gather_dot(x, y, idx).float(), tops.gather_dot(x.float(), y.float(), idx),
                               atol=0.1, rtol=0.02)


def test_torch_candidate_scores_refuse_a_topk_score_band() -> None:
    """Torch scores ``topk_score`` candidates by gathering: a band with a window width is refused."""
    from backends.torch.mixture import candidate_scores

    addr, q, k, win = band_case(W=8, d=5)
    layout = troute.bucket_layout(torch.tensor(addr))
    cand = TorchBackend().candidates(win)
    args = (torch.tensor(q), torch.tensor(k), torch.tensor(records.recency(75, "ar")), 0.7, cand)
    with pytest.raises(ValueError, match="pass no band"):
        candidate_scores(*args, band=routing.ScoreBand(layout, 12))


def test_torch_permute_rows_gradcheck() -> None:
    rng = np.random.default_rng(9)
    perm = torch.tensor(np.stack([rng.permutation(11) for _ in range(2)]))
    inverse = torch.argsort(perm, dim=1)
    x = torch.tensor(rng.normal(size=(2, 11, 3)), requires_grad=True)
    assert torch.equal(tops.permute_rows(x, perm, inverse), tops.batch_gather(x, perm))
    assert torch.autograd.gradcheck(lambda v: tops.permute_rows(v, perm, inverse), (x,))
