"""Structured schema of the Hydra app: the spec's RunConfig sections plus what the app itself needs.

Registered in Hydra's ConfigStore so that composition checks every key and type against the
dataclasses of :mod:`pcaf_core.config` (an unknown key or a wrong type fails before any training).
Profiles are registered from :data:`pcaf_core.profiles.PROFILES`, their single source of truth.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pcaf_core.config import RunConfig
from pcaf_core.profiles import PROFILES


@dataclass
class BackendConfig:
    """Which backend trains the run. ``device``: ``auto`` (the accelerator when present), ``cpu``, or the
    accelerator: ``cuda`` (torch: also ``cuda:<index>``; JAX: also ``gpu`` or ``tpu``), checked by
    :func:`experiments.app.check_device`."""

    name: str = "torch"
    device: str = "auto"
    world_size: int = 1  # > 1: data-parallel processes (torch: gloo on CPU, NCCL on GPUs)


@dataclass
class ScaleConfig:
    """How a row's paper settings are shrunk. Applied by :mod:`experiments.app` after composition.

    ``corpus``: the corpus the scale trains every table on in place of the table's own, as dotted ``data.*``
    keys plus a ``note`` saying so; a corpus chosen on the command line (``data=NAME`` or ``data.name=NAME``)
    replaces the whole block, note included. ``common``: dotted-key overrides for every row; ``tables``: per-table
    dotted-key overrides (applied after ``common``); ``notes``: per-table free-text deviations written into every
    output; ``only_tables``: the tables the scale is defined for (empty: every table; any other table is
    refused). Every changed value is recorded as a deviation from the paper's settings.
    """

    name: str = "paper"
    only_tables: list[str] = field(default_factory=list)
    corpus: dict[str, Any] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExperimentConfig(RunConfig):
    """One run: a paper row (``table``/``row``) at a scale on a backend; the spec's sections plus
    what the app needs."""

    backend: BackendConfig = field(default_factory=BackendConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    table: str = "adhoc"
    row: str = "adhoc"
    seed_runs: list[dict[str, Any]] = field(default_factory=list)  # one run per entry (dotted overrides)
    notes: list[str] = field(default_factory=list)  # the row's own remarks (e.g. budget not in the paper)
    output_root: str = "outputs"
    run_dir: str | None = None  # set by the app; a fixed path here resumes that run
    restart_damaged: bool = False  # every checkpoint of run_dir damaged: start over (they are kept, set aside)
    restart: bool = False  # with run_dir: train this command in a new run directory, run_dir kept as it is
    confirm: bool = False  # start a command predicted to train longer than experiments.long_run.LONG_RUN_HOURS


PROCESS_TOKEN = uuid.uuid4().hex[:6]
"""Random per process: ``${pcaf_process_token:}`` in the multirun directory name, so two sweeps started in the
same second get different directories (every job of one sweep runs in the process that launched it)."""


def gpus_for(device: str, world_size: int) -> int:
    """GPUs a run asks for: none for ``backend.device=cpu``; else one per data-parallel process
    (``backend.world_size``; JAX's ``0``, every device, asks for one)."""
    return 0 if str(device) == "cpu" else max(1, int(world_size))


def register() -> None:
    """Register the schema, the profiles and the ``pcaf_process_token`` and ``pcaf_gpus`` resolvers
    (idempotent; the config store once per process: storing builds each structured config again, 13% of a
    composition, which every composition of the table driver and the app calls this for)."""
    if not OmegaConf.has_resolver("pcaf_process_token"):
        OmegaConf.register_new_resolver("pcaf_process_token", lambda: PROCESS_TOKEN)
    if not OmegaConf.has_resolver("pcaf_gpus"):  # the launchers' GPUs a job (conf/hydra/launcher/*.yaml)
        OmegaConf.register_new_resolver("pcaf_gpus", gpus_for)
    cs = ConfigStore.instance()
    # Hydra reads a deep copy of a stored node, never the node itself: what was stored once stays as stored.
    stored = cs.repo.get("profile", {})
    if "experiment_schema.yaml" in cs.repo and all(f"{name}.yaml" in stored for name in PROFILES):
        return
    cs.store(name="experiment_schema", node=ExperimentConfig)
    for name, prof in PROFILES.items():
        cs.store(group="profile", name=name, node=prof)
