"""Regenerate one paper table: run every row (every seed), collect, render.

    python -m experiments.reproduce --table wt2-nt-1024 --scale cpu --backend torch

Every row is composed and validated before the first one trains, so a config error costs nothing
(one ``config error`` line, exit 2). A row whose completed run with the identical resolved config
already exists is reused; a stopped one (Ctrl-C, SIGTERM, SIGKILL, a full disk) is resumed from its
last checkpoint ("resuming <dir> from step N"); a run another process is training is waited for,
never written into; a failed row is shown as failed in the table. The last line printed is the path
of the rendered Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from omegaconf import OmegaConf

from experiments import app, preflight
from pcaf_core.checkpoints import RunRefused
from pcaf_core.config import ConfigError
from pcaf_core.loop import RunInterrupted
from pcaf_core.results import CONFIG_FILE, RunMetrics, read_metrics
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
    """Compose, scale and validate every run (one per seed entry) of a row (a one-line ConfigError if not)."""
    base = [f"experiment={table}/{row}", f"scale={scale}", f"backend={backend}"]
    cfg = preflight.compose_config(base + overrides)
    seed_runs = OmegaConf.to_container(cfg.seed_runs) or [{}]
    if seed_runs == [{}]:
        return [preflight.resolve_job(base + overrides, user_overrides=overrides, composed=cfg)]
    runs = []
    for entry in seed_runs:
        seeded = [f"{k}={v}" for k, v in entry.items()]
        # The seed entries are plain values: set on a copy of the composition, as Hydra would set them from the
        # command line, instead of composing the row again (most of a second each).
        cfg_seed = copy.deepcopy(cfg)
        for key, value in entry.items():
            OmegaConf.update(cfg_seed, key, value, merge=False)
        resolved = preflight.resolve_job(base + seeded + overrides, user_overrides=overrides, composed=cfg_seed)
        resolved.overrides = seeded + resolved.overrides  # the resume command must compose this seed
        runs.append(resolved)
    return runs


def _same_config(run_dir: Path, resolved: app.ResolvedRun) -> bool:
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return False
    old = OmegaConf.to_container(OmegaConf.load(path))
    new = OmegaConf.to_container(resolved.cfg, resolve=True)
    for key in ("run_dir", "restart_damaged"):  # where and how it runs, not what
        old.pop(key, None)
        new.pop(key, None)
    return old == new


def existing_run(resolved: app.ResolvedRun, root: Path) -> tuple[Path | None, str]:
    """The newest run dir of this row/seed with the identical config: (dir, status) or (None, '')."""
    parent = root / resolved.table / resolved.scale / resolved.backend / resolved.row
    candidates = sorted(parent.glob(f"seed{resolved.run.train.seed}-*"), reverse=True) if parent.exists() else []
    for run_dir in candidates:
        if not _same_config(run_dir, resolved):
            continue
        try:
            status = read_metrics(run_dir).status
        except Exception:  # noqa: BLE001 - an unreadable record: treat as interrupted
            status = "running"
        return run_dir, status
    return None, ""


def _record(run_dir: Path) -> RunMetrics | None:
    try:
        return read_metrics(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable or absent record: the run never finished
        return None


def claim_run(resolved: app.ResolvedRun, root: Path, fresh: bool, stack: ExitStack,
              say: Callable[[str], None]) -> tuple[Path, str]:
    """Pick and lock the directory of one run: ``(dir, action)``, action ``reuse``, ``resume`` or ``new``.

    The newest directory of this row and seed with the identical resolved config is locked (waiting,
    with a message, while another process runs it), then its record decides: ``completed`` is reused; a
    run that was stopped (SIGKILL leaves ``running``; SIGTERM, Ctrl-C and a full disk leave ``failed``
    with ``extra.resumable``) is resumed; any other failure gets a new directory. The lock stays held
    (in ``stack``) for the run's life."""
    tried: set[Path] = set()
    while not fresh:
        previous, _ = existing_run(resolved, root)
        if previous is None or previous in tried:
            break
        tried.add(previous)
        hold = ExitStack()
        hold.enter_context(run_lock(previous, on_wait=say))
        rec = _record(previous)  # read under the lock: the holder may just have finished it
        if rec is None or rec.status in ("completed", "running") or rec.extra.get("resumable"):
            stack.enter_context(hold.pop_all())
            return previous, "reuse" if rec is not None and rec.status == "completed" else "resume"
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
    parser.add_argument("--no-render", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every row (key=value)")
    args = parser.parse_intermixed_args(argv)

    try:
        root = preflight.check_writable(args.output_root, "--output-root")
        rows = select_rows(args.table, args.rows)
        plan = [(row, compose_row(args.table, row, args.scale, args.backend, args.overrides)) for row in rows]
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return preflight.CONFIG_ERROR_EXIT

    n_runs = sum(len(runs) for _, runs in plan)
    print(f"[{args.table} scale={args.scale} backend={args.backend}] {len(plan)} rows, {n_runs} runs -> {root}")
    started = time.time()
    done = 0
    refused: list[str] = []
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
    print(f"[{args.table} scale={args.scale} backend={args.backend}] runs finished in {time.time() - started:.0f} s")
    code = 0
    if not args.no_render:
        from paper_tables.__main__ import main as render_main

        code = render_main(["render", "--table", args.table, "--scale", args.scale, "--backend", args.backend,
                            "--runs", str(root), "--out", str(root / "tables"), "--rows", args.rows])
    for line in refused:
        print(f"refused (see above; nothing in it was changed): {line}", file=sys.stderr)
    return 1 if refused else code


if __name__ == "__main__":
    from experiments.allocator import ensure_tunables

    ensure_tunables()
    sys.exit(main())
