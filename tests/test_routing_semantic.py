"""The semantic routes, hybrid combination, gathers and banded products of both backends against the spec.

The dense and bucketed semantic routes with and without the target leak, the hybrid combination of context and
semantic candidates, record gathers, ``gather_dot`` values and gradients, and the banded products that score
full-AR candidates. Each case runs on both backends through the adapters of ``tests/routing_adapters.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcaf_core import records, routing
from tests.routing_adapters import (
    BOTH,
    JAX_SLOW,
    assert_same,
    band_case,
    gather_dot_reference,
    router_probs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ----------------------------------------------------------------------------- semantic

# (K, target_leak, chunk_elements): one chunk, or one query per chunk (per lax.map step in JAX). K = 30 exceeds
# most T. JAX computes its configurations in one compilation, which grows with each: one-query chunks for K = 3
# with the leak alone.
_SEM_CONFIGS = tuple((K, leak, chunk) for K in (3, 30) for leak in (False, True) for chunk in (1 << 22, 1))
_SEM_CONFIGS_JAX = tuple(c for c in _SEM_CONFIGS if c[2] > 1 or c[:2] == (3, True))


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("T", [1, 2, 24, 63])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_semantic_dense_matches_spec(backend, T: int, mode: str) -> None:
    rng = np.random.default_rng(T)
    probs = router_probs(rng, 2, T, 5)
    qpos = records.query_positions(T, mode)
    rec = records.recency(T, mode)
    overlap = routing.semantic_overlap(probs, qpos)
    configs = _SEM_CONFIGS_JAX if backend.compiles else _SEM_CONFIGS
    with backend.x64():
        for rho in (-0.7, 0.0, 1.3):
            got = backend.semantic_dense_all(probs, rec, rho, qpos, configs)
            for (K, leak, chunk), cand in zip(configs, got):
                ref = routing.route_semantic_dense(overlap, rec, rho, qpos, K, target_leak=leak)
                assert_same(cand, ref, f"K={K} leak={leak} chunk={chunk} rho={rho}")


@pytest.mark.parametrize("backend", BOTH)
def test_semantic_dense_leak_picks_the_target(backend) -> None:
    T, K = 12, 4
    probs = router_probs(np.random.default_rng(0), 1, T, 3)
    got, plain = backend.semantic_dense_all(probs, records.recency(T, "ar"), 1.0, np.arange(T),
                                            ((K, True, 1 << 22), (K, False, 1 << 22)))
    for t in range(K):
        assert got.valid[0, t].all() and t in got.index[0, t].tolist()  # record t holds target x_{t+1}
    assert (got.index[0, K:] < np.arange(K, T)[:, None]).all()  # later queries stay causal
    assert not plain.valid[0, 0].any()  # without the leak, query 0 reads nothing


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_semantic_bucketed_matches_spec(backend, T: int, mode: str) -> None:
    rng = np.random.default_rng(T)
    probs = router_probs(rng, 2, T, 4)
    probs[0, : T // 2] = 0.25  # exact ties: argmax takes the lower bucket
    qpos = records.query_positions(T, mode)
    buckets, got = backend.semantic_bucketed(probs, qpos, 3)
    np.testing.assert_array_equal(buckets, routing.semantic_buckets(probs))
    assert_same(got, routing.route_semantic_bucketed(routing.semantic_buckets(probs), qpos, 3))


@pytest.mark.parametrize("backend", BOTH)
def test_semantic_overlap_matches_spec(backend) -> None:
    probs = router_probs(np.random.default_rng(1), 2, 9, 4)
    qpos = np.arange(9)
    with backend.x64():
        got = backend.semantic_overlap(probs, qpos)
    np.testing.assert_allclose(got, routing.semantic_overlap(probs, qpos), rtol=1e-12)


# ----------------------------------------------------------------------------- hybrid, gathers, products


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("dedup", [False, True])
def test_combine_hybrid_matches_spec(backend, dedup: bool) -> None:
    rng = np.random.default_rng(5)
    T, K = 24, 4
    addr = rng.integers(0, 3, (2, T))
    qpos = np.arange(T)
    ctx = routing.route_context(addr, qpos, K, "recent")
    sem = routing.route_semantic_dense(routing.semantic_overlap(router_probs(rng, 2, T, 3), qpos),
                                       records.recency(T, "ar"), 1.0, qpos, K, target_leak=True)
    ref = routing.combine_hybrid(ctx, sem, dedup=dedup)
    got = backend.combine_hybrid(ctx, sem, dedup)
    assert_same(got, ref)
    assert got.width == 2 * K
    assert (got.valid.sum(-1) <= ref.valid.sum(-1)).all()
    n_dup = ref.valid.sum() - ctx.valid.sum() - sem.valid.sum()
    assert (n_dup < 0) == dedup  # the case really has duplicates, and dedup removes them


@pytest.mark.parametrize("backend", BOTH)
def test_gather_records_matches_spec(backend) -> None:
    rng = np.random.default_rng(6)
    values = rng.normal(size=(2, 10, 3))
    cand = routing.route_context(rng.integers(0, 2, (2, 10)), np.arange(10), 3, "first")
    got = backend.gather_records(values, cand)  # float64 in torch, float32 in JAX: exact either way
    np.testing.assert_array_equal(got, routing.gather_records(values.astype(got.dtype), cand))
    tok = rng.integers(0, 9, (2, 10))
    np.testing.assert_array_equal(backend.batch_gather(tok, cand.index.clip(0)), routing.gather_records(tok, cand))


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_gather_dot_values_and_gradients(backend) -> None:
    """Values and gradients (float64) against the dense product, chunked in every way."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 6, 3))
    idx = rng.integers(0, 6, (2, 5, 4))  # repeated records within a query: their gradients add
    assert any(len(set(row)) < 4 for row in idx.reshape(-1, 4).tolist())
    cot = rng.normal(size=(2, 5, 4))
    want = gather_dot_reference(x, y, idx, cot)
    with backend.x64():
        # Chunks of one query, of two (50 elements, 2·4·3 per query: three chunks, the last one padded in JAX),
        # and all at once.
        for chunk in (1, 50, 10**6):
            got = backend.gather_dot_vjp(x, y, idx, cot, chunk)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-12, err_msg=f"chunk={chunk}")
            for g, w in zip(got[1:], want[1:]):
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"chunk={chunk}")


