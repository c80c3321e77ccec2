"""Argument checks shared by the Triton and pure-torch implementations, and the bucket hash."""

from __future__ import annotations

import torch

from pcaf_core.hashing import BUCKET_ADD, HASH_MULT

#: Overflow policies these kernels implement (docs/DESIGN.md §3.2). ``topk_score`` needs the selection
#: scores and is handled by the torch routing module, not by an address-only kernel.
POLICIES: tuple[str, ...] = ("recent", "first")


def check_policy(policy: str) -> None:
    """Raise ``ValueError`` unless ``policy`` is one of :data:`POLICIES`."""
    if policy not in POLICIES:
        raise ValueError(
            f"candidate policy {policy!r} is not supported by the bucket kernels: expected one of "
            f"{list(POLICIES)} (topk_score ranks by score and is routed in backends/torch/routing.py)"
        )


def check_top_k(top_k: int) -> None:
    """Raise ``ValueError`` unless ``top_k >= 1``."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")


def validate_addresses(addresses: torch.Tensor, *, min_len: int = 1) -> None:
    """Raise unless ``addresses`` is a ``[B, T]`` integer tensor with ``T >= min_len`` (metadata only, so
    it is free under tracing)."""
    if addresses.dim() != 2:
        raise ValueError(f"addresses must be [B, T], got shape {tuple(addresses.shape)}")
    if addresses.dtype.is_floating_point or addresses.dtype.is_complex or addresses.dtype == torch.bool:
        raise TypeError(f"addresses must be an integer tensor, got {addresses.dtype}")
    if addresses.shape[1] < min_len:
        raise ValueError(f"addresses need at least {min_len} position(s), got T={addresses.shape[1]}")


def check_addresses(addresses: torch.Tensor, *, min_len: int = 1) -> torch.Tensor:
    """Validate ``[B, T]`` integer addresses and return them as contiguous int64.

    Args:
        addresses: ``[B, T]`` integer tensor (bucket ids or context hashes).
        min_len: smallest allowed T.
    Returns:
        The same values, ``int64``, contiguous, on the same device.
    """
    validate_addresses(addresses, min_len=min_len)
    return addresses.to(torch.int64).contiguous()


def check_num_buckets(num_buckets: int | None) -> None:
    """Raise ``ValueError`` unless ``num_buckets`` is ``None`` or ``>= 1``."""
    if num_buckets is not None and num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")


def bucket_of(hashes: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The spec's second hash, ``(h·1_000_003 + 97_531) mod num_buckets``, in int64.

    Args:
        hashes: ``[...]`` non-negative int64 context hashes (``pcaf_core.hashing.context_hash`` values lie
            in ``[0, 2^31 - 1)``, so the product stays below 2^51 and cannot overflow).
        num_buckets: B >= 1.
    Returns:
        ``[...]`` int64 bucket ids in ``[0, num_buckets)``.
    """
    return torch.remainder(hashes.to(torch.int64) * HASH_MULT + BUCKET_ADD, num_buckets)


def check_rows(name: str, floats: tuple[torch.Tensor, ...], rows: torch.Tensor, *others: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor of ``floats`` is contiguous float32 shaped like ``rows`` and every
    one of ``others`` (ids, masks) is contiguous: the inputs of the memory read's row kernels."""
    for t in floats:
        if t.dtype != torch.float32 or t.shape != rows.shape or not t.is_contiguous():
            raise ValueError(f"{name} takes contiguous float32 rows of shape {tuple(rows.shape)}, got {t.dtype} of "
                             f"shape {tuple(t.shape)} and strides {t.stride()}")
    for t in others:
        if not t.is_contiguous():
            raise ValueError(f"{name} takes contiguous ids and masks, got shape {tuple(t.shape)} with strides "
                             f"{t.stride()}")
