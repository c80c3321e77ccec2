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
from pathlib import Path

from omegaconf import OmegaConf

from experiments import app, long_run, preflight
from pcaf_core.checkpoints import RunRefused
from pcaf_core.config import ConfigError
from pcaf_core.loop import RunInterrupted
from pcaf_core.record_check import DAMAGED, check_run
from pcaf_core.results import RunMetrics, read_metrics
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


def claim_run(resolved: app.ResolvedRun, root: Path, fresh: bool, stack: ExitStack,
              say: Callable[[str], None]) -> tuple[Path, str]:
    """Pick and lock the directory of one run: ``(dir, action)``, action ``reuse``, ``resume`` or ``new``.

    The newest directory of this row and seed with ``resolved``'s identity is locked (waiting, with a
    message, while another process runs it), then its record decides: ``completed`` and passing its check is
    reused; a run that was stopped (SIGKILL leaves ``running``; SIGTERM, Ctrl-C and a full disk leave
    ``failed`` with ``extra.resumable``), or completed with a damaged record, is resumed when this command
    repeats its settings (:func:`pcaf_core.run_identity.resume_diff`); anything else gets a new directory.
    The lock stays held (in ``stack``) for the run's life."""
    tried: set[Path] = set()
    while not fresh:
        previous = next((d for d in existing_runs(resolved, root) if d not in tried), None)
        if previous is None:
            break
        tried.add(previous)
        hold = ExitStack()
        hold.enter_context(run_lock(previous, on_wait=say))
        rec = _record(previous)  # read under the lock: the holder may just have finished it
        check = check_run(previous)
        if rec is not None and rec.status == "completed" and check.state != DAMAGED:
            stack.enter_context(hold.pop_all())
            return previous, "reuse"
        if rec is None or rec.status in ("completed", "running") or rec.extra.get("resumable"):
            diff = resume_diff(read_run_config(previous) or {}, app.config_dict(resolved))
            if not diff:
                if check.state == DAMAGED:
                    say(f"the record of {previous} is damaged ({check.text()}): rebuilding it from its last "
                        "checkpoint; the damaged file is kept beside it")
                stack.enter_context(hold.pop_all())
                return previous, "resume"
            hold.close()
            say(f"{previous} was stopped, but this command runs it with other settings ({'; '.join(diff)}); "
                "starting a new run (it is kept as it is)")
            continue
        hold.close()
        say(f"{previous} failed ({' '.join(str(rec.error).split())[:200]}); starting a new run")
        # Loop: while this command waited, another may have started a newer run of the same config.
    run_dir = app.new_run_dir(resolved, root)
    stack.enter_context(run_lock(run_dir, on_wait=say))
    app.write_run_files(run_dir, resolved)  # at once: another command looking for this run finds it
    return run_dir, "new"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, help=f"one of {available_tables()}")
    parser.add_argument("--scale", default="cpu", choices=["paper", "cpu", "smoke"])
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
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every row (key=value)")
    args = parser.parse_intermixed_args(argv)

    try:
        rows = select_rows(args.table, args.rows)
        plan = [(row, compose_row(args.table, row, args.scale, args.backend, args.overrides)) for row in rows]
        everything = [resolved for _, runs in plan for resolved in runs]
        notice, too_long = long_run.assess(everything, "--yes (or the override confirm=true)", confirmed=args.yes)
        if too_long:
            print(f"config error: {too_long}", file=sys.stderr)
            return preflight.CONFIG_ERROR_EXIT
        root = preflight.check_writable(args.output_root, "--output-root")
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return preflight.CONFIG_ERROR_EXIT

    n_runs = sum(len(runs) for _, runs in plan)
    print(f"[{args.table} scale={args.scale} backend={args.backend}] {len(plan)} rows, {n_runs} runs -> {root}")
    if notice:
        print(notice, flush=True)
    started = time.time()
    done = 0
    refused: list[str] = []
    failed: list[str] = []
    for row, runs in plan:
        for resolved in runs:
            done += 1
            tag = (f"[{done}/{n_runs}] {args.table}/{row} seed={resolved.run.train.seed} "
                   f"profile={resolved.run.profile.name}")

            def say(line: str, tag: str = tag) -> None:
                print(f"{tag}: {line}", flush=True)

            run_dir = None
            try:
                with ExitStack() as stack:
                    run_dir, action = claim_run(resolved, root, args.fresh, stack, say)
                    if action == "reuse":
                        say(f"reusing completed run {run_dir}")
                        continue
                    say(app.resume_note(run_dir) or f"running in {run_dir}")
                    metrics = app.run_one(resolved, run_dir, restart_damaged=args.restart_damaged, on_wait=say)
            except RunRefused as exc:
                print(f"{tag}: refused: {exc}", file=sys.stderr, flush=True)
                refused.append(f"{tag}: {run_dir}")
                continue
            except (KeyboardInterrupt, RunInterrupted) as exc:
                rec = _record(run_dir) if run_dir is not None else None
                where = (f"{run_dir} stopped after step {rec.steps_done if rec else 0}" if run_dir is not None
                         else "stopped before the run started")
                print(f"{tag}: interrupted: {where}; run the same command again to resume it", file=sys.stderr,
                      flush=True)
                return 130 if isinstance(exc, KeyboardInterrupt) else 128 + getattr(exc, "signum", 15)
            print(f"[{done}/{n_runs}] {app.summary_line(resolved, metrics)}", flush=True)
            if metrics.status != "completed":
                failed.append(f"{tag}: {run_dir}")
    label = f"[{args.table} scale={args.scale} backend={args.backend}]"
    print(f"{label} runs finished in {time.time() - started:.0f} s")
    code = 0
    if not args.no_render:
        from paper_tables.__main__ import render_and_print

        expected = {(args.table, row): [identity_digest(app.config_dict(r)) for r in runs] for row, runs in plan}
        code = render_and_print(args.table, args.scale, args.backend, root, root / "tables", rows=args.rows,
                                expected=expected)
    for line in refused:
        print(f"refused (see above; nothing in it was changed): {line}", file=sys.stderr)
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
