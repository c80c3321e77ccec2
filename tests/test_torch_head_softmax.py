"""The head loss's kernels over 16-bit logits (``backends.torch.kernels.head_softmax``) against their ATen form:
the log-normaliser and target logit, the logits' gradient and its column sums, tile sizes that do not divide N or
V, infinite rows, the ``pcaf::`` registrations under ``torch.compile``, and the one-tile head loss with the kernels
equal to it without them, in value and gradient, under bf16 and fp16 autocast.

The kernels run compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU). The
interpreter rounds float32 to bfloat16 by truncation where a GPU rounds to nearest, and exp may differ in its last
float32 bit between the kernels and ATen, so a 16-bit gradient is checked to within two units of its float32
value.
"""

from __future__ import annotations

import pytest
import torch

from backends.torch.head_loss import target_log_softmax
from backends.torch.kernels import head_softmax
from backends.torch.kernels.ops import triton_enabled

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = (torch.bfloat16, torch.float16)
SHAPES = [(5, 7), (19, 2100), (130, 257), (1, 1)]
"""(N, V): one partial tile; V over three forward column steps and N over two backward row steps, the second
partial; N over three backward programs, the last a partial row step, and V one past a backward column block; a
single logit."""


def _logits(N: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    grad = torch.randn(N, generator=g)
    return logits.to(DEVICE), y.to(DEVICE), grad.to(DEVICE)


def _float32_grad(logits, lse, g, y):
    """The float32 gradient before it is stored in 16 bits (the ATen form's order of operations)."""
    d = torch.sub(logits, lse[:, None]).exp_().mul_(-g[:, None])
    return d.scatter_add_(1, y[:, None], g[:, None])


def test_kernels_run_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("N, V", SHAPES)
def test_log_normaliser_equals_logsumexp(N, V, dtype) -> None:
    logits, y, _ = _logits(N, V, dtype)
    lse, target = head_softmax.log_normaliser_triton(logits, y)
    ref_lse, ref_target = head_softmax.log_normaliser_torch(logits, y)
    assert lse.dtype == target.dtype == torch.float32 and lse.shape == target.shape == (N,)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-7, atol=2e-6)
    assert torch.equal(target, ref_target)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("N, V", SHAPES)
def test_logit_grad_equals_the_aten_form(N, V, dtype) -> None:
    logits, y, g = _logits(N, V, dtype, seed=1)
    y[:1] = V - 1  # the last column holds a target
    lse = head_softmax.log_normaliser_torch(logits, y)[0]
    dlogits, dbias = head_softmax.logit_grad_triton(logits, lse, g, y)
    ref_dlogits, ref_dbias = head_softmax.logit_grad_torch(logits, lse, g, y)
    assert dlogits.dtype == dtype and dlogits.shape == (N, V) and dbias.dtype == torch.float32
    # Within two units of the 16-bit dtype of the float32 value: one for the rounding (the interpreter truncates
    # to bf16 where a GPU rounds to nearest), one for exp, whose last float32 bit may differ between the two paths.
    # float16 also has a spacing of 2^-24 below its smallest normal number.
    unit, spacing = (2.0**-7, 1e-38) if dtype == torch.bfloat16 else (2.0**-10, 2.0**-24)
    exact = _float32_grad(logits, lse, g, y)
    assert ((dlogits.float() - exact).abs() <= exact.abs() * 2 * unit + spacing).all()
    assert ((ref_dlogits.float() - exact).abs() <= exact.abs() * unit + spacing).all()  # ATen: rounded once
    # The column sums in another order: float32 rounding of N terms of size |g|.
    torch.testing.assert_close(dbias, ref_dbias, rtol=1e-5, atol=1e-6 * max(N, 1))


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # the -inf row, on the interpreter
def test_infinite_rows_are_shifted_by_zero_as_logsumexp_does() -> None:
    logits, y, g = _logits(4, 50, torch.bfloat16)
    logits[1] = float("-inf")
    logits[2, 3] = float("inf")
    y[2] = 3
    lse, target = head_softmax.log_normaliser_triton(logits, y)
    ref_lse, ref_target = head_softmax.log_normaliser_torch(logits, y)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-7, atol=2e-6)
    assert lse[1] == float("-inf") and lse[2] == float("inf")
    assert torch.equal(target, ref_target)


