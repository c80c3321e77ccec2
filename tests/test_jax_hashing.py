"""JAX hashing and record helpers vs the NumPy spec: bit-for-bit addresses in 32-bit JAX.

The normative int64 hash is computed without ``jax_enable_x64`` by an exact uint32 modular multiply;
the int32 wrap-around form is plain int32 arithmetic. Both must equal :mod:`pcaf_core.hashing` for
every context order and bucket count, including the extremes of the int32 range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.jax import hashing as jhash
from backends.jax import records as jrec
from pcaf_core import hashing, records

BUCKETS = [1, 7, 8192, 32768, 1_000_003, 2**31 - 1, 2**31]


def _tokens(seed: int) -> np.ndarray:
    """``[3, 37]`` ids up to 2^31 - 1, the int32 extremes in front (one shape: one compilation)."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 40000, (3, 37))
    tok[0, :6] = [0, 2**31 - 1, 2**31 - 2, 123456789, 1, 2**30]
    tok[1] = rng.integers(0, 2**31, 37)  # large ids everywhere: every intermediate near its bound
    return tok


@pytest.mark.parametrize("order", [1, 2, 3, 5])
@pytest.mark.parametrize("int32", [False, True])
def test_addresses_match_spec_bit_for_bit(order: int, int32: bool) -> None:
    tok = _tokens(order * 10 + int32)
    h = jhash.context_hash(jnp.asarray(tok, jnp.int32), order, int32_wraparound=int32)
    assert h.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(h), hashing.context_hash(tok, order, int32_wraparound=int32))
    for num_buckets in BUCKETS:
        if int32 and num_buckets >= 2**31:
            continue  # rejected, see test_bucket_count_limits
        got = jhash.addresses(jnp.asarray(tok, jnp.int32), order, num_buckets, int32_wraparound=int32)
        want = hashing.addresses(tok, order, num_buckets, int32_wraparound=int32)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"B={num_buckets}")


def test_int32_wraparound_differs_from_int64_for_order_two() -> None:
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 40, (1, 64)), jnp.int32)
    a32 = np.asarray(jhash.addresses(tok, 2, 7, int32_wraparound=True))
    a64 = np.asarray(jhash.addresses(tok, 2, 7, int32_wraparound=False))
    assert (a32 != a64).any()  # the switch matters, so the exact matches are informative


def test_bucket_of_arbitrary_int32_hashes() -> None:
    # bucket_of on its own, over the whole int32 range (negative values exercise the floor mod).
    h = np.random.default_rng(1).integers(-(2**31), 2**31, 4096)
    h[:4] = [-(2**31), -1, 0, 2**31 - 1]
    for num_buckets in BUCKETS:
        got = np.asarray(jhash.bucket_of(jnp.asarray(h, jnp.int32), num_buckets))
        np.testing.assert_array_equal(got, hashing.bucket_of(h, num_buckets), err_msg=f"B={num_buckets}")


def test_addresses_under_jit_and_x64() -> None:
    tok = _tokens(3)
    fn = jax.jit(jhash.addresses, static_argnums=(1, 2), static_argnames=("int32_wraparound",))
    for int32 in (False, True):
        got = fn(jnp.asarray(tok, jnp.int32), 3, 1_000_003, int32_wraparound=int32)
        np.testing.assert_array_equal(np.asarray(got), hashing.addresses(tok, 3, 1_000_003, int32_wraparound=int32))
    with jax.enable_x64(True):  # int64 inputs are accepted and the result is unchanged
        got = jhash.addresses(jnp.asarray(tok), 2, 2**31)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), hashing.addresses(tok, 2, 2**31))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=8), st.integers(1, 4),
       st.integers(1, 2**31 - 1), st.booleans())
def test_addresses_property(tokens: list[int], order: int, num_buckets: int, int32: bool) -> None:
    tok = np.array([tokens])
    got = np.asarray(jhash.addresses(jnp.asarray(tok, jnp.int32), order, num_buckets, int32_wraparound=int32))
    np.testing.assert_array_equal(got, hashing.addresses(tok, order, num_buckets, int32_wraparound=int32))


def test_hash_argument_errors() -> None:
    z = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="context order"):
        jhash.context_hash(z, 0)
    with pytest.raises(ValueError, match="num_buckets"):
        jhash.bucket_of(z, 0)
    with pytest.raises(ValueError, match="num_buckets"):
        jhash.bucket_of(z, 2**31 + 1)
    with pytest.raises(ValueError, match="int32"):
        jhash.bucket_of(z, 2**31, int32_wraparound=True)


# ----------------------------------------------------------------------------- records


def test_records_helpers_match_spec() -> None:
    for T in (1, 2, 3, 5):
        for mode in ("nt", "ar"):
            q = jrec.query_positions(T, mode)
            assert q.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(q), records.query_positions(T, mode))
            np.testing.assert_allclose(np.asarray(jrec.recency(T, mode)), records.recency(T, mode), rtol=1e-7)
            with jax.enable_x64(True):
                r64 = jrec.recency(T, mode, jnp.float64)
                assert r64.dtype == jnp.float64
                np.testing.assert_array_equal(np.asarray(r64), records.recency(T, mode))
            h = np.arange(2 * T * 3, dtype=np.float32).reshape(2, T, 3)
            np.testing.assert_array_equal(np.asarray(jrec.query_rows(jnp.asarray(h), mode)),
                                          h[:, records.query_positions(T, mode)])
    tok = np.arange(12).reshape(2, 6) * 3 + 1
    got = jrec.successor_values(jnp.asarray(tok, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), records.successor_values(tok))
    with pytest.raises(ValueError, match="mode"):
        jrec.query_positions(3, "bidirectional")
    with pytest.raises(ValueError, match="mode"):
        jrec.check_mode("bidirectional")
