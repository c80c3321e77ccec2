"""Torch streaming state (:mod:`backends.torch.streaming`) against the spec's stream and the torch full AR forward.

float64, every streamable variant of tests/test_spec_streaming.py: candidates exactly equal, log-probs
within 1e-5 at every step; ``prefill`` equals feeding token by token; the memory stays bounded on a
stream many times longer than the window.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch import build_model, load_canonical
from backends.torch.streaming import NotStreamableError, StreamLimitError, TorchStream
from pcaf_core import reference, streaming
from tests.test_spec_streaming import STREAM_CASES, T, configs, spec_params, tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def torch_model(model, memory, prof, params, dtype=torch.float64):
    net = build_model(model, memory, prof, dtype=dtype)
    load_canonical(net, params)
    return net.eval()


def _close(got, want, what):
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-9, err_msg=what)


@pytest.mark.parametrize("variant,route,index,policy,profile,order", STREAM_CASES)
def test_torch_stream_equals_the_spec_stream_and_the_full_forward(variant, route, index, policy, profile, order):
    model, memory, prof = configs(variant, route, index, policy, profile, order)
    params = spec_params(model, memory, prof)
    x = tokens()
    spec = streaming.Stream(params, model, memory, prof, window=T)
    _, want = spec.feed(spec.init(2), x)
    net = torch_model(model, memory, prof, params)
    stream = TorchStream(net, window=T)
    _, got = stream.feed(stream.init(2), torch.tensor(x))
    _close(got.log_probs, want.log_probs, "log_probs vs spec stream")
    _close(got.param_log_probs, want.param_log_probs, "param_log_probs")
    with torch.no_grad():
        full = net(torch.tensor(x), mode="ar")
    _close(got.log_probs, full.log_probs.numpy(), "log_probs vs torch full forward")
    if want.cand_index is None:
        assert got.cand_index is None
        return
    np.testing.assert_array_equal(got.cand_index.numpy(), want.cand_index)
    np.testing.assert_array_equal(got.cand_valid.numpy(), want.cand_valid)
    np.testing.assert_array_equal(got.cand_index.numpy(), full.memory.cand.index.numpy())
    _close(got.gate, want.gate, "gate")


@pytest.mark.parametrize("variant,route,index,policy", [
    ("pcaf", "context", "dense", "recent"), ("pcaf", "hybrid", "bucketed", "first"),
    ("transformer_dense", "context", "dense", "recent"), ("transformer_global_local", "context", "dense", "recent"),
    ("linear_attention", "context", "dense", "recent"), ("local_conv", "context", "dense", "recent"),
])
@pytest.mark.parametrize("n_prompt", [1, 13])
def test_prefill_equals_feeding_the_prompt_token_by_token(variant, route, index, policy, n_prompt):
    model, memory, prof = configs(variant, route, index, policy)
    params = spec_params(model, memory, prof)
    x = torch.tensor(tokens())
    stream = TorchStream(torch_model(model, memory, prof, params), window=T)
    _, fed = stream.feed(stream.init(2), x)
    state, first = stream.prefill(stream.init(2), x[:, :n_prompt])
    _, rest = stream.feed(state, x[:, n_prompt:])
    _close(first.log_probs, fed.log_probs[:, n_prompt - 1].numpy(), "prefill's prediction")
    _close(rest.log_probs, fed.log_probs[:, n_prompt:].numpy(), "steps after prefill")
    if fed.cand_index is not None:
        np.testing.assert_array_equal(rest.cand_index.numpy(), fed.cand_index[:, n_prompt:].numpy())


def test_long_stream_stays_bounded_and_exact_in_float32():
    """A stream 8x the window: the bucket store never holds more than buckets x K records, and float32
    (relative recency) still equals the float64 spec within 1e-4."""
    model, memory, prof = configs("pcaf", "context", "dense", "recent")
    params = spec_params(model, memory, prof)
    n = 8 * T
    x = tokens(n=n, distinct=12, seed=4)
    spec = streaming.Stream(params, model, memory, prof, window=T)
    _, want = spec.feed(spec.init(2), x)
    stream = TorchStream(torch_model(model, memory, prof, params, torch.float32), window=T)
    state, got = stream.feed(stream.init(2), torch.tensor(x))
    np.testing.assert_allclose(got.log_probs.double().numpy(), want.log_probs, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got.cand_index.numpy(), want.cand_index)
    store = state.context
    assert store.keys.shape[1] <= 1 + store.max_records
    for b in range(2):  # records kept = Σ over buckets of min(records in the bucket, K)
        per_bucket = np.bincount(reference.hashing.addresses(x[b, :-1], 1, memory.num_buckets))
        assert int(store.used[b]) - 1 == np.minimum(per_bucket, memory.top_k).sum()


def test_torch_stream_errors():
    model, memory, prof = configs("pcaf", "context", "dense", "topk_score")
    net = torch_model(model, memory, prof, spec_params(model, memory, prof))
    with pytest.raises(NotStreamableError, match="topk_score"):
        TorchStream(net)
    model, memory, prof = configs("transformer_local")
    stream = TorchStream(torch_model(model, memory, prof, spec_params(model, memory, prof)))
    with pytest.raises(StreamLimitError, match="max_seq_len=32"):
        stream.prefill(stream.init(1), torch.zeros((1, 33), dtype=torch.int64))
