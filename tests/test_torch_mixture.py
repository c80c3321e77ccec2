"""The torch mixture's hand-written gradients (backends/torch/mixture.py) against autograd's chain of plain ops."""

from __future__ import annotations

import math

import pytest
import torch

from backends.torch import mixture
from pcaf_core.mixture import AR_PROB_FLOOR, MASKED_SCORE


def _cache_weights_by_autograd(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The masked softmax as plain ops, differentiated by autograd's chain rule."""
    top = torch.where(valid, scores, torch.full_like(scores, MASKED_SCORE)).amax(-1, keepdim=True).detach()
    e = torch.exp(torch.where(valid, scores - top, torch.full_like(scores, -math.inf)))
    return e / torch.clamp(e.sum(-1, keepdim=True), min=torch.finfo(scores.dtype).tiny)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cache_weights_and_gradient_are_autograds(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    scores = (torch.randn(3, 5, 6, generator=gen) * 4).to(dtype)
    valid = torch.rand(3, 5, 6, generator=gen) < 0.6
    valid[0, 0] = False  # an empty query: weights and gradient all 0
    valid[0, 1] = True
    valid[1, 0] = torch.tensor([True, False, False, False, False, False])  # one slot: weight 1, gradient 0
    scores[1, 1, ~valid[1, 1]] = 1e30  # junk in empty slots never reaches the softmax
    g = torch.randn(3, 5, 6, generator=gen).to(dtype)
    got_s, want_s = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    got, want = mixture.cache_weights(got_s, valid), _cache_weights_by_autograd(want_s, valid)
    assert torch.equal(got, want)
    assert torch.all(got[0, 0] == 0) and torch.equal(got[1, 0], valid[1, 0].to(dtype))
    got.backward(g)
    want.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got_s.grad, want_s.grad, rtol=tol, atol=tol * g.abs().max().item())
    assert torch.all(got_s.grad[0, 0] == 0) and torch.all(got_s.grad[~valid] == 0)
    if dtype == torch.float64:
        torch.autograd.gradcheck(lambda s: mixture.cache_weights(s, valid[2]), (scores[2].clone().requires_grad_(),))


def _floored_mixture_by_autograd(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.clamp((1.0 - gate) * torch.exp(lp) + gate * pc, min=AR_PROB_FLOOR))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_floored_full_ar_target_and_gradients_are_autograds(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    lp = (torch.randn(4, 7, generator=gen) * 3 - 4).to(dtype)
    pc = torch.rand(4, 7, generator=gen).to(dtype)
    gate = torch.rand(4, 7, generator=gen).to(dtype)
    lp[0, :3], pc[0, :3] = -200.0, 0.0  # a mixture below the floor: its gradients are 0, as the clamp's are
    gate[1, 0] = 0.0
    g = torch.randn(4, 7, generator=gen).to(dtype)
    got_in = [t.clone().requires_grad_() for t in (lp, pc, gate)]
    want_in = [t.clone().requires_grad_() for t in (lp, pc, gate)]
    got = mixture.target_log_prob(got_in[0], got_in[1], got_in[2], nt_floor=False, ar_floor=True, mode="ar")
    want = _floored_mixture_by_autograd(*want_in)
    assert torch.equal(got, want) and torch.all(got[0, :3] == math.log(AR_PROB_FLOOR))
    got.backward(g)
    want.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol * b.grad.abs().max().item())
        assert torch.all(a.grad[0, :3] == 0)
    if dtype == torch.float64:
        torch.autograd.gradcheck(lambda *t: mixture.target_log_prob(*t, nt_floor=False, ar_floor=True, mode="ar"),
                                 tuple(t[1:].clone().requires_grad_() for t in (lp, pc, gate)))


def _log_mixture_by_autograd(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    log_keep, log_gate = mixture.gate_log_weights(gate, per_term=False)
    return torch.logaddexp(log_keep + lp, log_gate + mixture.safe_log(pc))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_log_mixture_target_and_gradients_are_autograds(dtype: torch.dtype, mode: str) -> None:
    """The logaddexp mixture (next-token without the per-term clamp; full AR without the floor), with an empty
    query's gate of 0, a cache miss's p_cache of 0, and both."""
    gen = torch.Generator().manual_seed(6)
    lp = (torch.randn(4, 7, generator=gen) * 3 - 4).to(dtype)
    pc = torch.rand(4, 7, generator=gen).to(dtype)
    gate = torch.rand(4, 7, generator=gen).to(dtype)
    gate[0, :2] = 0.0
    pc[0, 1:3] = 0.0
    g = torch.randn(4, 7, generator=gen).to(dtype)
    got_in = [t.clone().requires_grad_() for t in (lp, pc, gate)]
    want_in = [t.clone().requires_grad_() for t in (lp, pc, gate)]
    got = mixture.target_log_prob(*got_in, nt_floor=False, ar_floor=False, mode=mode)
    want = _log_mixture_by_autograd(*want_in)
    assert torch.equal(got, want) and torch.equal(got[0, 1], lp[0, 1])  # gate 0: the parametric term alone
    got.backward(g)
    want.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(got_in, want_in):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol * b.grad.abs().max().item())
    assert torch.all(got_in[1].grad[0, 1:3] == 0)  # log 0's gradient is 0, as safe_log's
    if dtype == torch.float64:
        torch.autograd.gradcheck(lambda *t: mixture.target_log_prob(*t, nt_floor=False, ar_floor=False, mode=mode),
                                 tuple(t[1:].clone().requires_grad_() for t in (lp, pc, gate)))
