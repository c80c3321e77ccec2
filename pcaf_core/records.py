"""Successor records and queries for the two training modes (docs/REFERENCE_CODE.md §2.2).

A record at position s is (address a_s, key k_s, value v_s = x_{s+1}). A query at position t may read
records s < t only (strict causality): the record at t itself holds the token being predicted.

* Next-token (NT) mode: one query, the last position t = T-1; records s = 0..T-2;
  recency r_s = s / (T-2) (``linspace(0, 1, T-1)``).
* Full-autoregressive (AR) mode: every position t is a query; records s = 0..T-1 with the value at
  s = T-1 padded with 0 (never readable causally); recency r_s = s / (T-1) (``linspace(0, 1, T)``).

In both modes recency is the absolute position in the window, independent of the query.
"""

from __future__ import annotations

import numpy as np

from pcaf_core.config import MODES


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown: expected one of {list(MODES)}")


def query_positions(seq_len: int, mode: str) -> np.ndarray:
    """``[Q]`` int64 query positions: ``[T-1]`` in NT, ``0..T-1`` in AR."""
    _check_mode(mode)
    return np.array([seq_len - 1]) if mode == "nt" else np.arange(seq_len)


def query_rows(x: np.ndarray, mode: str) -> np.ndarray:
    """``x [B, T, ...]`` at the :func:`query_positions`: ``[B, 1, ...]`` (row T-1) in NT, ``x`` itself in AR.
    The backends take it as a view (a slice, no gather), so its gradient is no scatter either."""
    _check_mode(mode)
    return x[:, -1:] if mode == "nt" else x


def recency(seq_len: int, mode: str) -> np.ndarray:
    """``[T]`` float64 recency feature of every position as a record (NT: position T-1 gets 1 + 1/(T-2),
    but it is never a record)."""
    _check_mode(mode)
    denom = max(seq_len - 2, 1) if mode == "nt" else max(seq_len - 1, 1)
    return np.arange(seq_len, dtype=np.float64) / denom


def successor_values(tokens: np.ndarray) -> np.ndarray:
    """``[B, T]`` value of each record: ``v_s = x_{s+1}``, 0 for the last position."""
    x = np.asarray(tokens)
    v = np.zeros_like(x)
    v[..., :-1] = x[..., 1:]
    return v
