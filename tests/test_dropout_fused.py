"""Dropout fused with its neighbours (``backends.torch.kernels.dropout_fused``) against ATen's forms, and the layers
that use it (``Dropout.after_gelu``, ``Dropout.residual``) against the composition they replace.

- ``x + drop(y)`` and its y-gradient: ATen's values bit for bit (no transcendental function), every dtype pair the
  residual stream meets (float32 stream with float32, bfloat16 or float16 branches; bfloat16 with bfloat16);
- ``drop(GELU(x))`` and its gradient, erf and tanh forms: in float32 as close to float64 as ATen's form is; 16-bit
  outputs within one unit in the last place of ATen's, and nearly all equal outside GELU's negative tail;
- a conv block, the head's features and a Transformer block, forward and backward in training mode, with the
  kernels and without, from the same generator state: the same masks, the same values;
- the ops' registrations and one-line refusals.

The kernels run compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from backends.torch import dropout
from backends.torch.kernels import dropout_fused as fused
from backends.torch.kernels.ops import triton_enabled
from pcaf_core.dropout import DROPOUT_LEVELS, dropout_scale, dropout_threshold

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
P = 0.1
CUTOFF, SCALE = dropout_threshold(P) - DROPOUT_LEVELS // 2, dropout_scale(P)
HALF = (torch.bfloat16, torch.float16)


def _inputs(n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    x[:6] = torch.tensor([0.0, -0.0, 12.0, -12.0, 1e-3, -1e-3])  # zeros, tails where tanh saturates, near 0
    levels = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen)
    g = torch.randn(n, generator=gen)
    return x.to(dtype).to(DEVICE), levels.to(DEVICE), g.to(dtype).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def _near(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 to its rounding; a 16-bit tensor within one unit in the last place, and equal to it in nearly every
    element of at least 0.01 (below that lies GELU's negative tail, ``x·(1 + erf(x/√2))/2`` with ``1 + erf``
    cancelling, where a last-bit difference in erf moves a 16-bit result in a few percent of the elements)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp * 2**-6)
    large = want.float().abs() >= 0.01
    assert (got[large] != want[large]).float().mean() < 0.005


def test_kernels_run_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("x_dtype, y_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_add_dropout_and_its_gradient_are_atens_bit_for_bit(x_dtype: torch.dtype, y_dtype: torch.dtype) -> None:
    n = 5000  # three programs, the last one partial
    x, levels, _ = _inputs(n, x_dtype)
    y, _, _ = _inputs(n, y_dtype, seed=1)
    out = fused.add_dropout(x, y, levels, CUTOFF, SCALE)
    assert torch.equal(_bits(out), _bits(fused.add_dropout_torch(x, y, levels, CUTOFF, SCALE)))
    g = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(x_dtype).to(DEVICE)
    dy = fused.add_dropout_grad(g, levels, CUTOFF, SCALE, y_dtype)
    assert dy.dtype == y_dtype
    assert torch.equal(_bits(dy), _bits(fused.add_dropout_grad_torch(g, levels, CUTOFF, SCALE, y_dtype)))


@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_dropout_and_its_gradient_are_as_accurate_as_atens_in_float32(tanh: bool) -> None:
    """Kernel and ATen's form each within 4·eps·(|x| + |GELU(x)|) of float64 from the same inputs (forward), and
    4·eps·|g|·(1 + |x|) (gradient): the scale of the formulas' terms, so the cancelling tail counts as it should.
    The kernel's own errors are under 1.5 of these units, ATen's CPU form's under 2.5 (its erf is approximate)."""
    x, levels, g = _inputs(20000, torch.float32)
    x64, g64, lv = x.double().cpu(), g.double().cpu(), levels.cpu()
    unit = torch.finfo(torch.float32).eps * SCALE
    exact = fused.gelu_dropout_torch(x64, lv, CUTOFF, SCALE, tanh)
    bound = 4 * unit * (x64.abs() + exact.abs())
    for out in (fused.gelu_dropout(x, levels, CUTOFF, SCALE, tanh),
                fused.gelu_dropout_torch(x, levels, CUTOFF, SCALE, tanh)):
        assert torch.all((out.double().cpu() - exact).abs() <= bound)
    exact = fused.gelu_dropout_grad_torch(g64, x64, lv, CUTOFF, SCALE, tanh)
    bound = 4 * unit * g64.abs() * (1 + x64.abs())
    for dx in (fused.gelu_dropout_grad(g, x, levels, CUTOFF, SCALE, tanh),
               fused.gelu_dropout_grad_torch(g, x, levels, CUTOFF, SCALE, tanh)):
        assert torch.all((dx.double().cpu() - exact).abs() <= bound)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_dropout_and_its_gradient_round_as_atens_in_16_bits(tanh: bool, dtype: torch.dtype) -> None:
    x, levels, g = _inputs(5000, dtype)
    _near(fused.gelu_dropout(x, levels, CUTOFF, SCALE, tanh), fused.gelu_dropout_torch(x, levels, CUTOFF, SCALE, tanh))
    _near(fused.gelu_dropout_grad(g, x, levels, CUTOFF, SCALE, tanh),
          fused.gelu_dropout_grad_torch(g, x, levels, CUTOFF, SCALE, tanh))


