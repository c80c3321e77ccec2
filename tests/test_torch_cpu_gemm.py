"""Float32 products on oneDNN (``backends.torch.cpu_gemm``): the same products as ``addmm``/``mm`` to float32
rounding, for the operand layouts the head's forward and backward pass give it, and chosen only where stated."""

from __future__ import annotations

import pytest
import torch

from backends.torch import cpu_gemm
from backends.torch.head_loss import target_log_softmax

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g, dtype=torch.float64), torch.randn(n, k, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("m,k,n", [(37, 19, 53), (256, 128, 300), (1, 64, 5)])
def test_linear_is_x_times_weight_transposed_plus_bias(m, k, n, onednn, monkeypatch) -> None:
    """Contiguous operands, the transposed views the head's backward passes (``weight.t()``, ``saved.t()``),
    with and without a bias: float32 results within float32 rounding of the float64 product."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: onednn)
    x, w, b = _operands(m, k, n)
    want = x @ w.t() + b
    got = cpu_gemm.linear(x.float(), w.float(), b.float())
    assert cpu_gemm.uses_onednn(x.float(), w.float()) is onednn
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_gemm.linear(x.float(), w.float()).double(), x @ w.t(), rtol=1e-5, atol=1e-4)
    # x @ y for y [k, n]: linear(x, y.t()); xᵀ @ y for x [m, k], y [m, n]: linear(x.t(), y.t())
    y = w.t().contiguous()
    torch.testing.assert_close(cpu_gemm.linear(x.float(), y.float().t()).double(), x @ y, rtol=1e-5, atol=1e-4)
    z = torch.randn(m, n, dtype=torch.float64)
    torch.testing.assert_close(cpu_gemm.linear(x.float().t(), z.float().t()).double(), x.t() @ z, rtol=1e-5,
                               atol=1e-4)


def test_only_float32_cpu_products_outside_compile_go_to_onednn(monkeypatch) -> None:
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    x32, x64 = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)
    assert cpu_gemm.uses_onednn(x32, x32)
    assert not cpu_gemm.uses_onednn(x64, x64)
    assert not cpu_gemm.uses_onednn(x32.bfloat16(), x32.bfloat16())
    assert not cpu_gemm.uses_onednn(x32, x64)
    seen = []

    def product(x, w):
        seen.append(cpu_gemm.uses_onednn(x, w))
        return cpu_gemm.linear(x, w)

    out = torch.compile(product, backend="eager", fullgraph=True)(x32, torch.ones(4, 3))
    assert seen == [False] and torch.equal(out, torch.full((2, 4), 3.0))  # traced: inductor picks its products
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: False)
    assert not cpu_gemm.uses_onednn(x32, x32)


def test_onednn_is_chosen_on_amd_cpus_only(monkeypatch) -> None:
    for vendor, chosen in (("AuthenticAMD", torch.backends.mkldnn.is_available()), ("GenuineIntel", False),
                           (None, False)):
        monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda vendor=vendor: vendor)
        cpu_gemm.onednn_on_this_cpu.cache_clear()
        assert cpu_gemm.onednn_on_this_cpu() is chosen
    cpu_gemm.onednn_on_this_cpu.cache_clear()


def test_head_loss_on_either_library_agrees(monkeypatch) -> None:
    """The one-tile head loss and its gradients, products on oneDNN against oneMKL: float32 rounding apart."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(96, 40, generator=g, requires_grad=True)
    weight = torch.randn(700, 40, generator=g, requires_grad=True)
    bias = torch.randn(700, generator=g, requires_grad=True)
    y = torch.randint(0, 700, (96,), generator=g)
    results = {}
    for onednn in (True, False):
        monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda onednn=onednn: onednn)
        loss = target_log_softmax(z, weight, bias, y)
        results[onednn] = (loss, *torch.autograd.grad((loss * torch.linspace(-1, 1, 96)).sum(), (z, weight, bias)))
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
