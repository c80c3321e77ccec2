"""The address function in torch, bit for bit equal to :mod:`pcaf_core.hashing`.

The int32 wrap-around variant (the reference JAX code) is computed exactly in int64 and wrapped to
int32 once per step: modular arithmetic makes "wrap after every operation" equal to "wrap the exact
result", and this avoids relying on signed-overflow behaviour of any particular device kernel.
``torch.remainder`` takes the sign of the divisor, like ``np.remainder``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch.kernels import addresses as address_kernel
from backends.torch.kernels import triton_enabled
from pcaf_core.hashing import BUCKET_ADD, HASH_ADD, HASH_MOD, HASH_MULT

_TWO_31 = 1 << 31
_MASK_32 = (1 << 32) - 1


def wrap_int32(x: torch.Tensor) -> torch.Tensor:
    """Two's-complement wrap of int64 values into the int32 range (still stored as int64)."""
    return ((x + _TWO_31) & _MASK_32) - _TWO_31


def context_hash(tokens: torch.Tensor, order: int, *, int32_wraparound: bool = False) -> torch.Tensor:
    """See :func:`pcaf_core.hashing.context_hash`."""
    if order < 1:
        raise ValueError(f"context order must be >= 1, got {order}")
    x = tokens.to(torch.int64)
    if int32_wraparound:
        x = wrap_int32(x)
    T = x.shape[-1]
    h = None  # 0: the first step's h·HASH_MULT term is left out, and shift 0 reads x itself (fewer kernels)
    for shift in range(order - 1, -1, -1):
        if shift == 0:
            v = x
        elif shift < T:
            v = F.pad(x[..., : T - shift], (shift, 0))
        else:
            v = torch.zeros_like(x)
        step = v + HASH_ADD if h is None else torch.add(v, h, alpha=HASH_MULT) + HASH_ADD
        if int32_wraparound:
            step = wrap_int32(step)
        h = torch.remainder(step, HASH_MOD)
    return h


def bucket_of(hashes: torch.Tensor, num_buckets: int, *, int32_wraparound: bool = False) -> torch.Tensor:
    """See :func:`pcaf_core.hashing.bucket_of`."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    h = hashes.to(torch.int64)
    if int32_wraparound:
        if num_buckets >= _TWO_31:
            raise ValueError(f"num_buckets={num_buckets} does not fit the int32 arithmetic of int32_wraparound")
        h = wrap_int32(h)
        return torch.remainder(wrap_int32(h * HASH_MULT + BUCKET_ADD), num_buckets)
    return torch.remainder(h * HASH_MULT + BUCKET_ADD, num_buckets)


def addresses(
    tokens: torch.Tensor, order: int, num_buckets: int, *, int32_wraparound: bool = False
) -> torch.Tensor:
    """See :func:`pcaf_core.hashing.addresses`. On an eager CUDA step one kernel (``pcaf::addresses``,
    :mod:`backends.torch.kernels.addresses`) where the ops below are five or more, with the same values."""
    if _kernel(tokens) and order >= 1 and num_buckets >= 1 and not (int32_wraparound and num_buckets >= _TWO_31):
        return address_kernel.addresses(tokens, order, num_buckets, int32_wraparound)
    h = context_hash(tokens, order, int32_wraparound=int32_wraparound)
    return bucket_of(h, num_buckets, int32_wraparound=int32_wraparound)


def kernels_by_default(tokens: torch.Tensor) -> bool:
    """Whether :func:`addresses` runs as ``pcaf::addresses``' kernel: on CUDA tensors."""
    return tokens.is_cuda and triton_enabled(tokens)


def _kernel(tokens: torch.Tensor) -> bool:
    return (tokens.ndim == 2 and tokens.dtype in (torch.int32, torch.int64) and tokens.is_contiguous()
            and not torch.compiler.is_compiling() and kernels_by_default(tokens))
