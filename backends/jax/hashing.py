"""The address function in jnp, bit for bit equal to :mod:`pcaf_core.hashing`.

The backend runs with 32-bit integers (``jax_enable_x64`` off), so the normative int64 form cannot be
written as in the spec. Every intermediate of the spec's formula is below 2^51, and the result only
needs ``(x * 1_000_003 + c) mod m``, so it is computed exactly in uint32 by a modular multiply
(double-and-add over the bits of the constant, every value below 2m <= 2^32). The int32 wrap-around
variant (the reference JAX code) is plain int32 arithmetic: XLA wraps signed overflow silently, like
the reference, and ``jnp.remainder`` takes the sign of the divisor, like ``np.remainder``.

All functions take static Python ``order`` / ``num_buckets`` / ``int32_wraparound`` and trace under
``jax.jit``. Token ids are expected in ``[0, 2^31)``; outputs are int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pcaf_core.hashing import BUCKET_ADD, HASH_ADD, HASH_MOD, HASH_MULT

_TWO_31 = 1 << 31
_TWO_32 = 1 << 32


def _mulmod_const(x: jax.Array, const: int, m: int) -> jax.Array:
    """``(x * const) mod m`` exactly, for uint32 ``x < m <= 2^31`` and a Python int ``const >= 0``.

    Double-and-add from the top bit of ``const``: ``r`` stays below ``m``, so ``2r`` and ``r + x`` stay
    below ``2^32`` and never wrap.
    """
    mu = jnp.uint32(m)
    r = jnp.zeros_like(x)
    for bit in bin(const)[2:]:
        r = (r + r) % mu
        if bit == "1":
            r = (r + x) % mu
    return r


def _to_mod(x: jax.Array, m: int) -> jax.Array:
    """``x mod m`` (floor mod, result in ``[0, m)``) of int32 ``x`` as uint32, for ``m <= 2^31``."""
    u = jnp.asarray(x, jnp.int32).astype(jnp.uint32)  # two's complement: u = x + 2^32 where x < 0
    r = u % jnp.uint32(m)
    # For x < 0, x mod m = (u - 2^32) mod m = (u mod m + (m - 2^32 mod m)) mod m; the sum is below 2m.
    fix = (m - _TWO_32 % m) % m
    return jnp.where(x < 0, (r + jnp.uint32(fix)) % jnp.uint32(m), r)


def _affine_mod(x: jax.Array, mult: int, add: int, m: int) -> jax.Array:
    """Exact ``(x * mult + add) mod m`` of int32 ``x`` (floor mod, as ``np.remainder`` in int64), as uint32."""
    r = _mulmod_const(_to_mod(x, m), mult, m)
    return (r + jnp.uint32(add % m)) % jnp.uint32(m)


def _shifted(x: jax.Array, shift: int) -> jax.Array:
    """``x`` moved ``shift`` positions right along the last axis, zero-filled on the left."""
    T = x.shape[-1]
    if shift == 0:
        return x
    if shift >= T:
        return jnp.zeros_like(x)
    pad = [(0, 0)] * (x.ndim - 1) + [(shift, 0)]
    return jnp.pad(x[..., : T - shift], pad)


def context_hash(tokens: jax.Array, order: int, *, int32_wraparound: bool = False) -> jax.Array:
    """See :func:`pcaf_core.hashing.context_hash`; token ids in ``[0, 2^31)``, int32 hashes."""
    if order < 1:
        raise ValueError(f"context order must be >= 1, got {order}")
    x = jnp.asarray(tokens).astype(jnp.int32)
    if int32_wraparound:
        h = jnp.zeros_like(x)
        for shift in range(order - 1, -1, -1):
            step = h * jnp.int32(HASH_MULT) + _shifted(x, shift) + jnp.int32(HASH_ADD)
            h = jnp.remainder(step, jnp.int32(HASH_MOD))
        return h
    h = jnp.zeros(x.shape, jnp.uint32)
    for shift in range(order - 1, -1, -1):
        # h < HASH_MOD, so h * HASH_MULT mod HASH_MOD is the modular multiply; the token's addend
        # (v + 97 <= 2^31 + 96) is reduced separately and the sum of two residues stays below 2^32.
        addend = _affine_mod(_shifted(x, shift), 1, HASH_ADD, HASH_MOD)
        h = (_mulmod_const(h, HASH_MULT, HASH_MOD) + addend) % jnp.uint32(HASH_MOD)
    return h.astype(jnp.int32)


def bucket_of(hashes: jax.Array, num_buckets: int, *, int32_wraparound: bool = False) -> jax.Array:
    """See :func:`pcaf_core.hashing.bucket_of`; ``hashes`` in the int32 range (the output of
    :func:`context_hash`), ``num_buckets`` at most 2^31 (the 32-bit backend's limit), int32 buckets."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    h = jnp.asarray(hashes).astype(jnp.int32)
    if int32_wraparound:
        if num_buckets >= _TWO_31:
            raise ValueError(f"num_buckets={num_buckets} does not fit the int32 arithmetic of int32_wraparound")
        return jnp.remainder(h * jnp.int32(HASH_MULT) + jnp.int32(BUCKET_ADD), jnp.int32(num_buckets))
    if num_buckets > _TWO_31:
        raise ValueError(f"num_buckets={num_buckets} exceeds 2^31, the largest the 32-bit JAX backend supports")
    return _affine_mod(h, HASH_MULT, BUCKET_ADD, num_buckets).astype(jnp.int32)


def addresses(tokens: jax.Array, order: int, num_buckets: int, *, int32_wraparound: bool = False) -> jax.Array:
    """See :func:`pcaf_core.hashing.addresses`; int32."""
    h = context_hash(tokens, order, int32_wraparound=int32_wraparound)
    return bucket_of(h, num_buckets, int32_wraparound=int32_wraparound)
