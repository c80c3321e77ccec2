"""Every position's bucket address on CUDA in one kernel: ``pcaf::addresses``.

:func:`backends.torch.hashing.addresses` is the rolling context hash of the last n tokens followed by the bucket
hash (:mod:`pcaf_core.hashing`): in ATen two to three kernels a context step and three for the bucket (five at
n = 1), each a pass over ``[B, T]`` int64, with two more a step under the reference JAX code's int32
wrap-around. Here one kernel reads each position's n tokens and writes its address:

- ``pcaf::addresses(Tensor tokens, int order, int num_buckets, bool int32_wraparound) -> Tensor``: tokens ``[B, T]``
  int32 or int64, contiguous -> ``[B, T]`` int64 bucket ids in ``[0, num_buckets)``.

The arithmetic is the spec's, exact in int64 (every product stays below 2^52): ``h ← (h·HASH_MULT + x + HASH_ADD)
mod HASH_MOD`` oldest token first, 0 left of the window, then ``(h·HASH_MULT + BUCKET_ADD) mod B``, remainders
taking the divisor's sign as ``torch.remainder`` does; with ``int32_wraparound`` every step's sum wrapped to int32
first, as :func:`backends.torch.hashing.wrap_int32` does. The result equals ATen's form bit for bit
(``tests/test_torch_addresses.py``); :func:`backends.torch.hashing.addresses` takes that form wherever Triton does
not run, and calls this op only where it does.
"""

from __future__ import annotations

import torch

from backends.torch.kernels.ops import triton_enabled
from pcaf_core.hashing import BUCKET_ADD, HASH_ADD, HASH_MOD, HASH_MULT

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

BLOCK = 1024
"""Positions a program."""

if triton is not None:
    _MULT, _ADD, _MOD, _BUCKET_ADD = (tl.constexpr(v) for v in (HASH_MULT, HASH_ADD, HASH_MOD, BUCKET_ADD))

    @triton.jit
    def _wrap_int32(x):
        """int64 ``x`` wrapped to the int32 range (two's complement), still int64."""
        return ((x + 2147483648) & 4294967295) - 2147483648

    @triton.jit
    def _floor_mod(x, m):
        """``x mod m`` with the sign of ``m`` (> 0): Triton's ``%`` takes the dividend's."""
        r = x % m
        return tl.where(r < 0, r + m, r)

    @triton.jit
    def _addresses_kernel(tokens_ptr, out_ptr, N, T, num_buckets, ORDER: tl.constexpr, WRAP: tl.constexpr,
                          BLOCK: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK),)`` over the ``N = B·T`` positions, row-major."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < N
        t = offs % T
        h = tl.zeros([BLOCK], tl.int64)
        for j in tl.static_range(ORDER):  # oldest token first: shift ORDER - 1 - j
            x = tl.load(tokens_ptr + offs - (ORDER - 1 - j), mask=inside & (t >= ORDER - 1 - j), other=0).to(tl.int64)
            if WRAP:
                x = _wrap_int32(x)
            step = h * _MULT + x + _ADD
            if WRAP:
                step = _wrap_int32(step)
            h = _floor_mod(step, _MOD)
        if WRAP:
            b = _floor_mod(_wrap_int32(_wrap_int32(h) * _MULT + _BUCKET_ADD), num_buckets)
        else:
            b = _floor_mod(h * _MULT + _BUCKET_ADD, num_buckets)
        tl.store(out_ptr + offs, b, mask=inside)


@torch.library.custom_op("pcaf::addresses", mutates_args=())
def _addresses(tokens: torch.Tensor, order: int, num_buckets: int, int32_wraparound: bool) -> torch.Tensor:
    if triton is None or not triton_enabled(tokens):
        # ATen's form is backends.torch.hashing.addresses itself, which calls this op only where Triton runs.
        raise RuntimeError(f"pcaf::addresses runs Triton, which does not run on {tokens.device.type} tensors here: "
                           "call backends.torch.hashing.addresses, which takes ATen's form there")
    out = torch.empty(tokens.shape, dtype=torch.int64, device=tokens.device)
    N, T = tokens.numel(), tokens.shape[-1]
    if N:
        _addresses_kernel[(triton.cdiv(N, BLOCK),)](tokens, out, N, T, num_buckets, ORDER=order,
                                                    WRAP=int32_wraparound, BLOCK=BLOCK)
    return out


@_addresses.register_fake
def _(tokens: torch.Tensor, order: int, num_buckets: int, int32_wraparound: bool) -> torch.Tensor:
    return tokens.new_empty(tokens.shape, dtype=torch.int64)


def addresses(tokens: torch.Tensor, order: int, num_buckets: int, int32_wraparound: bool) -> torch.Tensor:
    """``[B, T]`` int64 bucket addresses of ``tokens`` ``[B, T]`` (int32 or int64, contiguous): see the module
    docstring."""
    if tokens.ndim != 2 or tokens.dtype not in (torch.int32, torch.int64) or not tokens.is_contiguous():
        raise ValueError(f"addresses takes contiguous [B, T] int32/int64 tokens, got {tokens.dtype} of shape "
                         f"{tuple(tokens.shape)}")
    return torch.ops.pcaf.addresses(tokens, order, num_buckets, int32_wraparound)
