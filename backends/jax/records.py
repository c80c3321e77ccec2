"""Successor records and queries for the two training modes, in jnp (mirrors :mod:`pcaf_core.records`).

A record at position s is (address a_s, key k_s, value v_s = x_{s+1}); a query at position t reads
records s < t only. NT: one query at T-1, recency ``s / (T-2)``; AR: every position is a query,
recency ``s / (T-1)``. Recency is the absolute position in the window, independent of the query.

``seq_len`` and ``mode`` are static Python values, so positions and recency are compile-time
constants under ``jax.jit``; they are taken from the spec itself and only cast here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pcaf_core import records as spec_records
from pcaf_core.config import MODES


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`pcaf_core.config.MODES`."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown: expected one of {list(MODES)}")


def query_positions(seq_len: int, mode: str) -> jax.Array:
    """``[Q]`` int32 query positions: ``[T-1]`` in NT, ``0..T-1`` in AR."""
    check_mode(mode)
    return jnp.asarray(spec_records.query_positions(seq_len, mode).astype(np.int32))


def query_rows(x: jax.Array, mode: str) -> jax.Array:
    """See :func:`pcaf_core.records.query_rows`: a static slice (``mode`` is static)."""
    check_mode(mode)
    return x[:, -1:] if mode == "nt" else x


def recency(seq_len: int, mode: str, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``[T]`` recency of every position as a record, computed in float64 (NumPy) and cast to ``dtype``."""
    check_mode(mode)
    return jnp.asarray(spec_records.recency(seq_len, mode), dtype=dtype)


def successor_values(tokens: jax.Array) -> jax.Array:
    """``[B, T]`` value of each record: ``v_s = x_{s+1}``, 0 for the last position."""
    x = jnp.asarray(tokens)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, 1)]
    return jnp.pad(x[..., 1:], pad)
