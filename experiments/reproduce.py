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
:func:`experiments.table_runs.run_planned` in its own process, on this machine or on a Slurm node, with the resources
:mod:`experiments.cluster` states; the command waits for the jobs (or, with ``--no-wait``, returns; the same
command again collects them) and renders the table when every run has ended.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from experiments import long_run, preflight
from experiments.table_plan import Plan, available_tables, compose_row, expected_identities, select_rows
from experiments.table_runs import Outcome, interrupted_line, report, run_planned, run_tag
from pcaf_core.config import ConfigError
from pcaf_core.loop import RunInterrupted
from pcaf_core.results import SCALES


def _run_here(plan: Plan, args: argparse.Namespace, root: Path) -> list[tuple[str, Outcome]] | int:
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

        try:
            outcomes = run_jobs(plan, args, root, settings)
        except ConfigError as exc:  # the cluster refused a job
            print(f"config error: {exc}", file=sys.stderr)
            return preflight.CONFIG_ERROR_EXIT
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
