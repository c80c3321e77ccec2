"""Turn a composed Hydra config into a validated run, and run it.

The flow for one run:

1. Hydra composes ``config.yaml`` + ``experiment=<table>/<row>`` + groups + command-line overrides
   against the structured schema (unknown keys, options and wrong types fail here).
2. :func:`apply_scale` applies the scale's ``common`` and per-table overrides and records every changed
   value as a deviation from the paper's settings.
3. :func:`to_run_config` converts to :class:`pcaf_core.config.RunConfig`, running every value check
   (impossible values fail here, before any data is read or any weight allocated).
4. :func:`run_one` makes a collision-proof run directory, holds its lock (one process at a time
   trains in a run directory), writes the resolved config and the environment when it creates the run
   (``config.yaml`` is written once, never rewritten), and calls the backend's ``train``. A command that
   continues an existing run must have the run's own config (:func:`check_resume`, by
   :mod:`pcaf_core.run_identity`'s resume view) and backend; otherwise it is refused before anything in the
   directory changes. A failure leaves a ``failed`` record; a refused resume (damaged checkpoints, another
   config or backend) leaves the directory as it was.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments import allocator
from pcaf_core.checkpoints import RunRefused, checkpoint_backend, latest_checkpoint, newest_step
from pcaf_core.config import ConfigError, RunConfig, validate
from pcaf_core.fsutil import atomic_write_text
from pcaf_core.profiles import resolve_matmul_precision
from pcaf_core.results import CONFIG_FILE, RunMetrics, SchemaError, read_metrics
from pcaf_core.resume import previous_divergence
from pcaf_core.run_identity import flatten, identity_digest, read_run_config, resume_diff
from pcaf_core.run_record import mark_failed, run_lock

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "experiments" / "conf"
RUN_SECTIONS = ("model", "memory", "profile", "data", "train", "eval")
_TRACKED_PACKAGES = ("numpy", "torch", "triton", "jax", "flax", "optax", "hydra-core", "pandas")


@functools.cache
def scale_tables(scale: str) -> tuple[str, ...]:
    """The tables ``conf/scale/<scale>.yaml`` is defined for (its ``only_tables``); ``()``: every table."""
    return tuple(OmegaConf.load(CONF_DIR / "scale" / f"{scale}.yaml").get("only_tables") or ())


def scale_covers(scale: str, table: str) -> bool:
    """Whether ``scale`` is defined for ``table`` (:func:`apply_scale` refuses the other tables)."""
    return not scale_tables(scale) or table in scale_tables(scale)


@dataclass
class ResolvedRun:
    """A run ready to start: the spec config, its labels and its deviations from the paper."""

    run: RunConfig
    cfg: DictConfig  # the full resolved config (written to config.yaml)
    table: str
    row: str
    scale: str
    backend: str
    deviations: list[str]
    overrides: list[str] = field(default_factory=list)  # what composes it besides experiment/scale/backend
    row_identities: list[str] | None = None  # its row's identity digests (app.row_identities), once computed


def _section_values(cfg: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True)
    return flatten({k: container[k] for k in RUN_SECTIONS})


def _overridden_keys(task_overrides: list[str]) -> set[str]:
    return {o.lstrip("+~").split("=", 1)[0] for o in task_overrides if "=" in o}


def resolve_auto_precision(cfg: DictConfig) -> str:
    """Replace ``train.precision=auto`` by what the run's backend trains fastest in on this machine (its
    ``auto_precision``), so the saved config and the record say ``fp32`` or ``bf16``; returns why ('' when
    the precision was not ``auto``). Runs resolved differently on two machines are different configs."""
    if cfg.train.precision != "auto":
        return ""
    import importlib

    module = importlib.import_module(f"backends.{cfg.backend.name}.backend")
    device = cfg.backend.device if cfg.backend.device != "auto" else None
    cfg.train.precision, why = module.auto_precision(device)
    return why


def apply_scale(cfg: DictConfig, task_overrides: list[str] | None = None) -> list[str]:
    """Apply ``cfg.scale`` in place; return one line per changed setting (and the scale's notes).

    A key the user set on the command line wins over the scale (it is recorded as a command-line
    deviation instead)."""
    user_keys = _overridden_keys(task_overrides or [])
    scale = cfg.scale
    if scale.only_tables and cfg.table not in scale.only_tables:
        raise ConfigError(f"scale={scale.name} is defined only for the tables {', '.join(scale.only_tables)}, "
                          f"not {cfg.table}: run {cfg.table} at scale=paper (or cpu/smoke)")
    before = _section_values(cfg)
    overrides: dict[str, Any] = dict(OmegaConf.to_container(scale.common, resolve=False) or {})
    table_over = scale.tables.get(cfg.table) if cfg.table in scale.tables else None
    if table_over is not None:
        overrides.update(OmegaConf.to_container(table_over, resolve=False))
    row_over = overrides.pop("rows", {}) or {}
    overrides.update(row_over.get(cfg.row, {}))
    for key, value in overrides.items():
        if key in user_keys:
            continue
        if key.split(".")[0] not in RUN_SECTIONS:
            raise ConfigError(f"scale.{scale.name}: override key {key!r} is not under {list(RUN_SECTIONS)}")
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"scale.{scale.name}: cannot set {key}={value!r}: {exc}") from exc
    why = resolve_auto_precision(cfg)
    after = _section_values(cfg)
    deviations = [
        f"{k}: {before.get(k)!r} -> {after[k]!r} (scale={scale.name})"
        for k in sorted(after)
        if before.get(k) != after[k]
    ]
    deviations = [f"{d[:-1]}; auto: {why})" if why and d.startswith("train.precision:") else d for d in deviations]
    notes = OmegaConf.to_container(scale.notes, resolve=True) or {}
    for note_key in ("*", cfg.table):
        note = notes.get(note_key)
        if note:
            deviations += [f"{n} (scale={scale.name})" for n in (note if isinstance(note, list) else [note])]
    return deviations


_LABEL_KEYS = ("experiment=", "scale=", "backend=", "output_root=", "run_dir=", "restart_damaged=", "restart=",
               "confirm=", "hydra.", "hydra/")


def command_line_deviations(task_overrides: list[str]) -> list[str]:
    """Command-line overrides that change a run's settings (group choices are labels, not deviations)."""
    return [f"{o} (command line)" for o in task_overrides if not o.lstrip("+~").startswith(_LABEL_KEYS)]


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Build and validate the spec's :class:`RunConfig` (raises ConfigError naming the key)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    except ConfigError:
        raise
    return validate(RunConfig(**{s: getattr(obj, s) for s in RUN_SECTIONS}))


def label_from_experiment(cfg: DictConfig, task_overrides: list[str] | None) -> None:
    """Set ``cfg.table``/``cfg.row`` from the ``experiment=<table>/<row>`` choice (a row file does not repeat its
    own path), unless the command line set them itself."""
    given = _overridden_keys(task_overrides or [])
    choice = [o.split("=", 1)[1] for o in task_overrides or [] if o.lstrip("+~").startswith("experiment=")]
    if choice and "/" in choice[-1]:
        table, row = choice[-1].split("/", 1)
        if "table" not in given:
            cfg.table = table
        if "row" not in given:
            cfg.row = row


def resolve(cfg: DictConfig, task_overrides: list[str] | None = None) -> ResolvedRun:
    """Label, scale and validate a composed config (mutates ``cfg``)."""
    label_from_experiment(cfg, task_overrides)
    if cfg.backend.name not in ("torch", "jax"):
        raise ConfigError(f"backend.name={cfg.backend.name!r} is unknown: expected 'torch' or 'jax'")
    deviations = apply_scale(cfg, task_overrides)
    deviations += [f"note: {n}" for n in cfg.notes]
    deviations += command_line_deviations(task_overrides or [])
    run = to_run_config(cfg)
    if run.train.matmul_precision == "profile":  # config.yaml names the precision that runs, as the record does
        run = resolve_matmul_precision(run)
        cfg.train.matmul_precision = run.train.matmul_precision
    overrides = [o for o in task_overrides or [] if not o.lstrip("+~").startswith(_LABEL_KEYS)]
    return ResolvedRun(run, cfg, str(cfg.table), str(cfg.row), str(cfg.scale.name), str(cfg.backend.name), deviations,
                       overrides)


def resume_command(resolved: ResolvedRun, run_dir: Path, backend: str | None = None) -> str:
    """The command line that continues the run in ``run_dir`` (same config; append a changed ``train.lr``
    after a divergence); ``backend``: another backend's name in place of the command's."""
    parts = ["python", "-m", "experiments.run", f"experiment={resolved.table}/{resolved.row}",
             f"scale={resolved.scale}", f"backend={backend or resolved.backend}", *resolved.overrides,
             f"run_dir={hydra_value(str(run_dir))}"]
    return " ".join(shlex.quote(p) for p in parts)


def hydra_value(text: str) -> str:
    """``text`` as a Hydra override value: as it is when Hydra's grammar reads it so, else quoted (a path with
    spaces, commas or non-ASCII characters)."""
    if re.fullmatch(r"[A-Za-z0-9_/.:+@%-]*", text):
        return text
    # Hydra's quoted strings: a quote is escaped by a backslash, and backslashes before a quote (or the closing
    # quote) are doubled; other backslashes are literal.
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


def config_dict(resolved: ResolvedRun) -> dict[str, Any]:
    """The resolved config as plain data (what ``config.yaml`` holds, less ``run_dir``)."""
    return OmegaConf.to_container(resolved.cfg, resolve=True)


def _recorded_command(run_dir: Path) -> str:
    try:
        return str(read_metrics(run_dir).extra.get("resume_command") or "")
    except (FileNotFoundError, SchemaError):
        return ""


def check_resume(resolved: ResolvedRun, run_dir: Path, existing: dict[str, Any] | None = None) -> None:
    """Raise :class:`RunRefused` (one line, nothing changed) when ``resolved`` cannot continue the run in
    ``run_dir``: the run was trained by another backend, or the command changes a field of the run's resume
    view (:func:`pcaf_core.run_identity.resume_diff`). The one change let through is a lower ``train.lr`` for a
    run that diverged and has a checkpoint (the loop records it as a deviation). A directory without a
    ``config.yaml`` is a new run."""
    existing = read_run_config(run_dir) if existing is None else existing
    if existing is None:
        return
    old_backend = str((existing.get("backend") or {}).get("name") or "")
    if old_backend and old_backend != resolved.backend:
        ckpt = latest_checkpoint(run_dir)
        fmt = checkpoint_backend(ckpt)[1] if ckpt is not None else ""
        held = f"its checkpoints are {fmt}" if fmt else ("it has checkpoints of that backend" if ckpt is not None
                                                          else "it has no checkpoint yet")
        command = _recorded_command(run_dir) or resume_command(resolved, run_dir, backend=old_backend)
        raise RunRefused(
            f"{run_dir} was trained by the {old_backend} backend ({held}); backend={resolved.backend} cannot resume "
            f"it. Resume it with: {command} (or add restart=true to train this command as a new run from step 0). "
            f"Nothing in {run_dir} was changed.")
    diff = resume_diff(existing, config_dict(resolved))
    if not diff:
        return
    if (all(d.startswith("train.lr: ") for d in diff) and previous_divergence(run_dir) is not None
            and newest_step(run_dir)):
        return
    own = _recorded_command(run_dir)
    raise RunRefused(
        f"cannot resume {run_dir} with this command: it changes {'; '.join(diff)}. Nothing in {run_dir} was changed. "
        f"To train this config, drop run_dir= (a new run directory) or add restart=true (a new run directory; "
        f"{run_dir} is kept as it is)" + (f"; to continue the run, repeat its own settings: {own}" if own else ""))


def new_run_dir(resolved: ResolvedRun, root: str | Path | None = None) -> Path:
    """``<root>/<table>/<scale>/<backend>/<row>/seed<seed>-<UTC time>-<random>``, created exclusively."""
    base = Path(root if root is not None else resolved.cfg.output_root)
    if not base.is_absolute():
        base = Path.cwd() / base
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    parent = base / resolved.table / resolved.scale / resolved.backend / resolved.row
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / f"seed{resolved.run.train.seed}-{stamp}-{uuid.uuid4().hex[:6]}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def package_versions() -> dict[str, str]:
    """The Python and tracked package versions of this process (a new dict each call)."""
    return dict(_package_versions())


@functools.cache
def _package_versions() -> tuple[tuple[str, str], ...]:
    # Looked up once per process: the packages a process has imported do not change under it (a table's runs
    # asked for them twice a run, ~6 ms each, every installed distribution scanned).
    versions = {"python": platform.python_version()}
    for pkg in _TRACKED_PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return tuple(versions.items())


def labels(resolved: ResolvedRun) -> dict[str, Any]:
    """The labels every record of this run carries."""
    return {
        "table": resolved.table,
        "row": resolved.row,
        "scale": resolved.scale,
        "backend": resolved.backend,
        "profile": resolved.run.profile.name,
        "seed": resolved.run.train.seed,
        "deviations": list(resolved.deviations),
        "git_commit": git_commit() or "",
        "versions": package_versions(),
    }


def config_yaml(data: dict[str, Any]) -> str:
    """``data`` (plain, resolved) as the YAML text ``config.yaml`` holds: what ``OmegaConf.to_yaml`` writes
    (its string representer quotes strings that would read back as a bool or a number), emitted by libyaml
    when PyYAML has it, 4-5x faster than the pure-Python emitter and the same text (every committed resolved
    config is compared, ``experiments.resolved_configs``)."""
    import yaml

    return yaml.dump(data, Dumper=_yaml_dumper(), default_flow_style=False, allow_unicode=True, sort_keys=False)


@functools.cache
def _yaml_dumper() -> type:
    """PyYAML's C dumper (its pure-Python one without libyaml) with OmegaConf's string representer."""
    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    omegaconf_dumper = get_omega_conf_dumper()
    dumper = type("ConfigDumper", (getattr(yaml, "CDumper", omegaconf_dumper),), {})
    dumper.add_representer(str, omegaconf_dumper.str_representer)
    return dumper


def write_run_files(run_dir: Path, resolved: ResolvedRun) -> None:
    """``config.yaml`` (the resolved Hydra config) and ``environment.json`` (labels, argv, host and process id of
    the process that created the run), atomically: once, when the run is created (nothing rewrites them
    afterwards)."""
    cfg = config_dict(resolved)
    cfg["run_dir"] = str(run_dir)
    atomic_write_text(run_dir / CONFIG_FILE, config_yaml(cfg))
    env = {**labels(resolved), "argv": sys.argv, "platform": platform.platform(), "host": platform.node(),
           "pid": os.getpid(), "malloc": allocator.describe()}
    atomic_write_text(run_dir / "environment.json", json.dumps(env, indent=2, default=str))


def initial_record(resolved: ResolvedRun, run_dir: Path | None = None) -> RunMetrics:
    """The identity and provenance a backend stamps on every version of the run's record (with ``run_dir``:
    ``extra.resume_command``, the command that continues it)."""
    record = RunMetrics(table=resolved.table, row=resolved.row, status="running")
    for key, value in labels(resolved).items():
        setattr(record, key, value)
    if run_dir is not None:
        record.extra["resume_command"] = resume_command(resolved, run_dir)
    # The run's identity is its config.yaml's (written once; a resume after a divergence may lower train.lr,
    # recorded as a deviation); the row's is what the row composes to at this scale and backend.
    existing = read_run_config(run_dir) if run_dir is not None else None
    record.identity = {"config": identity_digest(existing if existing is not None else config_dict(resolved)),
                       "row": row_identities(resolved)}
    return record


def row_identities(resolved: ResolvedRun) -> list[str]:
    """Identity digests of ``resolved``'s table row as composed at its scale and backend without command-line
    overrides, one per seed entry; ``[]`` for a run that is no paper row."""
    if resolved.row_identities is None:
        from experiments.table_plan import row_identities as compose_identities  # table_plan imports this module

        resolved.row_identities = compose_identities(resolved.table, resolved.row, resolved.scale, resolved.backend)
    return list(resolved.row_identities)


def _record_bytes(run_dir: Path) -> bytes | None:
    try:
        return (run_dir / "metrics.json").read_bytes()
    except OSError:
        return None


def _failed(run_dir: Path, resolved: ResolvedRun, error: str, *, resumable: bool = False,
            before: bytes | None = None, trace: str = "") -> RunMetrics:
    """The record of a run that raised: the loop's own ``failed`` record when it wrote one, else one
    written here (the run failed before the loop could start, or a worker died without recording), with
    ``trace`` appended to ``error.txt``. ``before``: the run's record before this command; when this command
    failed without the loop touching it, the run's files are left as they were (the failure is the
    command's, not the run's) and the returned record is not written."""
    if before is not None and _record_bytes(run_dir) == before:
        return RunMetrics(table=resolved.table, row=resolved.row, status="failed", error=error)
    if trace:
        _write_error_file(run_dir, trace)
    try:
        metrics = read_metrics(run_dir)
        if metrics.status == "failed":
            return metrics
    except (FileNotFoundError, SchemaError):
        pass
    try:
        return mark_failed(run_dir, initial_record(resolved, run_dir), error, cfg=resolved.run, resumable=resumable)
    except OSError as exc:  # e.g. the disk is still full: say so rather than hide the run's own failure
        say(f"could not write the failed record of {run_dir}: {exc}")
        return RunMetrics(table=resolved.table, row=resolved.row, status="failed", error=error)


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A metric for a log line: ``n/a`` when it was not measured."""
    return "n/a" if value is None else format(value, spec)


def summary_line(resolved: ResolvedRun, metrics: RunMetrics) -> str:
    """One labelled line per finished run."""
    tag = (f"[{resolved.table}/{resolved.row} scale={resolved.scale} backend={resolved.backend} "
           f"profile={resolved.run.profile.name} seed={resolved.run.train.seed}]")
    if metrics.status != "completed":
        return f"{tag} FAILED: {metrics.error}"
    return (f"{tag} best PPL {fmt(metrics.best_ppl)} / final {fmt(metrics.final_ppl)} (protocol=reference), "
            f"full-split PPL {fmt(metrics.full_ppl)} (protocol=full), {fmt(metrics.tokens_per_sec, '.0f')} tok/s, "
            f"{fmt(metrics.wall_time_s, '.0f')} s")


def say(line: str) -> None:
    """A progress line on stderr (waiting for a lock, resuming), flushed at once."""
    print(line, file=sys.stderr, flush=True)


def resume_note(run_dir: Path) -> str | None:
    """``resuming <dir> from step N`` when ``run_dir`` holds an earlier, unfinished run, else None."""
    try:
        metrics = read_metrics(run_dir)
    except (FileNotFoundError, SchemaError):
        return None
    if metrics.status == "completed":
        return None
    step = newest_step(run_dir)
    return f"resuming {run_dir} from step {step}" + ("" if step else " (no checkpoint was written)")


def _write_error_file(run_dir: Path, text: str) -> None:
    """Append a failure's traceback to ``error.txt`` under a time stamp (earlier failures stay above it)."""
    path = run_dir / "error.txt"
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        atomic_write_text(path, f"{old}=== {stamp} ===\n{text}")
    except OSError as exc:  # the record still says why the run failed
        say(f"could not write {path}: {exc}")


def run_one(resolved: ResolvedRun, run_dir: Path | None = None, *, progress: bool | None = None,
            restart_damaged: bool = False, on_wait: Callable[[str], None] | None = say) -> RunMetrics:
    """Train one resolved run in ``run_dir`` (new if None), holding the directory's lock throughout
    (another process running it is waited for, with ``on_wait`` told once). Never raises for a training
    failure: the returned record (and ``metrics.json``) says ``failed`` with the error. Raises
    :class:`~pcaf_core.checkpoints.RunRefused` (the directory untouched) when its checkpoints are all
    damaged (``restart_damaged`` starts over instead, keeping them) or were written for another config,
    and re-raises an interruption (Ctrl-C, SIGTERM) after it is recorded."""
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir(resolved)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir, on_wait=on_wait):
        return _run_locked(resolved, run_dir, progress, restart_damaged)


