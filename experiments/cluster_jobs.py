"""A table's runs as submitit jobs: ``python -m experiments.reproduce ... --launcher local|slurm``.

One job per run (per seed entry of a multi-seed row). A job runs :func:`experiments.table_runs.run_planned`, the
code path of the serial command, in its own process: on this machine (submitit's local executor) or on a Slurm
node, asking for the resources :func:`experiments.cluster.row_resources` states. Run identity, locks and records
therefore behave as without jobs: a completed run is reused (no job is submitted for it), a stopped one is
resumed from its last checkpoint, a run another process is training is waited for.

Jobs live under ``<output root>/jobs/<table>/<scale>/<backend>/``: ``<job id>/`` holds submitit's files (the
pickled call, ``<job id>_0_log.out`` / ``.err``, the result) and the sbatch script; ``jobs.json`` records which job
was submitted for which run identity, so that the same command run again while the jobs are queued or running
waits for them instead of submitting them twice (``--no-wait`` submits and returns; the command run again after
the jobs ended collects the runs and renders the table). A job that ends without finishing its run (killed, out
of memory, a node failure) is reported with its log and its run's record marked failed and resumable with that
line; the same command run again submits the run again, and the job resumes it from its last checkpoint. A job
preempted or signalled at its time limit is requeued by submitit (:class:`RowJob` is checkpointable) and continues
the run it claimed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import submitit

from experiments import app, cluster
from experiments.submitit_common import executor_parameters, job_result, mark_lost_run
from experiments.table_runs import Outcome, completed_run, existing_runs, interrupted_line, report, run_planned, run_tag
from pcaf_core.config import ConfigError
from pcaf_core.fsutil import atomic_write_text, file_lock
from pcaf_core.loop import RunInterrupted
from pcaf_core.run_identity import identity_digest

LEDGER = "jobs.json"
POLL_S = {"local": 1.0, "slurm": 30.0}
"""Seconds between a waiting command's looks at its jobs (on Slurm a look may ask ``sacct``: not too often;
``PCAF_SLURM_POLL_S`` sets it, e.g. for a cluster of one's own: :func:`poll_seconds`)."""


def poll_seconds(kind: str) -> float:
    """:data:`POLL_S` of the launcher ``kind``, or ``PCAF_SLURM_POLL_S`` for Slurm (a one-line ConfigError when it
    is not a number of seconds above 0)."""
    raw = os.environ.get("PCAF_SLURM_POLL_S", "") if kind == "slurm" else ""
    if not raw:
        return POLL_S[kind]
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"PCAF_SLURM_POLL_S={raw!r} is not a number of seconds above 0: unset it (30 s) or set "
                          "e.g. PCAF_SLURM_POLL_S=10")
    return seconds


class RowJob(submitit.helpers.Checkpointable):
    """One run of a table as a job: :func:`experiments.table_runs.run_planned` in the job's process, returning its
    :class:`~experiments.table_runs.Outcome` as a dict.

    Checkpointable: a job signalled at its time limit or preempted is requeued by submitit with this object as it
    is then (:meth:`checkpoint`), so the requeued job continues the directory it claimed, from the run's last
    checkpoint, instead of choosing again (with ``--fresh`` it would start yet another run)."""

    def __init__(self) -> None:
        self.run_dir: str | None = None

    def __call__(self, resolved: app.ResolvedRun, root: str, fresh: bool, restart_damaged: bool) -> dict[str, Any]:
        def claimed(run_dir: Path) -> None:
            self.run_dir = str(run_dir)

        try:
            outcome = run_planned(resolved, Path(root), fresh=fresh, restart_damaged=restart_damaged,
                                  say=lambda line: print(line, flush=True),
                                  run_dir=Path(self.run_dir) if self.run_dir else None, on_claim=claimed)
        except (KeyboardInterrupt, RunInterrupted):
            outcome = Outcome("interrupted", self.run_dir, interrupted_line(self.run_dir))
        print(outcome.line, flush=True)
        return dataclasses.asdict(outcome)


