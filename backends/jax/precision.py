"""``train.matmul_precision`` on JAX: what a float32 matrix product computes (docs/SPEC.md §9).

The setting is JAX's default matmul precision (``jax.default_matmul_precision``) around the traced step, so
it reaches every product that does not name its own precision: the model's. Routing's scores name
``Precision.HIGHEST``, so candidates never depend on it.

| setting | JAX precision | TPU | GPU | CPU |
|---|---|---|---|---|
| ``highest`` | ``"highest"`` | float32 (6 bf16 passes) | float32 | float32 |
| ``high`` | ``"high"`` | 3 bf16 passes | TF32 | float32 |
| ``default`` | ``"default"`` | 1 bf16 pass | TF32 | float32 |
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import jax

from pcaf_core.config import MATMUL_PRECISIONS

JAX_SETTINGS = {"highest": "highest", "high": "high", "default": "default"}
"""``train.matmul_precision`` -> the name ``jax.default_matmul_precision`` takes."""
assert set(JAX_SETTINGS) == set(MATMUL_PRECISIONS)


def matmul_precision(precision: str) -> AbstractContextManager[None]:
    """A context in which float32 products are traced at ``precision`` (one of
    :data:`pcaf_core.config.MATMUL_PRECISIONS`). Jitted functions called inside it compile for it (the
    setting is part of their cache key)."""
    if precision not in JAX_SETTINGS:
        raise ValueError(f"matmul precision {precision!r} is unknown: expected one of {list(MATMUL_PRECISIONS)}")
    return jax.default_matmul_precision(JAX_SETTINGS[precision])
