"""Regenerate one paper table: run every row (every seed), collect, render.

    python -m experiments.reproduce --table wt2-nt-1024 --scale cpu --backend torch

Every row is composed and validated before the first one trains, so a config error costs nothing
(one ``config error`` line, exit 2, nothing created); a command predicted to train longer than
:data:`experiments.long_run.LONG_RUN_HOURS` on a CPU needs ``--yes`` (exit 2 without it). A row's run is
chosen by its identity (:mod:`pcaf_core.run_identity`): the newest run of the row whose resolved config is the
row's composed config (output paths, compile and checkpoint cadence aside). A completed one whose record
passes its check is reused; a stopped one (Ctrl-C, SIGTERM, SIGKILL, a full disk) is resumed from its last
checkpoint ("resuming <dir> from step N"), and a completed one whose record is damaged is rebuilt from it (the
damaged file kept beside it); a run another process is training is waited for, never written into; a failed
row is shown as failed in the table. The table is rendered from the runs of exactly these identities (a sweep
job in the same output root is listed, never rendered as the row). The Markdown path is printed last on
stdout; when any run failed or was refused, a last line on stderr says how many, and the exit status is 1.

``--launcher local|slurm`` runs each run as a submitit job instead (:mod:`experiments.cluster_jobs`): the same
:func:`run_planned` in its own process, on this machine or on a Slurm node, with the resources
:mod:`experiments.cluster` states; the command waits for the jobs (or, with ``--no-wait``, returns; the same
command again collects them) and renders the table when every run has ended.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import functools
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from experiments import app, long_run, preflight
from pcaf_core.checkpoints import RunRefused
from pcaf_core.config import ConfigError
from pcaf_core.loop import RunInterrupted
from pcaf_core.record_check import DAMAGED, check_run
from pcaf_core.results import SCALES, RunMetrics, read_metrics
from pcaf_core.run_identity import identity_digest, read_run_config, resume_diff, same_identity
from pcaf_core.run_record import run_lock

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
    overrides those are composed when a run records them (:func:`experiments.app.row_identities`)."""
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


def existing_runs(resolved: app.ResolvedRun, root: Path) -> list[Path]:
    """Run dirs of this row and seed under ``root`` with ``resolved``'s identity, newest first."""
    parent = root / resolved.table / resolved.scale / resolved.backend / resolved.row
    candidates = sorted(parent.glob(f"seed{resolved.run.train.seed}-*"), reverse=True) if parent.exists() else []
    want = app.config_dict(resolved)
    found = []
    for run_dir in candidates:
        config = read_run_config(run_dir)
        if config is not None and same_identity(config, want):
            found.append(run_dir)
    return found


