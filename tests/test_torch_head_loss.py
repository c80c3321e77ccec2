"""The fused head target log-probability (``backends.torch.head_loss``) against the unfused
``log_softmax(...).gather(...)``: values and gradients in float64 and under bf16 autocast, and the model's
training path (``need_log_probs=False, need_predictions=False``) against its evaluation path. The chunked form
against the one-tile form: float64, float32 within 1e-5, bf16 autocast, tiles that do not divide N or V, no
buffer of ``[N, V]`` size, ``torch.compile``, and the models' chunked head."""

from __future__ import annotations

import pytest
import torch

from backends.torch import build_model
from backends.torch.head_loss import chunked_target_log_softmax, target_log_softmax, widen
from benchmarks.torch_memory import PeakLiveBytes
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


# (position chunk, vocabulary chunk) against N = 2 x 7 = 14 positions and V = 11: ragged last tiles on both
# axes, one-element tiles, one tile wider than the vocabulary, one tile holding everything.
CHUNKS = [(3, 4), (1, 1), (5, 11), (14, 20), (100, 100)]


def _chunked(z, w, b, y, chunks):
    return chunked_target_log_softmax(z, w, b, y, position_chunk=chunks[0], vocab_chunk=chunks[1])


def _grads(out, upstream, inputs):
    return torch.autograd.grad((out * upstream).sum(), inputs)


@pytest.mark.parametrize("chunks", CHUNKS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_chunked_equals_the_one_tile_form(chunks, dtype, tol):
    z, w, b, y = _inputs(dtype, N=7, H=5, V=11)
    upstream = torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    chunked, one_tile = _chunked(z, w, b, y, chunks), target_log_softmax(z, w, b, y)
    assert chunked.dtype == dtype and chunked.shape == y.shape
    torch.testing.assert_close(chunked, one_tile, rtol=0, atol=tol)
    for name, a, r in zip("zwb", _grads(chunked, upstream, (z, w, b)), _grads(one_tile, upstream, (z, w, b))):
        torch.testing.assert_close(a, r, rtol=0, atol=tol, msg=name)


def test_chunked_gradcheck():
    z, w, b, y = _inputs(torch.float64, N=3, H=4, V=6)
    assert torch.autograd.gradcheck(lambda z_, w_, b_: _chunked(z_, w_, b_, y, (2, 4)), (z, w, b))


def test_chunked_matches_the_one_tile_form_under_bf16_autocast():
    """Both run the tile products in bf16 and the normaliser in float32 (logits rounded to bf16 alike, so
    the values agree to float32 rounding); the gradients reach the float32 parameters in float32 and agree to
    bf16 rounding of the gradient's scale (both round the logits' gradient to bf16 before its products)."""
    z, w, b, y = _inputs(torch.float32, N=64, H=32, V=300, seed=1)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = _chunked(z, w, b, y, (48, 128))
        one_tile = target_log_softmax(z, w, b, y)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, one_tile, rtol=0, atol=1e-5)
    for a, r in zip(_grads(chunked, upstream, (z, w, b)), _grads(one_tile, upstream, (z, w, b))):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2**-8 * r.abs().max().item())


def test_chunked_holds_no_buffer_of_the_logits_size():
    """Forward and backward allocate nothing larger than a tile or a gradient (``[V, H]``): the one-tile form
    allocates the ``[N, V]`` logits, the chunked form ``[P, C]`` tiles."""
    N, H, V, P, C = 96, 4, 500, 32, 100
    g = torch.Generator().manual_seed(0)
    z = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    largest = {}
    for name, fn in (("chunked", lambda: _chunked(z, w, b, y, (P, C))), ("one tile", lambda: target_log_softmax(
            z, w, b, y))):
        with PeakLiveBytes() as probe:
            fn().sum().backward()
        largest[name] = probe.largest_bytes
    assert largest["one tile"] >= N * V * 4
    assert largest["chunked"] <= max(P * C, V * H) * 4, largest


@pytest.mark.slow
def test_chunked_compiles_to_one_graph():
    """Under ``torch.compile`` (``fullgraph``: no graph break) the chunked loss gives the eager values and
    gradients."""
    z, w, b, y = _inputs(torch.float32, N=7, H=5, V=11)
    compiled = torch.compile(lambda *a: _chunked(*a, (3, 4)), backend="aot_eager", fullgraph=True)
    eager = _chunked(z, w, b, y, (3, 4))
    got = compiled(z, w, b, y)
    torch.testing.assert_close(got, eager)
    for a, r in zip(torch.autograd.grad(got.sum(), (z, w, b)), torch.autograd.grad(eager.sum(), (z, w, b))):
        torch.testing.assert_close(a, r)


def test_chunk_sizes_below_one_are_refused():
    z, w, b, y = _inputs(torch.float32)
    with pytest.raises(ValueError, match="must both be >= 1"):
        _chunked(z, w, b, y, (0, 4))


@pytest.mark.parametrize("variant", ["pcaf", "transformer_dense"])
def test_models_chunked_head_trains_like_the_one_tile_head(variant):
    """``build_model(..., head_chunks=...)``: the training loss and every parameter's gradient equal the
    one-tile model's (float64), and evaluation still builds the whole distribution."""
    model = ModelConfig(variant=variant, vocab_size=23, d_model=8, d_hidden=12, n_layers=1, kernel_size=3,
                        n_heads=2, max_seq_len=10)
    memory = MemoryConfig(num_buckets=5, top_k=3)
    nets = [build_model(model, memory, get_profile("corrected"), seed=3, dtype=torch.float64, head_chunks=c)
            for c in (None, (4, 5))]
    assert nets[0].head.chunks is None and nets[1].head.chunks == (4, 5)
    g = torch.Generator().manual_seed(5)
    tokens, targets = torch.randint(0, 23, (2, 10), generator=g), torch.randint(0, 23, (2, 10), generator=g)
    outs = [n(tokens, targets, "ar", need_log_probs=False, need_predictions=False) for n in nets]
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=0, atol=1e-12)
    grads = [torch.autograd.grad(o.loss, list(n.parameters())) for o, n in zip(outs, nets)]
    for (name, _), a, r in zip(nets[0].named_parameters(), grads[1], grads[0]):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12, msg=name)
    assert nets[1](tokens, targets, "ar").param_log_probs.shape == (2, 10, 23)
