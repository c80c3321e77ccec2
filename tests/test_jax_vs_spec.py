"""JAX (flax.linen) modules vs the NumPy oracle (:func:`pcaf_core.reference.forward`) on the spec's own weights.

Every variant × {nt, ar} × {reference_jax, reference_torch, corrected}, with every route, semantic index
and candidate policy of the cache variants (the cases of tests/test_torch_vs_spec.py): addresses and
candidates exactly equal; hidden states, log-probs, target log-probs, loss, scores, cache weights, gate,
p_cache and router probabilities within 1e-5 relative in float64 and 1e-4 in float32 (matmul precision
"highest"); predictions equal. Parameters are perturbed away from the init so every parameter's wiring
shows in the outputs; few buckets and few distinct tokens make buckets overflow K.

The forward runs eagerly: per-op compilations are cached across cases of the same shapes, which on
these tiny shapes is several times faster than compiling a ``jax.jit`` program per configuration. The
T = 3 window's shapes are its own, so there nothing is shared and one jitted program per case compiles
faster than its operations one by one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import build_model, to_variables
from backends.jax.models import JaxForwardOutput
from pcaf_core import hashing, reference
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile
from tests.spec_helpers import (
    ALL_CASES,
    CACHE_CASES,
    MODES,
    PLAIN_CASES,
    PROFILES,
    RHO,
    configs,
    spec_params,
    window,
)


def jax_forward(params, model, memory, profile, tokens, targets, mode, *, dtype=jnp.float64,
                jitted: bool = False) -> JaxForwardOutput:
    """The module's forward, eager (every operation compiled on its own, cached by shape) or ``jitted``."""
    net = build_model(model, memory, profile, dtype=dtype)
    # Weights cast on the host: the same rounding as a cast on the device, without a compilation per shape.
    variables = to_variables({k: np.asarray(v, np.dtype(dtype)) for k, v in params.items()}, dtype)
    def forward(v, x, y):
        return net.apply(v, x, y, mode)

    return (jax.jit(forward) if jitted else forward)(variables, jnp.asarray(tokens), jnp.asarray(targets))


def _close(got, want, rtol: float, atol: float, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=rtol, atol=atol, err_msg=what)


def assert_matches(out: JaxForwardOutput, ref: reference.ForwardOutput, rtol: float, atol: float) -> None:
    _close(out.hidden, ref.hidden, rtol, atol, "hidden")
    _close(out.param_log_probs, ref.param_log_probs, rtol, atol, "param_log_probs")
    _close(out.log_probs, ref.log_probs, rtol, atol, "log_probs")
    _close(out.target_log_prob, ref.target_log_prob, rtol, atol, "target_log_prob")
    np.testing.assert_allclose(float(out.loss), ref.loss, rtol=rtol, atol=atol, err_msg="loss")
    np.testing.assert_array_equal(np.asarray(out.prediction), ref.prediction, err_msg="prediction")
    np.testing.assert_array_equal(np.asarray(out.prediction_param), np.argmax(ref.param_log_probs, -1),
                                  err_msg="prediction_param")
    np.testing.assert_array_equal(np.asarray(out.prediction_mixture), np.argmax(ref.log_probs, -1),
                                  err_msg="prediction_mixture")
    if ref.memory is None:
        assert out.memory is None
        return
    mem, rm = out.memory, ref.memory
    np.testing.assert_array_equal(np.asarray(mem.addresses), rm.addresses, err_msg="addresses")
    np.testing.assert_array_equal(np.asarray(mem.cand.index), rm.cand.index, err_msg="candidate index")
    np.testing.assert_array_equal(np.asarray(mem.cand.valid), rm.cand.valid, err_msg="candidate valid")
    valid = rm.cand.valid
    _close(np.asarray(mem.scores)[valid], rm.scores[valid], rtol, atol, "scores")
    _close(mem.cache_weights, rm.cache_weights, rtol, atol, "cache_weights")
    _close(mem.gate, rm.gate, rtol, atol, "gate")
    _close(mem.p_cache, rm.p_cache, rtol, atol, "p_cache")
    if rm.router_probs is None:
        assert mem.router_probs is None
    else:
        _close(mem.router_probs, rm.router_probs, rtol, atol, "router_probs")


