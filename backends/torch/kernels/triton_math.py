"""Small ``@triton.jit`` helpers the kernels share: float32 → bfloat16 rounding, a value as a dtype stores it, and
``log1p``.

Both exist because Triton's interpreter, where the kernel tests run without a GPU, differs from the compiler: its
float32 → bfloat16 cast truncates where a GPU's rounds to nearest even, and it has no ``log1p``. Written out here,
a kernel computes the same values compiled and interpreted.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_bf16(y):
    """``y`` (float32) rounded to bfloat16, to nearest with ties to even; a NaN stays a NaN (its quiet bit set)."""
    b = y.to(tl.uint32, bitcast=True)
    r = tl.where(y != y, (b >> 16) | 0x40, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def as_stored(y, ptr, BF16: tl.constexpr):
    """``y`` (float32) rounded to ``ptr``'s dtype (``BF16``: bfloat16, rounded by :func:`to_bf16`) and read back as
    float32: the value a tensor of that dtype holds."""
    if BF16:
        return to_bf16(y).to(tl.float32)
    return y.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def log1p(x):
    """``log(1 + x)`` without losing ``x``'s digits where ``1 + x`` rounds (Goldberg's form, exact to a few units
    in the last place)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))
