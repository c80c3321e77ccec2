"""The memory's L2 normalisation of keys and queries on CUDA, one kernel each way: ``pcaf::l2_normalize``.

:func:`backends.torch.layers.l2_normalize` scales each row of the key and query projections to unit length, in
either form of :func:`pcaf_core.reference.l2_normalize`: ``max_eps`` ``x / max(‖x‖, 1e-12)`` or ``rsqrt_eps``
``x / sqrt(Σx² + 1e-6)``. Its ATen form is three kernels forward (the norm, the floor, the division) and five to
seven backward; an eager step on CUDA normalises two arrays, so about 20 launches. Here each pass is one kernel
that reads a row once and writes it once:

- ``pcaf::l2_normalize(Tensor x, bool floored) -> Tensor``: x ``[N, d]`` float32, bfloat16 or float16 with
  contiguous rows -> ``y`` in x's dtype (``floored``: the ``max_eps`` form);
- ``pcaf::l2_normalize_grad(Tensor x, Tensor g, bool floored) -> Tensor``: ``dx = (g − y·Σ g·y) / n`` in x's dtype,
  the projection term left out where ``max_eps``'s floor holds (there ``n`` does not depend on x), with ``n`` and
  ``y`` recomputed from x.

Each is computed in float32 and rounded once to x's dtype (bfloat16 to nearest even,
:func:`backends.torch.kernels.triton_math.to_bf16`), where ATen's 16-bit form rounds the norm, the floor and the
quotient each to 16 bits: under bf16 autocast the two agree to bfloat16 rounding, in float32 to float32 rounding
(the square root and the division are the correctly rounded ones; the row sums run in another order). ATen's form
(:func:`l2_normalize_torch`, ``backends.torch.layers._L2Normalize``'s) serves off CUDA and is the reference of
``tests/test_torch_l2_normalize.py``.
"""

from __future__ import annotations

import torch

from backends.torch.kernels.ops import triton_enabled

try:
    import triton
    import triton.language as tl

    from backends.torch.kernels.triton_math import to_bf16
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

L2_RSQRT_EPS = 1e-6  # rsqrt_eps form: x / sqrt(Σx² + 1e-6)
L2_MAX_EPS = 1e-12  # max_eps form: x / max(‖x‖, 1e-12)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROW_ELEMENTS = 2048
"""``[rows, d]`` elements a program (d padded to a power of two): 16 a thread at 4 warps (the gradient's kernel,
which holds x and g, needs 80-90 registers a thread for sm_90 at this size, and about 195 at twice it)."""

if triton is not None:

    @triton.jit
    def _row_norms(x_ptr, N, d, FLOORED: tl.constexpr, EPS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
        """This program's rows of x in float32 ``[BLOCK_N, BLOCK_D]``, their offsets and mask, ``n`` (the divisor)
        and ``‖x‖``."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        inside = (rows < N)[:, None] & (cols < d)[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        sq = tl.sum(x * x, axis=1)
        norm = tl.sqrt_rn(sq)
        if FLOORED:
            n = tl.maximum(norm, EPS)
        else:
            n = tl.sqrt_rn(sq + EPS)
        return x, offs, inside, n, norm

    @triton.jit
    def _store(ptr, offs, value, inside, OUT_BF16: tl.constexpr):
        if OUT_BF16:  # rounded by hand: Triton's interpreter, where the tests run, truncates to bfloat16
            tl.store(ptr + offs, to_bf16(value), mask=inside)
        else:
            tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _l2_normalize_kernel(x_ptr, y_ptr, N, d, FLOORED: tl.constexpr, EPS: tl.constexpr, OUT_BF16: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK_N),)``."""
        x, offs, inside, n, _ = _row_norms(x_ptr, N, d, FLOORED, EPS, BLOCK_N, BLOCK_D)
        _store(y_ptr, offs, tl.div_rn(x, n[:, None]), inside, OUT_BF16)

    @triton.jit
    def _l2_normalize_grad_kernel(x_ptr, g_ptr, dx_ptr, N, d, FLOORED: tl.constexpr, EPS: tl.constexpr,
                                  OUT_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK_N),)``."""
        x, offs, inside, n, norm = _row_norms(x_ptr, N, d, FLOORED, EPS, BLOCK_N, BLOCK_D)
        g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        y = tl.div_rn(x, n[:, None])
        s = tl.sum(g * y, axis=1)
        if FLOORED:
            s = tl.where(norm < EPS, 0.0, s)
        _store(dx_ptr, offs, tl.div_rn(g - y * s[:, None], n[:, None]), inside, OUT_BF16)


def _launch(kernel, x: torch.Tensor, *tensors: torch.Tensor, floored: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    N, d = x.shape
    if N and d:
        block_d = triton.next_power_of_2(d)
        block_n = max(1, ROW_ELEMENTS // block_d)
        kernel[(triton.cdiv(N, block_n),)](x, *tensors, out, N, d, FLOORED=floored,
                                           EPS=L2_MAX_EPS if floored else L2_RSQRT_EPS,
                                           OUT_BF16=x.dtype == torch.bfloat16, BLOCK_N=block_n, BLOCK_D=block_d)
    return out


def l2_normalize_torch(x: torch.Tensor, floored: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ATen's form: ``(y, n, ‖x‖)`` (``‖x‖`` is ``n`` itself in the ``rsqrt_eps`` form), in x's dtype."""
    if floored:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        n = norm.clamp(min=L2_MAX_EPS)
    else:
        n = norm = torch.sqrt((x * x).sum(-1, keepdim=True) + L2_RSQRT_EPS)
    return x / n, n, norm


