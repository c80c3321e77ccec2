"""Compose and check runs before anything trains: the one place every entry point validates a command.

``python -m experiments.run`` (one run or a ``-m`` sweep) and ``python -m experiments.reproduce`` both
come here first. Every job of a sweep is composed, scaled and validated, and its output directory is
checked to be writable, before the first one starts; every problem is one line, ``config error: ...``,
naming the key and the fix, and the command exits with :data:`CONFIG_ERROR_EXIT` (2).

Hydra's and OmegaConf's own errors (unknown key, wrong type, missing option, unparsable override) are
several lines with a hint to set ``HYDRA_FULL_ERROR``; :func:`experiments.hydra_setup.one_line` turns them
into one.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from experiments import app
from experiments.hydra_setup import ensure_hydra, failing_override, one_line, schema_keys
from experiments.schema import BackendConfig, ExperimentConfig
from pcaf_core.config import ConfigError
from pcaf_core.config_io import SECTIONS

CONFIG_ERROR_EXIT = 2
"""Exit status of every entry point for a command line that cannot run (bad key, value, type, directory)."""

_NOT_A_RUN = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose ``config_name`` with ``overrides``; a composition error is a one-line :class:`ConfigError`."""
    ensure_hydra()
    try:
        return compose(config_name=config_name, overrides=list(overrides))
    except OverrideParseException as exc:
        raise ConfigError(one_line(exc, failing_override(list(overrides)))) from None
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(one_line(exc)) from None


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys the schema does not have (``+memory.foo=3`` adds one Hydra accepts and nothing would read)."""
    found = []
    top = {f.name for f in dataclasses.fields(ExperimentConfig)}
    found += [k for k in cfg if k not in top and k != "hydra"]
    for section, cls in {**SECTIONS, "backend": BackendConfig}.items():
        node = cfg.get(section)
        if isinstance(node, DictConfig):
            names = {f.name for f in dataclasses.fields(cls)}
            found += [f"{section}.{k}" for k in node if k not in names]
    return found


def resolve_job(overrides: list[str], config_name: str = "config",
                user_overrides: list[str] | None = None, composed: DictConfig | None = None) -> app.ResolvedRun:
    """Compose, scale and validate one job of a command line (raises a one-line :class:`ConfigError`).

    ``user_overrides`` (default: ``overrides``) are the ones the user typed: they win over the scale and
    are recorded as deviations (a row's own seed entries are not). ``composed``: the composition of
    ``overrides`` when the caller already has it (a Hydra composition costs most of a second)."""
    cfg = compose_config(overrides, config_name) if composed is None else composed
    extra = unknown_keys(cfg)
    if extra:
        raise ConfigError(f"{extra[0]} is not a setting (unknown key): drop the override that adds it "
                          f"(+{extra[0]}=...); the keys of {extra[0].rsplit('.', 1)[0]} are "
                          f"{', '.join(schema_keys(extra[0]))}")
    app.label_from_experiment(cfg, list(overrides))
    return app.resolve(cfg, list(overrides if user_overrides is None else user_overrides))


def check_writable(path: str | os.PathLike[str], key: str) -> Path:
    """Check that ``path`` is, or can be created as, a directory a file can be written in, without creating
    anything (the first run creates it); else a one-line ConfigError naming ``key`` (``output_root``,
    ``run_dir``, ``--output-root``). Returns the absolute path."""
    path = Path(path)
    if not path.is_absolute():
        path = Path.cwd() / path
    nearest = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        if nearest is None or not nearest.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(nearest))
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}={path} is not a writable directory ({exc.strerror or exc}): "
                          f"point {key} at a directory you can write to") from None
    return path


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override list of every job of a ``-m`` command line, in Hydra's (basic sweeper's) order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(one_line(exc, failing_override(list(overrides)))) from None
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _swept(job: list[str], jobs: list[list[str]]) -> str:
    varying = [o for o in job if any(o not in other for other in jobs)]
    return " ".join(varying)


def check_command_line(argv: list[str]) -> int | None:
    """Validate the jobs of an ``experiments.run`` command line before Hydra starts any.

    Returns None when every job is valid (or the command line only asks Hydra for help or a config
    dump), else prints one ``config error`` line per bad job to stderr and returns :data:`CONFIG_ERROR_EXIT`.
    """
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if any(getattr(args, name, None) for name in _NOT_A_RUN) or args.config_path or args.config_dir:
        return None
    try:
        return _check_jobs(args.overrides, args.multirun, args.config_name or "config")
    finally:
        GlobalHydra.instance().clear()  # Hydra's own main initialises it again


def _check_jobs(overrides: list[str], multirun: bool, config_name: str) -> int | None:
    from experiments.cluster import check_launcher_overrides

    try:
        check_launcher_overrides(overrides)  # once for the command: a missing extra is not one error per job
        jobs = sweep_jobs(overrides) if multirun else [list(overrides)]
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    errors = []
    resolved_jobs = []
    for num, job in enumerate(jobs):
        try:
            resolved = resolve_job(job, config_name)
            resolved_jobs.append(resolved)
            if resolved.cfg.run_dir:
                check_writable(resolved.cfg.run_dir, "run_dir")
            else:
                check_writable(resolved.cfg.output_root, "output_root")
        except ConfigError as exc:
            where = f" (job {num}: {_swept(job, jobs)})" if len(jobs) > 1 else ""
            errors.append(f"config error: {exc}{where}")
    if not errors:
        from experiments.long_run import assess

        notice, too_long = assess(resolved_jobs, "confirm=true")
        if too_long:
            errors.append(f"config error: {too_long}")
        elif notice:
            print(notice, file=sys.stderr, flush=True)
    for line in errors:
        print(line, file=sys.stderr)
    if errors and len(jobs) > 1:
        print(f"config error: {len(errors)} of {len(jobs)} jobs are invalid; no job was started", file=sys.stderr)
    return CONFIG_ERROR_EXIT if errors else None
