"""The spec's streaming state (:mod:`pcaf_core.streaming`) against the full AR forward (reference.forward).

Fed token by token, every streamable variant gives at every step the full forward's candidates exactly and
its log-probabilities within 1e-5 (float64), with buckets that overflow K and queries whose bucket is
empty; the state stays bounded on streams longer than the window; non-streamable configurations and
positions past a trainable positional table raise clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcaf_core import reference, streaming
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile
from tests.spec_helpers import SMALL, spec_params

T = 24
WIDTHS = {**SMALL, "linear_chunk": 5}  # T = 24 in chunks of 5: the linear-attention case ends in a partial chunk

STREAM_CASES = [  # (variant, route, semantic_index, candidate_policy, profile, context_order)
    ("pcaf", "context", "dense", "recent", "corrected", 1),
    ("pcaf", "context", "dense", "first", "corrected", 1),
    ("pcaf", "context", "dense", "recent", "reference_jax", 2),  # int32 hash wrap-around, order-2 addresses
    ("pcaf", "context", "dense", "first", "reference_torch", 1),  # erf GELU, max_eps norm, clipped empty gate
    ("pcaf", "semantic", "bucketed", "recent", "corrected", 1),
    ("pcaf", "hybrid", "bucketed", "recent", "corrected", 1),
    ("pcaf", "hybrid", "bucketed", "first", "reference_torch", 1),  # no de-duplication, LayerNorm router
    ("pcaf_no_gate", "hybrid", "bucketed", "first", "corrected", 2),
    ("pcaf_no_cache", "context", "dense", "recent", "corrected", 1),
    ("local_conv", "context", "dense", "recent", "corrected", 1),
    ("transformer_dense", "context", "dense", "recent", "corrected", 1),
    ("transformer_local", "context", "dense", "recent", "reference_torch", 1),  # fixed sinusoids
    ("transformer_global_local", "context", "dense", "recent", "corrected", 1),
    ("linear_attention", "context", "dense", "recent", "corrected", 1),
]


def configs(variant, route="context", index="dense", policy="recent", profile="corrected", order=1, **mem):
    model = ModelConfig(variant=variant, **WIDTHS)
    base = dict(num_buckets=7, top_k=3, semantic_buckets=5, semantic_temperature=0.2, semantic_score_scale=0.5,
                fixed_gate=0.3)
    memory = MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, context_order=order,
                          **{**base, **mem})
    return model, memory, get_profile(profile)



def tokens(B=2, n=T, distinct=9, seed=0):
    """Few distinct ids: buckets fill past K; the first occurrences find their bucket empty."""
    return np.random.default_rng(seed).integers(0, distinct, (B, n))


@pytest.mark.parametrize("variant,route,index,policy,profile,order", STREAM_CASES)
def test_stream_equals_the_full_ar_forward_at_every_step(variant, route, index, policy, profile, order):
    model, memory, prof = configs(variant, route, index, policy, profile, order)
    params = spec_params(model, memory, prof)
    x = tokens()
    ref = reference.forward(params, x, model, memory, prof, "ar")
    stream = streaming.Stream(params, model, memory, prof, window=T, mode="ar")
    state, out = stream.feed(stream.init(2), x)
    np.testing.assert_allclose(out.param_log_probs, ref.param_log_probs, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(out.log_probs, ref.log_probs, rtol=1e-5, atol=1e-9)
    if ref.memory is None:
        assert out.cand_index is None
        return
    np.testing.assert_array_equal(out.cand_index, ref.memory.cand.index)
    np.testing.assert_array_equal(out.cand_valid, ref.memory.cand.valid)
    np.testing.assert_allclose(out.gate, ref.memory.gate, rtol=1e-5, atol=1e-12)
    # The case exercises both boundary conditions: a query with an empty bucket and one whose bucket
    # holds more than K earlier records.
    addr = ref.memory.addresses
    earlier = np.array([[np.sum(addr[b, :t] == addr[b, t]) for t in range(T)] for b in range(2)])
    if route != "semantic":
        assert (earlier == 0).any() and (earlier > memory.top_k).any()
    assert (~out.cand_valid.any(-1)).any() and out.cand_valid.all(-1).any()


def test_nt_stream_equals_the_nt_forward_of_its_window():
    model, memory, prof = configs("pcaf", "hybrid", "bucketed", "recent")
    params = spec_params(model, memory, prof)
    x = tokens()
    ref = reference.forward(params, x, model, memory, prof, "nt")
    stream = streaming.Stream(params, model, memory, prof, window=T, mode="nt")
    _, out = stream.feed(stream.init(2), x)
    np.testing.assert_allclose(out.log_probs[:, -1], ref.log_probs[:, 0], rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(out.cand_index[:, -1], ref.memory.cand.index[:, 0])


def test_stream_past_the_window_equals_the_forward_of_the_longer_sequence_and_stays_bounded():
    """A stream built for window T runs on past T with recency s/(T-1): it equals the full forward of a
    longer sequence whose recency unit is the same, and holds at most K records per bucket."""
    model, memory, prof = configs("pcaf", "context", "dense", "recent")
    params = spec_params(model, memory, prof)
    n = 3 * T
    x = tokens(n=n, distinct=12, seed=3)
    stream = streaming.Stream(params, model, memory, prof, window=n, mode="ar")
    state, out = stream.feed(stream.init(2), x)
    ref = reference.forward(params, x, model, memory, prof, "ar")
    np.testing.assert_allclose(out.log_probs, ref.log_probs, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(out.cand_index, ref.memory.cand.index)
    assert state.num_records() <= 2 * memory.num_buckets * memory.top_k
    assert all(len(dq) <= memory.top_k for store in state.context for dq in store.values())


def test_local_attention_cache_keeps_only_visible_keys():
    model, memory, prof = configs("transformer_global_local")
    params = spec_params(model, memory, prof)
    stream = streaming.Stream(params, model, memory, prof, window=T)
    state, _ = stream.feed(stream.init(1), tokens(B=1, n=20))
    for _, _, pos in state.kv:
        np.testing.assert_array_equal(pos, [0, 1, 16, 17, 18, 19])  # n_global=2 and the last window-1=4


def test_horizon_reads_the_recent_candidates_inside_the_horizon():
    model, memory, prof = configs("pcaf", "context", "dense", "recent", num_buckets=3)
    params = spec_params(model, memory, prof)
    x = tokens(seed=5)
    ref = reference.forward(params, x, model, memory, prof, "ar").memory.cand
    stream = streaming.Stream(params, model, memory, prof, window=T, horizon=4)
    _, out = stream.feed(stream.init(2), x)
    t = np.arange(T)[None, :, None]
    inside = ref.valid & (ref.index >= t - 4)
    assert (ref.valid & ~inside).any()  # the horizon hides something
    for b in range(2):
        for q in range(T):
            want = ref.index[b, q][inside[b, q]]
            np.testing.assert_array_equal(out.cand_index[b, q][out.cand_valid[b, q]], want)


@pytest.mark.parametrize("route,index,policy,what", [
    ("context", "dense", "topk_score", "candidate_policy='topk_score'"),
    ("semantic", "dense", "recent", "semantic_index='dense'"),
    ("hybrid", "dense", "first", "semantic_index='dense'"),
])
def test_non_streamable_configurations_raise_a_clear_error(route, index, policy, what):
    model, memory, prof = configs("pcaf", route, index, policy)
    with pytest.raises(streaming.NotStreamableError, match=what):
        streaming.Stream(spec_params(model, memory, prof), model, memory, prof, window=T)


def test_horizon_needs_the_recent_policy():
    model, memory, prof = configs("pcaf", "context", "dense", "first")
    with pytest.raises(streaming.NotStreamableError, match="horizon needs memory.candidate_policy='recent'"):
        streaming.Stream(spec_params(model, memory, prof), model, memory, prof, window=T, horizon=8)


def test_a_trainable_positional_table_ends_the_stream_at_its_last_row():
    model, memory, prof = configs("transformer_dense")
    stream = streaming.Stream(spec_params(model, memory, prof), model, memory, prof, window=T)
    state, _ = stream.feed(stream.init(1), tokens(B=1, n=model.max_seq_len))
    with pytest.raises(streaming.StreamLimitError, match="max_seq_len=32"):
        stream.step(state, np.array([1]))
