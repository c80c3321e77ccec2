"""The address function (docs/REFERENCE_CODE.md §2.1)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcaf_core.hashing import HASH_MOD, addresses, bucket_of, context_hash


def python_hash(tokens: list[int], i: int, n: int, B: int) -> int:
    h = 0
    for shift in range(n - 1, -1, -1):
        v = tokens[i - shift] if i - shift >= 0 else 0
        h = (h * 1_000_003 + v + 97) % HASH_MOD
    return (h * 1_000_003 + 97_531) % B


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=20), st.integers(1, 4), st.integers(1, 40_000))
def test_int64_addresses_match_the_formula(tokens, n, B):
    got = addresses(np.array([tokens]), n, B)[0]
    assert got.tolist() == [python_hash(tokens, i, n, B) for i in range(len(tokens))]


def test_order_one_with_enough_buckets_is_a_bijection():
    V = 32_000
    a = addresses(np.arange(V)[None], 1, 32_768)[0]
    assert len(np.unique(a)) == V
    a20 = addresses(np.arange(20_000)[None], 1, 131_072)[0]
    assert len(np.unique(a20)) == 20_000


def test_int32_wraparound_equals_int64_for_order_one_power_of_two():
    toks = np.random.default_rng(0).integers(0, 32_000, (3, 50))
    for B in (1024, 8192, 32_768):
        assert np.array_equal(addresses(toks, 1, B), addresses(toks, 1, B, int32_wraparound=True))


def test_int32_wraparound_differs_for_higher_order():
    toks = np.random.default_rng(1).integers(0, 32_000, (1, 200))
    h64 = context_hash(toks, 2)
    h32 = context_hash(toks, 2, int32_wraparound=True)
    assert not np.array_equal(h64, h32)
    assert (h32 >= 0).all() and (h32 < HASH_MOD).all()


def test_collisions_with_few_buckets_are_exactly_the_congruent_tokens():
    toks = np.arange(3, 20_000)
    a = bucket_of(toks + 97, 8192)
    b = addresses(toks[None], 1, 8192)[0]
    assert np.array_equal(a, b)
    # 1,000,003 is odd, so (x+97)·1,000,003 + 97,531 mod 2^13 is a bijection of x mod 2^13.
    same = (toks[:, None] % 8192) == (toks[None, :50] % 8192)
    assert np.array_equal(same, b[:, None] == b[None, :50])
