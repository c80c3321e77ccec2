"""JAX routing vs the NumPy spec: exact candidates, slot for slot, on awkward shapes.

Covers the sorted ``recent``/``first`` layout, both branches of the ``topk_score`` route (the sparse
proof and the ``lax.cond`` dense fallback, each forced and asserted), exact score ties, the dense and
bucketed semantic routes with and without the target leak, hybrid combination, gathers and the
chunked ``gather_dot`` gradient. Routes run under ``jax.jit`` with static K/policy and a traced ρ;
several configurations share one compilation to keep the file fast.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.jax import routing as jr
from backends.jax.ops import band_gather_dot, banded_dot, batch_gather, gather_dot
from pcaf_core import hashing, mixture, records, routing

# ----------------------------------------------------------------------------- helpers


def _unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _assert_same(cand: jr.Candidates, ref: routing.Candidates, msg: str = "") -> None:
    assert cand.index.dtype == jnp.int32 and cand.valid.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(cand.index), ref.index, err_msg=msg)
    np.testing.assert_array_equal(np.asarray(cand.valid), ref.valid, err_msg=msg)


def _spec_select(query: np.ndarray, keys: np.ndarray, rec: np.ndarray, rho: float) -> np.ndarray:
    return mixture.selection_score(query, keys, rec, rho)


def _counts(addr: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """``[B, Q]`` number of earlier same-bucket records of each query."""
    return np.array([[np.sum(addr[b, :t] == addr[b, t]) for t in qpos] for b in range(len(addr))])


def _address_rows(T: int, seed: int) -> np.ndarray:
    """``[6, T]`` addresses: 7 and 32768 buckets, one overflowing bucket (all tokens equal), few long
    buckets, 3 buckets, and every position alone in its bucket (empty buckets everywhere)."""
    rng = np.random.default_rng(seed)
    return np.stack([
        hashing.addresses(rng.integers(0, 50, T), 1, 7),
        hashing.addresses(rng.integers(0, 5000, T), 2, 32768),
        hashing.addresses(np.full(T, 7), 1, 3),
        hashing.addresses(rng.integers(0, 3, T), 1, 3),
        rng.integers(0, 3, T),
        np.arange(T),
    ])


_CONTEXT_KS = (1, 4, 40)  # K = 40 exceeds most buckets' occupancy


@jax.jit
def _context_all(addr: jax.Array, qpos: jax.Array) -> dict:
    return {(K, p): jr.route_context(addr, qpos, K, p) for K in _CONTEXT_KS for p in ("recent", "first")}


# ----------------------------------------------------------------------------- recent / first


@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_recent_first_match_spec(T: int, mode: str) -> None:
    addr = _address_rows(T, seed=T)
    qpos = records.query_positions(T, mode)
    got = _context_all(jnp.asarray(addr, jnp.int32), jnp.asarray(qpos, jnp.int32))
    for (K, policy), cand in got.items():
        _assert_same(cand, routing.route_context(addr, qpos, K, policy), f"K={K} {policy}")
    if T == 200 and mode == "ar":
        assert np.asarray(got[(4, "recent")].valid)[2].sum(-1).max() == 4  # the full bucket overflows K
        assert not np.asarray(got[(1, "first")].valid)[5].any()  # empty buckets: empty slots


@pytest.mark.slow
def test_batch_of_one_eager() -> None:
    addr = _address_rows(30, seed=1)[3:4]
    qpos = np.arange(30)
    _assert_same(jr.route_context(addr, qpos, 3, "recent"), routing.route_context(addr, qpos, 3, "recent"))


def test_bucket_layout_is_a_bucket_sort() -> None:
    layout = jax.jit(jr.bucket_layout)
    lay = layout(jnp.asarray([[3, 1, 3, 0, 1, 3]], jnp.int32))
    assert np.asarray(lay.order).tolist() == [[3, 1, 4, 0, 2, 5]]
    assert np.asarray(lay.seg_start).tolist() == [[0, 1, 1, 3, 3, 3]]
    assert np.asarray(jnp.take_along_axis(lay.order, lay.rank, 1)).tolist() == [list(range(6))]
    # Addresses near 2^31 (no address·T + position key to overflow).
    big = layout(jnp.asarray([[2**31 - 1, 5, 2**31 - 1, 5, 0, 2**31 - 1]], jnp.int32))
    assert np.asarray(big.order).tolist() == [[4, 1, 3, 0, 2, 5]]


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2**16))
def test_recent_first_property(n_buckets: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    T = 24  # fixed shapes: one compilation serves every example
    addr = rng.integers(0, n_buckets, (2, T))
    qpos = np.arange(T)
    for (K, policy), got in _context_all(jnp.asarray(addr, jnp.int32), jnp.asarray(qpos, jnp.int32)).items():
        _assert_same(got, routing.route_context(addr, qpos, K, policy))
        # Causality and capacity: every valid slot is an earlier same-bucket record.
        idx, ok = np.asarray(got.index), np.asarray(got.valid)
        b, q, _ = np.nonzero(ok)
        assert (idx[ok] < qpos[q]).all() and (addr[b, idx[ok]] == addr[b, qpos[q]]).all()


# ----------------------------------------------------------------------------- topk_score


@partial(jax.jit, static_argnames=("K", "config"))
def _topk_one(addr, qpos, query, keys, rec, rho, *, K: int, config: tuple) -> tuple[jr.Candidates, jax.Array]:
    """The route under jit: K and the keyword configuration static, ρ traced."""
    return jr.route_context_topk_score(addr, qpos, K, jr.SelectionInputs(query, keys, rec, rho), **dict(config))


def _topk_case(T: int, mode: str, d: int, seed: int, nb: int = 2):
    rng = np.random.default_rng(seed)
    addr = np.stack([hashing.addresses(rng.integers(0, 50, T), 1, nb),
                     hashing.addresses(rng.integers(0, 3, T), 1, 5),
                     hashing.addresses(np.full(T, 7), 1, 7)])  # one bucket: every query overflows
    qpos = records.query_positions(T, mode)
    rec = records.recency(T, mode)
    return addr, qpos, rec, _unit(rng, 3, len(qpos), d), _unit(rng, 3, T, d)


def _run_topk(addr, qpos, rec, query, keys, rho, K, configs=((),)):
    """``[(Candidates, dense)]`` per configuration; tests with equal shapes share compilations."""
    args = (jnp.asarray(addr, jnp.int32), jnp.asarray(qpos, jnp.int32), jnp.asarray(query), jnp.asarray(keys),
            jnp.asarray(rec), jnp.asarray(rho, jnp.asarray(query).dtype))
    return [_topk_one(*args, K=K, config=c) for c in configs]


_BANDED = (("query_layout", "ar"),)  # full AR: window scores read off blocked GEMMs, not gathered


def _topk_configs(T: int, mode: str, K: int) -> tuple:
    """Default, forced dense, and (AR, T = 200) the smallest window M = K with one query per dense chunk;
    in AR also the banded window scores (default window, and M = K at T = 200, where M does not divide T).
    Each is a compilation, so the redundant ones are left out: K = 50 (above the occupancy of most
    buckets) needs only the default (and, AR, banded); the property test below covers other small windows."""
    banded = (_BANDED,) if mode == "ar" else ()
    if K > 3:
        return ((), *banded)
    configs = ((), (("strategy", "dense"),), *banded)
    if T == 200 and mode == "ar":
        configs += ((("sparse_window", K), ("chunk_elements", T)), (("sparse_window", K), *_BANDED))
    return configs


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_topk_score_matches_spec(T: int, mode: str) -> None:
    with jax.enable_x64(True):
        for K in ((3,) if T <= 2 else (3, 50)):  # K = 50 is above the occupancy of most buckets
            addr, qpos, rec, query, keys = _topk_case(T, mode, 8, seed=T + K)
            configs = _topk_configs(T, mode, K)
            for rho in (-0.5, 0.0, 0.3, 1.0, 40.0):
                ref = routing.route_context(addr, qpos, K, "topk_score", _spec_select(query, keys, rec, rho))
                for cfg, (got, dense) in zip(configs, _run_topk(addr, qpos, rec, query, keys, rho, K, configs)):
                    _assert_same(got, ref, f"K={K} rho={rho} {cfg}")
                    assert dense.shape == (3, len(qpos))


def test_topk_score_sparse_proof_branch_is_taken_and_exact() -> None:
    # Two buckets over T = 200 hold ~100 records each, far more than M = 4K = 12; ρ = 40 makes the
    # recency gap between the K-th and the (M+1)-th most recent record exceed 2/√d, so the proof holds.
    with jax.enable_x64(True):
        addr, qpos, rec, query, keys = _topk_case(200, "ar", 8, seed=1)
        assert (_counts(addr, qpos) > 12).sum() > 300  # the proof was needed for most queries...
        ref = routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 40.0))
        for got, dense in _run_topk(addr, qpos, rec, query, keys, 40.0, 3, ((), _BANDED)):
            assert not np.asarray(dense).any()  # ...and it held for all of them
            _assert_same(got, ref)


@pytest.mark.parametrize("rho", [-0.5, 0.0])
def test_topk_score_dense_fallback_branch_is_taken_and_exact(rho: float) -> None:
    # ρ < 0 voids the proof; ρ = 0 leaves no recency gap to separate the window from older records.
    with jax.enable_x64(True):
        addr, qpos, rec, query, keys = _topk_case(200, "ar", 8, seed=2)
        ((got, dense),) = _run_topk(addr, qpos, rec, query, keys, rho, 3)
        np.testing.assert_array_equal(np.asarray(dense), _counts(addr, qpos) > 12)  # exactly the overflowing
        _assert_same(got, routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, rho)))


def test_topk_score_proof_uses_the_vector_norms() -> None:
    # Keys and queries of norm ~4: a bound that assumed unit vectors would wrongly accept the window.
    with jax.enable_x64(True):
        addr, qpos, rec, query, keys = _topk_case(200, "ar", 8, seed=6)
        rng = np.random.default_rng(6)
        query, keys = query * 4.0, keys * rng.uniform(0.5, 4.0, (3, 200, 1))
        ((got, dense),) = _run_topk(addr, qpos, rec, query, keys, 8.0, 3)
        assert np.asarray(dense).any()
        _assert_same(got, routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 8.0)))


def test_topk_score_mixed_branches() -> None:
    with jax.enable_x64(True):
        addr, qpos, rec, query, keys = _topk_case(200, "ar", 8, seed=3, nb=3)
        ((got, dense),) = _run_topk(addr, qpos, rec, query, keys, 4.0, 3)
        dense = np.asarray(dense)
        assert dense.any() and not dense.all()
        _assert_same(got, routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 4.0)))


# Unit vectors whose dot products are exact in any summation order, so exact score ties are real ties.
_EXACT_UNITS = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0.5, 0.5, 0.5, 0.5], [0.5, -0.5, 0.5, -0.5],
                         [-1, 0, 0, 0], [0, 0, 0.5, 0.5]])


@pytest.mark.slow
def test_topk_score_ties_go_to_the_lower_index() -> None:
    rng = np.random.default_rng(4)
    T = 63
    addr = rng.integers(0, 2, (2, T))
    qpos = np.arange(T)
    rec = records.recency(T, "ar")
    keys = _EXACT_UNITS[rng.integers(0, 2, (2, T))]  # only two distinct keys: many exact ties
    query = _EXACT_UNITS[rng.integers(0, 4, (2, T))]
    with jax.enable_x64(True):
        for rho in (0.0, 1.0):
            ref = routing.route_context(addr, qpos, 5, "topk_score", _spec_select(query, keys, rec, rho))
            configs = ((), (("strategy", "dense"),), _BANDED)
            for cfg, (got, _) in zip(configs, _run_topk(addr, qpos, rec, query, keys, rho, 5, configs)):
                _assert_same(got, ref, f"rho={rho} {cfg}")


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 4), st.sampled_from([-1.0, 0.0, 0.5, 3.0, 50.0]), st.integers(0, 2**16))
def test_topk_score_property(nb: int, rho: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    T, K = 30, 3  # fixed shapes: one compilation serves every example
    addr = rng.integers(0, nb, (2, T))
    qpos = np.arange(T)
    rec = records.recency(T, "ar")
    keys = _EXACT_UNITS[rng.integers(0, len(_EXACT_UNITS), (2, T))]
    query = _EXACT_UNITS[rng.integers(0, len(_EXACT_UNITS), (2, T))]
    ref = routing.route_context(addr, qpos, K, "topk_score", _spec_select(query, keys, rec, rho))
    with jax.enable_x64(True):
        configs = ((("sparse_window", K + 1),), (("sparse_window", K + 1), *_BANDED))
        for got, _ in _run_topk(addr, qpos, rec, query, keys, rho, K, configs):
            _assert_same(got, ref)


@pytest.mark.slow
def test_topk_score_float32_selection_matches_spec() -> None:
    addr, qpos, rec, query, keys = _topk_case(63, "ar", 8, seed=5)
    ref = routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 1.5))
    with jax.default_matmul_precision("highest"):
        sel = jr.SelectionInputs(jnp.asarray(query, jnp.float32), jnp.asarray(keys, jnp.float32),
                                 jnp.asarray(rec, jnp.float32), 1.5)
        got = jax.jit(jr.route_context, static_argnums=(2, 3))(addr, qpos, 3, "topk_score", sel)
    assert got.index.dtype == jnp.int32
    _assert_same(got, ref)


@pytest.mark.slow
def test_topk_score_selection_is_not_differentiated() -> None:
    # Gradients flow through the scores of the selected slots, never through the selection: the
    # gradient equals the one with the candidates held fixed.
    addr, qpos, rec, query, keys = _topk_case(24, "ar", 4, seed=7)
    rec32 = jnp.asarray(rec, jnp.float32)

    def slot_scores(q: jax.Array, k: jax.Array, cand: jr.Candidates) -> jax.Array:
        return jnp.sum(jnp.where(cand.valid, gather_dot(q, k, jnp.maximum(cand.index, 0)), 0.0))

    def loss(q: jax.Array, k: jax.Array) -> jax.Array:
        cand = jr.route_context(addr, qpos, 2, "topk_score", jr.SelectionInputs(q, k, rec32, 1.0))
        return slot_scores(q, k, cand), cand

    q, k = jnp.asarray(query, jnp.float32), jnp.asarray(keys, jnp.float32)
    (gq, gk), cand = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(q, k)
    fixed = jax.jit(jax.grad(slot_scores, argnums=(0, 1)))(q, k, cand)
    np.testing.assert_allclose(np.asarray(gq), np.asarray(fixed[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gk), np.asarray(fixed[1]), rtol=1e-6)
    assert float(jnp.abs(gq).sum()) > 0


def test_route_context_argument_errors() -> None:
    addr, q = jnp.zeros((1, 4), jnp.int32), jnp.arange(4)
    with pytest.raises(ValueError, match="needs select"):
        jr.route_context(addr, q, 2, "topk_score")
    with pytest.raises(ValueError, match="unknown"):
        jr.route_context(addr, q, 2, "oldest")
    sel = jr.SelectionInputs(jnp.zeros((1, 4, 2)), jnp.zeros((1, 4, 2)), jnp.zeros(4), 1.0)
    with pytest.raises(ValueError, match="strategy"):
        jr.route_context_topk_score(addr, q, 2, sel, strategy="sparse")
    with pytest.raises(ValueError, match="query_layout 'full' is unknown"):
        jr.route_context(addr, q, 2, "recent", query_layout="full")
    with pytest.raises(ValueError, match="query_layout 'ar' needs 4 query positions, got 1"):
        jr.route_context_topk_score(addr, jnp.array([3]), 2, sel, query_layout="ar")


def _band_case(T: int = 75, W: int = 8, d: int = 6, seed: int = 11):
    """Addresses in 3 buckets (each holding more than W records, T not a multiple of W), rows, and the
    ``recent`` slots of every position: the layout :func:`banded_dot` reads."""
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, 3, (2, T))
    x, y = rng.normal(size=(2, T, d)), rng.normal(size=(2, T, d))
    layout = jr.bucket_layout(jnp.asarray(addr))
    slot, _, count = jr._query_slots(layout, jnp.arange(T))
    return layout, x, y, jr._recent_slots(layout, slot, count, W)


@pytest.mark.slow
def test_banded_dot_equals_gather_dot_on_the_recent_slots() -> None:
    """Values and gradients of banded_dot equal gather_dot's on every valid slot (f64, so exactly enough)."""
    W = 8
    with jax.enable_x64(True):
        layout, x, y, win = _band_case(W=W)
        ok = np.asarray(win.valid)
        assert ok.sum() > 500 and (~ok).sum() > 100
        idx = jnp.maximum(win.index, 0)
        cot = jnp.where(win.valid, jnp.asarray(np.random.default_rng(1).normal(size=ok.shape)), 0.0)

        def banded(x, y):
            return banded_dot(layout.order, layout.rank, x, y, W)

        def gathered(x, y):
            return gather_dot(x, y, idx)

        np.testing.assert_allclose(np.asarray(banded(x, y))[ok], np.asarray(gathered(x, y))[ok], rtol=1e-12)
        for f, g in zip(jax.grad(lambda x, y: jnp.sum(banded(x, y) * cot), argnums=(0, 1))(x, y),
                        jax.grad(lambda x, y: jnp.sum(gathered(x, y) * cot), argnums=(0, 1))(x, y)):
            np.testing.assert_allclose(np.asarray(f), np.asarray(g), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_candidate_scores_with_a_band_equal_the_gathered_scores() -> None:
    """The scores the models compute for full-AR recent / bucketed semantic slots, with and without the
    band, router term included."""
    from backends.jax.mixture import candidate_scores

    W = 8
    with jax.enable_x64(True):
        layout, q, k, win = _band_case(W=W, d=5)
        rng = np.random.default_rng(3)
        probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 75, 4))), axis=-1)
        rec = jnp.asarray(records.recency(75, "ar"))
        args = (jnp.asarray(q), jnp.asarray(k), rec, 0.7, win, probs, probs, 1.0)
        ok = np.asarray(win.valid)
        np.testing.assert_allclose(np.asarray(candidate_scores(*args, band=routing.ScoreBand(layout)))[ok],
                                   np.asarray(candidate_scores(*args))[ok], rtol=1e-12)