def run_case(case, profile_name: str, mode: str, *, dtype=jnp.float64, T: int = 20, jitted: bool = False):
    variant, route, index, policy = case
    model, memory, profile = configs(variant, route, index, policy, profile_name)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens, targets = window(T, mode)
    ref = reference.forward(params, tokens, model, memory, profile, mode, targets)
    out = jax_forward(params, model, memory, profile, tokens, targets, mode, dtype=dtype, jitted=jitted)
    return out, ref


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# The fast tier (make test-fast) keeps PCAF on each route in both modes (profiles rotated); the rest of the
# product, the plain backbones included, is slow.
_FAST_FLOAT64 = {(CACHE_CASES[0], "nt", "reference_jax"), (CACHE_CASES[0], "ar", "corrected"),
                 (CACHE_CASES[3], "nt", "corrected"), (CACHE_CASES[3], "ar", "reference_torch"),
                 (CACHE_CASES[5], "nt", "reference_torch"), (CACHE_CASES[5], "ar", "reference_jax")}
FLOAT64_PARAMS = [pytest.param(c, m, p, id=f"{'-'.join(c)}-{m}-{p}",
                               marks=() if (c, m, p) in _FAST_FLOAT64 else pytest.mark.slow)
                  for c in ALL_CASES for m in MODES for p in PROFILES]


@pytest.mark.parametrize(("case", "mode", "profile_name"), FLOAT64_PARAMS)
def test_float64_matches_spec(x64, case, mode: str, profile_name: str) -> None:
    out, ref = run_case(case, profile_name, mode)
    assert out.hidden.dtype == jnp.float64
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)
    if ref.memory is not None:  # non-trivial routing: records found, and (AR) early queries with empty slots
        assert ref.memory.cand.valid.any()
        leak_fills_all = case[1:3] == ("semantic", "dense") and get_profile(profile_name).semantic_ar_target_leak
        assert mode == "nt" or leak_fills_all or not ref.memory.cand.valid.all()
        dense = out.memory.topk_dense
        if case[1] != "semantic" and case[3] == "topk_score":
            assert dense.shape == ref.memory.cand.index.shape[:2] and dense.dtype == jnp.bool_
        else:
            assert dense is None


# Every route, index and policy and every backbone once in float32 (each new route costs a compilation);
# tests/test_cross_backend.py runs every case in float32 in both modes against the torch backend.
FLOAT32_CASES = [CACHE_CASES[i] for i in (0, 2, 3, 4, 6, 10)] + PLAIN_CASES


