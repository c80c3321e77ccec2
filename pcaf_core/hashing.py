"""The address function (docs/REFERENCE_CODE.md §2.1).

``h_i = fold over the n tokens x_{i-n+1..i} (zero left-padding) of (h * 1_000_003 + v + 97) mod (2^31 - 1)``
and the bucket ``a_i = (h_i * 1_000_003 + 97_531) mod B``. The normative form computes in int64;
``int32_wraparound=True`` reproduces the reference JAX code, whose int32 products overflow silently
(equal to int64 for n = 1 with B a power of two, different for n >= 2).
"""

from __future__ import annotations

import numpy as np

HASH_MULT = 1_000_003
HASH_ADD = 97
HASH_MOD = 2_147_483_647  # 2^31 - 1
BUCKET_ADD = 97_531


def context_hash(tokens: np.ndarray, order: int, *, int32_wraparound: bool = False) -> np.ndarray:
    """Rolling context hash of every position.

    Args:
        tokens: ``[..., T]`` integer token ids.
        order: context order n >= 1; position i hashes ``x_{i-n+1..i}`` oldest first, 0 left of the window.
        int32_wraparound: compute in int32 with silent overflow (reference JAX) instead of int64.
    Returns:
        ``[..., T]`` int64 hashes in ``[0, 2^31 - 1)``.
    """
    if order < 1:
        raise ValueError(f"context order must be >= 1, got {order}")
    dtype = np.int32 if int32_wraparound else np.int64
    x = np.asarray(tokens).astype(dtype)
    h = np.zeros_like(x)
    T = x.shape[-1]
    with np.errstate(over="ignore"):
        for shift in range(order - 1, -1, -1):
            v = np.zeros_like(x)
            if shift < T:
                v[..., shift:] = x[..., : T - shift]
            h = np.remainder(h * dtype(HASH_MULT) + v + dtype(HASH_ADD), dtype(HASH_MOD))
    return h.astype(np.int64)


def bucket_of(hashes: np.ndarray, num_buckets: int, *, int32_wraparound: bool = False) -> np.ndarray:
    """Second hash to a bucket: ``(h * 1_000_003 + 97_531) mod B``; ``[...]`` int64 in ``[0, B)``.

    ``num_buckets``: B >= 1; with ``int32_wraparound`` below 2^31 (B is an int32 there too).
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    dtype = np.int32 if int32_wraparound else np.int64
    h = np.asarray(hashes).astype(dtype)
    with np.errstate(over="ignore"):
        a = np.remainder(h * dtype(HASH_MULT) + dtype(BUCKET_ADD), dtype(num_buckets))
    return a.astype(np.int64)


def addresses(tokens: np.ndarray, order: int, num_buckets: int, *, int32_wraparound: bool = False) -> np.ndarray:
    """Bucket address of every position: ``[..., T]`` int64 in ``[0, B)``."""
    h = context_hash(tokens, order, int32_wraparound=int32_wraparound)
    return bucket_of(h, num_buckets, int32_wraparound=int32_wraparound)