def _scattered_slots(T: int = 75, W: int = 8, C: int = 5, seed: int = 5):
    """A bucket layout and, for every position, C slots drawn from all its earlier same-bucket records (so
    many lie further back than W sorted slots), some empty: the shape of ``topk_score`` candidates with
    dense-fallback queries among them."""
    layout, x, y, _ = _band_case(T=T, W=W, seed=seed)
    order, rank, start = (np.array(a) for a in layout)
    rng = np.random.default_rng(seed)
    index = np.full((2, T, C), -1)
    for b in range(2):
        for t in range(T):
            earlier = order[b, start[b, rank[b, t]]:rank[b, t]]
            pick = rng.permutation(earlier)[:C]
            index[b, t, :len(pick)] = pick
    return layout, x, y, jnp.asarray(index)


@pytest.mark.parametrize(("outside_pairs", "band_width"), [(4096, 8), (7, 8), (4096, 80)],
                         ids=["compact", "every-slot", "none-outside"])
@pytest.mark.slow
def test_band_gather_dot_equals_gather_dot(outside_pairs: int, band_width: int) -> None:
    """Values and gradients on every non-empty slot, inside the band and outside it: outside pairs gathered
    compactly, or (more of them than ``outside_pairs``) every slot gathered; with a band wider than the
    sequence no pair lies outside and nothing is gathered."""
    W = band_width
    with jax.enable_x64(True):
        layout, x, y, index = _scattered_slots(W=8)
        ok = np.asarray(index) >= 0
        offset = np.asarray(layout.rank)[..., None] - 1 - np.take_along_axis(
            np.asarray(layout.rank), np.maximum(np.asarray(index), 0).reshape(2, -1), axis=1).reshape(index.shape)
        outside = (ok & (offset >= W)).sum()
        assert (ok & (offset < W)).sum() > 300 and (~ok).sum() > 20
        assert outside > 100 if W == 8 else outside == 0
        cot = jnp.where(ok, jnp.asarray(np.random.default_rng(2).normal(size=ok.shape)), 0.0)

        def banded(x, y):
            return band_gather_dot(layout.order, layout.rank, x, y, index, W, outside_pairs=outside_pairs)

        def gathered(x, y):
            return gather_dot(x, y, jnp.maximum(index, 0))

        np.testing.assert_allclose(np.asarray(banded(x, y))[ok], np.asarray(gathered(x, y))[ok], rtol=1e-12)
        for f, g in zip(jax.grad(lambda x, y: jnp.sum(banded(x, y) * cot), argnums=(0, 1))(x, y),
                        jax.grad(lambda x, y: jnp.sum(gathered(x, y) * cot), argnums=(0, 1))(x, y)):
            np.testing.assert_allclose(np.asarray(f), np.asarray(g), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_topk_score_candidates_scored_with_a_band_equal_the_gathered_scores() -> None:
    """Full-AR ``topk_score`` as the models run it (M = 4K, the route's band), with queries the proof
    cannot cover (ρ < 0 sends every overflowing query to the dense fallback): the banded scores equal the
    gathered ones on every valid slot, and some of those slots lie outside the M-window."""
    from backends.jax.mixture import candidate_scores

    T, K, d = 120, 2, 4
    M = routing.topk_sparse_window(K)
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        addr = jnp.asarray(rng.integers(0, 2, (1, T)))
        q, k = (jnp.asarray(rng.normal(size=(1, T, d))) for _ in range(2))
        rec = jnp.asarray(records.recency(T, "ar"))
        layout = jr.bucket_layout(addr)
        for rho in (0.5, -0.5):
            cand, dense = jr.route_context_topk_score(addr, jnp.arange(T), K, jr.SelectionInputs(q, k, rec, rho),
                                                      query_layout="ar", layout=layout)
            ok = np.asarray(cand.valid)
            args = (q, k, rec, rho, cand)
            np.testing.assert_allclose(np.asarray(candidate_scores(*args, band=routing.ScoreBand(layout, M)))[ok],
                                       np.asarray(candidate_scores(*args))[ok], rtol=1e-12)
        rank = np.asarray(layout.rank)[0]
        offset = rank[:, None] - 1 - rank[np.maximum(np.asarray(cand.index)[0], 0)]
        assert np.asarray(dense).any() and (ok[0] & (offset >= M)).any()


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([1, 5, 25]), st.integers(0, 2**16))
def test_topk_rows_matches_lexsort(k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    T = 20  # k = 25 > T: padded slots
    score = rng.integers(-3, 3, (4, T)).astype(np.float32)  # many ties
    valid = rng.random((4, T)) < 0.7
    idx, ok = jr.topk_rows(jnp.asarray(score), jnp.asarray(valid), k)
    idx, ok = np.asarray(idx), np.asarray(ok)
    assert idx.shape == ok.shape == (4, k)
    for r in range(4):
        cols = np.flatnonzero(valid[r])
        want = cols[np.lexsort((cols, -score[r, cols]))][:k]
        assert idx[r, : len(want)].tolist() == want.tolist()
        assert ok[r].sum() == len(want) and (idx[r, len(want):] == -1).all()


# ----------------------------------------------------------------------------- semantic


def _router_probs(rng: np.random.Generator, B: int, T: int, S: int, tau: float = 0.2) -> np.ndarray:
    logits = rng.normal(size=(B, T, S)) / tau
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# (K, target_leak, chunk_elements); chunk 1 = one query per lax.map step. K = 30 exceeds most T.
_SEM_CONFIGS = ((3, False, 1 << 22), (3, True, 1 << 22), (30, False, 1 << 22), (30, True, 1 << 22), (3, True, 1))


@jax.jit
def _semantic_all(probs, rec, rho, qpos) -> list:
    return [jr.route_semantic_dense(probs, rec, rho, qpos, K, target_leak=leak, chunk_elements=chunk)
            for K, leak, chunk in _SEM_CONFIGS]


@pytest.mark.parametrize("T", [1, 2, 63])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_semantic_dense_matches_spec(T: int, mode: str) -> None:
    rng = np.random.default_rng(T)
    probs = _router_probs(rng, 2, T, 5)
    qpos = records.query_positions(T, mode)
    rec = records.recency(T, mode)
    with jax.enable_x64(True):
        for rho in (-0.7, 0.0, 1.3):
            got = _semantic_all(jnp.asarray(probs), jnp.asarray(rec), jnp.asarray(rho), jnp.asarray(qpos))
            overlap = routing.semantic_overlap(probs, qpos)
            for (K, leak, chunk), cand in zip(_SEM_CONFIGS, got):
                ref = routing.route_semantic_dense(overlap, rec, rho, qpos, K, target_leak=leak)
                _assert_same(cand, ref, f"K={K} leak={leak} chunk={chunk} rho={rho}")


@pytest.mark.slow
def test_semantic_dense_leak_picks_the_target() -> None:
    T, K = 12, 4
    probs = _router_probs(np.random.default_rng(0), 1, T, 3)
    got = jr.route_semantic_dense(jnp.asarray(probs, jnp.float32), jrec_recency(T), 1.0, jnp.arange(T), K,
                                  target_leak=True)
    index, valid = np.asarray(got.index), np.asarray(got.valid)
    for t in range(K):
        assert valid[0, t].all() and t in index[0, t].tolist()  # record t holds target x_{t+1}
    assert (index[0, K:] < np.arange(K, T)[:, None]).all()  # later queries stay causal
    plain = jr.route_semantic_dense(jnp.asarray(probs, jnp.float32), jrec_recency(T), 1.0, jnp.arange(T), K)
    assert not np.asarray(plain.valid)[0, 0].any()  # without the leak, query 0 reads nothing


def jrec_recency(T: int) -> jax.Array:
    return jnp.asarray(records.recency(T, "ar"), jnp.float32)


@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_semantic_bucketed_matches_spec(T: int, mode: str) -> None:
    rng = np.random.default_rng(T)
    probs = _router_probs(rng, 2, T, 4)
    probs[0, : T // 2] = 0.25  # exact ties: argmax takes the lower bucket
    qpos = records.query_positions(T, mode)
    buckets, got = _bucketed(jnp.asarray(probs, jnp.float32), jnp.asarray(qpos, jnp.int32))
    np.testing.assert_array_equal(np.asarray(buckets), routing.semantic_buckets(probs))
    _assert_same(got, routing.route_semantic_bucketed(routing.semantic_buckets(probs), qpos, 3))


@jax.jit
def _bucketed(probs: jax.Array, qpos: jax.Array) -> tuple[jax.Array, jr.Candidates]:
    buckets = jr.semantic_buckets(probs)
    return buckets, jr.route_semantic_bucketed(buckets, qpos, 3)


def test_semantic_overlap_matches_spec() -> None:
    probs = _router_probs(np.random.default_rng(1), 2, 9, 4)
    qpos = np.arange(9)
    with jax.enable_x64(True):
        got = jr.semantic_overlap(jnp.asarray(probs), jnp.asarray(qpos))
        np.testing.assert_allclose(np.asarray(got), routing.semantic_overlap(probs, qpos), rtol=1e-12)


# ----------------------------------------------------------------------------- hybrid, gathers


@pytest.mark.parametrize("dedup", [False, True])
def test_combine_hybrid_matches_spec(dedup: bool) -> None:
    rng = np.random.default_rng(5)
    T, K = 24, 4
    addr = rng.integers(0, 3, (2, T))
    qpos = np.arange(T)
    ctx = routing.route_context(addr, qpos, K, "recent")
    sem = routing.route_semantic_dense(routing.semantic_overlap(_router_probs(rng, 2, T, 3), qpos),
                                       records.recency(T, "ar"), 1.0, qpos, K, target_leak=True)
    ref = routing.combine_hybrid(ctx, sem, dedup=dedup)
    jc = jr.Candidates(jnp.asarray(ctx.index, jnp.int32), jnp.asarray(ctx.valid))
    js = jr.Candidates(jnp.asarray(sem.index, jnp.int32), jnp.asarray(sem.valid))
    got = jax.jit(jr.combine_hybrid, static_argnames="dedup")(jc, js, dedup=dedup)
    _assert_same(got, ref)
    assert got.width == 2 * K
    n_dup = ref.valid.sum() - ctx.valid.sum() - sem.valid.sum()
    assert (n_dup < 0) == dedup  # the case really has duplicates, and dedup removes them


def test_gather_records_matches_spec() -> None:
    rng = np.random.default_rng(6)
    values = rng.normal(size=(2, 10, 3)).astype(np.float32)
    cand = routing.route_context(rng.integers(0, 2, (2, 10)), np.arange(10), 3, "first")
    got = jr.gather_records(jnp.asarray(values), jr.Candidates(jnp.asarray(cand.index, jnp.int32),
                                                                jnp.asarray(cand.valid)))
    np.testing.assert_array_equal(np.asarray(got), routing.gather_records(values, cand))
    tok = rng.integers(0, 9, (2, 10))
    np.testing.assert_array_equal(np.asarray(batch_gather(jnp.asarray(tok), jnp.asarray(cand.index.clip(0)))),
                                  routing.gather_records(tok, cand))


@pytest.mark.slow
def test_gather_dot_values_and_gradients() -> None:
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(2, 5, 3)))
        y = jnp.asarray(rng.normal(size=(2, 6, 3)))
        idx = jnp.asarray(rng.integers(0, 6, (2, 5, 4)))
        w = jnp.asarray(rng.normal(size=(2, 5, 4)))

        def dense(a, b):
            return jnp.einsum("bqd,bqcd->bqc", a, b[jnp.arange(2)[:, None, None], idx])

        g_dense = jax.grad(lambda a, b: jnp.sum(w * dense(a, b)), argnums=(0, 1))(x, y)

        def loss(a, b):
            # 2·4·3 = 24 elements per query: two queries per chunk, three chunks, the last one padded.
            out = gather_dot(a, b, idx, chunk_elements=50)
            return jnp.sum(w * out), out

        g, out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(x, y)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense(x, y)), rtol=1e-12)
        for gi, gd in zip(g, g_dense):
            np.testing.assert_allclose(np.asarray(gi), np.asarray(gd), rtol=1e-12, atol=1e-14)


def test_permute_rows_vjp_is_the_inverse_gather() -> None:
    """permute_rows' custom VJP (a gather by the inverse) equals autodiff of the plain row gather."""
    from backends.jax.ops import permute_rows

    rng = np.random.default_rng(9)
    perm = jnp.asarray(np.stack([rng.permutation(11) for _ in range(2)]))
    inverse = jnp.argsort(perm, axis=1)
    x = jnp.asarray(rng.normal(size=(2, 11, 3)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(2, 11, 3)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(permute_rows(x, perm, inverse)), np.asarray(batch_gather(x, perm)))
    got = jax.grad(lambda v: jnp.sum(permute_rows(v, perm, inverse) * cot))(x)
    want = jax.grad(lambda v: jnp.sum(batch_gather(v, perm) * cot))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
