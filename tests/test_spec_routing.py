"""Property tests of the routes and of the mixture (docs/DESIGN.md §5, tier 1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcaf_core import mixture, records, reference, routing
from pcaf_core.hashing import addresses
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile
from tests.spec_helpers import tiny_memory, tiny_model

token_windows = st.integers(1, 40).flatmap(
    lambda T: st.lists(st.integers(3, 12), min_size=T, max_size=T)
)


def _query_setup(tokens: np.ndarray, mode: str, K: int, B_buckets: int, seed: int):
    T = tokens.shape[1]
    qpos = records.query_positions(T, mode)
    rng = np.random.default_rng(seed)
    addr = addresses(tokens, 1, B_buckets)
    sel = rng.normal(size=(tokens.shape[0], len(qpos), T))
    return qpos, addr, sel


@settings(max_examples=60, deadline=None)
@given(token_windows, st.sampled_from(["nt", "ar"]), st.integers(1, 6), st.integers(1, 9),
       st.sampled_from(["topk_score", "recent", "first"]), st.integers(0, 2**31))
def test_context_route_is_causal_same_bucket_and_at_most_k(toks, mode, K, nb, policy, seed):
    tokens = np.array([toks])
    qpos, addr, sel = _query_setup(tokens, mode, K, nb, seed)
    cand = routing.route_context(addr, qpos, K, policy, sel)
    assert cand.index.shape == (1, len(qpos), K)
    for qi, t in enumerate(qpos):
        idx = cand.index[0, qi][cand.valid[0, qi]]
        assert np.array_equal(cand.valid[0, qi], cand.index[0, qi] >= 0)
        assert (idx < t).all()
        assert (addr[0, idx] == addr[0, t]).all()
        assert len(set(idx.tolist())) == len(idx)
        occupancy = int((addr[0, :t] == addr[0, t]).sum())
        assert len(idx) == min(K, occupancy)
        if policy == "recent":
            assert list(idx) == sorted(np.flatnonzero(addr[0, :t] == addr[0, t]))[::-1][:K]
        elif policy == "first":
            assert list(idx) == sorted(np.flatnonzero(addr[0, :t] == addr[0, t]))[:K]


@settings(max_examples=60, deadline=None)
@given(token_windows, st.integers(1, 6), st.integers(0, 2**31))
def test_topk_score_equals_brute_force_sort(toks, K, seed):
    tokens = np.array([toks])
    qpos, addr, sel = _query_setup(tokens, "ar", K, 5, seed)
    sel = np.round(sel, 1)  # force ties: they must go to the lower index
    cand = routing.route_context(addr, qpos, K, "topk_score", sel)
    for qi, t in enumerate(qpos):
        allowed = [s for s in range(t) if addr[0, s] == addr[0, t]]
        brute = sorted(allowed, key=lambda s: (-sel[0, qi, s], s))[:K]
        assert cand.index[0, qi][cand.valid[0, qi]].tolist() == brute


def _semantic_inputs(T: int, S: int, seed: int):
    rng = np.random.default_rng(seed)
    probs = np.exp(rng.normal(size=(1, T, S)) * 2)
    probs /= probs.sum(-1, keepdims=True)
    qpos = records.query_positions(T, "ar")
    return routing.semantic_overlap(probs, qpos), records.recency(T, "ar"), qpos, probs


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 8), st.integers(0, 2**31))
def test_semantic_routes_are_causal_without_the_leak(T, K, seed):
    overlap, rec, qpos, probs = _semantic_inputs(T, 4, seed)
    dense = routing.route_semantic_dense(overlap, rec, 0.7, qpos, K, target_leak=False)
    bucketed = routing.route_semantic_bucketed(routing.semantic_buckets(probs), qpos, K)
    for cand in (dense, bucketed):
        assert cand.width == K
        for t in qpos:
            idx = cand.index[0, t][cand.valid[0, t]]
            assert (idx < t).all() and len(idx) <= min(K, t)
    for t in qpos:  # the dense route fills every slot it can
        assert dense.valid[0, t].sum() == min(K, t)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 8), st.integers(0, 2**31))
def test_leak_switch_adds_exactly_the_reference_picks(T, K, seed):
    overlap, rec, qpos, _ = _semantic_inputs(T, 4, seed)
    clean = routing.route_semantic_dense(overlap, rec, 0.7, qpos, K, target_leak=False)
    leak = routing.route_semantic_dense(overlap, rec, 0.7, qpos, K, target_leak=True)
    for t in qpos:
        n = min(K, t)
        assert np.array_equal(leak.index[0, t, :n], clean.index[0, t, :n])
        extra = leak.index[0, t, n:][leak.valid[0, t, n:]].tolist()
        assert extra == (list(range(t, min(K, T))) if t < K else [])
        assert not clean.valid[0, t, n:].any()


def test_hybrid_concatenates_or_deduplicates():
    ctx = routing.Candidates(np.array([[[3, 1, -1]]]), np.array([[[True, True, False]]]))
    sem = routing.Candidates(np.array([[[1, 2, 3]]]), np.array([[[True, True, True]]]))
    raw = routing.combine_hybrid(ctx, sem, dedup=False)
    assert raw.index.tolist() == [[[3, 1, -1, 1, 2, 3]]]
    assert raw.valid.sum() == 5
    dd = routing.combine_hybrid(ctx, sem, dedup=True)
    assert dd.index.tolist() == [[[3, 1, -1, -1, 2, -1]]]
    assert dd.valid.tolist() == [[[True, True, False, False, True, False]]]


def test_order_one_with_enough_buckets_routes_to_previous_occurrences_of_the_same_token():
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, 40, (2, 60))
    addr = addresses(tokens, 1, 64)  # B >= V: bucket = token identity
    qpos = records.query_positions(60, "ar")
    cand = routing.route_context(addr, qpos, 60, "recent")
    for b in range(2):
        for t in qpos:
            idx = cand.index[b, t][cand.valid[b, t]]
            assert sorted(idx.tolist()) == np.flatnonzero(tokens[b, :t] == tokens[b, t]).tolist()


# --------------------------------------------------------------------------- gate and mixture


def _forward(variant, route, profile, mode, tokens, seed=0, **mem):
    model = tiny_model(variant)
    memory = tiny_memory(route, **mem)
    prof = get_profile(profile)
    params = init_params(model, memory, prof, seed=seed)
    rng = np.random.default_rng(seed + 1)
    params["memory.recency_scale"] = np.array(rng.uniform(-2, 2))
    targets = rng.integers(3, model.vocab_size, tokens.shape[0] if mode == "nt" else tokens.shape)
    return reference.forward(params, tokens, model, memory, prof, mode, targets), model


@pytest.mark.parametrize("profile", ["corrected", "reference_jax", "reference_torch"])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_empty_bucket_masks_the_gate_to_zero(profile, mode):
    tokens = np.array([[3, 4, 5, 6, 7, 8, 9, 10]])  # all distinct: every query's bucket is empty
    out, _ = _forward("pcaf", "context", profile, mode, tokens, num_buckets=64)
    empty = ~out.memory.cand.valid.any(-1)
    assert empty.all()
    prof = get_profile(profile)
    if mixture.mixture_rule(prof, mode).gate_per_term:
        # reference PyTorch NT: the masked gate stays 0; the parametric term keeps weight exactly 1 and
        # the cache term gets max(0, 1e-5) times the floored p_cache 1e-6 on every entry.
        assert (out.memory.gate == 0).all()
        assert np.allclose(out.log_probs, np.logaddexp(out.param_log_probs, np.log(1e-5 * 1e-6)), rtol=0,
                           atol=1e-13)
    elif prof.gate_clip_when_empty:
        assert np.allclose(out.memory.gate, mixture.GATE_CLIP)  # reference: masked to 0, then clipped
    else:
        assert (out.memory.gate == 0).all()
        assert np.allclose(out.log_probs, out.param_log_probs)
    assert (out.memory.p_cache == 0).all() and (out.memory.cache_weights == 0).all()


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["context", "semantic", "hybrid"]), st.sampled_from(["nt", "ar"]),
       st.integers(0, 1000), st.sampled_from(["pcaf", "pcaf_no_gate"]))
def test_corrected_mixture_sums_to_one(route, mode, seed, variant):
    tokens = np.random.default_rng(seed).integers(3, 9, (2, 14))
    out, _ = _forward(variant, route, "corrected", mode, tokens, seed=seed, num_buckets=8)
    assert np.allclose(np.exp(out.log_probs).sum(-1), 1.0, atol=1e-12)
    assert np.allclose(out.memory.p_cache.sum(-1), out.memory.cand.valid.any(-1), atol=1e-12)
    w = out.memory.cache_weights
    assert (w[~out.memory.cand.valid] == 0).all()


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["context", "semantic", "hybrid"]), st.integers(0, 1000))
def test_reference_nt_mixture_mass_exceeds_one_by_the_floor(route, seed):
    tokens = np.random.default_rng(seed).integers(3, 9, (2, 14))
    out, model = _forward("pcaf", route, "reference_jax", "nt", tokens, seed=seed, num_buckets=8)
    lam = out.memory.gate[:, 0]
    pc = out.memory.p_cache[:, 0]
    distinct = (pc > 0).sum(-1)
    # Cached entries all carry >= 1e-6 mass here (at most 2K slots), so the excess is exact:
    # (1-λ) + λ·(Σ p_cache + 1e-6·#zero entries), i.e. 1 + λ·1e-6·(V - distinct) when a candidate exists.
    mass = np.exp(out.log_probs[:, 0]).sum(-1)
    expected = (1.0 - lam) + lam * (pc.sum(-1) + 1e-6 * (model.vocab_size - distinct))
    assert np.allclose(mass, expected, rtol=1e-9)
    hit = out.memory.cand.valid[:, 0].any(-1)
    assert np.allclose(mass[hit], 1.0 + lam[hit] * 1e-6 * (model.vocab_size - distinct[hit]), rtol=1e-9)
    assert (mass[hit] > 1.0).all()


def test_ar_accuracy_definitions():
    tokens = np.random.default_rng(5).integers(3, 8, (2, 16))
    ref, _ = _forward("pcaf", "context", "reference_jax", "ar", tokens, num_buckets=8)
    cor, _ = _forward("pcaf", "context", "corrected", "ar", tokens, num_buckets=8)
    assert np.array_equal(ref.prediction, ref.param_log_probs.argmax(-1))
    assert np.array_equal(cor.prediction, cor.log_probs.argmax(-1))
