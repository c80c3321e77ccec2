"""The segmented-sum kernel of ``gather_dot``'s key-side gradient (``backends.torch.kernels.gather_grad``):
values against a float64 loop, repeatability, the ``pcaf::gather_dot_grad_y`` registration, and ``gather_dot``'s
gradients through the kernel equal to those of its default path.

The kernel runs compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU), so
grids stay at a few dozen programs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.torch import ops
from backends.torch.kernels import gather_grad
from backends.torch.kernels.ops import triton_enabled

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reference(x: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, T: int) -> torch.Tensor:
    """``gy`` by a float64 loop over the slots."""
    B, Q, C = index.shape
    out = torch.zeros(B, T, x.shape[-1], dtype=torch.float64)
    xd, gd, ic = x.double().cpu(), grad.double().cpu(), index.cpu()
    for b in range(B):
        for q in range(Q):
            for c in range(C):
                out[b, ic[b, q, c]] += gd[b, q, c] * xd[b, q]
    return out


def _inputs(B: int, Q: int, C: int, T: int, d: int, dtype: torch.dtype, seed: int, hot: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, Q, d, generator=g).to(dtype)
    grad = torch.randn(B, Q, C, generator=g).to(dtype)
    index = torch.randint(0, T, (B, Q, C), generator=g)
    if hot:  # most slots on row 0: one program sums a segment several BLOCK_SLOTS long
        index[..., :-1] = 0
    return x.to(DEVICE), grad.to(DEVICE), index.to(DEVICE)


def test_kernel_runs_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B, Q, C, T, d, hot",  # hot: most slots on row 0, or "empty" slots
    [
        (2, 7, 3, 9, 5, False),  # rows nobody reads (zeros), repeats
        (1, 16, 4, 16, 33, True),  # a 49-slot segment: four BLOCK_SLOTS steps, the last one partial
        (3, 5, 2, 1, 8, False),  # T = 1: every slot on one row
        (2, 6, 5, 6, 300, False),  # d above MAX_BLOCK_D: two column blocks, the second partial
        (2, 9, 4, 7, 16, "empty"),  # masked empty slots clipped to 0 with zero gradient (left out)
    ],
)
def test_kernel_equals_a_float64_loop(B, Q, C, T, d, hot, dtype) -> None:
    x, grad, index = _inputs(B, Q, C, T, d, dtype, seed=B * 1000 + d, hot=hot is True)
    if hot == "empty":  # as candidate_scores leaves them: the last two slots of every query empty
        index[..., 2:] = 0
        grad[..., 2:] = 0
    got = gather_grad.gather_dot_grad_y_triton(x, grad, index, T)
    assert got.dtype == torch.float32 and got.shape == (B, T, d)
    ref = _reference(x, grad, index, T)
    # float32 sums of bf16/fp32 products: the error is float32 rounding of a sum of <= B·Q·C terms
    torch.testing.assert_close(got.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gather_grad.gather_dot_grad_y_torch(x, grad, index, T).double().cpu(), ref,
                               rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Q=st.integers(1, 9), C=st.integers(1, 4), T=st.integers(1, 9), d=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_kernel_property_and_repeatability(B, Q, C, T, d, seed) -> None:
    x, grad, index = _inputs(B, Q, C, T, d, torch.float32, seed)
    first = gather_grad.gather_dot_grad_y_triton(x, grad, index, T)
    torch.testing.assert_close(first.double().cpu(), _reference(x, grad, index, T), rtol=1e-5, atol=1e-5)
    assert torch.equal(first, gather_grad.gather_dot_grad_y_triton(x, grad, index, T))  # bit for bit


def test_opcheck() -> None:
    x, grad, index = _inputs(2, 4, 3, 5, 6, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.pcaf.gather_dot_grad_y.default, (x, grad, index, 5))


def test_shape_mismatch_is_an_error() -> None:
    x, grad, index = _inputs(2, 4, 3, 5, 6, torch.float32, seed=4)
    with pytest.raises(ValueError, match="must share"):
        gather_grad.gather_dot_grad_y(x, grad[:, :3], index, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_dot_gradients_through_the_kernel(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """``gather_dot``'s gradients with the kernel summing ``gy`` equal those of the default path on this device
    (the chunked ``index_add_`` on a CPU, or the CSR products in float32)."""
    B, Q, T, C, d = 2, 10, 12, 4, 24
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(B, Q, d, generator=g).to(dtype).to(DEVICE)
    y0 = torch.randn(B, T, d, generator=g).to(dtype).to(DEVICE)
    index = torch.randint(0, T, (B, Q, C), generator=g).to(DEVICE)
    w = torch.randn(B, Q, C, generator=g).to(dtype).to(DEVICE)

    def grads(use_kernel: bool):
        monkeypatch.setattr(ops, "_segment_kernel_for", lambda grad, y: use_kernel)
        x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
        (ops.gather_dot(x, y, index, chunk_elements=64) * w).sum().backward()
        return x.grad, y.grad

    gx_k, gy_k = grads(True)
    gx_d, gy_d = grads(False)
    assert gy_k.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(gx_k, gx_d, **tol)
    torch.testing.assert_close(gy_k, gy_d, **tol)


def test_kernel_is_chosen_on_cuda_for_32_bit_keys_only() -> None:
    cpu = torch.zeros(1)
    assert not ops._segment_kernel_for(cpu, cpu)
    if torch.cuda.is_available():
        cuda = torch.zeros(1, device="cuda")
        assert ops._segment_kernel_for(cuda, cuda)
        assert not ops._segment_kernel_for(cuda, cuda.double())


def test_gather_chunks_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathered path's chunk: ``CHUNK_ELEMENTS`` on a CPU, the larger CUDA default on a GPU, which keeps the
    paper-shape full-AR scoring (T = 1,024, batch 8, K = 16, d = 256) in one chunk (a chunk costs launches), and a
    caller's own value everywhere; one chunk and many give the same products and gradients."""
    assert ops.chunk_elements_for(torch.zeros(1), None) == ops.CHUNK_ELEMENTS
    assert ops.chunk_elements_for(torch.zeros(1), 64) == 64
    if torch.cuda.is_available():
        assert ops.chunk_elements_for(torch.zeros(1, device="cuda"), None) == ops.CHUNK_ELEMENTS_CUDA
    B, Q, C, d = 8, 1024, 16, 256
    assert ops._query_chunk(Q, B * C * d, ops.CHUNK_ELEMENTS_CUDA) == Q
    assert ops._query_chunk(Q, B * C * d, ops.CHUNK_ELEMENTS) == Q // 8
    g = torch.Generator().manual_seed(3)
    x0, y0 = torch.randn(2, 9, 5, generator=g, dtype=torch.float64), torch.randn(2, 11, 5, generator=g,
                                                                                  dtype=torch.float64)
    index = torch.randint(0, 11, (2, 9, 4), generator=g)
    monkeypatch.setattr(ops, "_sparse_path", lambda x, y, index: False)  # the gathered path, as on a GPU
    outs = []
    for chunk in (2 * 4 * 5, None):  # one query a chunk; all in one
        x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
        out = ops._GatherDot.apply(x, y, index, ops.chunk_elements_for(x, chunk))
        (out * out).sum().backward()
        outs.append((out.detach(), x.grad, y.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
