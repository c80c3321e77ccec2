"""Hashing, records and context routing of both backends against the NumPy spec :mod:`pcaf_core`: exact
addresses and candidates, slot for slot, on awkward shapes.

Covers the sorted ``recent``/``first`` layout and both branches of the ``topk_score`` route (the sparse proof and
the dense fallback, each forced and asserted), exact score ties and argument errors. Each case runs on both
backends through the adapters of ``tests/routing_adapters.py``; where a JAX parameter would cost compilations of
its own, torch alone runs it (said at each test). The semantic routes, hybrid combination, gathers and banded
products are in ``tests/test_routing_semantic.py``; what one backend alone has, in ``tests/test_torch_routing.py``
and ``tests/test_jax_routing.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcaf_core import records, routing
from tests.routing_adapters import (
    BANDED,
    BOTH,
    JAX_SLOW,
    address_rows,
    assert_same,
    earlier_same_bucket,
    spec_select,
    topk_case,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ----------------------------------------------------------------------------- recent / first

_CONTEXT_KS = (1, 4, 40)  # K = 40 exceeds most buckets' occupancy
_ROW_SETS = ("hashed", "random", "equal", "few")


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("rows", _ROW_SETS)
def test_recent_first_match_spec(backend, T: int, mode: str, rows: str) -> None:
    addr = address_rows(rows, T, seed=T)
    qpos = records.query_positions(T, mode)
    got = backend.route_context_all(addr, qpos, _CONTEXT_KS)
    for (K, policy), cand in got.items():
        assert_same(cand, routing.route_context(addr, qpos, K, policy), f"K={K} {policy}")
    if rows == "hashed":
        for cand in got.values():  # every position alone in its bucket: empty slots
            assert not cand.valid[5].any() and (cand.index[5] == -1).all()
        if T == 200 and mode == "ar":
            assert got[(4, "recent")].valid[2].sum(-1).max() == 4  # the full bucket overflows K


@pytest.mark.parametrize("backend", BOTH)
def test_empty_buckets_give_empty_slots(backend) -> None:
    got = backend.route_context(np.arange(10)[None], np.arange(10), 3, "recent")  # every position alone
    assert not got.valid.any() and (got.index == -1).all()


@pytest.mark.parametrize("backend", BOTH)
@settings(max_examples=30, deadline=None)
@given(n_buckets=st.integers(1, 6), seed=st.integers(0, 2**16), data=st.data())
def test_recent_first_property(backend, n_buckets: int, seed: int, data: st.DataObject) -> None:
    if backend.compiles:
        T, Ks = 24, _CONTEXT_KS  # fixed shapes: one compilation serves every example
    else:
        T, Ks = data.draw(st.integers(1, 40), label="T"), (data.draw(st.integers(1, 8), label="K"), *_CONTEXT_KS)
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, n_buckets, (2, T))
    qpos = np.arange(T)
    for (K, policy), got in backend.route_context_all(addr, qpos, Ks).items():
        assert_same(got, routing.route_context(addr, qpos, K, policy), f"K={K} {policy}")
        # Causality and capacity: every valid slot is an earlier same-bucket record.
        idx, ok = got.index, got.valid
        b, q, _ = np.nonzero(ok)
        assert (idx[ok] < qpos[q]).all() and (addr[b, idx[ok]] == addr[b, qpos[q]]).all()


@pytest.mark.parametrize("backend", BOTH)
def test_bucket_layout_is_a_bucket_sort(backend) -> None:
    lay = backend.bucket_layout(np.array([[3, 1, 3, 0, 1, 3]]))
    assert lay.order.tolist() == [[3, 1, 4, 0, 2, 5]]
    assert lay.seg_start.tolist() == [[0, 1, 1, 3, 3, 3]]
    assert np.take_along_axis(lay.order, lay.rank, 1).tolist() == [list(range(6))]
    # Addresses near 2^31 (no address·T + position key to overflow).
    big = backend.bucket_layout(np.array([[2**31 - 1, 5, 2**31 - 1, 5, 0, 2**31 - 1]]))
    assert big.order.tolist() == [[4, 1, 3, 0, 2, 5]]


# ----------------------------------------------------------------------------- topk_score


# (K, nb, kind, mixed): K = 50 above the occupancy of most buckets; K = 4 with one bucket, where every query
# overflows. The last two run in torch alone (in JAX each K is a compilation per configuration), on two sequences.
_TOPK_SPEC_CASES = ((3, 2, "random", True), (50, 3, "random", True), (2, 5, "few", False), (4, 1, "equal", False))


@pytest.mark.parametrize("backend", JAX_SLOW)
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("rho", [-0.5, 0.0, 0.3, 1.0, 40.0])
def test_topk_score_matches_spec(backend, T: int, mode: str, rho: float) -> None:
    # JAX: K = 3, and K = 50 where T > 2 (at T <= 2 every bucket holds fewer than 3 records).
    cases = _TOPK_SPEC_CASES[: 1 if T <= 2 else 2] if backend.compiles else _TOPK_SPEC_CASES
    with backend.x64():
        for K, nb, kind, mixed in cases:
            addr, qpos, rec, query, keys = topk_case(T, mode, seed=T + K, nb=nb, kind=kind, mixed=mixed)
            ref = routing.route_context(addr, qpos, K, "topk_score", spec_select(query, keys, rec, rho))
            configs = backend.topk_configs(T, mode, K)
            for cfg, (got, dense) in zip(configs, backend.route_topk_score(addr, qpos, rec, query, keys, rho, K,
                                                                            configs)):
                assert_same(got, ref, f"K={K} rho={rho} {cfg}")
                assert dense.shape == (len(addr), len(qpos))


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_topk_score_sparse_proof_branch_is_taken_and_exact(backend) -> None:
    # Buckets over T = 200 hold ~100 records (or all of them), far more than M = 4K = 12; ρ = 40 makes the
    # recency gap between the K-th and the (M+1)-th most recent record exceed 2/√d, so the proof holds.
    with backend.x64():
        addr, qpos, rec, query, keys = topk_case(200, "ar", seed=1)
        # The proof was needed for most queries (> 100 of the first 400 and > 300 of the last 600)...
        assert (earlier_same_bucket(addr, qpos) > 12).sum() > 700
        ref = routing.route_context(addr, qpos, 3, "topk_score", spec_select(query, keys, rec, 40.0))
        for got, dense in backend.route_topk_score(addr, qpos, rec, query, keys, 40.0, 3, ((), BANDED)):
            assert not dense.any()  # ...and it held for all of them
            assert_same(got, ref)


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("rho", [-0.5, 0.0])
def test_topk_score_dense_fallback_branch_is_taken_and_exact(backend, rho: float) -> None:
    # ρ < 0 voids the proof; ρ = 0 leaves no recency gap to separate the window from older records.
    with backend.x64():
        addr, qpos, rec, query, keys = topk_case(200, "ar", seed=2)
        ref = routing.route_context(addr, qpos, 3, "topk_score", spec_select(query, keys, rec, rho))
        # The fallback in one chunk, and (torch; a compilation of its own in JAX) in several.
        configs = ((),) if backend.compiles else ((), (("chunk_elements", 1000),))
        for got, dense in backend.route_topk_score(addr, qpos, rec, query, keys, rho, 3, configs):
            overflowing = earlier_same_bucket(addr, qpos) > 12
            np.testing.assert_array_equal(dense, overflowing)  # exactly the overflowing queries
            assert_same(got, ref)


@pytest.mark.parametrize("backend", BOTH)
def test_topk_score_proof_uses_the_vector_norms(backend) -> None:
    # Keys and queries of norm ~4: a bound that assumed unit vectors would wrongly accept the window.
    with backend.x64():
        addr, qpos, rec, query, keys = topk_case(200, "ar", seed=6)
        rng = np.random.default_rng(6)
        query, keys = query * 4.0, keys * rng.uniform(0.5, 4.0, (len(keys), 200, 1))
        ((got, dense),) = backend.route_topk_score(addr, qpos, rec, query, keys, 8.0, 3, ((),))
        assert dense.any()
        assert_same(got, routing.route_context(addr, qpos, 3, "topk_score", spec_select(query, keys, rec, 8.0)))


@pytest.mark.parametrize("backend", BOTH)
def test_topk_score_mixed_branches(backend) -> None:
    # K = 2 would be a compilation of its own in JAX.
    with backend.x64():
        addr, qpos, rec, query, keys = topk_case(200, "ar", seed=3, nb=3)
        for K in (3,) if backend.compiles else (3, 2):
            ((got, dense),) = backend.route_topk_score(addr, qpos, rec, query, keys, 4.0, K, ((),))
            assert dense.any() and not dense.all()
            assert_same(got, routing.route_context(addr, qpos, K, "topk_score",
                                                    spec_select(query, keys, rec, 4.0)))


# Unit vectors whose dot products are exact in any summation order, so exact score ties are real ties.
_EXACT_UNITS = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0.5, 0.5, 0.5, 0.5], [0.5, -0.5, 0.5, -0.5],
                         [-1, 0, 0, 0], [0, 0, 0.5, 0.5]])


@pytest.mark.parametrize("backend", JAX_SLOW)
@pytest.mark.parametrize("rho", [0.0, 1.0])
@pytest.mark.parametrize("strategy", ["auto", "dense"])
def test_topk_score_ties_go_to_the_lower_index(backend, rho: float, strategy: str) -> None:
    rng = np.random.default_rng(4)
    T = 63
    addr = rng.integers(0, 2, (2, T))
    qpos = np.arange(T)
    rec = records.recency(T, "ar")
    keys = _EXACT_UNITS[rng.integers(0, 2, (2, T))]  # only two distinct keys: many exact ties
    query = _EXACT_UNITS[rng.integers(0, 4, (2, T))]
    ref = routing.route_context(addr, qpos, 5, "topk_score", spec_select(query, keys, rec, rho))
    configs = ((), BANDED) if strategy == "auto" else ((("strategy", "dense"),),)
    with backend.x64():
        for cfg, (got, _) in zip(configs, backend.route_topk_score(addr, qpos, rec, query, keys, rho, 5, configs)):
            assert_same(got, ref, f"{cfg}")


@pytest.mark.parametrize("backend", JAX_SLOW)
@settings(max_examples=30, deadline=None)
@given(nb=st.integers(1, 4), rho=st.sampled_from([-1.0, 0.0, 0.5, 3.0, 50.0]), seed=st.integers(0, 2**16),
       data=st.data())
def test_topk_score_property(backend, nb: int, rho: float, seed: int, data: st.DataObject) -> None:
    if backend.compiles:
        T, K, window = 30, 3, 1  # fixed shapes: one compilation serves every example
    else:
        T, K, window = (data.draw(st.integers(1, 30), label="T"), data.draw(st.integers(1, 6), label="K"),
                        data.draw(st.integers(0, 3), label="window - K"))
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, nb, (2, T))
    qpos = np.arange(T)
    rec = records.recency(T, "ar")
    keys = _EXACT_UNITS[rng.integers(0, len(_EXACT_UNITS), (2, T))]
    query = _EXACT_UNITS[rng.integers(0, len(_EXACT_UNITS), (2, T))]
    ref = routing.route_context(addr, qpos, K, "topk_score", spec_select(query, keys, rec, rho))
    configs = ((("sparse_window", K + window),), (("sparse_window", K + window), *BANDED))
    with backend.x64():
        for got, _ in backend.route_topk_score(addr, qpos, rec, query, keys, rho, K, configs):
            assert_same(got, ref)


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_topk_score_float32_selection_matches_spec(backend) -> None:
    addr, qpos, rec, query, keys = topk_case(63, "ar", seed=5, nb=3)
    ref = routing.route_context(addr, qpos, 3, "topk_score", spec_select(query, keys, rec, 1.5))
    assert_same(backend.route_topk_float32(addr, qpos, 3, query, keys, rec, 1.5), ref)


@pytest.mark.parametrize("backend", BOTH)
def test_route_context_argument_errors(backend) -> None:
    r = backend.routing
    addr, q = backend.ints(np.zeros((1, 4))), backend.ints(np.arange(4))
    with pytest.raises(ValueError, match="needs select"):
        r.route_context(addr, q, 2, "topk_score")
    with pytest.raises(ValueError, match="unknown"):
        r.route_context(addr, q, 2, "oldest")
    sel = r.SelectionInputs(backend.floats(np.zeros((1, 4, 2))), backend.floats(np.zeros((1, 4, 2))),
                            backend.floats(np.zeros(4)), 1.0)
    with pytest.raises(ValueError, match="strategy"):
        r.route_context_topk_score(addr, q, 2, sel, strategy="sparse")
    with pytest.raises(ValueError, match="query_layout 'full' is unknown"):
        r.route_context(addr, q, 2, "recent", query_layout="full")
    with pytest.raises(ValueError, match="query_layout 'ar' needs 4 query positions, got 1"):
        r.route_context_topk_score(addr, backend.ints([3]), 2, sel, query_layout="ar")


@pytest.mark.parametrize("backend", BOTH)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_topk_rows_matches_lexsort(backend, seed: int, data: st.DataObject) -> None:
    if backend.compiles:
        n, T, k = 4, 20, data.draw(st.sampled_from([1, 5, 25]), label="k")  # fixed shapes; k > T: padded slots
    else:
        n, T, k = (data.draw(st.integers(1, 12), label="n"), data.draw(st.integers(1, 20), label="T"),
                   data.draw(st.integers(1, 25), label="k"))
    rng = np.random.default_rng(seed)
    score = rng.integers(-3, 3, (n, T)).astype(np.float64)  # many ties; exact in float32 too
    valid = rng.random((n, T)) < 0.7
    idx, ok = backend.topk_rows(score, valid, k)
    assert idx.shape == ok.shape == (n, k)
    for r in range(n):
        cols = np.flatnonzero(valid[r])
        want = cols[np.lexsort((cols, -score[r, cols]))][:k]
        assert idx[r, : len(want)].tolist() == want.tolist()
        assert ok[r].sum() == len(want) and (idx[r, len(want):] == -1).all()
