"""The addresses' kernel (``backends.torch.kernels.addresses``) against ATen's form and the spec, bit for bit: context
orders 1-3, int32 and int64 tokens, the int32 wrap-around at its extremes (token ids near 2^31, bucket counts up to
2^31 - 1), windows shorter than the order, rows that do not fill a program; ``hashing.addresses`` through it; the
op's registration and one-line refusals.

The kernel runs compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from backends.torch import hashing
from backends.torch.kernels import addresses as kernel
from backends.torch.kernels.ops import triton_enabled
from pcaf_core import hashing as spec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def aten_addresses(tokens: torch.Tensor, order: int, buckets: int, wrap: bool) -> torch.Tensor:
    """ATen's form of :func:`backends.torch.hashing.addresses`: its context hash, then the bucket."""
    return hashing.bucket_of(hashing.context_hash(tokens, order, int32_wraparound=wrap), buckets,
                             int32_wraparound=wrap)


def test_the_kernel_runs_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("shape, high", [((3, 700), 20_000), ((2, 1), 50), ((1, 2), 5), ((4, 33), 2**31 - 1)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_addresses_equal_atens_and_the_spec(shape, high: int, order: int, wrap: bool, dtype: torch.dtype) -> None:
    """(3, 700): two programs, a partial second; (2, 1) and (1, 2): windows shorter than the order; ids up to
    2^31 - 1, where the int32 arithmetic wraps."""
    gen = torch.Generator().manual_seed(order)
    tokens = torch.randint(0, high, shape, generator=gen, dtype=torch.int64)
    tokens.view(-1)[0] = high - 1
    tokens = tokens.to(dtype).to(DEVICE)
    for buckets in (1, 32_768, 2**31 - 1):
        got = kernel.addresses(tokens, order, buckets, wrap)
        want = aten_addresses(tokens, order, buckets, wrap)
        assert got.dtype == torch.int64 and torch.equal(got, want), (buckets, order, wrap)
        np.testing.assert_array_equal(got.cpu().numpy(), spec.addresses(tokens.cpu().numpy(), order, buckets,
                                                                        int32_wraparound=wrap))


def test_hashing_addresses_takes_the_kernel_where_it_applies() -> None:
    tokens = torch.randint(0, 100, (2, 9), device=DEVICE)
    with mock.patch.object(hashing, "kernels_by_default", return_value=True), \
            mock.patch.object(kernel, "addresses", wraps=kernel.addresses) as called:
        got = hashing.addresses(tokens, 2, 1000)
        assert called.call_count == 1
        assert torch.equal(hashing.addresses(tokens[:, ::2], 2, 1000), aten_addresses(tokens[:, ::2], 2, 1000,
                                                                                      False))
        assert called.call_count == 1  # a strided window takes ATen's form
        with pytest.raises(ValueError, match="context order must be >= 1"):  # the same refusals as before
            hashing.addresses(tokens, 0, 1000)
        with pytest.raises(ValueError, match="does not fit the int32 arithmetic"):
            hashing.addresses(tokens, 1, 2**31, int32_wraparound=True)
    assert torch.equal(got, aten_addresses(tokens, 2, 1000, False))


def test_the_ops_registration_and_refusals() -> None:
    tokens = torch.randint(0, 100, (2, 9), device=DEVICE)
    for wrap in (False, True):
        torch.library.opcheck(torch.ops.pcaf.addresses, (tokens, 2, 1000, wrap))
    for bad in (tokens.float(), tokens[0], tokens.t()):
        with pytest.raises(ValueError, match="contiguous \\[B, T\\] int32/int64 tokens") as err:
            kernel.addresses(bad, 1, 1000, False)
        assert "\n" not in str(err.value)
    # Off Triton the op refuses and names the function that takes ATen's form there.
    with mock.patch.object(kernel, "triton_enabled", return_value=False), \
            pytest.raises(RuntimeError, match="call backends.torch.hashing.addresses") as err:
        kernel.addresses(tokens, 1, 1000, False)
    assert "\n" not in str(err.value)