def l2_normalize_grad_torch(g: torch.Tensor, y: torch.Tensor, n: torch.Tensor, norm: torch.Tensor, floored: bool
                            ) -> torch.Tensor:
    """ATen's form of the gradient from the forward's ``(y, n, ‖x‖)``."""
    s = (g * y).sum(-1, keepdim=True)
    if floored:
        s = s.masked_fill(norm < L2_MAX_EPS, 0)
    return (g - y * s) / n


@torch.library.custom_op("pcaf::l2_normalize", mutates_args=())
def _l2_normalize(x: torch.Tensor, floored: bool) -> torch.Tensor:
    if triton is not None and triton_enabled(x):
        return _launch(_l2_normalize_kernel, x, floored=floored)
    return l2_normalize_torch(x, floored)[0]


@_l2_normalize.register_fake
def _(x: torch.Tensor, floored: bool) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pcaf::l2_normalize_grad", mutates_args=())
def _l2_normalize_grad(x: torch.Tensor, g: torch.Tensor, floored: bool) -> torch.Tensor:
    if triton is not None and triton_enabled(x):
        return _launch(_l2_normalize_grad_kernel, x, g, floored=floored)
    return l2_normalize_grad_torch(g, *l2_normalize_torch(x, floored), floored)


@_l2_normalize_grad.register_fake
def _(x: torch.Tensor, g: torch.Tensor, floored: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _check(*tensors: torch.Tensor) -> None:
    x = tensors[0]
    for t in tensors:
        if t.ndim != 2 or t.dtype != x.dtype or t.dtype not in KERNEL_DTYPES or not t.is_contiguous() \
                or t.shape != x.shape:
            raise ValueError(f"l2_normalize kernels take contiguous [N, d] float32/bfloat16/float16 rows of one "
                             f"shape and dtype, got {t.dtype} of shape {tuple(t.shape)} and strides {t.stride()}")


def l2_normalize(x: torch.Tensor, floored: bool) -> torch.Tensor:
    """Each row of ``x`` ``[N, d]`` scaled to unit length (``floored``: ``max_eps``, else ``rsqrt_eps``)."""
    _check(x)
    return torch.ops.pcaf.l2_normalize(x, floored)


def l2_normalize_grad(x: torch.Tensor, g: torch.Tensor, floored: bool) -> torch.Tensor:
    """The gradient in ``x`` ``[N, d]`` of :func:`l2_normalize` times ``g`` ``[N, d]`` (x's dtype)."""
    _check(x, g)
    return torch.ops.pcaf.l2_normalize_grad(x, g, floored)