@pytest.mark.slow
@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: "-".join(c))
def test_float32_matches_spec(case) -> None:
    # AR (every position a query); the profile rotates over the cases.
    profile_name = PROFILES[FLOAT32_CASES.index(case) % len(PROFILES)]
    with jax.default_matmul_precision("highest"):
        out, ref = run_case(case, profile_name, "ar", dtype=jnp.float32)
    assert out.log_probs.dtype == jnp.float32
    assert_matches(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("profile_name", ["reference_jax", "corrected"])
@pytest.mark.parametrize("mode", MODES)
def test_context_order_two_hash_matches_spec(x64, profile_name: str, mode: str) -> None:
    model, memory, profile = configs("pcaf", "hybrid", "dense", "topk_score", profile_name, context_order=2)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens, targets = window(20, mode, distinct=4)
    ref = reference.forward(params, tokens, model, memory, profile, mode, targets)
    assert_matches(jax_forward(params, model, memory, profile, tokens, targets, mode), ref, 1e-5, 1e-10)
    # The int32 wrap-around changes the addresses at n = 2, so the exact match is informative.
    other = hashing.addresses(tokens, 2, memory.num_buckets, int32_wraparound=not profile.hash_int32_wraparound)
    assert (other != ref.memory.addresses).any()


@pytest.mark.slow
@pytest.mark.parametrize(("T", "mode"), [(1, "nt"), (1, "ar"), (3, "ar")])
def test_tiny_windows_match_spec(x64, mode: str, T: int) -> None:
    """T = 1 (no record at all) and T = 3 (queries with 0, 1, 2 records). Each window shape compiles
    afresh, so the three cases share it and rotate the profiles. At T = 1 the nt and ar windows have the same
    shapes (eagerly, the second reuses the first's compilations); T = 3's are its own: one jitted program
    per case compiles faster there than its operations one by one."""
    cases = (("pcaf", "hybrid", "dense", "topk_score"), ("pcaf", "semantic", "dense", "recent"),
             ("transformer_global_local", "context", "dense", "topk_score"))
    for i, case in enumerate(cases):
        out, ref = run_case(case, PROFILES[(i + T) % len(PROFILES)], mode, T=T, jitted=T > 1)
        assert_matches(out, ref, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("profile_name", PROFILES)
def test_all_tokens_equal_matches_spec(x64, profile_name: str) -> None:
    model, memory, profile = configs("pcaf", "hybrid", "bucketed", "topk_score", profile_name)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens = np.full((2, 20), 5)
    ref = reference.forward(params, tokens, model, memory, profile, "ar", tokens)
    assert_matches(jax_forward(params, model, memory, profile, tokens, tokens, "ar"), ref, 1e-5, 1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("profile_name", ["reference_jax", "reference_torch"])  # trainable / fixed table
def test_positional_scale_matches_spec(x64, profile_name: str) -> None:
    """``profile.positional_scale`` scales the trainable table's start (JAX init) and the fixed table."""
    from backends.jax.params import init_params as jax_init

    scale = 0.02
    model, memory, _ = configs("transformer_dense", profile=profile_name)
    profile = get_profile(profile_name, positional_scale=scale)
    unscaled = get_profile(profile_name)
    if profile.positional == "trainable_jax":
        want = scale * init_params(model, memory, unscaled)["pos.table"]
        got = jax_init(model, memory, profile, dtype=jnp.float64)["pos.table"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-15)
    params = spec_params(model, memory, profile)
    tokens, targets = window(20, "ar")
    ref = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    assert_matches(jax_forward(params, model, memory, profile, tokens, targets, "ar"), ref, 1e-10, 1e-10)
    if profile.positional == "fixed_torch":  # the fixed table is not a parameter: the forward changes
        ref_unscaled = reference.forward(params, tokens, model, memory, unscaled, "ar", targets)
        assert not np.allclose(ref.hidden, ref_unscaled.hidden)


@pytest.mark.parametrize("mode", MODES)
def test_training_path_equals_full_head(x64, mode: str) -> None:
    """The training call (head at the targets only, no [B, Q, V] arrays) gives the evaluation loss."""
    case = ("pcaf", "hybrid", "dense", "topk_score")
    model, memory, profile = configs(*case, profile="reference_jax")
    params = spec_params(model, memory, profile, rho=RHO["reference_jax"])
    tokens, targets = window(20, mode)
    ref = reference.forward(params, tokens, model, memory, profile, mode, targets)
    net = build_model(model, memory, profile, dtype=jnp.float64)
    out = net.apply(to_variables(params, jnp.float64), jnp.asarray(tokens), jnp.asarray(targets), mode,
                    need_log_probs=False, need_predictions=False)
    assert out.param_log_probs is None and out.log_probs is None and out.prediction is None
    assert out.memory.p_cache is None
    _close(out.target_log_prob, ref.target_log_prob, 1e-10, 1e-12, "target_log_prob")
    np.testing.assert_allclose(float(out.loss), ref.loss, rtol=1e-10)
