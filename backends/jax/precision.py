"""``train.matmul_precision`` on JAX (docs/SPEC.md §9 says what each value computes).

The setting is JAX's default matmul precision (``jax.default_matmul_precision`` of the same name:
``highest``, ``high``, ``default``) around every traced step, so it reaches each product that does not name
its own precision: the model's. Routing's scores name ``Precision.HIGHEST``.
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
