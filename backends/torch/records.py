"""Successor records and queries for the two training modes, in torch (mirrors :mod:`pcaf_core.records`).

A record at position s is (address a_s, key k_s, value v_s = x_{s+1}); a query at position t reads
records s < t only. NT: one query at T-1, recency ``s / (T-2)``; AR: every position is a query,
recency ``s / (T-1)``. Recency is the absolute position in the window, independent of the query.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pcaf_core.config import MODES


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown: expected one of {list(MODES)}")


CONSTANTS_KEPT = 64
"""Most step constants :func:`step_constant` keeps at once (a few window lengths, modes and dtypes in a run)."""

_constants: dict[tuple, torch.Tensor] = {}


def step_constant(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, made once per ``key`` and handed out again by later eager calls: each step would otherwise make
    its positions and recencies again, a few kernel launches each that an eager GPU step waits on. Callers only
    read the tensor. Made afresh under ``torch.compile`` (the graph holds its own; a tensor made while a CUDA
    graph is captured lives in the graph's pool) and under inference mode (an inference tensor cannot be saved
    for a later step's backward pass)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return make()
    t = _constants.get(key)
    if t is None:
        if len(_constants) >= CONSTANTS_KEPT:
            _constants.clear()
        t = _constants[key] = make()
    return t


def query_positions(seq_len: int, mode: str, device: torch.device | str | None = None) -> torch.Tensor:
    """``[Q]`` int64 query positions: ``[T-1]`` in NT, ``0..T-1`` in AR (a :func:`step_constant`)."""
    check_mode(mode)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if mode == "nt":
        # A fill, not torch.tensor: a host-to-device copy would make every step wait on the device.
        return step_constant(("qpos", seq_len, mode, device),
                             lambda: torch.full((1,), seq_len - 1, dtype=torch.int64, device=device))
    return step_constant(("qpos", seq_len, mode, device),
                         lambda: torch.arange(seq_len, dtype=torch.int64, device=device))


def query_rows(x: torch.Tensor, mode: str) -> torch.Tensor:
    """See :func:`pcaf_core.records.query_rows`; a view. Not ``x[:, query_positions(...)]``: indexing with a
    position tensor copies the rows, and its backward is an accumulating ``index_put_`` that CUDA runs as a sort
    under deterministic algorithms (a sort and a scatter kernel per use, every step)."""
    check_mode(mode)
    return x[:, -1:] if mode == "nt" else x


def recency(
    seq_len: int, mode: str, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[T]`` recency of every position as a record, computed in float64 and cast to ``dtype`` (a
    :func:`step_constant`)."""
    check_mode(mode)
    denom = max(seq_len - 2, 1) if mode == "nt" else max(seq_len - 1, 1)
    device = torch.device(device) if device is not None else torch.get_default_device()
    return step_constant(("recency", seq_len, mode, dtype, device),
                         lambda: (torch.arange(seq_len, dtype=torch.float64, device=device) / denom).to(dtype))


def successor_values(tokens: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` value of each record: ``v_s = x_{s+1}``, 0 for the last position (one pad: one kernel where a zero
    fill and a copy were two)."""
    return torch.nn.functional.pad(tokens[..., 1:], (0, 1))
