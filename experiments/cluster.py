"""What a job asks a cluster for, and the checks a command passes before it submits anything.

Sweeps go to a cluster through the suite's Hydra launchers (``hydra/launcher=local|slurm``: Hydra's submitit
launchers with the suite's reports, :mod:`experiments.sweep_jobs`; their settings in
``experiments/conf/hydra/launcher/``, on top of the plugin's ``submitit_local`` / ``submitit_slurm``); tables
through submitit's Python API, one job per run (:mod:`experiments.cluster_jobs`).
Both read the launcher settings from the same files, and this module turns them, with a run's config, into
the job's resources (:func:`row_resources`):

- GPUs: ``backend.world_size`` on one node (:func:`experiments.schema.gpus_for`), one task: the job's process
  runs the backend's own data-parallel path (torch spawns its DDP ranks; JAX shards over the node's devices).
- Time (Slurm): the row's training time, from a step cost measured with ``make step-cost`` on the cluster's
  device (``--step-cost CSV``) times :data:`MEASURED_MARGIN`, or, without one, from the step's analytic FLOPs
  (:mod:`pcaf_core.flops`) at :data:`GPU_FLOPS` times :data:`FLOP_MARGIN`, plus :data:`START_MINUTES`; capped
  at ``hydra.launcher.timeout_min`` (the partition's limit), a longer run continuing in requeued jobs.
  ``--time-min`` replaces the estimate.
- Memory: ``hydra.launcher.mem_gb`` when set, else :func:`host_memory_gb`.

This module imports neither submitit nor the plugin, so a command can say in one line that the ``cluster``
extra is missing (:func:`require_extra`).
"""

from __future__ import annotations

import csv
import importlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.schema import gpus_for
from pcaf_core.config import ConfigError
from pcaf_core.params import count_params

EXTRA_HINT = "pip install -e '.[cluster]' (or make setup EXTRAS=cluster)"
SUITE_LAUNCHERS = ("local", "slurm")
"""The suite's launcher configs (``experiments/conf/hydra/launcher/<name>.yaml``), ``--launcher`` values."""
PLUGIN_LAUNCHERS = ("submitit_local", "submitit_slurm")

START_MINUTES = 10
"""Added to every estimate: start-up, the token cache, compilation."""
MEASURED_MARGIN = 2.0
"""A measured step cost's training time is multiplied by this: evaluation and checkpoints are not in it."""
GPU_FLOPS = 48e12
"""FLOP/s a FLOP-based estimate assumes: the fp32 GEMM peak measured on an H100 (docs/results/bench_cuda.md)."""
FLOP_MARGIN = 10.0
"""A FLOP-based training time is multiplied by this: the H100 step costs of docs/results/gpu_h100_step_cost.csv
took 0.5-9.3x the time of their analytic FLOPs at :data:`GPU_FLOPS`."""


def require_extra(what: str) -> None:
    """Raise a one-line :class:`ConfigError` naming the ``cluster`` extra when submitit or Hydra's submitit
    launcher plugin cannot be imported; ``what`` is the option that needs them."""
    try:
        for module in ("submitit", "hydra_plugins.hydra_submitit_launcher.submitit_launcher"):
            importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{what} needs the cluster extra (hydra-submitit-launcher and submitit; {exc.name} cannot "
                          f"be imported): {EXTRA_HINT}") from None


def require_slurm(what: str) -> None:
    """Raise a one-line :class:`ConfigError` when Slurm's ``sbatch`` and ``srun`` are not on ``PATH``."""
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise ConfigError(f"{what} submits jobs with Slurm's sbatch, which is not on PATH here: run the command on "
                          "the cluster's login node, or use the local launcher to run the jobs on this machine")


def check_launcher_overrides(overrides: list[str]) -> None:
    """For a command line choosing a submitit launcher (``hydra/launcher=...``): the extra must be installed,
    and Slurm present for a Slurm launcher (one-line :class:`ConfigError` otherwise)."""
    choices = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("hydra/launcher=")]
    choice = choices[-1] if choices else ""
    if choice in SUITE_LAUNCHERS + PLUGIN_LAUNCHERS:
        require_extra(f"hydra/launcher={choice}")
        if choice.endswith("slurm"):
            require_slurm(f"hydra/launcher={choice}")


