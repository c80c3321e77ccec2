"""JAX streaming state (:mod:`backends.jax.streaming`) against the spec's stream, and torch beside JAX.

float64 (``jax_enable_x64``): the streamable variants of tests/test_spec_streaming.py (every code path, one
through a memory horizon) fed through ``lax.scan`` give the spec stream's candidates exactly and its
log-probs within 1e-5; ``step`` equals the spec's first step; the torch and JAX streams agree on shared
canonical weights in float32; the capacity and positional limits raise on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from backends.jax import build_model as build_jax
from backends.jax import to_variables
from backends.jax.streaming import JaxStream, NotStreamableError, StreamCapacityError, StreamLimitError
from backends.torch import build_model as build_torch
from backends.torch import load_canonical
from backends.torch.streaming import TorchStream
from pcaf_core import streaming
from tests.test_spec_streaming import STREAM_CASES, T, configs, spec_params, tokens

# Every code path of the JAX stream, compiled once each (about 1 s a case on a quiet machine): order-2 int32
# hashes through a memory horizon, the reference_torch forms (erf GELU, max_eps norm, LayerNorm router,
# clipped empty gate) on a hybrid under `first` without de-duplication, the constant gate with exact order-2
# hashes and de-duplication, conv only, and the dense, windowed-plus-global and linear attention states. The
# corrected `recent` context and semantic paths run in the torch-beside-JAX test below.
JAX_CASES = [c for c in STREAM_CASES if (c[0], c[1], c[3], c[4]) in {
    ("pcaf", "context", "recent", "reference_jax"), ("pcaf", "hybrid", "first", "reference_torch"),
    ("pcaf_no_gate", "hybrid", "first", "corrected"), ("local_conv", "context", "recent", "corrected"),
    ("transformer_dense", "context", "recent", "corrected"),
    ("transformer_global_local", "context", "recent", "corrected"),
    ("linear_attention", "context", "recent", "corrected")}]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def jax_stream(model, memory, prof, params, dtype, **kw) -> JaxStream:
    # Weights cast on the host: the same rounding as a cast on the device, without a compilation per shape.
    variables = to_variables({k: np.asarray(v, np.dtype(dtype)) for k, v in params.items()}, dtype)
    return JaxStream(build_jax(model, memory, prof, dtype=dtype), variables, window=T, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("variant,route,index,policy,profile,order", JAX_CASES)
def test_jax_stream_equals_the_spec_stream(x64, variant, route, index, policy, profile, order):
    model, memory, prof = configs(variant, route, index, policy, profile, order)
    params = spec_params(model, memory, prof)
    x = tokens()
    horizon = 5 if profile == "reference_jax" else None  # one case reads through a memory horizon
    spec = streaming.Stream(params, model, memory, prof, window=T, horizon=horizon)
    _, want = spec.feed(spec.init(2), x)
    stream = jax_stream(model, memory, prof, params, jnp.float64, horizon=horizon)
    state, got = stream.feed(stream.init(2, capacity=T), x)
    np.testing.assert_allclose(np.asarray(got.log_probs), want.log_probs, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got.param_log_probs), want.param_log_probs, rtol=1e-5, atol=1e-9)
    if want.cand_index is None:
        assert got.cand_index is None
        return
    np.testing.assert_array_equal(np.asarray(got.cand_index), want.cand_index)
    np.testing.assert_array_equal(np.asarray(got.cand_valid), want.cand_valid)
    np.testing.assert_allclose(np.asarray(got.gate), want.gate, rtol=1e-5, atol=1e-12)


@pytest.mark.slow
def test_torch_and_jax_streams_agree_on_shared_canonical_weights():
    model, memory, prof = configs("pcaf", "hybrid", "bucketed", "recent")
    params = {k: v.astype(np.float32) for k, v in spec_params(model, memory, prof).items()}
    x = tokens(n=30, seed=7)
    net = build_torch(model, memory, prof, dtype=torch.float32)
    load_canonical(net, params)
    ts = TorchStream(net.eval(), window=T)
    _, want = ts.feed(ts.init(2), torch.tensor(x))
    with jax.default_matmul_precision("highest"):
        js = jax_stream(model, memory, prof, params, jnp.float32)
        _, got = js.feed(js.init(2, capacity=30), x)
    np.testing.assert_allclose(np.asarray(got.log_probs), want.log_probs.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got.cand_index), want.cand_index.numpy())


@pytest.mark.slow
def test_jax_step_and_the_limits_raise_on_the_host():
    model, memory, prof = configs("pcaf", "context", "dense", "recent")
    params = spec_params(model, memory, prof)
    stream = jax_stream(model, memory, prof, params, jnp.float32)
    x = tokens(B=1, n=4)
    state, out = stream.step(stream.init(1, capacity=4), x[:, 0])
    spec = streaming.Stream(params, model, memory, prof, window=T)
    _, want = spec.step(spec.init(1), x[:, 0])
    np.testing.assert_allclose(np.asarray(out.log_probs), want.log_probs, rtol=1e-4, atol=1e-4)
    state, _ = stream.feed(state, x[:, 1:])  # 4 tokens: the capacity
    with pytest.raises(StreamCapacityError, match="sized for 4 tokens"):
        stream.step(state, x[:, 0])
    model, memory, prof = configs("transformer_dense")
    with pytest.raises(StreamLimitError, match="max_seq_len=32"):
        jax_stream(model, memory, prof, spec_params(model, memory, prof), jnp.float32).init(1, capacity=33)
    model, memory, prof = configs("pcaf", "semantic", "dense", "recent")
    with pytest.raises(NotStreamableError, match="semantic_index='dense'"):
        jax_stream(model, memory, prof, spec_params(model, memory, prof), jnp.float32)
