"""A sweep's jobs through the suite's submitit launchers (``hydra/launcher=local|slurm``), and how a stopped sweep
continues.

Hydra's submitit plugin submits a batch of a sweep as one job array and waits for each job's result; an ``sbatch``
that refuses the array, or a job that ends without a result (SIGKILL, out of memory, a node failure), ends the
command in submitit's traceback, the summary never rendered. The suite's launchers
(``hydra_plugins/pcaf_launchers``) keep the plugin's jobs, resources and requeueing, and :func:`launch` reports both
in lines:

- ``sbatch`` refusing a batch (no cluster reachable, an unknown partition or account): one ``config error`` line
  naming the jobs and ``sbatch``'s reason, exit 2; when earlier batches ran, the line says how to continue the
  sweep in its directory.
- Ctrl-C while waiting: one line naming the jobs and the command that continues the sweep, exit 130.
- a job whose task raised (outside a run, which records its own failure): one line with the error and the job's
  log, and it counts as failed as below.
- a job ending without a result: one line naming the job, the cluster's state of it and its log, as soon as the
  command sees it; its run's record, which the dead process left ``running``, is marked failed and resumable with
  that line (:func:`experiments.submitit_common.mark_lost_run`); the sweep's other jobs and later batches go on.
  The summary (:class:`experiments.callbacks.SweepSummary`) lists it with the failed jobs, says how to continue
  the sweep (its run resumes from its last checkpoint, the finished jobs are reused), and the command exits 1.

A job whose run is already complete with the job's config (a continued sweep) is not submitted: the command says
so and keeps the run (:func:`finished_run`). The jobs themselves are the plugin's: each runs ``experiments.run``'s
task in its own process.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

from experiments import app
from experiments.submitit_common import executor_parameters, job_result, mark_lost_run

_LOST: dict[Path, dict[int, str]] = {}
"""Sweep directory -> job number -> the line said when the job ended without a result, for the summary that
:class:`experiments.callbacks.SweepSummary` renders in the same process once the sweep has ended."""


def continue_sweep_command(argv: list[str], sweep_dir: Path) -> str:
    """The sweep command ``argv`` (``experiments.run``'s arguments) run again in ``sweep_dir``: the same jobs in the
    same order get the same run directories, so the finished ones are reused and a stopped one resumes."""
    kept = [a for a in argv if not a.lstrip("+~").startswith("hydra.sweep.dir=")]
    return shlex.join(["python", "-m", "experiments.run", *kept, f"hydra.sweep.dir={app.hydra_value(str(sweep_dir))}"])


def lost_jobs(sweep_dir: Path) -> dict[int, str]:
    """Job number -> line, for every job of the sweep in ``sweep_dir`` that ended without a result in this
    process's sweep (empty for the basic launcher, whose jobs run in this process)."""
    return dict(_LOST.get(Path(sweep_dir).resolve(), {}))


def _result(job, number: int, overrides: list[str], sweep_dir: Path, since: float):
    """The job's ``JobReturn``; for a job that ended without one, or whose task raised (Hydra returns the error in
    a failed ``JobReturn``), its line said and kept for the summary."""
    from hydra.core.utils import JobReturn, JobStatus

    results, line = job_result(job)
    if results is not None and results[0].status != JobStatus.FAILED:
        return results[0]
    if results is not None:
        error = results[0]._return_value  # the exception the task raised (experiments.run records a run's own)
        said = next((part.strip() for part in str(error).splitlines() if part.strip()), "")
        line = (f"job {job.job_id} failed: {type(error).__name__}{': ' + said[:300] if said else ''}; its log: "
                f"{job.paths.stdout} and {job.paths.stderr}")
    print(f"sweep job #{number} ({' '.join(overrides)}): {line}", file=sys.stderr, flush=True)
    _LOST.setdefault(sweep_dir.resolve(), {})[number] = line
    records = [d for d in sweep_dir.glob(f"{number:03d}-*") if (d / "metrics.json").is_file()]
    if len(records) == 1:
        mark_lost_run(records[0], f"{line}; the sweep's command, run again in its directory, resumes it", since)
    # COMPLETED, with nothing returned: Hydra's sweeper raises a failed job's exception, which would stop the sweep
    # and skip its summary; the summary reads this job's failure from lost_jobs() instead.
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None)


