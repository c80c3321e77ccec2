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
- a job ending without a result: one line naming the job, the cluster's state of it and its log, as soon as the
  command sees it; its run's record, which the dead process left ``running``, is marked failed and resumable with
  that line; the sweep's other jobs and later batches go on. The summary
  (:class:`experiments.callbacks.SweepSummary`) lists it with the failed jobs, says how to continue the sweep (its
  run resumes from its last checkpoint, the finished jobs are reused), and the command exits 1.

The jobs themselves are the plugin's: each runs ``experiments.run``'s task in its own process.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from experiments import app

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


def executor_parameters(kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    """submitit's executor parameters from a suite launcher's ``settings`` (``kind``: ``local`` or ``slurm``), named
    as Hydra's submitit plugin names them: its shared keys as they are, the others prefixed by the executor. The
    keys that are not the job's (the folder, the requeue count, which the executor takes at construction) are left
    out, and so are unset ones."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    shared = set(BaseQueueConf.__dataclass_fields__)
    skip = {"_target_", "submitit_folder", "max_num_timeout"}
    return {(k if k in shared else f"{kind}_{k}"): v for k, v in settings.items() if k not in skip and v is not None}


def job_result(job) -> tuple[list | None, str | None]:
    """``(results, None)`` of a submitit ``job`` that has ended (its tasks' results), or ``(None, line)`` for one
    that ended without them (killed, out of memory, a node failure, or its call raised): the line names the job,
    why (submitit's text of a job that left no result names the cluster's state of it, Slurm's from ``sacct``:
    CANCELLED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...; else the error's first line) and its log."""
    import submitit

    if isinstance(job, submitit.LocalJob):
        # A local job's process writes its result before it ends, on this machine's file system: one that ended
        # without it never writes it (submitit would wait 15 s for a shared file system's lag).
        job._results_timeout_s = 0
    try:
        return job.results(), None
    except Exception as exc:  # noqa: BLE001 - the job died (killed, out of memory) or raised: reported, not lost
        state = re.search(r"has not produced any output \(state: ([^)]*)\)", str(exc))
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        why = f"no result; job state {state.group(1)}" if state else first[:300]
        if isinstance(job, submitit.LocalJob) and state and state.group(1) == "FINISHED":
            # submitit's local state of a job whose process exited, however it exited: this one left no result.
            why = "no result; its process exited without one: killed, or out of memory"
        return None, (f"job {job.job_id} ended without finishing its run ({why}); its log: {job.paths.stdout} and "
                      f"{job.paths.stderr}")


def _result(job, number: int, overrides: list[str], sweep_dir: Path):
    """The job's ``JobReturn``; for a job that ended without one, its line said and kept for the summary."""
    from hydra.core.utils import JobReturn, JobStatus

    results, line = job_result(job)
    if results is not None:
        return results[0]
    print(f"sweep job #{number} ({' '.join(overrides)}): {line}", file=sys.stderr, flush=True)
    _LOST.setdefault(sweep_dir.resolve(), {})[number] = line
    records = [d for d in sweep_dir.glob(f"{number:03d}-*") if (d / "metrics.json").is_file()]
    if len(records) == 1:
        _mark_stopped(records[0], line)
    # COMPLETED, with nothing returned: Hydra's sweeper raises a failed job's exception, which would stop the sweep
    # and skip its summary; the summary reads this job's failure from lost_jobs() instead.
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None)


def _mark_stopped(run_dir: Path, line: str) -> None:
    """The record of a run whose job died, left ``running`` by its process, marked failed and resumable with
    ``line`` (as a SIGTERM leaves a run): the sweep's table then says why, and its command run again resumes it.
    Under the run's lock, which a cancelled Slurm job's process may hold until Slurm has ended it."""
    from pcaf_core.results import SchemaError, read_metrics
    from pcaf_core.run_record import mark_failed, run_lock

    with run_lock(run_dir, on_wait=app.say):
        try:
            if read_metrics(run_dir).status != "running":
                return  # the job ended its record itself (failed, or completed before its result was lost)
        except SchemaError:
            return  # a damaged record stays as it is: the resume reports it
        mark_failed(run_dir, None, f"{line}; the sweep's command, run again in its directory, resumes it",
                    resumable=True)


def launch(launcher, job_overrides, initial_job_idx: int) -> list:
    """Submit one batch of a sweep as one job array through ``launcher`` (a suite launcher: Hydra's submitit
    launcher with :attr:`params`, :attr:`config` and the plugin's job call) and wait for its jobs: their
    ``JobReturn``, in order. See the module's docstring for what is said when ``sbatch`` refuses or a job dies."""
    import logging

    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import filter_overrides

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
    numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
    for number, overrides in zip(numbers, job_overrides):
        log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
    # The plugin's job call (launcher.__call__) in every job: the job's overrides, where its directory goes, its
    # number, an id and Hydra's global state, as Hydra's own submitit launcher passes them.
    calls = [(list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state())
             for n, o in zip(numbers, job_overrides)]
    try:
        jobs = executor.map_array(launcher, *zip(*calls))
    except submitit.core.utils.FailedJobError as exc:  # sbatch said no: no cluster, a bad partition, ...
        said = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["(nothing)"]
        which = f"job #{numbers[0]}" if len(numbers) == 1 else f"jobs #{numbers[0]}-#{numbers[-1]}"
        ran = (f"; the sweep's {initial_job_idx} earlier job(s) ran: continue the sweep in its directory with "
               f"{continue_sweep_command(sys.argv[1:], sweep_dir.resolve())}" if initial_job_idx else
               "; no job of the sweep was submitted")
        print(f"config error: sbatch refused the sweep's {which}: {said[-1]}{ran}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    return [_result(job, n, list(o), sweep_dir) for job, n, o in zip(jobs, numbers, job_overrides)]
