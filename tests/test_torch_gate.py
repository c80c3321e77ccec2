"""The gate's kernel (``backends.torch.kernels.gate``: the last layer, sigmoid and mask) against ATen's chain, and
``Gate.masked`` through it against the layer and ``mixture.mask_gate``.

- forward and gradients (in the hidden layer's output, the layer's weight and bias), each combination of the
  profiles' switches, both GELU forms, float32 and the 16-bit dtypes, rows that do not fill a program and a width
  that is not a power of two, saturated and empty rows;
- the module in training mode with the kernel and without, in float32 and under bf16 autocast;
- the ops' registrations and one-line refusals.

The kernels run compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from backends.torch import layers
from backends.torch.kernels import gate as kernel
from backends.torch.kernels.ops import triton_enabled
from pcaf_core.mixture import GATE_CLIP

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SWITCHES = [(clip, per_term) for clip in (False, True) for per_term in (False, True)]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
"""Relative, at the scale of the largest value: float32 rounding; one unit of the 16-bit dtype, where the layer's
product, summed in another order, can round its output the other way."""


def _inputs(R: int, D: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(R, D, generator=gen) * 2
    w = torch.randn(D, generator=gen) / D**0.5
    b = torch.randn(1, generator=gen)
    any_valid = torch.rand(R, generator=gen) < 0.8
    if R > 3:
        pre[1] = 40.0 * torch.sign(w)  # a saturated row (logit ~ 40·Σ|w| over w > 0): λ clipped, no gradient
        any_valid[1], any_valid[2] = True, False  # and an empty query
    g = torch.randn(R, generator=gen)
    return [t.to(DEVICE) for t in (pre.to(dtype), w.to(dtype), b.to(dtype), any_valid, g)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_the_kernel_runs_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tanh", [False, True])
@pytest.mark.parametrize("R, D", [(1, 1), (7, 5), (300, 128), (33, 112)])
def test_masked_gate_and_gradients_equal_atens_chain(R: int, D: int, tanh: bool, dtype: torch.dtype) -> None:
    pre, w, b, any_valid, g = _inputs(R, D, dtype)
    for clip, per_term in SWITCHES:
        lam = kernel.masked_gate(pre, w, b, any_valid, tanh=tanh, clip_when_empty=clip, per_term=per_term)
        want = kernel.masked_gate_torch(pre, w, b, any_valid, tanh, clip, per_term)
        assert lam.dtype == torch.float32 and lam.shape == (R,)
        _close(lam, want, dtype if dtype == torch.float32 else torch.bfloat16)  # λ: float32 after a 16-bit logit
        d_pre, d_w, d_b = kernel.masked_gate_grad(g, pre, w, b, any_valid, tanh=tanh, per_term=per_term)
        want_pre, partial = kernel.masked_gate_grad_torch(g, pre, w, b, any_valid, tanh, per_term)
        assert d_pre.dtype == d_w.dtype == d_b.dtype == dtype and d_w.shape == (D,) and d_b.shape == (1,)
        _close(d_pre, want_pre, dtype)
        _close(torch.cat([d_w, d_b]), partial[0].to(dtype), dtype)
        if R > 3 and not per_term:
            assert torch.all(d_pre[2] == 0)  # the empty query's gradient
            assert lam[1] == torch.tensor(1 - GATE_CLIP, dtype=torch.float32) and torch.all(d_pre[1] == 0)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gate_masked_through_the_kernel_equals_the_layer_and_mask(dtype: torch.dtype | None) -> None:
    torch.manual_seed(0)
    gate = layers.Gate(16, "tanh").to(DEVICE).train()
    h = torch.randn(2, 9, 16, device=DEVICE)
    any_valid = torch.rand(2, 9, device=DEVICE) < 0.7
    results = []
    for kernels in (True, False):
        gate.zero_grad()
        leaf = h.clone().requires_grad_()
        autocast = torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype is not None)
        with mock.patch.object(layers, "gate_kernels_by_default", return_value=kernels), \
                mock.patch.object(kernel, "masked_gate", wraps=kernel.masked_gate) as called, autocast:
            lam = gate.masked(leaf, any_valid, clip_when_empty=False, per_term=False)
        lam.pow(2).sum().backward()
        assert called.called == kernels and lam.dtype == torch.float32
        results.append([lam.detach(), leaf.grad, *(p.grad for p in gate.parameters())])
    for got, want in zip(*results, strict=True):
        if dtype is None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:  # the layer's bf16 output rounds either way where the sums' orders differ
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    assert torch.all(results[0][0][~any_valid] == 0)


def _autograds_chain(g, pre, w, b, any_valid, tanh: bool, per_term: bool):
    leaves = [t.detach().requires_grad_() for t in (pre, w, b)]
    lam = kernel.masked_gate_torch(*leaves, any_valid, tanh, True, per_term)
    d_pre, d_w, d_b = torch.autograd.grad(lam, leaves, g)
    return d_pre, torch.cat([d_w.float(), d_b.float()])[None]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tanh", [False, True])
def test_the_written_out_gradient_is_autograds_chain(tanh: bool, dtype: torch.dtype) -> None:
    pre, w, b, any_valid, g = _inputs(300, 112, dtype, seed=1)
    for _, per_term in SWITCHES:
        want_pre, want_partial = _autograds_chain(g, pre, w, b, any_valid, tanh, per_term)
        got_pre, got_partial = kernel.masked_gate_grad_torch(g, pre, w, b, any_valid, tanh, per_term)
        assert got_pre.dtype == want_pre.dtype and got_partial.shape == want_partial.shape == (1, 113)
        _close(got_pre, want_pre, dtype)
        _close(got_partial, want_partial, dtype)


def test_the_ops_run_atens_chain_where_triton_does_not() -> None:
    """Off Triton each op's body is ATen's chain, below autograd: it must need none (the gradient's form)."""
    pre, w, b, any_valid, g = _inputs(33, 112, torch.float32, seed=2)
    with mock.patch.object(kernel, "_use_triton", return_value=False):
        lam = torch.ops.pcaf.masked_gate(pre, w, b, any_valid, False, True, False)
        d_pre, partial = torch.ops.pcaf.masked_gate_grad(g, pre, w, b, any_valid, False, False)
    assert torch.equal(lam, kernel.masked_gate_torch(pre, w, b, any_valid, False, True, False))
    want_pre, want_partial = kernel.masked_gate_grad_torch(g, pre, w, b, any_valid, False, False)
    assert torch.equal(d_pre, want_pre) and torch.equal(partial, want_partial)


def test_the_ops_registrations() -> None:
    pre, w, b, any_valid, g = _inputs(7, 5, torch.float32)
    for clip, per_term in SWITCHES:
        torch.library.opcheck(torch.ops.pcaf.masked_gate, (pre, w, b, any_valid, True, clip, per_term))
    torch.library.opcheck(torch.ops.pcaf.masked_gate_grad, (g, pre, w, b, any_valid, False, False))


def test_bad_inputs_are_refused_in_one_line() -> None:
    pre, w, b, any_valid, g = _inputs(7, 5, torch.float32)
    cases = [((pre.double(), w, b, any_valid), "rows"), ((pre.t().contiguous().t(), w, b, any_valid), "rows"),
             ((pre, w[:3], b, any_valid), "w \\[5\\] and b \\[1\\]"), ((pre, w.bfloat16(), b, any_valid), "w \\[5\\]"),
             ((pre, w, b, any_valid.float()), "bool any_valid")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            kernel.masked_gate(*args, tanh=False, clip_when_empty=True, per_term=False)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="float32 gradient"):
        kernel.masked_gate_grad(g.double(), pre, w, b, any_valid, tanh=False, per_term=False)