def job_parameters(kind: str, settings: dict[str, Any], resources: cluster.Resources, name: str) -> dict[str, Any]:
    """The submitit executor parameters of one job: the launcher ``settings`` with the run's resources
    (:func:`experiments.submitit_common.executor_parameters`). A table's job is one task on one node."""
    return executor_parameters(kind, {**settings, "name": name, "gpus_per_node": resources.gpus,
                                      "timeout_min": resources.timeout_min, "mem_gb": resources.mem_gb,
                                      "tasks_per_node": 1, "nodes": 1})


def make_executor(kind: str, folder: Path, settings: dict[str, Any], resources: cluster.Resources,
                  name: str) -> submitit.AutoExecutor:
    """The executor that submits one job (``kind``: ``local`` or ``slurm``) into ``folder/<job id>/``."""
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster=kind,
                                     **{f"{kind}_max_num_timeout": resources.requeues})
    executor.update_parameters(**job_parameters(kind, settings, resources, name))
    return executor


def job_name(resolved: app.ResolvedRun) -> str:
    return f"pcaf-{resolved.table}-{resolved.row}-seed{resolved.run.train.seed}"


# --------------------------------------------------------------------------- the ledger: run identity -> job


def _read_ledger(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((folder / LEDGER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _record_job(folder: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one job to ``jobs.json`` (under a lock: two commands of one table may submit side by side)."""
    with file_lock(folder / ".jobs.lock"):
        ledger = _read_ledger(folder)
        ledger[key] = entry
        atomic_write_text(folder / LEDGER, json.dumps(ledger, indent=2, sort_keys=True))


def _local_alive(job_id: str) -> bool:
    """Whether a local job another command started still runs: its id is its controller's process id, which
    submitit cannot poll from another process."""
    pid = int(job_id)
    try:
        os.kill(pid, 0)
        return "submitit" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except ProcessLookupError:
        return False
    except OSError:  # no /proc (not Linux) or no permission: the process exists
        return True


def _slurm_queued(job_id: str) -> bool:
    """Whether Slurm's queue still holds the job (pending, running, requeued or completing).

    submitit takes the first ended state it reads from sacct as final, and sacct says CANCELLED while the job's
    process still runs: a job process ignores SIGTERM (submitit waits for USR2), so a cancelled job stays COMPLETING
    in the queue until Slurm's KillWait ends it, holding its run's lock. The queue says when the job has let go;
    it also holds a job Slurm requeued, pending, until the next instance starts."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False  # no squeue to ask: submitit's state stands
    if out.returncode != 0:
        # A job Slurm no longer knows (ended long ago) is an error too; any other error is a question unanswered.
        return "Invalid job id" not in out.stderr
    return bool(out.stdout.strip())


def _earlier_job(folder: Path, entry: dict[str, Any]) -> submitit.Job | None:
    """The job an earlier command submitted, when it is still queued or running; else None."""
    if entry["cluster"] == "slurm":
        job = submitit.SlurmJob(folder=folder / "%j", job_id=entry["job_id"])
        return None if job.done(force_check=True) and not _slurm_queued(job.job_id) else job
    return submitit.LocalJob(folder=folder / "%j", job_id=entry["job_id"]) if _local_alive(entry["job_id"]) else None


def _finished(job: submitit.Job, earlier: bool) -> bool:
    if earlier and isinstance(job, submitit.LocalJob):
        return not _local_alive(job.job_id)
    if isinstance(job, submitit.SlurmJob):
        return job.done() and not _slurm_queued(job.job_id)
    return job.done()


def _outcome(job: submitit.Job) -> dict[str, Any]:
    results, line = job_result(job)
    if results is None:
        return {"status": "lost", "run_dir": None,
                "line": f"{line}; run the same command again to resume the run from its last checkpoint"}
    return results[0]


def _mark_lost(resolved: app.ResolvedRun, root: Path, outcome: Outcome, since: float) -> None:
    """The run a lost job was training, which its dead process left ``running``: the newest of its identity (the
    one a job claims, resumed or new), marked failed and resumable with the outcome's line when the job wrote it
    (:func:`experiments.submitit_common.mark_lost_run`). A job that died before it claimed a run changed none."""
    found = existing_runs(resolved, root)
    if found and mark_lost_run(found[0], outcome.line, since):
        outcome.run_dir = str(found[0])


# --------------------------------------------------------------------------- the command


def run_jobs(plan: list, args: argparse.Namespace, root: Path, settings: dict[str, Any]) -> list | int:
    """Submit a job for every run of ``plan`` that is neither complete nor already queued or running as a job,
    then wait for the jobs: ``(tag, outcome)`` per run in the plan's order. Returns 0 instead when the command
    returns without waiting (``--no-wait``) and jobs remain, 130 when Ctrl-C stopped the waiting (the jobs go
    on)."""
    kind = args.launcher
    poll_s = poll_seconds(kind)
    folder = root / "jobs" / args.table / args.scale / args.backend
    folder.mkdir(parents=True, exist_ok=True)
    costs = cluster.read_step_costs(args.step_cost) if args.step_cost else None
    ledger = _read_ledger(folder)
    runs = [(run_tag(i + 1, sum(len(r) for _, r in plan), args.table, row, resolved), resolved)
            for i, (row, resolved) in enumerate((row, r) for row, rs in plan for r in rs)]
    outcomes: dict[int, Outcome] = {}
    active: list[tuple[int, submitit.Job, bool]] = []  # (index, job, submitted by an earlier command)
    submitted: dict[int, float] = {}  # index -> when its job was submitted (seconds since the epoch)
    queue: list[int] = []
    for i, (tag, resolved) in enumerate(runs):
        done = None if args.fresh else completed_run(resolved, root)
        if done is not None:
            print(f"{tag}: reusing completed run {done}", flush=True)
            outcomes[i] = Outcome("reused", str(done), f"reusing completed run {done}")
            continue
        entry = ledger.get(identity_digest(app.config_dict(resolved)))
        job = _earlier_job(folder, entry) if entry and entry["cluster"] == kind else None
        if job is not None:
            print(f"{tag}: job {job.job_id} (submitted {entry['submitted']}) is still queued or running; "
                  f"its log: {job.paths.stdout}", flush=True)
            active.append((i, job, True))
            submitted[i] = datetime.fromisoformat(entry["submitted"]).timestamp()
        else:
            queue.append(i)

    def submit(i: int) -> None:
        tag, resolved = runs[i]
        resources = cluster.row_resources(resolved, kind, settings, costs, args.time_min)
        executor = make_executor(kind, folder, settings, resources, job_name(resolved))
        try:
            job = executor.submit(RowJob(), resolved, str(root), args.fresh, args.restart_damaged)
        except submitit.core.utils.FailedJobError as exc:  # sbatch said no: no cluster, a bad partition, ...
            said = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["(nothing)"]
            going = (f"; the {len(active)} job(s) submitted before it go on (jobs: {folder}), and the same command, "
                     "run again, waits for them" if active else "")
            raise ConfigError(f"sbatch refused the job of {tag}: {said[-1]}{going}") from None
        _record_job(folder, identity_digest(app.config_dict(resolved)),
                    {"cluster": kind, "job_id": job.job_id, "table": resolved.table, "row": resolved.row,
                     "seed": resolved.run.train.seed, "submitted": datetime.now(UTC).isoformat(timespec="seconds")})
        print(f"{tag}: submitted job {job.job_id}: {resources.text()}; its log: {job.paths.stdout}", flush=True)
        active.append((i, job, False))
        submitted[i] = time.time()

    limit = args.jobs or len(runs)
    while queue and len(active) < limit:
        submit(queue.pop(0))
    if args.no_wait and active:
        print(f"[{args.table} scale={args.scale} backend={args.backend}] {len(active)} job(s) queued or running "
              f"(jobs: {folder}); run the same command again after they end to collect the runs and render the table",
              flush=True)
        return 0
    try:
        while active:
            for item in [a for a in active if _finished(a[1], a[2])]:
                active.remove(item)
                i, job, _ = item
                outcomes[i] = Outcome(**_outcome(job))
                if outcomes[i].status == "lost":
                    _mark_lost(runs[i][1], root, outcomes[i], submitted[i])
                report(runs[i][0], i + 1, len(runs), outcomes[i])
                if queue:
                    submit(queue.pop(0))
            if active:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        print(f"interrupted while waiting for {len(active)} job(s) (jobs: {folder}; Slurm jobs go on, local ones got "
              "the Ctrl-C too); run the same command again to wait for them or resume their runs", file=sys.stderr,
              flush=True)
        return 130
    return [(runs[i][0], outcomes[i]) for i in sorted(outcomes)]