def finished_run(launcher, sweep_dir: Path, number: int, overrides: list[str]) -> Path | None:
    """The run directory of sweep job ``number`` when its run is complete with the job's own config: the run a job
    would only report finished (a table reuses such a run the same way, :func:`experiments.table_runs.run_state`).
    None when there is none, or when anything is in doubt (the job then runs and decides)."""
    dirs = sorted(sweep_dir.glob(f"{number:03d}-*"))
    if len(dirs) != 1:
        return None
    from omegaconf import open_dict, read_write

    from experiments.table_runs import run_state
    from pcaf_core.run_identity import read_run_config, same_identity

    existing = read_run_config(dirs[0])
    if existing is None:
        return None
    try:  # the job's config as its process composes it (Hydra's run_job drops the hydra node)
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        resolved = app.resolve(cfg, list(overrides))
    except Exception:  # noqa: BLE001 - the job composes it again and says what is wrong
        return None
    if not same_identity(existing, app.config_dict(resolved)):
        return None
    return dirs[0] if run_state(dirs[0], resolved)[0] == "reuse" else None


def launch(launcher, job_overrides, initial_job_idx: int) -> list:
    """Submit one batch of a sweep as one job array through ``launcher`` (a suite launcher: Hydra's submitit
    launcher with :attr:`params`, :attr:`config` and the plugin's job call) and wait for its jobs: their
    ``JobReturn``, in order. See the module's docstring for what is said when ``sbatch`` refuses or a job dies."""
    import logging

    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, filter_overrides

    from experiments.preflight import CONFIG_ERROR_EXIT

    kind = launcher._EXECUTOR
    params = launcher.params
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in launcher.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(launcher.config.hydra.sweep.mode), 8))
    init = {f"{kind}_max_num_timeout": params["max_num_timeout"]} if "max_num_timeout" in params else {}
    executor = submitit.AutoExecutor(folder=params["submitit_folder"], cluster=kind, **init)
    executor.update_parameters(**executor_parameters(kind, params))

    log = logging.getLogger(__name__)
    log.info(f"Submitit '{kind}' sweep output dir : {sweep_dir}")
    kept: dict[int, JobReturn] = {}
    for number, overrides in enumerate(job_overrides, start=initial_job_idx):
        log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
        done = finished_run(launcher, sweep_dir, number, list(overrides))
        if done is not None:  # a continued sweep: no job (and no wait in a cluster's queue) for a finished run
            print(f"sweep job #{number} ({' '.join(overrides)}): {done} is finished with this config: kept, no job "
                  "submitted", file=sys.stderr, flush=True)
            kept[number] = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None)
    todo = [(n, list(o)) for n, o in enumerate(job_overrides, start=initial_job_idx) if n not in kept]
    if not todo:
        return [kept[n] for n in sorted(kept)]
    numbers = [n for n, _ in todo]
    # The plugin's job call (launcher.__call__) in every job: the job's overrides, where its directory goes, its
    # number, an id and Hydra's global state, as Hydra's own submitit launcher passes them.
    calls = [(o, "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state()) for n, o in todo]
    since = time.time()
    try:
        jobs = executor.map_array(launcher, *zip(*calls))
    except submitit.core.utils.FailedJobError as exc:  # sbatch said no: no cluster, a bad partition, ...
        said = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["(nothing)"]
        which = ("job " if len(numbers) == 1 else "jobs ") + ", ".join(f"#{n}" for n in numbers)
        before = (f"; the sweep's {initial_job_idx} earlier job(s) ran: continue the sweep in its directory with "
                  f"{continue_sweep_command(sys.argv[1:], sweep_dir.resolve())}" if initial_job_idx else
                  "; no job of the sweep was submitted")
        print(f"config error: sbatch refused the sweep's {which}: {said[-1]}{before}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    try:
        ran = {n: _result(job, n, o, sweep_dir, since) for job, (n, o) in zip(jobs, todo)}
        return [kept[n] if n in kept else ran[n] for n in range(initial_job_idx, initial_job_idx + len(job_overrides))]
    except KeyboardInterrupt:
        # Ctrl-C while waiting: the jobs are not this process's to stop (Slurm's go on; local ones got a terminal's
        # Ctrl-C too, and a run stopped so resumes). Without this, Hydra's run would end in a traceback.
        ids = ", ".join(str(job.job_id) for job in jobs)
        print(f"interrupted while waiting for the sweep's jobs {ids} (Slurm jobs go on; local ones got a terminal's "
              f"Ctrl-C too); continue the sweep in its directory with "
              f"{continue_sweep_command(sys.argv[1:], sweep_dir.resolve())} (a run a job still trains is waited for, "
              "then kept)", file=sys.stderr, flush=True)
        sys.exit(130)
