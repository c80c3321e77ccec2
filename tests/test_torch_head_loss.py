"""The fused head target log-probability (``backends.torch.head_loss``) against the unfused
``log_softmax(...).gather(...)``: values and gradients in float64 and under bf16 autocast, and the model's
training path (``need_log_probs=False, need_predictions=False``) against its evaluation path."""

from __future__ import annotations

import pytest
import torch

from backends.torch import build_model
from backends.torch.head_loss import target_log_softmax, widen
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile


def _unfused(z, weight, bias, y):
    log_probs = torch.log_softmax(widen(torch.nn.functional.linear(z, weight, bias)), dim=-1)
    return log_probs.gather(-1, y[..., None])[..., 0]


def _inputs(dtype, N=7, H=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, N, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (2, N), generator=g)
    y[0, 0] = y[0, 1]  # a repeated target: its gradient rows accumulate
    return z, w, b, y


def test_values_and_gradients_match_the_unfused_head_in_float64():
    z, w, b, y = _inputs(torch.float64)
    upstream = torch.randn(y.shape, dtype=torch.float64)
    fused = target_log_softmax(z, w, b, y)
    ref = _unfused(z, w, b, y)
    assert fused.dtype == torch.float64 and fused.shape == y.shape
    torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
    g_fused = torch.autograd.grad((fused * upstream).sum(), (z, w, b))
    g_ref = torch.autograd.grad((ref * upstream).sum(), (z, w, b))
    for a, r in zip(g_fused, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    z, w, b, y = _inputs(torch.float64, N=3, H=4, V=6)
    assert torch.autograd.gradcheck(lambda z_, w_, b_: target_log_softmax(z_, w_, b_, y), (z, w, b))


def test_bf16_autocast_matches_the_unfused_head_under_autocast():
    """Both paths run the output matmul in bf16 (``nn.Linear`` under autocast) and the normaliser in
    float32; gradients reach the float32 parameters in float32."""
    z, w, b, y = _inputs(torch.float32, N=64, H=32, V=300, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = target_log_softmax(z, w, b, y)
        ref = _unfused(z, w, b, y)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, ref.float(), rtol=0, atol=1e-5)
    g_fused = torch.autograd.grad(fused.sum(), (z, w, b))
    g_ref = torch.autograd.grad(ref.float().sum(), (z, w, b))
    for a, r in zip(g_fused, g_ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("variant,route", [("transformer_dense", "context"), ("local_conv", "context"),
                                           ("pcaf", "context"), ("pcaf", "semantic")])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_training_path_loss_and_gradients_equal_the_evaluation_path(variant, route, mode):
    model = ModelConfig(variant=variant, vocab_size=23, d_model=8, d_hidden=12, n_layers=1, kernel_size=3,
                        n_heads=2, window=4, n_global=1, max_seq_len=10)
    memory = MemoryConfig(route=route, num_buckets=5, top_k=3, semantic_buckets=4)
    net = build_model(model, memory, get_profile("reference_jax"), seed=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 23, (2, 10), generator=g)
    targets = torch.randint(0, 23, (2,) if mode == "nt" else (2, 10), generator=g)

    train_out = net(tokens, targets, mode, need_log_probs=False, need_predictions=False)
    assert train_out.param_log_probs is None
    eval_out = net(tokens, targets, mode)
    torch.testing.assert_close(train_out.target_log_prob, eval_out.target_log_prob, rtol=1e-12, atol=1e-12)
    params = [p for p in net.parameters() if p.requires_grad]
    g_train = torch.autograd.grad(train_out.loss, params, allow_unused=True)
    g_eval = torch.autograd.grad(eval_out.loss, params, allow_unused=True)
    for (name, _), a, r in zip(net.named_parameters(), g_train, g_eval):
        if r is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12, msg=name)
