"""Canonical weights on disk: one safetensors file of the canonical parameter dict, shared by every backend.

A file holds ``name -> array`` in the canonical names and layouts of :func:`pcaf_core.params.param_shapes`
(Linear ``[in, out]``, conv ``[k, d]`` by lag, ρ 0-d) and carries the metadata tag
``format = pcaf-canonical``, so a file written by the torch backend loads into the JAX backend or the
NumPy reference unchanged, and a foreign safetensors file (another project's checkpoint, a torch
``state_dict`` dump) is refused with a message instead of being loaded as garbage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from pcaf_core.fsutil import atomic_path
from pcaf_core.params import check_params

FORMAT_KEY = "format"
FORMAT_VALUE = "pcaf-canonical"
FORMAT_TAG = {FORMAT_KEY: FORMAT_VALUE}


class WeightsError(ValueError):
    """A weights file cannot be used as canonical PCAF weights; the message says why and what to do."""


def save_canonical(
    path: str | os.PathLike[str], params: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``params`` (canonical names, NumPy arrays) to ``path`` atomically with the format tag.

    ``metadata`` adds string entries to the file's header (the format tag always wins). Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {str(k): np.array(v, order="C", copy=True) for k, v in params.items()}
    meta = {**{str(k): str(v) for k, v in (metadata or {}).items()}, **FORMAT_TAG}
    with atomic_path(path, size_hint=sum(int(t.nbytes) for t in tensors.values())) as tmp:
        safetensors.numpy.save_file(tensors, str(tmp), metadata=meta)
    return path


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The header metadata of a safetensors file (empty when it has none)."""
    with safetensors.safe_open(str(path), framework="numpy") as fh:
        return dict(fh.metadata() or {})


def load_canonical(
    path: str | os.PathLike[str], expected: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray]:
    """Read a canonical weights file written by :func:`save_canonical` (any backend).

    Checks, each failing with one line that names the file: the format tag, floating-point dtypes, finite
    values, and with ``expected`` (``pcaf_core.params.param_shapes(...)``) the exact key set and shapes.
    Returns ``name -> np.ndarray`` in ``expected``'s order when given.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such weights file")
    try:
        meta = read_metadata(path)
        params = safetensors.numpy.load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged header
        raise WeightsError(f"{path} is not a readable safetensors file ({exc}); re-create it from its run") from exc
    if meta.get(FORMAT_KEY) != FORMAT_VALUE:
        raise WeightsError(
            f"{path} has format tag {meta.get(FORMAT_KEY)!r}, not {FORMAT_VALUE!r}: it was not written by this suite; "
            "convert it with backends.<torch|jax>.weights (canonical names and layouts) first"
        )
    bad_dtype = sorted(f"{k}: {v.dtype}" for k, v in params.items() if not np.issubdtype(v.dtype, np.floating))
    if bad_dtype:
        raise WeightsError(f"{path} holds non-float parameters ({', '.join(bad_dtype[:5])}); canonical weights are "
                           "float arrays: the file is damaged or not a weights file")
    bad_value = sorted(k for k, v in params.items() if not np.all(np.isfinite(v)))
    if bad_value:
        raise WeightsError(f"{path} holds NaN or infinite values in {bad_value[:5]}; the run that wrote it had "
                           "diverged: use an earlier checkpoint")
    if expected is None:
        return params
    try:
        check_params(params, dict(expected))
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    return {name: params[name] for name in expected}