def launcher_settings(kind: str, overrides: list[str]) -> dict[str, Any]:
    """The settings of the suite's ``hydra/launcher=<kind>`` config with ``overrides`` (``hydra.launcher.KEY=V``)
    applied: what a sweep's jobs get, and what a table's jobs start from (:func:`row_resources` replaces the
    per-run keys). A bad key or value is a one-line :class:`ConfigError`."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from experiments.hydra_setup import ensure_hydra, one_line

    if any(o.lstrip("+~").startswith("hydra/launcher=") for o in overrides):
        raise ConfigError("--launcher chooses the launcher: drop the hydra/launcher= override")
    ensure_hydra()
    try:
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={kind}", *overrides],
                      return_hydra_config=True)
        node = cfg.hydra.launcher
        with open_dict(node):  # per-run keys: interpolations of a sweep's config, set per job by row_resources
            node.submitit_folder, node.name, node.gpus_per_node = "", "", None
        settings = OmegaConf.to_container(node, resolve=True)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(one_line(exc)) from None
    return settings


# --------------------------------------------------------------------------- time and memory


def read_step_costs(path: str | Path) -> dict[tuple[str, str, str, str], dict[str, str]]:
    """The rows of a ``make step-cost`` CSV (``python -m experiments.step_cost --csv``) by
    ``(table, row, scale, backend)``; a missing or unreadable file is a one-line :class:`ConfigError`."""
    try:
        with open(path, newline="") as fh:
            return {(r["table"], r["row"], r["scale"], r["backend"]): r for r in csv.DictReader(fh)}
    except (OSError, KeyError, csv.Error) as exc:
        raise ConfigError(f"--step-cost={path} is not a CSV of make step-cost ({exc}): write one with python -m "
                          "experiments.step_cost ... --device cuda --csv FILE on the cluster's device") from None


def train_seconds(resolved: Any, costs: dict | None) -> tuple[float, str]:
    """``(seconds, basis)``: a run's estimated wall time before the start-up allowance (its training time times a
    margin for what that leaves out: evaluation, checkpoints, a step slower than its FLOP count), and one phrase
    saying where the figure comes from. A measured step cost counts when its row has the run's T, batch and
    precision; the speed-up of several data-parallel GPUs is not counted."""
    run = resolved.run
    measured = (costs or {}).get((resolved.table, resolved.row, resolved.scale, resolved.backend))
    if measured is not None and (int(measured["T"]), int(measured["batch"]), measured["precision"]) == (
            run.train.seq_len, run.train.batch_size, run.train.precision):
        seconds = float(measured["step_ms"]) / 1e3 * run.train.steps
        return seconds * MEASURED_MARGIN, (f"step cost measured on {measured['device'].split(';')[0]} "
                                           f"({float(measured['step_ms']):g} ms x {run.train.steps} steps) "
                                           f"x {MEASURED_MARGIN:g}")
    from experiments.long_run import matmul_flops_per_s
    from experiments.long_run import train_seconds as flop_seconds

    on_cpu = str(resolved.cfg.backend.device) == "cpu"
    rate = matmul_flops_per_s() if on_cpu else GPU_FLOPS
    where = "this machine's fp32 matmul rate" if on_cpu else f"{GPU_FLOPS / 1e12:g} TFLOP/s"
    return flop_seconds(run, rate) * FLOP_MARGIN, (f"no measured step cost: analytic FLOPs at {where} x "
                                                   f"{FLOP_MARGIN:g}")


def host_memory_gb(resolved: Any) -> int:
    """Host memory a run's job asks for: per training process, 8 GB (interpreter, framework, CUDA context,
    token cache) plus 32 bytes a parameter (weights, gradients, two AdamW moments, a checkpoint's copies); a
    rule of thumb, not a measurement: ``hydra.launcher.mem_gb`` overrides it."""
    run = resolved.run
    processes = max(1, int(resolved.cfg.backend.world_size)) if resolved.backend == "torch" else 1
    params = count_params(run.model, run.memory, run.profile)
    return int(math.ceil(processes * (8 + 32 * params / 1e9)))


@dataclass(frozen=True)
class Resources:
    """What one job asks for. ``requeues``: how often a job that reaches its time limit is requeued to go on
    from its last checkpoint (submitit's ``max_num_timeout``); ``basis``: how the time was chosen."""

    gpus: int
    mem_gb: int | None
    timeout_min: int
    requeues: int
    basis: str

    def text(self) -> str:
        hours, minutes = divmod(self.timeout_min, 60)
        mem = f"{self.mem_gb} GB" if self.mem_gb else "no memory request"
        return (f"{self.gpus} GPU(s), {mem}, {hours}:{minutes:02d} h ({self.basis})"
                + (f", requeued up to {self.requeues} times" if self.requeues else ""))


def row_resources(resolved: Any, kind: str, settings: dict[str, Any], costs: dict | None = None,
                  time_min: int = 0) -> Resources:
    """The resources of one run's job under the launcher ``kind`` with ``settings`` (:func:`launcher_settings`).

    Slurm: the time is ``time_min`` when given, else the estimate (:func:`train_seconds` plus
    :data:`START_MINUTES`), capped at ``settings['timeout_min']``; a run estimated longer than the cap is
    requeued (from its last checkpoint) often enough to finish, at least ``max_num_timeout`` times. The local
    launcher takes ``timeout_min`` as it is (the jobs share this machine; nothing queues them)."""
    gpus = gpus_for(resolved.cfg.backend.device, resolved.cfg.backend.world_size)
    mem = settings.get("mem_gb")
    if mem is None and kind == "slurm":
        mem = host_memory_gb(resolved)
    cap = int(settings["timeout_min"])
    # The local launcher's settings have no max_num_timeout: submitit's default, 3.
    requeues = int(settings.get("max_num_timeout", 3))
    if kind != "slurm":
        minutes = time_min or cap
        return Resources(gpus, mem, minutes, requeues, "--time-min" if time_min else "hydra.launcher.timeout_min")
    if time_min:
        minutes, basis = time_min, "--time-min"
    else:
        seconds, basis = train_seconds(resolved, costs)
        minutes = START_MINUTES + int(math.ceil(seconds / 60))
        basis += f" + {START_MINUTES} min"
    if minutes > cap:
        requeues = max(requeues, math.ceil(minutes / cap))
        basis += f"; {minutes} min in jobs of at most hydra.launcher.timeout_min={cap}"
        minutes = cap
    return Resources(gpus, mem, minutes, requeues, basis)