def _run_locked(resolved: ResolvedRun, run_dir: Path, progress: bool | None, restart_damaged: bool) -> RunMetrics:
    existing = read_run_config(run_dir)
    if existing is None and not (run_dir / CONFIG_FILE).exists():
        write_run_files(run_dir, resolved)
    else:
        check_resume(resolved, run_dir, existing or {})
    before = _record_bytes(run_dir)
    try:
        backend = importlib.import_module(f"backends.{resolved.backend}.train")
    except ImportError as exc:
        return _failed(run_dir, resolved, f"backend {resolved.backend!r} is not available: {exc}", before=before)
    from pcaf_core.loop import RESTART_DAMAGED, RunInterrupted

    try:
        # The loop writes metrics.json (labels from the template, its own deviations added) and is its only
        # writer; nothing below rewrites a record the loop has written.
        return backend.train(resolved.run, run_dir, progress=progress, record=initial_record(resolved, run_dir),
                             resume=RESTART_DAMAGED if restart_damaged else True,
                             device=resolved.cfg.backend.device, world_size=int(resolved.cfg.backend.world_size))
    except RunRefused:
        raise
    except (KeyboardInterrupt, RunInterrupted):
        _failed(run_dir, resolved, f"interrupted before training started; run the same command again to resume "
                                   f"{run_dir}", resumable=True, before=before)
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, the table shows the row as failed
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return _failed(run_dir, resolved, detail, before=before, trace=traceback.format_exc())
