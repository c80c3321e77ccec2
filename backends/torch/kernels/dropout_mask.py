"""Dropout's mask and scale in one pass each way on CUDA: ``pcaf::dropout_mask``.

:class:`backends.torch.dropout.Dropout` draws its levels as ATen's ``randint`` words, two signed 16-bit levels a
word, and keeps an element where its level is at least the threshold (:mod:`pcaf_core.dropout`). In ATen the
forward is four kernels after the draw (the comparison, the bool mask's cast, its scaling, the product) and keeps
the float mask for the backward's product. Here each pass is one kernel that reads the 16-bit levels and the
input and writes the output, and the backward keeps the levels themselves (2 bytes an element, where the float
mask took the input's 2 or 4).

Op (namespace ``pcaf``), the Triton kernel where :func:`backends.torch.kernels.triton_enabled` holds and ATen
elsewhere (:func:`dropout_mask_torch`, the reference the kernel is tested against: ``tests/test_dropout.py``):

- ``pcaf::dropout_mask(Tensor x, Tensor levels, int cutoff, float scale) -> Tensor``: x contiguous float32,
  bfloat16 or float16, levels int16 with ``x.numel()`` elements (the signed level, level − 2^15) ->
  ``x · m`` in x's dtype, with ``m = scale`` rounded to x's dtype where ``levels >= cutoff`` and ``0`` elsewhere.

The product is ATen's: formed in float32 from x and the rounded scale, rounded once to x's dtype (to nearest,
ties to even); a dropped element is ``x · 0`` (so ``-0.0`` for negative x and NaN for NaN, as the mask's product
gives; a NaN's payload may differ).
"""

from __future__ import annotations

import functools

import torch

from backends.torch.kernels.ops import triton_enabled

try:
    import triton
    import triton.language as tl

    from backends.torch.kernels.triton_math import to_bf16
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

BLOCK = 2048
"""Elements a program: 16 a thread at 4 warps."""

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _dropout_mask_kernel(
        x_ptr,  # [n] float32 / bfloat16 / float16
        levels_ptr,  # [n] int16: level - 2^15
        out_ptr,  # [n] out, x's dtype
        n,
        cutoff,  # keep where levels >= cutoff
        scale,  # float32: the scale already rounded to x's dtype
        BLOCK: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        """Grid ``(cdiv(n, BLOCK),)``."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        level = tl.load(levels_ptr + offs, mask=inside, other=0)
        y = x.to(tl.float32) * tl.where(level >= cutoff, scale, 0.0)
        if OUT_BF16:  # rounded by hand: Triton's interpreter, where the tests run, truncates to bfloat16
            tl.store(out_ptr + offs, to_bf16(y), mask=inside)
        else:
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


def dropout_mask_triton(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    """``x · m`` by one kernel (see the module docstring)."""
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _dropout_mask_kernel[(triton.cdiv(n, BLOCK),)](x, levels, out, n, cutoff, rounded_scale(scale, x.dtype),
                                                       BLOCK=BLOCK, OUT_BF16=x.dtype == torch.bfloat16)
    return out


@functools.lru_cache(maxsize=64)
def rounded_scale(scale: float, dtype: torch.dtype) -> float:
    """``scale`` rounded to ``dtype`` (the value ATen's mask holds), as a Python float."""
    return torch.tensor(scale, dtype=dtype).item()


def dropout_mask_torch(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    """The same ``x · m`` in ATen: the mask in x's dtype, then the product."""
    return x * (levels.view(x.shape) >= cutoff).to(x.dtype).mul_(scale)


@torch.library.custom_op("pcaf::dropout_mask", mutates_args=())
def _dropout_mask(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    """``pcaf::dropout_mask``: see :func:`dropout_mask`."""
    if triton is not None and triton_enabled(x):
        return dropout_mask_triton(x, levels, cutoff, scale)
    return dropout_mask_torch(x, levels, cutoff, scale)


@_dropout_mask.register_fake
def _dropout_mask_fake(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def dropout_mask(x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
    """``x`` times the mask of ``levels``: see the module docstring. x ``[...]`` contiguous, float32 / bfloat16 /
    float16; levels int16, contiguous, ``x.numel()`` of them."""
    if x.dtype not in KERNEL_DTYPES or not x.is_contiguous():
        raise ValueError(f"dropout_mask takes a contiguous float32/bfloat16/float16 tensor, got {x.dtype} of shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    if levels.dtype != torch.int16 or levels.numel() != x.numel() or not levels.is_contiguous():
        raise ValueError(f"dropout_mask takes {x.numel()} contiguous int16 levels, got {levels.numel()} of "
                         f"{levels.dtype}")
    return torch.ops.pcaf.dropout_mask(x, levels, cutoff, scale)
