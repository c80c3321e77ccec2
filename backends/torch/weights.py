"""Canonical parameter dict <-> torch modules, and safetensors files of it.

Torch parameter names are the canonical names (:func:`pcaf_core.params.param_shapes`); only layouts
differ: ``nn.Linear`` stores ``[out, in]`` (canonical ``[in, out]``) and the depthwise ``nn.Conv1d``
stores ``[d, 1, k]`` with taps ordered oldest first (canonical ``[k, d]`` indexed by lag, i.e. the taps
reversed). Files hold the canonical dict, so they load into the JAX backend unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pcaf_core.params import check_params
from pcaf_core.weights import FORMAT_TAG, save_canonical
from pcaf_core.weights import load_canonical as load_canonical_file

__all__ = ["FORMAT_TAG", "canonical_shapes", "load_canonical", "load_safetensors", "save_safetensors", "to_canonical"]


def _to_canonical_layout(owner: nn.Module, leaf: str, t: torch.Tensor) -> torch.Tensor:
    if leaf == "weight" and isinstance(owner, nn.Linear):
        return t.T
    if leaf == "weight" and isinstance(owner, nn.Conv1d):
        if t.shape[1] != 1:
            raise ValueError(f"only depthwise Conv1d weights [d, 1, k] have a canonical layout, got {tuple(t.shape)}")
        return t[:, 0, :].flip(-1).T
    return t


def _from_canonical_layout(owner: nn.Module, leaf: str, t: torch.Tensor) -> torch.Tensor:
    if leaf == "weight" and isinstance(owner, nn.Linear):
        return t.T
    if leaf == "weight" and isinstance(owner, nn.Conv1d):
        return t.T.flip(-1)[:, None, :]
    return t


def _owned_parameters(module: nn.Module):
    modules = dict(module.named_modules())
    for name, p in module.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        yield name, modules[owner_name], leaf, p


def canonical_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The canonical ``name -> shape`` of ``module``: the model's configured shapes when it knows them
    (``module.canonical_shapes()``), otherwise derived from its parameters."""
    if hasattr(module, "canonical_shapes"):
        return dict(module.canonical_shapes())
    return {name: tuple(_to_canonical_layout(owner, leaf, p.detach()).shape)
            for name, owner, leaf, p in _owned_parameters(module)}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16; float32 holds it exactly
        t = t.to(torch.float32)
    return np.array(t.numpy(), order="C", copy=True)  # ascontiguousarray would make 0-d arrays 1-d


def to_canonical(module: nn.Module) -> dict[str, np.ndarray]:
    """Canonical ``name -> np.ndarray`` (canonical layouts, parameter dtypes, CPU copies), in the canonical
    order. Raises ValueError if the module's parameters do not match its configured canonical shapes."""
    got = {name: _to_numpy(_to_canonical_layout(owner, leaf, p.detach()))
           for name, owner, leaf, p in _owned_parameters(module)}
    expected = canonical_shapes(module)
    check_params(got, expected)
    return {name: got[name] for name in expected}


def _as_tensor(value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.tensor(np.asarray(value))


def load_canonical(module: nn.Module, params: Mapping[str, object]) -> nn.Module:
    """Copy a canonical dict (NumPy arrays or tensors) into ``module`` in place and return it.

    Raises ValueError naming every missing, unexpected or mis-shaped key (nothing is copied then).
    Values are cast to each parameter's dtype and device.
    """
    check_params(dict(params), canonical_shapes(module))
    with torch.no_grad():
        for name, owner, leaf, p in _owned_parameters(module):
            src = _from_canonical_layout(owner, leaf, _as_tensor(params[name]))
            p.copy_(src.to(dtype=p.dtype, device=p.device))
    return module


def save_safetensors(path: str | os.PathLike, module: nn.Module, metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``to_canonical(module)`` to ``path`` (atomically, with the canonical format tag:
    :func:`pcaf_core.weights.save_canonical`). Returns the path."""
    return save_canonical(path, to_canonical(module), metadata)


def load_safetensors(path: str | os.PathLike, module: nn.Module) -> nn.Module:
    """Load a canonical safetensors file into ``module`` and return it. The file's format tag, dtypes,
    finiteness and keys/shapes are checked first (:func:`pcaf_core.weights.load_canonical`)."""
    return load_canonical(module, load_canonical_file(path, canonical_shapes(module)))
