"""A table's rows, composed: which rows a table has, each row's runs (one per seed entry), and their identities.

Every entry point that trains or renders a paper row composes it here (``experiments.reproduce``, the
benchmarks, ``make step-cost``), so a row means one thing everywhere. A row's identity digests
(:func:`row_identities`) are what a table counts as that row's runs (:mod:`pcaf_core.run_identity`).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
from collections.abc import Sequence

from omegaconf import OmegaConf

from experiments import app, preflight
from pcaf_core.config import ConfigError, RunConfig
from pcaf_core.run_identity import identity_digest

EXPERIMENT_DIR = app.CONF_DIR / "experiment"


def available_tables() -> list[str]:
    return sorted(p.name for p in EXPERIMENT_DIR.iterdir() if p.is_dir())


def table_rows(table: str) -> list[str]:
    """Row ids of ``table`` in the paper's order (from paper_tables' spec when it lists them)."""
    if table not in available_tables():
        raise ConfigError(f"table={table!r} is unknown: expected one of {available_tables()}")
    # ``_base.yaml`` holds what the table's rows share; it is not a row.
    files = sorted(p.stem for p in (EXPERIMENT_DIR / table).glob("*.yaml") if not p.stem.startswith("_"))
    try:
        from paper_tables.specs import TABLES

        ordered = [r for r in TABLES[table].row_ids if r in files] if table in TABLES else []
    except ImportError:
        ordered = []
    return ordered + [r for r in files if r not in ordered]


def select_rows(table: str, rows: str) -> list[str]:
    """Row ids of ``table`` matching ``rows`` (comma-separated globs), in the paper's order; a ConfigError
    listing the rows when nothing matches."""
    patterns = rows.split(",")
    selected = [r for r in table_rows(table) if any(fnmatch.fnmatch(r, p) for p in patterns)]
    if not selected:
        raise ConfigError(f"--rows={rows!r} matches no row of {table}: {table_rows(table)}")
    return selected


def compose_row(table: str, row: str, scale: str, backend: str, overrides: list[str]) -> list[app.ResolvedRun]:
    """Compose, scale and validate every run (one per seed entry) of a row (a one-line ConfigError if not).
    Without overrides the runs are the row itself and carry its identity digests (``row_identities``); with
    overrides those are composed when a run records them (:func:`experiments.runner.row_identities`)."""
    base = [f"experiment={table}/{row}", f"scale={scale}", f"backend={backend}"]
    cfg = preflight.compose_config(base + overrides)
    seed_runs = OmegaConf.to_container(cfg.seed_runs) or [{}]
    if seed_runs == [{}]:
        runs = [preflight.resolve_job(base + overrides, user_overrides=overrides, composed=cfg)]
    else:
        runs = []
        for entry in seed_runs:
            seeded = [f"{k}={v}" for k, v in entry.items()]
            # The seed entries are plain values: set on a copy of the composition, as Hydra would set them from
            # the command line, instead of composing the row again (most of a second each).
            cfg_seed = copy.deepcopy(cfg)
            for key, value in entry.items():
                OmegaConf.update(cfg_seed, key, value, merge=False)
            resolved = preflight.resolve_job(base + seeded + overrides, user_overrides=overrides, composed=cfg_seed)
            resolved.overrides = seeded + resolved.overrides  # the resume command must compose this seed
            runs.append(resolved)
    if not overrides:
        digests = [identity_digest(app.config_dict(r)) for r in runs]
        for resolved in runs:
            resolved.row_identities = list(digests)
    return runs


def row_config(experiment: str, scale: str = "cpu", backend: str = "torch", overrides: Sequence[str] = ()
               ) -> RunConfig:
    """The validated spec config of paper row ``experiment`` (``"<table>/<row>"``, what ``experiment=`` takes)
    at ``scale`` on ``backend``, with ``overrides`` (``"key=value"`` strings), composed as ``experiments.run``
    composes it; for a row trained over several seeds, its first seed entry's. A one-line ConfigError for an
    unknown row, scale, key or value. For using the models in one's own code (docs/LIBRARY.md)."""
    table, _, row = experiment.partition("/")
    if not row:
        raise ConfigError(f"experiment={experiment!r}: expected <table>/<row>, e.g. wt2-nt-1024/pcaf_context; "
                          f"the tables are {available_tables()}")
    return compose_row(table, row, scale, backend, list(overrides))[0].run


@functools.cache
def _row_identities(table: str, row: str, scale: str, backend: str) -> tuple[str, ...]:
    if table not in available_tables() or not (EXPERIMENT_DIR / table / f"{row}.yaml").is_file():
        return ()
    try:
        return tuple(identity_digest(app.config_dict(r)) for r in compose_row(table, row, scale, backend, []))
    except ConfigError:
        return ()


def row_identities(table: str, row: str, scale: str, backend: str) -> list[str]:
    """Identity digests (:func:`pcaf_core.run_identity.identity_digest`) of the row's composed configs at
    ``scale`` on ``backend`` without command-line overrides, one per seed entry; ``[]`` for no paper row."""
    return list(_row_identities(table, row, scale, backend))


Plan = list[tuple[str, list[app.ResolvedRun]]]
"""``[(row id, its composed runs)]``: what a table command trains, in order."""


def plan_identities(table: str, plan: Plan) -> dict[tuple[str, str], list[str]]:
    """``(table, row) -> identity digests`` of each planned row's composed runs (``paper_tables.collect.Expected``):
    what a table counts as its rows' runs when they were trained with the plan's command-line overrides."""
    return {(table, row): [identity_digest(app.config_dict(r)) for r in runs] for row, runs in plan}


def expected_identities(table: str, scale: str, backend: str, rows: str, overrides: list[str],
                        plan: Plan | None = None) -> dict[tuple[str, str], list[str]]:
    """:func:`plan_identities` of the rows matching ``rows`` composed at ``scale`` on ``backend`` with
    ``overrides`` (``plan``: those rows already composed), and of every row of the tables ``table``'s claims
    compare with, composed the same way: the runs a table renders when they were all trained with ``overrides``.
    A one-line ConfigError for a bad override or row glob."""
    from paper_tables.claims import referenced_tables
    from paper_tables.specs import get_table

    if plan is None:
        plan = [(row, compose_row(table, row, scale, backend, overrides)) for row in select_rows(table, rows)]
    expected = plan_identities(table, plan)
    for other in referenced_tables(get_table(table)):
        expected.update(plan_identities(other, [(row, compose_row(other, row, scale, backend, overrides))
                                                for row in table_rows(other)]))
    return expected
