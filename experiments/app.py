"""Turn a composed Hydra config into a validated run (the run itself: :mod:`experiments.runner`).

The flow for one run:

1. Hydra composes ``config.yaml`` + ``experiment=<table>/<row>`` + groups + command-line overrides
   against the structured schema (unknown keys, options and wrong types fail here).
2. :func:`apply_scale` applies the scale's ``common`` and per-table overrides and records every changed
   value as a deviation from the paper's settings.
3. :func:`to_run_config` converts to :class:`pcaf_core.config.RunConfig`, running every value check
   (impossible values fail here, before any data is read or any weight allocated).
4. :func:`experiments.runner.run_one` makes a collision-proof run directory, holds its lock (one process at a time
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
import uuid
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
from pcaf_core.results import CONFIG_FILE, SchemaError, read_metrics
from pcaf_core.resume import previous_divergence
from pcaf_core.run_identity import flatten, read_run_config, resume_diff

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
    row_identities: list[str] | None = None  # its row's identity digests (runner.row_identities), once computed


def _section_values(cfg: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True)
    return flatten({k: container[k] for k in RUN_SECTIONS})


def _overridden_keys(task_overrides: list[str]) -> set[str]:
    return {o.lstrip("+~").split("=", 1)[0] for o in task_overrides if "=" in o}


def _chose_corpus(user_keys: set[str]) -> bool:
    """Whether the command line chose the corpus: ``data=NAME`` (the config group) or ``data.name=NAME``."""
    return bool({"data", "data.name"} & user_keys)


def resolve_auto_precision(cfg: DictConfig) -> str:
    """Replace ``train.precision=auto`` by what the run's backend trains fastest in on this machine (its
    ``auto_precision``), so the saved config and the record say ``fp32`` or ``bf16``; returns why ('' when
    the precision was not ``auto``). Runs resolved differently on two machines are different configs."""
    if cfg.train.precision != "auto":
        return ""

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
    corpus: dict[str, Any] = dict(OmegaConf.to_container(scale.corpus, resolve=True) or {})
    corpus_note = corpus.pop("note", None)
    if _chose_corpus(user_keys):
        # The scale's corpus stands in for a table's own; a corpus the user named is trained as named, in its
        # own layout.
        corpus = {}
    if set(corpus) & user_keys or not corpus:
        corpus_note = None  # it describes the block as written, which is not what this run trains on
    overrides: dict[str, Any] = {**corpus, **(OmegaConf.to_container(scale.common, resolve=False) or {})}
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
    if corpus_note:
        deviations.append(f"{corpus_note} (scale={scale.name})")
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


DEVICES = {"torch": "auto, cpu, cuda or cuda:<index>", "jax": "auto, cpu, gpu (or cuda) or tpu"}
"""The ``backend.device`` values each backend trains on, as a config error states them."""


def check_device(backend: str, device: str) -> str:
    """The ``backend.device`` a run of ``backend`` is recorded with: ``device`` as given, except JAX's ``gpu`` for
    ``cuda`` (one name per device in a run's identity). A one-line :class:`ConfigError` when ``backend`` cannot
    train on ``device``, before a run starts (the backend would fail only once the run exists)."""
    ok = device in ("auto", "cpu") or (re.fullmatch(r"cuda(:\d+)?", device) if backend == "torch" else
                                       device in ("gpu", "cuda", "tpu"))
    if not ok:
        raise ConfigError(f"backend.device={device!r} is invalid for backend={backend}: use {DEVICES[backend]}")
    return "gpu" if backend == "jax" and device == "cuda" else device


def resolve(cfg: DictConfig, task_overrides: list[str] | None = None) -> ResolvedRun:
    """Label, scale and validate a composed config (mutates ``cfg``)."""
    label_from_experiment(cfg, task_overrides)
    if cfg.backend.name not in ("torch", "jax"):
        raise ConfigError(f"backend.name={cfg.backend.name!r} is unknown: expected 'torch' or 'jax'")
    cfg.backend.device = check_device(str(cfg.backend.name), str(cfg.backend.device))
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


def say(line: str) -> None:
    """A progress line on stderr (waiting for a lock, resuming), flushed at once."""
    print(line, file=sys.stderr, flush=True)
