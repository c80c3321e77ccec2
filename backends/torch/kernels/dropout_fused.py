"""Dropout fused with its neighbours on CUDA: the GELU before it and the residual add after it.

A conv block's MLP computes ``x + drop(W_out·drop(GELU(W_in·y)))`` and the head's features ``drop(GELU(·))``
(:mod:`backends.torch.layers`). In ATen each GELU and each dropout is a kernel of its own both ways, the residual
add one more forward, and under autocast the add's gradient is cast to the branch's dtype by one more. Here
(:class:`backends.torch.dropout.Dropout`'s ``gelu`` and ``residual``) each pair is one kernel each way:

- ``pcaf::gelu_dropout(Tensor x, Tensor levels, int cutoff, float scale, bool tanh) -> Tensor``:
  ``drop(GELU(x))`` in x's dtype (``tanh``: the tanh approximation, else erf's);
- ``pcaf::gelu_dropout_grad(Tensor g, Tensor x, Tensor levels, int cutoff, float scale, bool tanh) -> Tensor``:
  its gradient in x: the dropped gradient, then GELU's derivative at x;
- ``pcaf::add_dropout(Tensor x, Tensor y, Tensor levels, int cutoff, float scale) -> Tensor``: ``x + drop(y)`` in
  x's dtype (the residual stream's, at least y's);
- ``pcaf::add_dropout_grad(Tensor g, Tensor levels, int cutoff, float scale, ScalarType dtype) -> Tensor``: the
  gradient in y: g cast to y's ``dtype``, then dropped (x's gradient is g itself).

Each intermediate is rounded to the dtype ATen's chain holds it in (the GELU's output before the mask, the dropped
branch before the add, the cast gradient before the mask), so the values are ATen's but for GELU's ``erf``,
``exp`` and ``tanh``, which may differ in the last float32 bit, which rounding to 16 bits rarely keeps
(``tests/test_dropout_fused.py``). The mask is :mod:`backends.torch.kernels.dropout_mask`'s, from the same int16
levels; the ATen forms (``*_torch``) serve off CUDA and are the tests' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch.kernels.dropout_mask import KERNEL_DTYPES, dropout_mask_torch, rounded_scale
from backends.torch.kernels.ops import triton_enabled

try:
    import triton
    import triton.language as tl

    from backends.torch.kernels.triton_math import as_stored, gelu, gelu_slope
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

BLOCK = 2048
"""Elements a program: 16 a thread at 4 warps."""

if triton is not None:

    @triton.jit
    def _gelu_dropout_kernel(x_ptr, levels_ptr, out_ptr, n, cutoff, scale, TANH: tl.constexpr,
                             OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """Grid ``(cdiv(n, BLOCK),)``; ``scale`` already rounded to x's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        level = tl.load(levels_ptr + offs, mask=inside, other=0)
        a = as_stored(gelu(x, TANH), out_ptr, OUT_BF16)
        y = a * tl.where(level >= cutoff, scale, 0.0)
        tl.store(out_ptr + offs, as_stored(y, out_ptr, OUT_BF16).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _gelu_dropout_grad_kernel(g_ptr, x_ptr, levels_ptr, out_ptr, n, cutoff, scale, TANH: tl.constexpr,
                                  OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """Grid ``(cdiv(n, BLOCK),)``."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        level = tl.load(levels_ptr + offs, mask=inside, other=0)
        dropped = as_stored(g * tl.where(level >= cutoff, scale, 0.0), out_ptr, OUT_BF16)
        dx = dropped * gelu_slope(x, TANH)
        tl.store(out_ptr + offs, as_stored(dx, out_ptr, OUT_BF16).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _add_dropout_kernel(x_ptr, y_ptr, levels_ptr, out_ptr, n, cutoff, scale, Y_BF16: tl.constexpr,
                            OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """Grid ``(cdiv(n, BLOCK),)``; ``scale`` already rounded to y's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        level = tl.load(levels_ptr + offs, mask=inside, other=0)
        dropped = as_stored(y * tl.where(level >= cutoff, scale, 0.0), y_ptr, Y_BF16)
        tl.store(out_ptr + offs, as_stored(x + dropped, out_ptr, OUT_BF16).to(out_ptr.dtype.element_ty),
                 mask=inside)

    @triton.jit
    def _add_dropout_grad_kernel(g_ptr, levels_ptr, out_ptr, n, cutoff, scale, OUT_BF16: tl.constexpr,
                                 BLOCK: tl.constexpr):
        """Grid ``(cdiv(n, BLOCK),)``; ``scale`` already rounded to the output's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = as_stored(tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32), out_ptr, OUT_BF16)
        level = tl.load(levels_ptr + offs, mask=inside, other=0)
        y = g * tl.where(level >= cutoff, scale, 0.0)
        tl.store(out_ptr + offs, as_stored(y, out_ptr, OUT_BF16).to(out_ptr.dtype.element_ty), mask=inside)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and triton_enabled(x)


# ------------------------------------------------------------------ the ATen forms (the kernels' reference)


def gelu_dropout_torch(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, tanh: bool
                       ) -> torch.Tensor:
    return dropout_mask_torch(F.gelu(x, approximate="tanh" if tanh else "none"), levels, cutoff, scale)


def gelu_dropout_grad_torch(g: torch.Tensor, x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float,
                            tanh: bool) -> torch.Tensor:
    dropped = dropout_mask_torch(g, levels, cutoff, scale)
    return torch.ops.aten.gelu_backward(dropped, x, approximate="tanh" if tanh else "none")


def add_dropout_torch(x: torch.Tensor, y: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float
                      ) -> torch.Tensor:
    return x + dropout_mask_torch(y, levels, cutoff, scale)


def add_dropout_grad_torch(g: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, dtype: torch.dtype
                           ) -> torch.Tensor:
    return dropout_mask_torch(g.to(dtype), levels, cutoff, scale)


# ------------------------------------------------------------------ the ops


@torch.library.custom_op("pcaf::gelu_dropout", mutates_args=())
def _gelu_dropout(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, tanh: bool) -> torch.Tensor:
    if not _use_triton(x):
        return gelu_dropout_torch(x, levels, cutoff, scale, tanh)
    out = torch.empty_like(x)
    if x.numel():
        _gelu_dropout_kernel[_grid(x.numel())](x, levels, out, x.numel(), cutoff, rounded_scale(scale, x.dtype),
                                               TANH=tanh, OUT_BF16=x.dtype == torch.bfloat16, BLOCK=BLOCK)
    return out


@_gelu_dropout.register_fake
def _(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, tanh: bool) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pcaf::gelu_dropout_grad", mutates_args=())
def _gelu_dropout_grad(g: torch.Tensor, x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float,
                       tanh: bool) -> torch.Tensor:
    if not _use_triton(x):
        return gelu_dropout_grad_torch(g, x, levels, cutoff, scale, tanh)
    out = torch.empty_like(x)
    if x.numel():
        _gelu_dropout_grad_kernel[_grid(x.numel())](g, x, levels, out, x.numel(), cutoff,
                                                    rounded_scale(scale, x.dtype), TANH=tanh,
                                                    OUT_BF16=x.dtype == torch.bfloat16, BLOCK=BLOCK)
    return out


@_gelu_dropout_grad.register_fake
def _(g: torch.Tensor, x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, tanh: bool
      ) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pcaf::add_dropout", mutates_args=())
def _add_dropout(x: torch.Tensor, y: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float
                 ) -> torch.Tensor:
    if not _use_triton(x):
        return add_dropout_torch(x, y, levels, cutoff, scale)
    out = torch.empty_like(x)
    if x.numel():
        _add_dropout_kernel[_grid(x.numel())](x, y, levels, out, x.numel(), cutoff, rounded_scale(scale, y.dtype),
                                              Y_BF16=y.dtype == torch.bfloat16, OUT_BF16=x.dtype == torch.bfloat16,
                                              BLOCK=BLOCK)
    return out


@_add_dropout.register_fake
def _(x: torch.Tensor, y: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pcaf::add_dropout_grad", mutates_args=())
def _add_dropout_grad(g: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, dtype: torch.dtype
                      ) -> torch.Tensor:
    if not _use_triton(g):
        return add_dropout_grad_torch(g, levels, cutoff, scale, dtype)
    out = torch.empty_like(g, dtype=dtype)
    if g.numel():
        _add_dropout_grad_kernel[_grid(g.numel())](g, levels, out, g.numel(), cutoff, rounded_scale(scale, dtype),
                                                   OUT_BF16=dtype == torch.bfloat16, BLOCK=BLOCK)
    return out


@_add_dropout_grad.register_fake
def _(g: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(g, dtype=dtype)


# ------------------------------------------------------------------ checked entry points


def _check(name: str, levels: torch.Tensor, *tensors: torch.Tensor) -> None:
    n = tensors[0].numel()
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES or not t.is_contiguous() or t.shape != tensors[0].shape:
            raise ValueError(f"{name} takes contiguous float32/bfloat16/float16 tensors of one shape, got {t.dtype} "
                             f"of shape {tuple(t.shape)} and strides {t.stride()}")
    if levels.dtype != torch.int16 or levels.numel() != n or not levels.is_contiguous():
        raise ValueError(f"{name} takes {n} contiguous int16 levels, got {levels.numel()} of {levels.dtype}")


def gelu_dropout(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, tanh: bool) -> torch.Tensor:
    """``drop(GELU(x))`` in x's dtype (see the module docstring)."""
    _check("gelu_dropout", levels, x)
    return torch.ops.pcaf.gelu_dropout(x, levels, cutoff, scale, tanh)


def gelu_dropout_grad(g: torch.Tensor, x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float,
                      tanh: bool) -> torch.Tensor:
    """The gradient in x of :func:`gelu_dropout` times ``g`` (x's dtype)."""
    _check("gelu_dropout_grad", levels, x, g)
    if g.dtype != x.dtype:
        raise ValueError(f"gelu_dropout_grad takes g in x's dtype {x.dtype}, got {g.dtype}")
    return torch.ops.pcaf.gelu_dropout_grad(g, x, levels, cutoff, scale, tanh)


def add_dropout(x: torch.Tensor, y: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    """``x + drop(y)`` in x's dtype, which must hold y's (``torch.result_type(x, y) == x.dtype``)."""
    _check("add_dropout", levels, x, y)
    if torch.result_type(x, y) != x.dtype:
        raise ValueError(f"add_dropout adds y into x's dtype, which must hold y's: got x {x.dtype}, y {y.dtype}")
    return torch.ops.pcaf.add_dropout(x, y, levels, cutoff, scale)


def add_dropout_grad(g: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, dtype: torch.dtype
                     ) -> torch.Tensor:
    """The gradient in y of :func:`add_dropout` times ``g``: g cast to y's ``dtype``, then dropped."""
    _check("add_dropout_grad", levels, g)
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"add_dropout_grad returns float32/bfloat16/float16, got {dtype}")
    return torch.ops.pcaf.add_dropout_grad(g, levels, cutoff, scale, dtype)
