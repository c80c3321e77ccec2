"""Regenerate one paper table: run every row (every seed), collect, render.

    python -m experiments.reproduce --table wt2-nt-1024 --scale cpu --backend torch

Every row is composed and validated before the first one trains, so a config error costs nothing.
A row whose completed run with the identical resolved config already exists is reused; an
interrupted one resumes from its last checkpoint; a failed row is shown as failed in the table. The
last line printed is the path of the rendered Markdown table.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from experiments import app
from experiments.schema import register
from pcaf_core.config import ConfigError
from pcaf_core.results import CONFIG_FILE, read_metrics

EXPERIMENT_DIR = app.CONF_DIR / "experiment"


def available_tables() -> list[str]:
    return sorted(p.name for p in EXPERIMENT_DIR.iterdir() if p.is_dir())


def table_rows(table: str) -> list[str]:
    """Row ids of ``table`` in the paper's order (from paper_tables' spec when it lists them)."""
    if table not in available_tables():
        raise ConfigError(f"table={table!r} is unknown: expected one of {available_tables()}")
    files = sorted(p.stem for p in (EXPERIMENT_DIR / table).glob("*.yaml"))
    try:
        from paper_tables.specs import TABLES

        ordered = [r for r in TABLES[table].row_ids if r in files] if table in TABLES else []
    except ImportError:
        ordered = []
    return ordered + [r for r in files if r not in ordered]


def _ensure_hydra() -> None:
    """Initialise Hydra's compose API on the suite's config directory once per process."""
    register()
    if not GlobalHydra.instance().is_initialized():
        initialize_config_dir(config_dir=str(app.CONF_DIR), version_base="1.3", job_name="reproduce")


def compose_row(table: str, row: str, scale: str, backend: str, overrides: list[str]) -> list[app.ResolvedRun]:
    """Compose, scale and validate every run (one per seed entry) of a row."""
    _ensure_hydra()
    base = [f"experiment={table}/{row}", f"scale={scale}", f"backend={backend}"]
    cfg = compose(config_name="config", overrides=base + overrides)
    seed_runs = OmegaConf.to_container(cfg.seed_runs) or [{}]
    if seed_runs == [{}]:
        return [app.resolve(cfg, overrides)]
    runs = []
    for entry in seed_runs:
        seeded = compose(config_name="config", overrides=base + [f"{k}={v}" for k, v in entry.items()] + overrides)
        runs.append(app.resolve(seeded, overrides))
    return runs


def _same_config(run_dir: Path, resolved: app.ResolvedRun) -> bool:
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return False
    old = OmegaConf.to_container(OmegaConf.load(path))
    new = OmegaConf.to_container(resolved.cfg, resolve=True)
    old.pop("run_dir", None)
    new.pop("run_dir", None)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, help=f"one of {available_tables()}")
    parser.add_argument("--scale", default="cpu", choices=["paper", "cpu", "smoke"])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--rows", default="*", help="glob over row ids, comma-separated (default: all rows)")
    parser.add_argument("--output-root", default="outputs")
    parser.add_argument("--fresh", action="store_true", help="always start new runs (no reuse, no resume)")
    parser.add_argument("--no-render", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every row (key=value)")
    args = parser.parse_args(argv)
    root = Path(args.output_root).resolve()

    try:
        patterns = args.rows.split(",")
        rows = [r for r in table_rows(args.table) if any(fnmatch.fnmatch(r, p) for p in patterns)]
        if not rows:
            raise ConfigError(f"--rows={args.rows!r} matches no row of {args.table}: {table_rows(args.table)}")
        plan = [(row, compose_row(args.table, row, args.scale, args.backend, args.overrides)) for row in rows]
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    n_runs = sum(len(runs) for _, runs in plan)
    print(f"[{args.table} scale={args.scale} backend={args.backend}] {len(plan)} rows, {n_runs} runs -> {root}")
    started = time.time()
    done = 0
    for row, runs in plan:
        for resolved in runs:
            done += 1
            tag = (f"[{done}/{n_runs}] {args.table}/{row} seed={resolved.run.train.seed} "
                   f"profile={resolved.run.profile.name}")
            previous, status = (None, "") if args.fresh else existing_run(resolved, root)
            if status == "completed":
                print(f"{tag}: reusing completed run {previous}")
                continue
            run_dir = previous if previous is not None and status != "failed" else app.new_run_dir(resolved, root)
            print(f"{tag}: {'resuming' if run_dir == previous else 'running'} in {run_dir}", flush=True)
            metrics = app.run_one(resolved, run_dir)
            print(f"[{done}/{n_runs}] {app.summary_line(resolved, metrics)}", flush=True)
    print(f"[{args.table} scale={args.scale} backend={args.backend}] runs finished in {time.time() - started:.0f} s")
    if args.no_render:
        return 0
    from paper_tables.__main__ import main as render_main

    return render_main(["render", "--table", args.table, "--scale", args.scale, "--backend", args.backend,
                        "--runs", str(root), "--out", str(root / "tables"), "--rows", args.rows])


if __name__ == "__main__":
    from experiments.allocator import ensure_tunables

    ensure_tunables()
    sys.exit(main())
