"""Torch modules vs the NumPy oracle (:func:`pcaf_core.reference.forward`) on the spec's own weights.

Every variant × {nt, ar} × {reference_jax, reference_torch, corrected}, with every route, semantic index
and candidate policy of the cache variants: addresses and candidates exactly equal; hidden states,
log-probs, target log-probs, loss, scores, cache weights, gate and p_cache within 1e-5 relative in float64
and 1e-4 in float32. Parameters are perturbed away from the init (random biases and LayerNorm
parameters, a unit-variance embedding, a peaky router, varied ρ including negative) so that every
parameter's wiring shows in the outputs and the routes pick non-trivial sets; few buckets and few
distinct tokens make buckets overflow K.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch import build_model, load_canonical
from backends.torch.models import TorchForwardOutput
from pcaf_core import hashing, reference
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile
from tests.spec_helpers import CACHE_CASES, MODES, PLAIN_CASES, PROFILES, RHO, configs, spec_params, window

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def torch_forward(params, model, memory, profile, tokens, targets, mode, *, dtype=torch.float64,
                  **attrs) -> TorchForwardOutput:
    net = build_model(model, memory, profile, dtype=dtype)
    load_canonical(net, params)
    for key, value in attrs.items():
        setattr(net, key, value)
    net.eval()
    with torch.no_grad():
        return net(torch.tensor(tokens), torch.tensor(targets), mode)


def _close(got: torch.Tensor, want: np.ndarray, rtol: float, atol: float, what: str) -> None:
    np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=rtol, atol=atol, err_msg=what)


def assert_matches(out: TorchForwardOutput, ref: reference.ForwardOutput, rtol: float, atol: float) -> None:
    _close(out.hidden, ref.hidden, rtol, atol, "hidden")
    _close(out.param_log_probs, ref.param_log_probs, rtol, atol, "param_log_probs")
    _close(out.log_probs, ref.log_probs, rtol, atol, "log_probs")
    _close(out.target_log_prob, ref.target_log_prob, rtol, atol, "target_log_prob")
    np.testing.assert_allclose(float(out.loss), ref.loss, rtol=rtol, atol=atol, err_msg="loss")
    np.testing.assert_array_equal(out.prediction.numpy(), ref.prediction, err_msg="prediction")
    if ref.memory is None:
        assert out.memory is None
        return
    mem, rm = out.memory, ref.memory
    np.testing.assert_array_equal(mem.addresses.numpy(), rm.addresses, err_msg="addresses")
    np.testing.assert_array_equal(mem.cand.index.numpy(), rm.cand.index, err_msg="candidate index")
    np.testing.assert_array_equal(mem.cand.valid.numpy(), rm.cand.valid, err_msg="candidate valid")
    valid = rm.cand.valid
    _close(mem.scores[torch.tensor(valid)], rm.scores[valid], rtol, atol, "scores")
    _close(mem.cache_weights, rm.cache_weights, rtol, atol, "cache_weights")
    _close(mem.gate, rm.gate, rtol, atol, "gate")
    _close(mem.p_cache, rm.p_cache, rtol, atol, "p_cache")
    if rm.router_probs is None:
        assert mem.router_probs is None
    else:
        _close(mem.router_probs, rm.router_probs, rtol, atol, "router_probs")


def _run_case(case, profile_name: str, mode: str, *, dtype=torch.float64, T: int = 20, **attrs):
    variant, route, index, policy = case
    model, memory, profile = configs(variant, route, index, policy, profile_name)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens, targets = window(T, mode)
    ref = reference.forward(params, tokens, model, memory, profile, mode, targets)
    out = torch_forward(params, model, memory, profile, tokens, targets, mode, dtype=dtype, **attrs)
    return out, ref


@pytest.mark.parametrize("profile_name", PROFILES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CACHE_CASES + PLAIN_CASES, ids=lambda c: "-".join(c))
def test_float64_matches_spec(case, mode: str, profile_name: str) -> None:
    out, ref = _run_case(case, profile_name, mode)
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)
    if ref.memory is not None:  # non-trivial routing: records found, and (AR) early queries with empty slots
        assert ref.memory.cand.valid.any()
        leak_fills_all = case[1:3] == ("semantic", "dense") and get_profile(profile_name).semantic_ar_target_leak
        assert mode == "nt" or leak_fills_all or not ref.memory.cand.valid.all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CACHE_CASES + PLAIN_CASES, ids=lambda c: "-".join(c))
def test_float32_matches_spec(case, mode: str) -> None:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for profile_name in ("reference_jax", "corrected"):
            out, ref = _run_case(case, profile_name, mode, dtype=torch.float32)
            assert out.log_probs.dtype == torch.float32
            assert_matches(out, ref, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("profile_name", PROFILES)
@pytest.mark.parametrize("attrs", [{"topk_strategy": "dense"}, {"sparse_window": 3}, {"sparse_window": 4}],
                         ids=["dense", "window-K", "window-K+1"])
def test_topk_score_strategies_match_spec(profile_name: str, attrs: dict) -> None:
    case = ("pcaf", "hybrid", "dense", "topk_score")
    out, ref = _run_case(case, profile_name, "ar", T=24, **attrs)
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)
    dense = out.memory.topk_dense
    if attrs.get("topk_strategy") == "dense":
        assert dense.all()
    elif profile_name == "reference_jax":  # ρ = 25: the proof covers every overflowing query
        assert not dense.any()
    elif profile_name == "reference_torch":  # ρ < 0: every overflowing query goes dense
        assert dense.any()


def test_both_topk_branches_occur_in_one_forward() -> None:
    model, memory, profile = configs("pcaf", "context", policy="topk_score")
    params = spec_params(model, memory, profile, rho=3.0)
    tokens, targets = window(48, "ar", distinct=6)
    ref = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    out = torch_forward(params, model, memory, profile, tokens, targets, "ar", sparse_window=3)
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)
    count = torch.tensor([[int((tokens[b, :t] == tokens[b, t]).sum()) for t in range(48)] for b in range(2)])
    overflow = count > 3  # n = 1 and B = 7 > 6 distinct tokens: bucket = token
    dense = out.memory.topk_dense
    assert (overflow & dense).any() and (overflow & ~dense).any()


@pytest.mark.parametrize("profile_name", ["reference_jax", "corrected"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("route", ["context", "hybrid"])
def test_context_order_two_hash_matches_spec(profile_name: str, mode: str, route: str) -> None:
    model, memory, profile = configs("pcaf", route, "dense", "topk_score", profile_name, context_order=2)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens, targets = window(20, mode, distinct=4)
    ref = reference.forward(params, tokens, model, memory, profile, mode, targets)
    out = torch_forward(params, model, memory, profile, tokens, targets, mode)
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)
    # The int32 wrap-around changes the addresses at n = 2, so the exact match is informative.
    other = hashing.addresses(tokens, 2, memory.num_buckets, int32_wraparound=not profile.hash_int32_wraparound)
    assert (other != ref.memory.addresses).any()


@pytest.mark.parametrize("profile_name", PROFILES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, 2, 3])
def test_tiny_windows_match_spec(profile_name: str, mode: str, T: int) -> None:
    for case in (("pcaf", "hybrid", "dense", "topk_score"), ("pcaf", "semantic", "dense", "recent"),
                 ("transformer_global_local", "context", "dense", "topk_score")):
        out, ref = _run_case(case, profile_name, mode, T=T)
        assert_matches(out, ref, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("profile_name", PROFILES)
def test_all_tokens_equal_matches_spec(profile_name: str) -> None:
    model, memory, profile = configs("pcaf", "hybrid", "bucketed", "topk_score", profile_name)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens = np.full((2, 24), 5)
    targets = np.full((2, 24), 5)
    ref = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    out = torch_forward(params, model, memory, profile, tokens, targets, "ar")
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("profile_name", ["reference_jax", "reference_torch"])  # trainable / fixed table
@pytest.mark.parametrize("init", ["jax_normal", "torch_default"])
def test_positional_scale_matches_spec(profile_name: str, init: str) -> None:
    """``profile.positional_scale`` scales the trainable table's start and the fixed table alike, in the
    spec's init, the torch init under both schemes, and the forward."""
    scale = 0.02
    model, memory, _ = configs("transformer_dense", profile=profile_name)
    profile = get_profile(profile_name, positional_scale=scale, init=init)
    unscaled = get_profile(profile_name)
    net = build_model(model, memory, profile, dtype=torch.float64)
    if profile.positional == "trainable_jax":
        want = scale * init_params(model, memory, unscaled)["pos.table"]
        np.testing.assert_allclose(init_params(model, memory, profile)["pos.table"], want, rtol=1e-15)
        # build_model creates float32 parameters and then casts: float32 rounding
        np.testing.assert_allclose(net.pos.table.detach().numpy(), want, rtol=1e-7, atol=1e-9)
    else:
        base = build_model(model, memory, unscaled, dtype=torch.float64)
        torch.testing.assert_close(net.pos(9, torch.float64, torch.device("cpu")),
                                   scale * base.pos(9, torch.float64, torch.device("cpu")), rtol=1e-15, atol=0)
    params = spec_params(model, memory, profile)
    tokens, targets = window(20, "ar")
    ref = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    assert_matches(torch_forward(params, model, memory, profile, tokens, targets, "ar"), ref, 1e-10, 1e-10)
    ref_unscaled = reference.forward(params, tokens, model, memory, unscaled, "ar", targets)
    if profile.positional == "fixed_torch":  # the fixed table is not a parameter: the forward changes
        assert not np.allclose(ref.hidden, ref_unscaled.hidden)
