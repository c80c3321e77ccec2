"""Dense causal attention in query blocks (backends.torch.layers.causal_attention_in_blocks): the CPU form of a
training step's attention under dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.torch.layers import Attention, causal_attention_in_blocks


def _qkv(T: int, hd: int = 8, dtype=torch.float64):
    g = torch.Generator().manual_seed(T)
    return [torch.randn(2, 3, T, hd, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def _grads(out, inputs):
    return torch.autograd.grad(out, inputs, torch.ones_like(out))


@pytest.mark.parametrize("T,block", [(300, 128), (256, 128), (7, 3), (100, 128)])
def test_blocks_without_dropout_are_causal_sdpa(T: int, block: int) -> None:
    """Values and gradients equal SDPA's causal attention over the whole window (float64), for T a multiple of
    the block, not one, and T within one block."""
    q, k, v = _qkv(T)
    out = causal_attention_in_blocks(q, k, v, 0.0, block)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_dropout_drops_causal_weights_and_rescales_the_rest() -> None:
    """With v the identity, each output row is that query's attention weights after dropout: every weight past
    the query is 0, every kept weight is the causal softmax weight / (1 - p), and about p of the weights the
    query may read are dropped, in every block."""
    T, block, p = 300, 128, 0.3
    q, k, _ = _qkv(T, hd=T)
    eye = torch.eye(T, dtype=torch.float64).expand(2, 3, T, T)
    torch.manual_seed(0)
    with torch.no_grad():
        weights = causal_attention_in_blocks(q, k, eye, p, block)
        clean = F.scaled_dot_product_attention(q, k, eye, is_causal=True)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    assert (weights[..., ~allowed] == 0).all()
    kept = weights != 0
    torch.testing.assert_close(weights[kept], clean[kept] / (1 - p), rtol=1e-12, atol=0)
    for start in range(0, T, block):
        rows = allowed[start:start + block]
        dropped = 1 - kept[:, :, start:start + block][..., rows].double().mean().item()
        assert abs(dropped - p) < 0.02, (start, dropped)


def test_attention_trains_dense_in_blocks_on_a_cpu_only_under_dropout(monkeypatch) -> None:
    """The dense module's training forward with dropout takes the blocked form on a CPU; evaluation (no dropout)
    stays SDPA's causal kernel; a next-token top row never reaches it."""
    import backends.torch.layers as layers

    calls = []
    real = layers.causal_attention_in_blocks
    monkeypatch.setattr(layers, "causal_attention_in_blocks", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attn = Attention(12, 2, "transformer_dense", 4, 0, 4, 0.1)
    x = torch.randn(2, 20, 12)
    attn.train()(x)
    assert calls == [1]
    attn.eval()(x)
    attn.train()(x, (0, 1))
    assert calls == [1]