def test_bad_inputs_are_refused_in_one_line() -> None:
    logits, y, g = _logits(3, 8, torch.float32)
    with pytest.raises(ValueError, match="bfloat16/float16 logits"):
        head_softmax.log_normaliser(logits, y)
    with pytest.raises(ValueError, match=r"contiguous \[N\] = \[3\]"):
        head_softmax.log_normaliser(logits.bfloat16(), y[:2])


def test_ops_compile_without_a_graph_break() -> None:
    """Registered with fake implementations, so ``fullgraph`` compiles them as opaque ops."""
    logits, y, g = _logits(9, 33, torch.bfloat16)

    def both(logits, y, g):
        lse, target = head_softmax.log_normaliser(logits, y)
        return target - lse, head_softmax.logit_grad(logits, lse, g, y)

    eager = both(logits, y, g)
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")(logits, y, g)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
def test_head_loss_with_the_kernels_equals_it_without(dtype) -> None:
    """The one-tile head loss under autocast: value, and the gradients of z, W and b, with the kernels and
    with ATen's passes (N = 2·37 positions, V = 300: neither divides a tile)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 37, 24, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(300, 24, generator=g) * 0.3).to(DEVICE).requires_grad_()
    b = torch.randn(300, generator=g).to(DEVICE).requires_grad_()
    y = torch.randint(0, 300, (2, 37), generator=g).to(DEVICE)
    upstream = torch.randn(2, 37, generator=g).to(DEVICE)
    out = {}
    for kernels in (True, False):
        with torch.autocast(DEVICE.type, dtype=dtype):
            lp = target_log_softmax(z, w, b, y, kernels=kernels)
        out[kernels] = (lp, *torch.autograd.grad((lp * upstream).sum(), (z, w, b)))
    assert out[True][0].dtype == torch.float32
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-5)  # log-normalisers' rounding
    # The gradient products read 16-bit dlogits that may differ by a unit (the interpreter truncates to bf16; exp
    # may differ in its last float32 bit and move a value across a 16-bit rounding boundary).
    tol = 1e-3 if dtype == torch.float16 else 2e-2
    for a, r in zip(out[True][1:], out[False][1:]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA device; the interpreter "
                    "runs the same kernels on CPU tensors in the tests above")
@pytest.mark.parametrize("dtype", HALF)
def test_compiled_kernels_equal_the_aten_passes_at_the_paper_shape(dtype) -> None:
    """On a GPU, at the WikiText-2 full-AR shape (N = 8·1,024, V = 20,000): the kernels' log-normaliser within float
    rounding of ATen's, the target logits equal, the 16-bit gradient equal to ATen's except where exp's last
    float32 bit moves a value across a rounding boundary (both round to nearest: rarely, by one unit), and the bias
    gradient within the rounding of another summation order."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N, V = 8 * 1024, 20_000
    logits = (torch.randn(N, V, generator=g, device="cuda") * 4).to(dtype)
    y = torch.randint(0, V, (N,), generator=g, device="cuda")
    grad = torch.randn(N, generator=g, device="cuda")
    lse, target = head_softmax.log_normaliser(logits, y)
    ref_lse, ref_target = head_softmax.log_normaliser_torch(logits, y)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    assert torch.equal(target, ref_target)
    dlogits, dbias = head_softmax.logit_grad(logits, ref_lse, grad, y)
    ref_dlogits, ref_dbias = head_softmax.logit_grad_torch(logits, ref_lse, grad, y)
    # exp may differ in its last float32 bit between Triton and ATen: at most one 16-bit unit apart, rarely.
    unit, spacing = (2.0**-7, 1e-38) if dtype == torch.bfloat16 else (2.0**-10, 2.0**-24)
    diff = (dlogits.float() - ref_dlogits.float()).abs()
    assert (diff <= ref_dlogits.float().abs() * 2 * unit + spacing).all() and (diff > 0).float().mean() < 1e-3
    torch.testing.assert_close(dbias, ref_dbias, rtol=1e-4, atol=1e-5)
