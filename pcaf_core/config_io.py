"""A :class:`~pcaf_core.config.RunConfig` as plain data: dicts, hashes, files.

Used by the loop (checkpoints record the config and its hash), by launched workers (``torchrun``,
multi-host JAX) that receive the resolved config as a file, and by the app.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pcaf_core import results
from pcaf_core.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    MemoryConfig,
    ModelConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
)
from pcaf_core.run_identity import BATCHING_FIELDS, location_fields

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "memory": MemoryConfig,
    "profile": ProfileConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
}
RUN_SECTIONS = tuple(SECTIONS)



def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of ``cfg`` (JSON-compatible)."""
    return asdict(cfg)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Inverse of :func:`config_to_dict`; unknown sections or keys raise (the dataclasses reject them)."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config dict has unknown sections {unknown}; expected {sorted(SECTIONS)}")
    try:
        return RunConfig(**{name: cls(**data.get(name, {})) for name, cls in SECTIONS.items()})
    except TypeError as exc:  # an unknown key inside a section
        raise ConfigError(f"config dict does not match the RunConfig schema: {exc}") from exc


def hashable_config(cfg: RunConfig) -> dict[str, Any]:
    """:func:`config_to_dict` without where the corpus and its cache live (a run may resume after its data
    moved; :func:`pcaf_core.run_identity.location_fields`) and the batching fields
    (:data:`pcaf_core.run_identity.BATCHING_FIELDS`)."""
    data = config_to_dict(cfg)
    for section, name in (f.split(".") for f in (*location_fields(cfg.data.name), *BATCHING_FIELDS)):
        data[section].pop(name, None)
    return data


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything in ``cfg`` that affects the computation (file locations excluded)."""
    return results.hash_config(hashable_config(cfg))


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``section.key: old -> new`` for every differing field of two :func:`hashable_config` dicts."""
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                out.append(f"{section}.{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out


def read_config(path: str | os.PathLike[str]) -> RunConfig:
    """The :class:`RunConfig` stored in ``path``: JSON (:func:`config_to_dict`), or YAML with the same
    sections (e.g. the ``config.yaml`` the Hydra app writes into a run directory; its other sections,
    labels, scale and backend, are ignored)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a config mapping")
    return config_from_dict({k: v for k, v in data.items() if k in SECTIONS})
