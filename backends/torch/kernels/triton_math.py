"""Small ``@triton.jit`` helpers the kernels share: float32 → bfloat16 rounding, a value as a dtype stores it,
``log1p``, ``tanh`` and ATen's GELU and its derivative.

The rounding, ``log1p`` and ``tanh`` exist because Triton's interpreter, where the kernel tests run without a GPU,
differs from the compiler: its float32 → bfloat16 cast truncates where a GPU's rounds to nearest even, and it has
neither ``log1p`` nor ``tanh``. Written out here, a kernel computes the same values compiled and interpreted.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

_SQRT1_2, _PDF_SCALE = tl.constexpr(1.0 / math.sqrt(2.0)), tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_TANH_BETA, _TANH_KAPPA = tl.constexpr(math.sqrt(2.0 / math.pi)), tl.constexpr(0.044715)


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


@triton.jit
def tanh(u):
    """tanh(u) from exp (Triton has no tanh): ``(1 − e^{−2|u|}) / (1 + e^{−2|u|})`` with u's sign."""
    t = tl.exp(-2.0 * tl.where(u < 0, -u, u))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(u < 0, -r, r)


@triton.jit
def gelu(x, TANH: tl.constexpr):
    """ATen's GELU in float32: ``x·Φ(x)`` (erf) or its tanh approximation, in ATen's order."""
    if TANH:
        inner = _TANH_BETA * (x + _TANH_KAPPA * (x * x * x))
        return 0.5 * x * (1.0 + tanh(inner))
    return x * 0.5 * (1.0 + tl.erf(x * _SQRT1_2))


@triton.jit
def gelu_slope(x, TANH: tl.constexpr):
    """ATen's GELU derivative at x in float32, in ATen's order."""
    if TANH:
        x_sq = x * x
        inner = _TANH_BETA * (x + _TANH_KAPPA * (x_sq * x))
        t = tanh(inner)
        left = 0.5 * x
        right = 1.0 + t
        return 0.5 * right + left * (1.0 - t * t) * (_TANH_BETA * (1.0 + 3.0 * _TANH_KAPPA * x_sq))
    cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
    pdf = tl.exp(-0.5 * x * x) * _PDF_SCALE
    return cdf + x * pdf