def _layer_results(layer: torch.nn.Module, inputs: list[torch.Tensor], kernels: bool, dtype: torch.dtype | None):
    """Outputs, input gradients and parameter gradients of one training-mode forward and backward."""
    layer.zero_grad()
    leaves = [t.clone().requires_grad_() for t in inputs]
    torch.manual_seed(5)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None and DEVICE.type == "cpu" else (
        torch.autocast("cuda", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False))
    with mock.patch.object(dropout, "kernels_by_default", return_value=kernels), \
            mock.patch.object(fused, "gelu_dropout", wraps=fused.gelu_dropout) as gelu_kernel, \
            mock.patch.object(fused, "add_dropout", wraps=fused.add_dropout) as add_kernel, autocast:
        out = layer(*leaves)
    out.float().pow(2).sum().backward()
    assert gelu_kernel.called == kernels
    return [out.detach(), *(t.grad for t in leaves), *(p.grad for p in layer.parameters() if p.grad is not None)], \
        add_kernel.called


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("which", ["conv block", "head features", "transformer block"])
def test_layers_with_the_fused_kernels_equal_the_composition(which: str, dtype: torch.dtype | None) -> None:
    from backends.torch.layers import ConvBlock, Head, TransformerBlock

    torch.manual_seed(0)
    if which == "conv block":
        layer, inputs, adds = ConvBlock(8, 16, 3, "erf", P), [torch.randn(2, 5, 8)], True
        layer.conv_form = "conv1d"
    elif which == "head features":
        head = Head(8, 16, 11, "tanh", P)
        layer, inputs, adds = _Features(head), [torch.randn(2, 5, 8)], False
    else:
        block = TransformerBlock(8, 16, 2, "transformer_local", 3, 1, 4, "erf", P)
        layer, inputs, adds = block, [torch.randn(2, 5, 8)], True
    layer = layer.to(DEVICE).train()
    inputs = [t.to(DEVICE) for t in inputs]
    (with_kernels, added), (without, _) = (_layer_results(layer, inputs, k, dtype) for k in (True, False))
    assert added == adds and len(with_kernels) == len(without) > 2
    for got, want in zip(with_kernels, without, strict=True):
        _near(got, want) if got.dtype != torch.float32 or dtype is None else torch.testing.assert_close(
            got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


class _Features(torch.nn.Module):
    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head.features(h)


def test_the_ops_registrations() -> None:
    x, levels, g = _inputs(300, torch.float32)
    y = x.bfloat16()
    ops = torch.ops.pcaf
    for tanh in (False, True):
        torch.library.opcheck(ops.gelu_dropout, (x, levels, CUTOFF, SCALE, tanh))
        torch.library.opcheck(ops.gelu_dropout_grad, (g, x, levels, CUTOFF, SCALE, tanh))
    torch.library.opcheck(ops.add_dropout, (x, y, levels, CUTOFF, SCALE))
    torch.library.opcheck(ops.add_dropout_grad, (g, levels, CUTOFF, SCALE, torch.bfloat16))


def test_bad_inputs_are_refused_in_one_line() -> None:
    x, levels, g = _inputs(30, torch.float32)
    cases = [(lambda: fused.gelu_dropout(x.double(), levels, CUTOFF, SCALE, False), "float32/bfloat16/float16"),
             (lambda: fused.gelu_dropout(x, levels[:5], CUTOFF, SCALE, False), "30 contiguous int16 levels"),
             (lambda: fused.gelu_dropout_grad(g.bfloat16(), x, levels, CUTOFF, SCALE, False), "in x's dtype"),
             (lambda: fused.add_dropout(x.bfloat16(), x, levels, CUTOFF, SCALE), "must hold y's"),
             (lambda: fused.add_dropout(x, x[:10], levels, CUTOFF, SCALE), "of one shape"),
             (lambda: fused.add_dropout_grad(g, levels, CUTOFF, SCALE, torch.int32), "returns float32")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
