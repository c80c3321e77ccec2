"""Next-token forwards from receptive fields only (``nt_receptive_field``) equal the full forward.

A next-token prediction of the conv-backbone models reads the query's final state and its candidates'
keys; each depends on the last R = n_layers·(k-1)+1 tokens. Computed from those sub-windows, every output,
memory trace and gradient equals the full window's, in float64, for every route and policy, windows
shorter than R, buckets that overflow K and empty buckets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch.layers import l2_normalize
from backends.torch.models import build_model
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile

CASES = [  # (variant, route, semantic index, policy)
    ("pcaf", "context", "dense", "first"),
    ("pcaf", "context", "dense", "recent"),
    ("pcaf", "context", "dense", "topk_score"),
    ("pcaf", "semantic", "dense", "topk_score"),
    ("pcaf", "semantic", "bucketed", "recent"),
    ("pcaf", "hybrid", "bucketed", "topk_score"),
    ("pcaf", "hybrid", "dense", "first"),
    ("pcaf_no_gate", "context", "dense", "first"),
    ("pcaf_no_cache", "context", "dense", "first"),
    ("local_conv", "context", "dense", "first"),
]


def _model(case, profile: str, seed: int = 0):
    variant, route, index, policy = case
    model = ModelConfig(variant=variant, vocab_size=40, d_model=12, d_hidden=16, n_layers=2, kernel_size=3)
    memory = MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=5, top_k=3,
                          semantic_buckets=4, semantic_temperature=0.5, semantic_score_scale=0.7)
    net = build_model(model, memory, get_profile(profile), seed=seed, dtype=torch.float64)
    with torch.no_grad():  # move every parameter off its init so each one's wiring shows
        g = torch.Generator().manual_seed(seed + 1)
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return net.eval()


def _run(net, tokens, targets, receptive: bool):
    net.nt_receptive_field = receptive
    net.zero_grad()
    out = net(tokens, targets, "nt")
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("profile", ["reference_jax", "reference_torch", "corrected"])
@pytest.mark.parametrize("T", [4, 37])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_receptive_field_forward_equals_the_full_window(case, T: int, profile: str) -> None:
    rng = np.random.default_rng(T)
    tokens = torch.as_tensor(rng.integers(3, 9, (3, T)))  # few distinct tokens: buckets overflow K
    tokens[2] = torch.arange(3, 3 + T) % 40  # all distinct: the query's bucket may be empty
    targets = torch.as_tensor(rng.integers(3, 40, 3))
    net = _model(case, profile)
    full, g_full = _run(net, tokens, targets, False)
    part, g_part = _run(net, tokens, targets, True)
    for name in ("param_log_probs", "log_probs", "target_log_prob"):
        torch.testing.assert_close(getattr(part, name), getattr(full, name), rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(part.loss, full.loss, rtol=1e-10, atol=1e-12)
    assert torch.equal(part.prediction, full.prediction)
    torch.testing.assert_close(part.hidden[:, 0], full.hidden[:, -1], rtol=1e-10, atol=1e-12)
    if full.memory is not None:
        assert torch.equal(part.memory.cand.index, full.memory.cand.index)
        assert torch.equal(part.memory.cand.valid, full.memory.cand.valid)
        for name in ("scores", "cache_weights", "gate", "p_cache"):
            got, want = getattr(part.memory, name), getattr(full.memory, name)
            valid = full.memory.cand.valid if name == "scores" else torch.ones_like(want, dtype=torch.bool)
            torch.testing.assert_close(got[valid], want[valid], rtol=1e-10, atol=1e-12, msg=name)
        slots = full.memory.cand.index.clamp(min=0)[:, 0]
        torch.testing.assert_close(part.hidden[:, 1:], full.hidden[torch.arange(3)[:, None], slots], rtol=1e-10,
                                   atol=1e-12)
    assert g_part.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_part[name], g_full[name], rtol=1e-9, atol=1e-12, msg=name)


def test_receptive_field_is_what_the_states_depend_on() -> None:
    net = _model(("pcaf", "context", "dense", "first"), "corrected")
    assert net.receptive_field == 2 * (3 - 1) + 1
    tokens = torch.as_tensor(np.random.default_rng(0).integers(3, 40, (2, 20)))
    changed = tokens.clone()
    changed[:, 20 - net.receptive_field - 1] += 1  # just outside the last position's receptive field
    with torch.no_grad():
        last = net.states_at(tokens, torch.tensor([[19], [19]]))
        assert torch.equal(net.states_at(changed, torch.tensor([[19], [19]])), last)
        changed[:, 20 - net.receptive_field] += 1  # inside it
        assert not torch.equal(net.states_at(changed, torch.tensor([[19], [19]])), last)


def test_dropout_runs_on_the_computed_positions_in_training() -> None:
    net = _model(("pcaf", "context", "dense", "first"), "reference_torch").train()
    net.nt_receptive_field = True
    tokens = torch.as_tensor(np.random.default_rng(1).integers(3, 9, (4, 30)))
    a = net(tokens, torch.full((4,), 5), "nt", need_log_probs=False, need_predictions=False).loss
    b = net(tokens, torch.full((4,), 5), "nt", need_log_probs=False, need_predictions=False).loss
    assert torch.isfinite(a) and not torch.equal(a, b)  # fresh masks each call


@pytest.mark.parametrize("strategy, sparse_window", [("auto", None), ("auto", 2), ("dense", None)])
def test_topk_score_ranks_its_query_bucket_from_receptive_fields(strategy: str, sparse_window) -> None:
    # Three token values in 120 positions: ~40 records a bucket, far past K=3 and the sparse window M, so
    # the route's sparse pass, its proof and its dense pass all rank keys that bucket_keys computed.
    net = _model(("pcaf", "context", "dense", "topk_score"), "reference_jax")
    net.topk_strategy, net.sparse_window = strategy, sparse_window
    rng = np.random.default_rng(7)
    tokens = torch.as_tensor(rng.integers(3, 6, (4, 120)))
    targets = torch.as_tensor(rng.integers(3, 40, 4))
    qpos = torch.tensor([119])
    with torch.no_grad():
        query, keys = net.bucket_keys(tokens, qpos)
        h = net.hidden_states(tokens)
        want_keys = l2_normalize(net.memory.key(h), net.profile.l2norm)
        want_query = l2_normalize(net.memory.query(h[:, -1:]), net.profile.l2norm)
    addr = net.memory_read(tokens, h, "nt")[0].addresses
    member = addr == addr[:, -1:]
    assert member.sum() > 4 * 30  # the buckets overflow
    torch.testing.assert_close(keys[member], want_keys[member], rtol=1e-10, atol=1e-12)
    assert not keys[~member].any()  # nothing outside the query's bucket is computed
    torch.testing.assert_close(query, want_query, rtol=1e-10, atol=1e-12)
    full, g_full = _run(net, tokens, targets, False)
    part, g_part = _run(net, tokens, targets, True)
    assert torch.equal(part.memory.cand.index, full.memory.cand.index)
    assert part.memory.cand.valid.all()
    torch.testing.assert_close(part.loss, full.loss, rtol=1e-10, atol=1e-12)
    for name in g_full:
        torch.testing.assert_close(g_part[name], g_full[name], rtol=1e-9, atol=1e-12, msg=name)


ATTENTION = ["transformer_local", "transformer_global_local", "transformer_dense", "linear_attention"]


def _attention_model(variant: str, profile: str, impl: str = "auto"):
    model = ModelConfig(variant=variant, vocab_size=40, d_model=12, d_hidden=16, n_layers=3, n_heads=2, window=4,
                        n_global=2, linear_chunk=4, max_seq_len=40, attention_impl=impl if variant in (
                            "transformer_local", "transformer_global_local") else "auto")
    net = build_model(model, MemoryConfig(), get_profile(profile), seed=0, dtype=torch.float64)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return net.eval()


@pytest.mark.parametrize("profile", ["reference_jax", "reference_torch"])  # trainable table / fixed sinusoids
@pytest.mark.parametrize("T", [5, 37])
@pytest.mark.parametrize("variant", ATTENTION)
def test_attention_next_token_forward_from_its_sub_window_equals_the_full_window(variant, T: int,
                                                                                 profile: str) -> None:
    """Windowed attention reads the global prefix and the last n_layers·(w-1)+1 positions (T=37 cuts, T=5 does
    not), each layer computing the rows the prediction reads (pcaf_core.reference.nt_attention_rows); dense
    attention reads the whole window and computes its top layer's last row only; linear attention computes
    everything. Outputs and gradients equal the full window's. (The
    masked path; FlexAttention's block mask applies the same rule, pcaf_core.reference.attention_allowed, in the
    same sub-window coordinates.)"""
    rng = np.random.default_rng(T)
    tokens = torch.as_tensor(rng.integers(0, 40, (3, T)))
    targets = torch.as_tensor(rng.integers(0, 40, 3))
    net = _attention_model(variant, profile)
    full, g_full = _run(net, tokens, targets, False)
    part, g_part = _run(net, tokens, targets, True)
    assert part.hidden.shape == (3, 1, 12)
    for name in ("param_log_probs", "log_probs", "target_log_prob"):
        torch.testing.assert_close(getattr(part, name), getattr(full, name), rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(part.hidden[:, 0], full.hidden[:, -1], rtol=1e-10, atol=1e-12)
    assert g_part.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_part[name], g_full[name], rtol=1e-9, atol=1e-12, msg=name)
