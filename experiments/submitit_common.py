"""What the suite's submitit jobs share, a sweep's (:mod:`experiments.sweep_jobs`) and a table's
(:mod:`experiments.cluster_jobs`): the executor's parameters from a launcher's settings, a job's results or why it
has none, and the record of a run whose job died.

Imports submitit only inside the functions that use a job: a command without the ``cluster`` extra can import it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from experiments import app

CLOCK_SKEW_S = 60.0
"""How far behind this machine's clock a record's modification time may be and still be a job's own
(:func:`mark_lost_run`)."""


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


def mark_lost_run(run_dir: Path, error: str, since: float) -> bool:
    """Mark the record of a run whose job died, which the dead process left ``running``, failed and resumable with
    ``error`` (as a SIGTERM leaves a run): a table then says why, and the command run again resumes it. Returns
    whether it did.

    Only a record written at or after ``since`` (the job's submission, seconds since the epoch) is this job's: one
    older is an earlier process's, left as it is. Read and written under the run's lock, which a cancelled Slurm
    job's process may hold until Slurm has ended it."""
    from pcaf_core.results import SchemaError, read_metrics
    from pcaf_core.run_record import mark_failed, run_lock

    with run_lock(run_dir, on_wait=app.say):
        try:
            written = (run_dir / "metrics.json").stat().st_mtime
            # A minute's allowance: a cluster node's clock (or its file server's) may be behind this machine's.
            if read_metrics(run_dir).status != "running" or written < since - CLOCK_SKEW_S:
                return False  # ended by the job itself, or not this job's record
        except (OSError, SchemaError):
            return False  # no record, or a damaged one: the resume reports it
        mark_failed(run_dir, None, error, resumable=True)
        return True
