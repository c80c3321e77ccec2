"""Canonical parameter dict <-> linen variables, and safetensors files of it (mirrors
:mod:`backends.torch.weights`).

The linen modules of :mod:`backends.jax.models` store every parameter in its canonical layout (Linear
``[in, out]``, conv ``[k, d]`` by lag, ρ 0-d) under its canonical name split at the dots, with list
submodules named ``blocks_0`` where the canonical name says ``blocks.0``. So the conversion only nests
and flattens names: ``blocks.0.attn.qkv.weight`` <-> ``{"blocks_0": {"attn": {"qkv": {"weight": ...}}}}``.
Files hold the canonical dict (:mod:`pcaf_core.weights`), so they load into the torch backend unchanged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pcaf_core.params import check_params
from pcaf_core.weights import FORMAT_TAG, save_canonical
from pcaf_core.weights import load_canonical as load_canonical_file

__all__ = ["FORMAT_TAG", "load_safetensors", "save_safetensors", "to_canonical", "to_variables"]

_LIST_ITEM = re.compile(r"^(.+)_(\d+)$")


def _tree_path(name: str) -> list[str]:
    """Canonical name -> linen path: a numeric segment joins the previous one (``blocks.0`` -> ``blocks_0``)."""
    path: list[str] = []
    for part in name.split("."):
        if part.isdigit():
            if not path:
                raise ValueError(f"canonical name {name!r} starts with a list index")
            path[-1] = f"{path[-1]}_{part}"
        else:
            path.append(part)
    return path


def _canonical_name(path: list[str]) -> str:
    """Linen path -> canonical name (``blocks_0`` -> ``blocks.0``)."""
    parts: list[str] = []
    for key in path:
        m = _LIST_ITEM.match(key)
        parts.extend((m.group(1), m.group(2)) if m else (key,))
    return ".".join(parts)


def to_variables(params: Mapping[str, Any], dtype: Any = None) -> dict[str, dict[str, Any]]:
    """Canonical flat ``name -> array`` (NumPy or JAX) -> ``{"params": nested tree}`` for ``module.apply``.

    Values become JAX arrays of their own dtype, or of ``dtype`` when given (e.g. float64 under x64).
    """
    tree: dict[str, Any] = {}
    for name, value in params.items():
        *parents, leaf = _tree_path(name)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"canonical name {name!r} nests under a parameter")
        node[leaf] = jnp.asarray(value, dtype=dtype)
    return {"params": tree}


def _to_numpy(x: Any) -> np.ndarray:
    a = np.asarray(jax.device_get(x))
    if a.dtype == jnp.bfloat16:  # safetensors.numpy has no bfloat16; float32 holds it exactly
        a = a.astype(np.float32)
    return np.array(a, order="C", copy=True)  # ascontiguousarray would make 0-d arrays 1-d


def to_canonical(params: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]] | None = None
                 ) -> dict[str, np.ndarray]:
    """Nested linen parameter tree (or ``{"params": tree}``) -> canonical ``name -> np.ndarray`` host copies.

    With ``expected`` (``pcaf_core.params.param_shapes(...)``) the keys and shapes are checked (ValueError
    naming every missing, unexpected or mis-shaped key) and the result is in the canonical order;
    otherwise it is in the tree's (sorted) order.
    """
    if set(params) == {"params"}:
        params = params["params"]
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    out: dict[str, np.ndarray] = {}
    for path, value in leaves:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out[_canonical_name(keys)] = _to_numpy(value)
    if expected is None:
        return out
    check_params(out, dict(expected))
    return {name: out[name] for name in expected}


def save_safetensors(path: str | os.PathLike[str], params: Mapping[str, Any],
                     metadata: Mapping[str, str] | None = None,
                     expected: Mapping[str, tuple[int, ...]] | None = None) -> Path:
    """Write ``to_canonical(params, expected)`` to ``path`` (atomically, with the canonical format tag:
    :func:`pcaf_core.weights.save_canonical`). ``params`` is the nested tree (or ``{"params": tree}``)."""
    return save_canonical(path, to_canonical(params, expected), metadata)


def load_safetensors(path: str | os.PathLike[str], expected: Mapping[str, tuple[int, ...]],
                     dtype: Any = None) -> dict[str, Any]:
    """Load a canonical safetensors file (any backend) as the nested linen parameter tree (the value of
    ``to_variables(...)["params"]``). The format tag, dtypes, finiteness and the exact keys/shapes of
    ``expected`` are checked first (:func:`pcaf_core.weights.load_canonical`, ValueError naming them)."""
    return to_variables(load_canonical_file(path, dict(expected)), dtype)["params"]