@pytest.mark.parametrize("backend", JAX_SLOW)
@pytest.mark.parametrize("T", [75, 80, 5])
def test_banded_dot_equals_gather_dot_on_the_recent_slots(backend, T: int) -> None:
    """Values and gradients of banded_dot equal gather_dot's on every valid slot (float64), with T a multiple
    of the width, not one, and shorter than it."""
    W = 8
    addr, x, y, win = band_case(T=T, W=W)
    ok = win.valid
    assert T < W or (ok.sum() > 4 * T and (~ok).sum() > 20)
    assert T != 75 or (ok.sum() > 500 and (~ok).sum() > 100)
    cot = np.where(ok, np.random.default_rng(1).normal(size=ok.shape), 0.0)
    with backend.x64():
        banded = backend.banded_dot_vjp(addr, x, y, W, cot)
        gathered = backend.gather_dot_vjp(x, y, win.index.clip(0), cot)
    np.testing.assert_allclose(banded[0][ok], gathered[0][ok], rtol=1e-12)
    for got, want in zip(banded[1:], gathered[1:]):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_candidate_scores_with_a_band_equal_the_gathered_scores(backend) -> None:
    """The scores the models compute for full-AR recent / bucketed semantic slots, with and without the
    band, router term included."""
    addr, q, k, win = band_case(W=8, d=5)
    logits = np.random.default_rng(3).normal(size=(2, 75, 4))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    with backend.x64():
        banded, gathered = backend.candidate_scores(addr, q, k, records.recency(75, "ar"), 0.7, win, probs, 1.0)
    np.testing.assert_allclose(banded[win.valid], gathered[win.valid], rtol=1e-12)


@pytest.mark.parametrize("backend", BOTH)
def test_permute_rows_vjp_is_the_inverse_gather(backend) -> None:
    """permute_rows' own backward (a gather by the inverse) equals autodiff of the plain row gather."""
    rng = np.random.default_rng(9)
    perm = np.stack([rng.permutation(11) for _ in range(2)])
    x = rng.normal(size=(2, 11, 3))
    cot = rng.normal(size=(2, 11, 3))
    (out, grad), (want, want_grad) = backend.permute_rows_and_gather_vjp(x, perm, cot)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(grad, want_grad)