def _record(run_dir: Path) -> RunMetrics | None:
    try:
        return read_metrics(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable or absent record: the run never finished
        return None


def run_state(previous: Path, resolved: app.ResolvedRun) -> tuple[str, str]:
    """What :func:`claim_run` does with an earlier run of ``resolved``'s identity, from its record: ``("reuse",
    "")`` for a completed run whose record passes its check; ``("resume", note)`` for a run that was stopped
    (SIGKILL leaves ``running``; SIGTERM, Ctrl-C and a full disk leave ``failed`` with ``extra.resumable``) or
    completed with a damaged record, when this command repeats its settings
    (:func:`pcaf_core.run_identity.resume_diff`); ``("new", why)`` otherwise."""
    rec = _record(previous)
    check = check_run(previous)
    if rec is not None and rec.status == "completed" and check.state != DAMAGED:
        return "reuse", ""
    if rec is None or rec.status in ("completed", "running") or rec.extra.get("resumable"):
        diff = resume_diff(read_run_config(previous) or {}, app.config_dict(resolved))
        if not diff:
            return "resume", (f"the record of {previous} is damaged ({check.text()}): rebuilding it from its last "
                              "checkpoint; the damaged file is kept beside it" if check.state == DAMAGED else "")
        return "new", (f"{previous} was stopped, but this command runs it with other settings ({'; '.join(diff)}); "
                       "starting a new run (it is kept as it is)")
    return "new", f"{previous} failed ({' '.join(str(rec.error).split())[:200]}); starting a new run"


def claim_run(resolved: app.ResolvedRun, root: Path, fresh: bool, stack: ExitStack,
              say: Callable[[str], None]) -> tuple[Path, str]:
    """Pick and lock the directory of one run: ``(dir, action)``, action ``reuse``, ``resume`` or ``new``.

    The newest directory of this row and seed with ``resolved``'s identity is locked (waiting, with a
    message, while another process runs it), then :func:`run_state` decides from its record; a run it does not
    reuse or resume is kept as it is and a new directory made. The lock stays held (in ``stack``) for the run's
    life."""
    tried: set[Path] = set()
    while not fresh:
        previous = next((d for d in existing_runs(resolved, root) if d not in tried), None)
        if previous is None:
            break
        tried.add(previous)
        hold = ExitStack()
        hold.enter_context(run_lock(previous, on_wait=say))
        action, note = run_state(previous, resolved)  # read under the lock: the holder may just have finished it
        if action != "new":
            if note:
                say(note)
            stack.enter_context(hold.pop_all())
            return previous, action
        hold.close()
        say(note)
        # Loop: while this command waited, another may have started a newer run of the same config.
    run_dir = app.new_run_dir(resolved, root)
    stack.enter_context(run_lock(run_dir, on_wait=say))
    app.write_run_files(run_dir, resolved)  # at once: another command looking for this run finds it
    return run_dir, "new"


def completed_run(resolved: app.ResolvedRun, root: Path) -> Path | None:
    """The run :func:`claim_run` would reuse for ``resolved`` now, read without waiting for any lock (a command
    that only reports, or decides whether to submit a job); None when it would resume a run or start one."""
    for previous in existing_runs(resolved, root):
        action, _ = run_state(previous, resolved)
        if action != "new":
            return previous if action == "reuse" else None
    return None


@dataclass
class Outcome:
    """How one planned run of a table ended, as every launcher reports it: ``status`` is ``reused`` (a completed
    run was found), ``completed``, ``failed``, ``refused`` (nothing in the run was changed), ``interrupted`` or
    ``lost`` (its job ended without a result: killed, out of memory); the same command resumes the last two.
    ``line`` is what the command prints for it."""

    status: str
    run_dir: str | None
    line: str


def run_planned(resolved: app.ResolvedRun, root: Path, *, fresh: bool, restart_damaged: bool,
                say: Callable[[str], None], run_dir: Path | None = None,
                on_claim: Callable[[Path], None] | None = None) -> Outcome:
    """Run one planned run of a table: claim its directory by identity (:func:`claim_run`: reuse, resume or new),
    train it (:func:`experiments.app.run_one`) and say how it ended. The one code path of every launcher: the
    serial loop of :func:`main` and a cluster job (:mod:`experiments.cluster_jobs`) call it alike.

    ``run_dir``: continue this directory instead of claiming one (a requeued cluster job continues the run it
    claimed). ``on_claim`` is told the directory as soon as it is claimed. An interruption (Ctrl-C, SIGTERM)
    propagates after the loop has recorded it."""
    claimed = None
    try:
        with ExitStack() as stack:
            if run_dir is None:
                claimed, action = claim_run(resolved, root, fresh, stack, say)
            else:
                claimed = Path(run_dir)
                stack.enter_context(run_lock(claimed, on_wait=say))
                action = "reuse" if run_state(claimed, resolved)[0] == "reuse" else "resume"
            if on_claim is not None:
                on_claim(claimed)
            if action == "reuse":
                say(f"reusing completed run {claimed}")
                return Outcome("reused", str(claimed), f"reusing completed run {claimed}")
            say(app.resume_note(claimed) or f"running in {claimed}")
            metrics = app.run_one(resolved, claimed, restart_damaged=restart_damaged, on_wait=say)
    except RunRefused as exc:
        return Outcome("refused", str(claimed) if claimed else None, f"refused: {exc}")
    status = "completed" if metrics.status == "completed" else "failed"
    return Outcome(status, str(claimed), app.summary_line(resolved, metrics))


def interrupted_line(run_dir: Path | str | None) -> str:
    """What a command says for a run it stopped: where, after which step, and that the same command resumes it."""
    rec = _record(Path(run_dir)) if run_dir is not None else None
    where = (f"{run_dir} stopped after step {rec.steps_done if rec else 0}" if run_dir is not None
             else "stopped before the run started")
    return f"interrupted: {where}; run the same command again to resume it"


def _run_here(plan: list[tuple[str, list[app.ResolvedRun]]], args: argparse.Namespace,
              root: Path) -> list[tuple[str, Outcome]] | int:
    """Every run of ``plan`` in this process, one after another: ``(tag, outcome)`` per run, or the exit status
    of an interruption (130 for Ctrl-C, 128 + the signal otherwise)."""
    n_runs = sum(len(runs) for _, runs in plan)
    outcomes = []
    for row, runs in plan:
        for resolved in runs:
            tag = run_tag(len(outcomes) + 1, n_runs, args.table, row, resolved)

            def say(line: str, tag: str = tag) -> None:
                print(f"{tag}: {line}", flush=True)

            claimed: list[Path] = []
            try:
                outcome = run_planned(resolved, root, fresh=args.fresh, restart_damaged=args.restart_damaged,
                                      say=say, on_claim=claimed.append)
            except (KeyboardInterrupt, RunInterrupted) as exc:
                print(f"{tag}: {interrupted_line(claimed[0] if claimed else None)}", file=sys.stderr, flush=True)
                return 130 if isinstance(exc, KeyboardInterrupt) else 128 + getattr(exc, "signum", 15)
            report(tag, len(outcomes) + 1, n_runs, outcome)
            outcomes.append((tag, outcome))
    return outcomes


def run_tag(done: int, n_runs: int, table: str, row: str, resolved: app.ResolvedRun) -> str:
    """The prefix of every line a command prints about one of its runs."""
    return f"[{done}/{n_runs}] {table}/{row} seed={resolved.run.train.seed} profile={resolved.run.profile.name}"


def report(tag: str, done: int, n_runs: int, outcome: Outcome) -> None:
    """Print how a run ended: its summary line on stdout (``FAILED: ...`` for a failed run), a refusal or an
    interruption on stderr; a reuse was said when it was found."""
    if outcome.status in ("completed", "failed"):
        print(f"[{done}/{n_runs}] {outcome.line}", flush=True)
    elif outcome.status in ("refused", "interrupted", "lost"):
        print(f"{tag}: {outcome.line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, help=f"one of {available_tables()}")
    parser.add_argument("--scale", default="cpu", choices=SCALES)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--rows", default="*", help="glob over row ids, comma-separated (default: all rows)")
    parser.add_argument("--output-root", default="outputs")
    parser.add_argument("--fresh", action="store_true", help="always start new runs (no reuse, no resume)")
    parser.add_argument("--restart-damaged", action="store_true",
                        help="start a run over from step 0 when every checkpoint it has is damaged (they are kept "
                             "under checkpoints_set_aside/ and the restart is recorded); without it such a run is "
                             "refused")
    parser.add_argument("--yes", action="store_true",
                        help=f"start even when the command is predicted to train longer than "
                             f"{long_run.LONG_RUN_HOURS:g} hours on a CPU (same as the override confirm=true)")
    parser.add_argument("--no-render", action="store_true")
    parser.add_argument("--launcher", default="none", choices=["none", "local", "slurm"],
                        help="none: every run in this process, one after another; local: one submitit job (its own "
                             "process) per run on this machine; slurm: one Slurm job per run (docs/EXPERIMENTS.md, "
                             "'On a cluster'); settings: hydra.launcher.KEY=VALUE overrides")
    parser.add_argument("--no-wait", action="store_true",
                        help="with --launcher: submit and return; the same command again collects the runs and "
                             "renders the table once every job has ended")
    parser.add_argument("--jobs", type=int, default=0,
                        help="--launcher local: at most this many jobs at once (0: every job at once)")
    parser.add_argument("--time-min", type=int, default=0,
                        help="minutes each job may run: on Slurm instead of the estimate, locally instead of "
                             "hydra.launcher.timeout_min")
    parser.add_argument("--step-cost", default="",
                        help="--launcher slurm: a CSV of make step-cost (--csv) measured on the cluster's device, "
                             "from which each row's time is estimated")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every row (key=value)")
    args = parser.parse_intermixed_args(argv)
    launcher_overrides = [o for o in args.overrides if o.lstrip("+~").startswith(("hydra.launcher.", "hydra/launcher"))]
    row_overrides = [o for o in args.overrides if o not in launcher_overrides]

    settings: dict = {}
    try:
        if args.launcher == "none" and (launcher_overrides or args.no_wait or args.jobs or args.time_min
                                        or args.step_cost):
            raise ConfigError("hydra.launcher.* overrides, --no-wait, --jobs, --time-min and --step-cost apply to "
                              "jobs: add --launcher local or --launcher slurm")
        if args.jobs and args.no_wait:
            raise ConfigError("--jobs needs the command to wait for its jobs: drop --no-wait or --jobs")
        if args.launcher != "none":
            from experiments import cluster

            cluster.require_extra(f"--launcher {args.launcher}")
            if args.launcher == "slurm":
                cluster.require_slurm(f"--launcher {args.launcher}")
        rows = select_rows(args.table, args.rows)
        plan = [(row, compose_row(args.table, row, args.scale, args.backend, row_overrides)) for row in rows]
        everything = [resolved for _, runs in plan for resolved in runs]
        notice, too_long = (None, None) if args.launcher == "slurm" else long_run.assess(
            everything, "--yes (or the override confirm=true)", confirmed=args.yes)
        if too_long:
            print(f"config error: {too_long}", file=sys.stderr)
            return preflight.CONFIG_ERROR_EXIT
        root = preflight.check_writable(args.output_root, "--output-root")
        if args.launcher != "none":
            settings = cluster.launcher_settings(args.launcher, launcher_overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return preflight.CONFIG_ERROR_EXIT

    n_runs = sum(len(runs) for _, runs in plan)
    label = f"[{args.table} scale={args.scale} backend={args.backend}]"
    print(f"{label} {len(plan)} rows, {n_runs} runs -> {root}")
    if notice:
        print(notice, flush=True)
    started = time.time()
    if args.launcher == "none":
        outcomes = _run_here(plan, args, root)
    else:
        from experiments.cluster_jobs import run_jobs

        outcomes = run_jobs(plan, args, root, settings)
    if isinstance(outcomes, int):  # interrupted, or jobs still running (--no-wait)
        return outcomes
    print(f"{label} runs finished in {time.time() - started:.0f} s")
    code = 0
    if not args.no_render:
        from paper_tables.__main__ import render_and_print

        code = render_and_print(args.table, args.scale, args.backend, root, root / "tables", rows=args.rows,
                                expected=expected_identities(args.table, args.scale, args.backend, args.rows,
                                                             row_overrides, plan))
    refused = [tag for tag, o in outcomes if o.status == "refused"]
    failed = [tag for tag, o in outcomes if o.status in ("failed", "interrupted", "lost")]
    for tag, outcome in outcomes:
        if outcome.status == "refused":
            print(f"refused (see above; nothing in it was changed): {tag}: {outcome.run_dir}", file=sys.stderr)
    if failed or refused:
        parts = [f"{len(failed)} failed" if failed else "", f"{len(refused)} refused" if refused else ""]
        print(f"{label} {' and '.join(p for p in parts if p)} of {n_runs} runs (their rows show why)",
              file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    from experiments.allocator import ensure_tunables

    ensure_tunables()
    sys.exit(main())
