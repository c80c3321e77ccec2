"""Hydra entry point: train one paper row (or a multirun sweep of it).

    python -m experiments.run experiment=wt2-nt-1024/pcaf_context scale=cpu backend=torch
    python -m experiments.run -m experiment=wt2-nt-1024/pcaf_context scale=smoke memory.top_k=4,8,16,32

Each run writes its own directory (see :func:`experiments.app.new_run_dir`); ``run_dir=<path>``
resumes an interrupted run from its last checkpoint (``restart_damaged=true`` starts it over when every
checkpoint it has is damaged). A command that does not repeat the run's own settings and backend is refused
with one line and changes nothing (:func:`experiments.app.check_resume`); ``restart=true`` trains it in a new
run directory instead, the old one kept as it is. Before Hydra starts, every job of the command line is composed and
validated (:mod:`experiments.preflight`): a bad key, type, value or output directory exits 2 with one
``config error`` line per bad job, and nothing runs. In a sweep, a job that fails while running is
recorded as failed and the others go on; the sweep's summary marks it, and the command exits 1.
``hydra/launcher=local|slurm`` runs each job of a sweep as a submitit job, on this machine or on a Slurm cluster
(docs/EXPERIMENTS.md, "On a cluster").
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments import app, runner
from experiments.preflight import CONFIG_ERROR_EXIT, check_command_line
from experiments.schema import register
from experiments.sweep_jobs import continue_sweep_command
from pcaf_core.checkpoints import RunRefused
from pcaf_core.config import ConfigError
from pcaf_core.loop import RunInterrupted
from pcaf_core.results import RunMetrics
from pcaf_core.run_record import write_failed_record

register()


def _run_dir(cfg: DictConfig, resolved: app.ResolvedRun | None, row: str, seed: object) -> Path | None:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        path = Path(hc.sweep.dir) / f"{hc.job.num:03d}-{row}-seed{seed}"
        return path if path.is_absolute() else Path.cwd() / path
    return None


def _interrupted(run_dir: Path, exc: BaseException) -> None:
    code = 130 if isinstance(exc, KeyboardInterrupt) else 128 + getattr(exc, "signum", 15)
    resolved_cmd = ""
    try:
        resolved_cmd = app.read_metrics(run_dir).extra.get("resume_command") or ""
    except (FileNotFoundError, app.SchemaError):
        pass
    app.say(f"interrupted: {run_dir} stopped" + (f"; resume it with: {resolved_cmd}" if resolved_cmd else ""))
    hc = HydraConfig.get()
    # A sweep run in this process (Hydra's basic launcher) stops here, its later jobs not started: the same command
    # would start a new sweep directory, so say how to continue this one. Launcher jobs run in processes of their own
    # and resume through the launcher (docs/EXPERIMENTS.md, "On a cluster").
    if hc.mode == RunMode.MULTIRUN and hc.launcher.get("_target_", "").endswith("BasicLauncher"):
        sweep_dir = Path(hc.sweep.dir).resolve()
        app.say(f"the sweep in {sweep_dir} stopped at job {hc.job.num}; continue it there (finished jobs reused, this "
                f"one resumed, the rest run): {continue_sweep_command(sys.argv[1:], sweep_dir)} "
                f"(make sweep: the same command with SWEEP_DIR={shlex.quote(str(sweep_dir))})")
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        resolved = app.resolve(cfg, list(HydraConfig.get().overrides.task))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        if not multirun:
            sys.exit(CONFIG_ERROR_EXIT)
        # A sweep goes on with its other jobs; this one is recorded as failed where its runs would be.
        app.label_from_experiment(cfg, list(HydraConfig.get().overrides.task))
        run_dir = _run_dir(cfg, None, str(cfg.row), cfg.train.seed)
        write_failed_record(run_dir, RunMetrics(table=str(cfg.table), row=str(cfg.row)), f"config error: {exc}")
        return
    run_dir = _run_dir(cfg, resolved, resolved.row, resolved.run.train.seed)
    if run_dir is not None and cfg.restart and cfg.run_dir:
        old, run_dir = run_dir, app.new_run_dir(resolved)
        app.say(f"restart: training this command in a new run directory {run_dir}; {old} is kept as it is")
    run_dir = run_dir or app.new_run_dir(resolved)
    try:
        app.check_resume(resolved, run_dir)  # before saying "resuming": the run may not be this command's
        note = runner.resume_note(run_dir)
        if note:
            app.say(note)
        metrics = runner.run_one(resolved, run_dir, restart_damaged=bool(cfg.restart_damaged))
    except RunRefused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        if not multirun:
            sys.exit(1)
        return
    except (KeyboardInterrupt, RunInterrupted) as exc:
        _interrupted(run_dir, exc)
    print(runner.summary_line(resolved, metrics), file=sys.stdout if metrics.status == "completed" else sys.stderr)
    if metrics.status != "completed" and not multirun:
        sys.exit(1)


if __name__ == "__main__":
    from experiments.allocator import ensure_tunables

    ensure_tunables()
    code = check_command_line(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    main()
