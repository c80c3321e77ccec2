"""The L2 normalisation's kernels (``backends.torch.kernels.l2_normalize``) against float64 and ATen's form, both
forms (``max_eps``, ``rsqrt_eps``), forward and gradient: rows that do not fill a program, d not a power of two, a
zero row and one below the floor, float32 and the 16-bit dtypes; ``layers.l2_normalize`` through them equal to its
ATen form in value and gradient; the ops' registrations and one-line refusals.

The kernels run compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from backends.torch import layers
from backends.torch.kernels import l2_normalize as l2
from backends.torch.kernels.ops import triton_enabled

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = [(1, 1), (7, 5), (33, 224), (40, 256)]
"""(N, d): one element; d under a power of two; d = 224 (the 41M model's width) over two programs; the paper's
d = 256 over three."""
FORMS = {"max_eps": True, "rsqrt_eps": False}
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}
"""Relative tolerance: float32 rounding (the row sums' order), and one unit in the last place of a 16-bit value
(rounded once from float32 where ATen's form rounds each step)."""


def _rows(N: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, dtype=torch.float64, generator=gen)
    if N > 2:
        x[1] = 0.0  # a zero row: max_eps's floor holds, rsqrt_eps's eps dominates
        x[2] *= 1e-14  # below max_eps's floor
    return x, torch.randn(N, d, dtype=torch.float64, generator=gen)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_kernels_run_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


# float16 gradients of the rows below max_eps's floor overflow (g / 1e-12); the interpreter's numpy cast warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("N, d", SHAPES)
def test_kernels_equal_float64_rounded_once(N: int, d: int, form: str, dtype: torch.dtype) -> None:
    floored = FORMS[form]
    x64, g64 = _rows(N, d)
    x, g = x64.to(dtype), g64.to(dtype)
    # The reference: float64 from the same (rounded) inputs.
    y_ref, n_ref, norm_ref = l2.l2_normalize_torch(x.double(), floored)
    dx_ref = l2.l2_normalize_grad_torch(g.double(), y_ref, n_ref, norm_ref, floored)
    y = l2.l2_normalize(x.to(DEVICE), floored)
    dx = l2.l2_normalize_grad(x.to(DEVICE), g.to(DEVICE), floored)
    assert y.dtype == dx.dtype == dtype
    _close(y.cpu(), y_ref, dtype)
    if floored and N > 2:
        assert torch.all(dx[1].cpu() == g[1] / l2.L2_MAX_EPS)  # a zero row: g / eps, no projection term
    if dtype == torch.float32 or not floored:  # 16-bit rows below the floor give gradients near 1e12
        _close(dx.cpu(), dx_ref, dtype)
    # ATen's form in the same dtype agrees to that dtype's rounding too, on the ordinary rows (in float16 its floor,
    # 1e-12, is 0, and a zero row divides 0 by 0).
    ordinary = slice(3, None) if N > 2 else slice(None)
    _close(y[ordinary].cpu(), l2.l2_normalize_torch(x, floored)[0][ordinary], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(FORMS))
def test_layers_l2_normalize_through_the_kernels_equals_its_aten_form(form: str, dtype: torch.dtype) -> None:
    x64, g64 = _rows(6, 16, seed=1)
    x = x64.reshape(2, 3, 16).to(dtype).to(DEVICE)
    g = g64.reshape(2, 3, 16).to(dtype).to(DEVICE)
    results = []
    for kernels in (True, False):
        leaf = x.clone().requires_grad_()
        with mock.patch.object(layers, "l2_kernels_by_default", return_value=kernels) as chosen, \
                mock.patch.object(l2, "l2_normalize_torch", wraps=l2.l2_normalize_torch) as aten:
            y = layers.l2_normalize(leaf, form)
            y.backward(g)
        assert chosen.called and aten.called != kernels
        results.append((y.detach(), leaf.grad))
    (y_k, dx_k), (y_a, dx_a) = results
    assert y_k.shape == y_a.shape == x.shape and dx_k.dtype == dtype
    _close(y_k.cpu(), y_a.cpu(), dtype)
    if dtype == torch.float32:
        _close(dx_k.cpu(), dx_a.cpu(), dtype)
    else:  # ATen's bf16 chain rounds y, n and s on the way: its gradient is within a few bf16 units
        torch.testing.assert_close(dx_k.double().cpu(), dx_a.double().cpu(), rtol=3e-2,
                                   atol=3e-2 * dx_a.abs().max().item())


def test_the_ops_registrations() -> None:
    x, g = (t.float().to(DEVICE) for t in _rows(7, 5))
    for floored in (True, False):
        torch.library.opcheck(torch.ops.pcaf.l2_normalize, (x, floored))
        torch.library.opcheck(torch.ops.pcaf.l2_normalize_grad, (x, g, floored))


def test_bad_inputs_are_refused_in_one_line() -> None:
    x = torch.randn(4, 6, device=DEVICE)
    for bad_args in ((x.double(),), (x.t(),), (x[None],), (x, x[:2]), (x, x.bfloat16())):
        with pytest.raises(ValueError, match="contiguous \\[N, d\\]") as err:
            if len(bad_args) == 1:
                l2.l2_normalize(bad_args[0], True)
            else:
                l2.l2_normalize_grad(*bad_args, True)
        assert "\n" not in str(err.value)
