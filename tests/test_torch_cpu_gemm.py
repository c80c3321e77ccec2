"""Float32 products on oneDNN (``backends.torch.cpu_gemm``): the same products as ``addmm``/``mm`` to float32
rounding, for the operand layouts the head's forward and backward pass give it, and chosen only where stated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch import cpu_gemm
from backends.torch.head_loss import chunked_target_log_softmax, target_log_softmax

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


def test_only_float32_cpu_products_go_to_onednn(monkeypatch) -> None:
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    x32, x64 = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)
    assert cpu_gemm.uses_onednn(x32, x32)
    assert not cpu_gemm.uses_onednn(x64, x64)
    assert not cpu_gemm.uses_onednn(x32.bfloat16(), x32.bfloat16())
    assert not cpu_gemm.uses_onednn(x32, x64)
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: False)
    assert not cpu_gemm.uses_onednn(x32, x32)


@pytest.mark.parametrize("rows", [1, 4096])
def test_compiled_graphs_keep_the_onednn_product_both_ways(rows, monkeypatch) -> None:
    """Under torch.compile the layer's product stays the one ``pcaf::onednn_linear`` call in the traced graph (not
    lowered to ``mm``), and the compiled forward and backward (AOTAutograd) equal eager's, for a row-major and a
    column-major weight."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    torch._dynamo.reset()
    layer = cpu_gemm.Linear(8, 24)
    cpu_gemm.lay_out_for_onednn(layer, rows)  # 4,096 rows: a column-major weight
    assert cpu_gemm.column_major(layer.weight) is (rows == 4096)
    graphs = []

    def record(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(3, 5, 8)
    torch.compile(layer, backend=record, fullgraph=True)(x)
    assert "pcaf.onednn_linear" in graphs[0] and "linear(" not in graphs[0].replace("onednn_linear(", "")
    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        results.append((out, *torch.autograd.grad((out * torch.linspace(-1, 1, 24)).sum(), (xi, *layer.parameters()))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_onednn_is_chosen_on_amd_cpus_only(monkeypatch) -> None:
    for vendor, chosen in (("AuthenticAMD", torch.backends.mkldnn.is_available()), ("GenuineIntel", False),
                           (None, False)):
        monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda vendor=vendor: vendor)
        cpu_gemm._onednn_vendor.cache_clear()
        assert cpu_gemm.onednn_on_this_cpu() is chosen
    cpu_gemm._onednn_vendor.cache_clear()


@pytest.mark.parametrize("chunks", [None, (40, 300)])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_head_loss_on_either_library_agrees(chunks, layout, monkeypatch) -> None:
    """The head loss and its gradients, one tile or in tiles that divide neither N nor V, with the weight
    row- or column-major: products on oneDNN against oneMKL, float32 rounding apart; the weight's gradient
    comes back in the weight's layout."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(96, 40, generator=g, requires_grad=True)
    weight = torch.randn(700, 40, generator=g)
    if layout == "column-major":
        weight = weight.t().contiguous().t()
    weight.requires_grad_(True)
    bias = torch.randn(700, generator=g, requires_grad=True)
    y = torch.randint(0, 700, (96,), generator=g)
    results = {}
    for onednn in (True, False):
        monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda onednn=onednn: onednn)
        if chunks is None:
            loss = target_log_softmax(z, weight, bias, y)
        else:
            loss = chunked_target_log_softmax(z, weight, bias, y, position_chunk=chunks[0], vocab_chunk=chunks[1])
        results[onednn] = (loss, *torch.autograd.grad((loss * torch.linspace(-1, 1, 96)).sum(), (z, weight, bias)))
        if onednn:
            assert results[onednn][2].stride() == weight.stride()
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("m,n,k", [(64, 300, 20), (64, 20, 300), (5, 7, 7), (1, 3, 9)])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_weight_grad_is_dy_transposed_times_x_in_the_weights_layout(m, n, k, onednn, layout, monkeypatch) -> None:
    """Both orientations of the product (a column-major weight's: a transposed view of ``xᵀ @ dy``; a row-major
    one's: ``dyᵀ @ x``) and oneMKL's equal the float64 ``dyᵀ @ x``; on oneDNN the result has the weight's strides,
    and ``index_add_`` into it lands in the right rows either way; operands strided both ways are taken too."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: onednn)
    g = torch.Generator().manual_seed(m + n + k)
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    like = torch.empty(n, k) if layout == "row-major" else torch.empty(k, n).t()
    got = cpu_gemm.weight_grad(dy.float(), x.float(), like)
    assert got.shape == (n, k)
    if onednn:
        assert got.stride() == like.stride() or min(n, k) == 1
    torch.testing.assert_close(got.double(), dy.t() @ x, rtol=1e-5, atol=1e-4)
    rows = torch.tensor([0, n - 1, 0])
    extra = torch.randn(3, k, generator=g, dtype=torch.float64)
    want = (dy.t() @ x).index_add_(0, rows, extra)
    torch.testing.assert_close(got.index_add_(0, rows, extra.float()).double(), want, rtol=1e-5, atol=1e-4)
    # column slices: operands strided both ways once transposed (oneDNN's slow case, copied first)
    wide_dy, wide_x = torch.cat([dy, dy], 1).float(), torch.cat([x, x], 1).float()
    sliced = cpu_gemm.weight_grad(wide_dy[:, n:], wide_x[:, :k], like)
    torch.testing.assert_close(sliced.double(), dy.t() @ x, rtol=1e-5, atol=1e-4)


def _linear_pair(d_in: int, d_out: int, bias: bool) -> tuple[cpu_gemm.Linear, torch.nn.Linear]:
    ours = cpu_gemm.Linear(d_in, d_out, bias=bias)
    plain = torch.nn.Linear(d_in, d_out, bias=bias)
    plain.load_state_dict(ours.state_dict())
    return ours, plain


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("d_in,d_out", [(24, 96), (96, 24), (16, 1)])
@pytest.mark.parametrize("rows", [1, 4096])
def test_linear_module_matches_nn_linear_in_value_and_gradients(d_in, d_out, bias, rows, monkeypatch) -> None:
    """``cpu_gemm.Linear`` on oneDNN against ``nn.Linear`` with the same state dict: outputs and the gradients of
    the input, weight (in the weight's layout) and bias within float32 rounding, for a ``[B, T, d]`` input
    (flattened and restored), a strided input, and frozen weights (input gradient only); row-major weights and,
    where the layer widens, column-major ones."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    ours, plain = _linear_pair(d_in, d_out, bias)
    cpu_gemm.lay_out_for_onednn(ours, rows)  # 4,096 rows: column-major where it widens
    g = torch.Generator().manual_seed(d_in * d_out)
    base = torch.randn(3, 2 * d_in, 11, generator=g)
    for x in (torch.randn(3, 11, d_in, generator=g), base.transpose(1, 2)[..., ::2]):
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        outs = [ours(xs[0]), plain(xs[1])]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        upstream = torch.randn(outs[0].shape, generator=g)
        params = [[p for p in m.parameters()] for m in (ours, plain)]
        grads = [torch.autograd.grad((o * upstream).sum(), (xi, *ps)) for o, xi, ps in zip(outs, xs, params)]
        for a, b in zip(*grads, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ours.requires_grad_(False)
    plain.requires_grad_(False)
    x = torch.randn(4, d_in, generator=g)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    dxs = [torch.autograd.grad(m(xi).sum(), xi)[0] for m, xi in zip((ours, plain), xs)]
    torch.testing.assert_close(dxs[0], dxs[1], rtol=1e-5, atol=1e-5)


def test_linear_module_is_nn_linear_off_onednn(monkeypatch) -> None:
    """Under autocast, with float64 tensors, or where oneDNN is not chosen, the module runs ``nn.Linear.forward``
    itself (no oneDNN op is called)."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    calls = []
    real = cpu_gemm.onednn_linear
    monkeypatch.setattr(cpu_gemm, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    layer = cpu_gemm.Linear(8, 4)
    x = torch.randn(2, 8)
    layer(x)
    assert calls == [1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    layer.double()(x.double())
    layer.float()
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: False)
    layer(x)
    assert calls == [1]


def test_lay_out_for_onednn_moves_widening_weights_only(monkeypatch) -> None:
    """Column-major weights for the widening ``cpu_gemm.Linear`` layers from ``COLUMN_MAJOR_FROM_ROWS`` rows on
    oneDNN; values, shapes and the state dict stay; narrowing layers, plain ``nn.Linear``, fewer rows and other
    CPUs are left alone."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    net = torch.nn.Sequential(cpu_gemm.Linear(4, 9), cpu_gemm.Linear(9, 4), torch.nn.Linear(4, 9))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    cpu_gemm.lay_out_for_onednn(net, cpu_gemm.COLUMN_MAJOR_FROM_ROWS - 1)
    assert not any(cpu_gemm.column_major(m.weight) for m in net)
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: False)
    cpu_gemm.lay_out_for_onednn(net, cpu_gemm.COLUMN_MAJOR_FROM_ROWS)
    assert not any(cpu_gemm.column_major(m.weight) for m in net)
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    cpu_gemm.lay_out_for_onednn(net, cpu_gemm.COLUMN_MAJOR_FROM_ROWS)
    assert [cpu_gemm.column_major(m.weight) for m in net] == [True, False, False]
    assert isinstance(net[0].weight, torch.nn.Parameter) and net[0].weight.requires_grad
    after = net.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_column_major_training_steps_match_row_major(monkeypatch) -> None:
    """Two full-AR training steps (dropout, clipping, fused AdamW) of a PCAF model with its widening weights
    column-major against the same steps row-major: the losses and every parameter after the updates agree to
    float32 rounding, and the column-major weights stay column-major through the optimiser."""
    from backends.torch.backend import TorchBackend
    from tests.compiled_steps import B, T, step_config

    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    cfg = step_config(("pcaf", "context", "dense", "first"), "ar")
    rng = np.random.default_rng(0)
    x, y = rng.integers(3, 64, (B, T)), rng.integers(3, 64, (B, T))
    runs = {}
    for threshold in (B * T, B * T + 1):  # the head's rows a step: B·T
        monkeypatch.setattr(cpu_gemm, "COLUMN_MAJOR_FROM_ROWS", threshold)
        backend = TorchBackend("cpu")
        state = backend.init(cfg)
        losses = []
        for _ in range(2):
            state, loss = backend.train_step(state, x, y, 1e-2)
            losses.append(loss)
        runs[threshold] = (losses, {n: p.detach() for n, p in state.module.named_parameters()})
        assert cpu_gemm.column_major(state.module.head.out.weight) is (threshold == B * T)
    (loss_c, params_c), (loss_r, params_r) = runs[B * T], runs[B * T + 1]
    np.testing.assert_allclose(loss_c, loss_r, rtol=1e-5)
    for name, value in params_r.items():
        torch.testing.assert_close(params_c[name], value, rtol=1e-5, atol=1e-6, msg=name)
