"""The cluster path against real Slurm (docs/EXPERIMENTS.md, "On a cluster"): a table's rows and a sweep's values
submitted with sbatch to a one-node cluster started here (tests/local_slurm.py: slurmctld, slurmd, slurmdbd with
MariaDB, munge), their states read back with sacct, a job cancelled with scancel and one signalled as Slurm
signals a job before its time limit, requeued by Slurm itself.

tests/test_cluster.py runs the same commands through submitit's local executor, which needs no daemons; here the
submission, the job states, the cancellation and the requeue are Slurm's. The daemons need root and Debian's
packages: ``make test-slurm`` installs them (``make slurm-deps``) and runs this file; CI runs it after ``make test``,
which leaves it out (it spends about 105 s waiting on Slurm)."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcaf_core.results import read_curve, read_metrics
from tests import local_slurm
from tests.test_cluster import REPO, SWEEP, TABLE_ARGS, _env, _wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ON_THE_NODE = ["hydra.launcher.partition=" + local_slurm.PARTITION, "backend.device=cpu"]


@pytest.fixture(scope="module")
def slurm():
    """The client environment of a one-node cluster, for every test of this file."""
    if local_slurm.missing_binaries() or os.geteuid() != 0:
        pytest.skip("needs Slurm's daemons: `make test-slurm` (root, Debian) installs them and runs these tests")
    with local_slurm.one_node_slurm() as env:
        yield env


def _slurm_env(slurm: dict[str, str], **extra: str) -> dict[str, str]:
    # The table command looks at its jobs every 2 s, not every 30 s: the cluster is this machine's own.
    return _env(SLURM_CONF=slurm["SLURM_CONF"], PCAF_SLURM_POLL_S="2", **extra)


def _states(slurm: dict[str, str], job_ids: list[str], want: dict[str, str] | None = None) -> dict[str, str]:
    """Each job's state as Slurm's accounting records it (the allocation's line, not its steps'). With ``want``,
    read again for up to 30 s until the records are those: slurmctld hands them to slurmdbd asynchronously, so an
    array task that has ended may not be in sacct yet."""
    end = time.monotonic() + 30
    while True:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)], env=slurm,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if line)
        if want is None or states == want or time.monotonic() > end:
            return states
        time.sleep(0.5)


def _submitted(log: str) -> list[str]:
    return re.findall(r"submitted job (\d+):", log)


def test_a_tables_rows_run_as_slurm_jobs_and_the_same_command_collects_them(slurm, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.reproduce", *TABLE_ARGS[:4], "--rows", "pcaf_context,local_conv",
           *TABLE_ARGS[6:], "--launcher", "slurm", "--output-root", str(out), *ON_THE_NODE]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_slurm_env(slurm), timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    jobs = _submitted(first.stdout)
    assert len(jobs) == 2, first.stdout[-3000:]
    assert _states(slurm, jobs, want := {j: "COMPLETED" for j in jobs}) == want
    runs = sorted((out / "wt2-nt-1024" / "smoke" / "torch").glob("*/*/metrics.json"))
    assert [read_metrics(p.parent).status for p in runs] == ["completed", "completed"]
    # The jobs' records name the submitted jobs, and each job ran in a process Slurm started, not the command's.
    recorded = json.loads(next((out / "jobs").rglob("jobs.json")).read_text())
    assert sorted(str(v["job_id"]) for v in recorded.values()) == sorted(jobs)
    assert all(json.loads((p.parent / "environment.json").read_text())["argv"][0].endswith("_submit.py")
               for p in runs)

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_slurm_env(slurm), timeout=600)
    assert again.returncode == 0 and not _submitted(again.stdout), again.stdout[-3000:]
    assert again.stdout.count("reusing completed run") == 2


def test_a_sweeps_values_run_as_one_job_array_and_a_cancelled_one_is_said_and_resumed(slurm, tmp_path):
    """The sweep's two values as one Slurm job array, a task at a time (array_parallelism=1). scancel ends task 0 at
    step 3: the command says so in one line with sacct's state, runs task 1, renders the summary and exits 1 with the
    command that continues the sweep; that command keeps #1 without a job and resumes #0 from step 2 in one job,
    which, signalled at step 5 as before a time limit, is requeued by Slurm and resumes from step 4."""
    sweep_dir = tmp_path / "sweep"
    args = [*SWEEP, "hydra/launcher=slurm", *ON_THE_NODE, "hydra.launcher.array_parallelism=1", "train.steps=8",
            "train.checkpoint_every=2", "eval.protocol=reference"]
    log, held = tmp_path / "first.log", tmp_path / "3.held"
    first = subprocess.Popen([sys.executable, "-m", "experiments.run", "-m", *args, f"hydra.sweep.dir={sweep_dir}"],
                             cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                             env=_slurm_env(slurm, PCAF_SITE_HOLD_AT_STEP="3", PCAF_SITE_HOLD_MARKER=str(held)))
    _wait_for(held.exists, "task 0 to reach step 3", first, log, timeout=300)
    # One array job, a task per swept value (the plugin submits a sweep's batch as a Slurm job array).
    (array,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.name.isdigit()]
    subprocess.run(["scancel", f"{array}_0"], env=slurm, check=True, timeout=30)
    assert first.wait(300) == 1, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert re.search(rf"sweep job #0 \(\S+ scale=smoke memory.top_k=4 .*\): job {array}_0 ended without finishing its "
                     r"run \(no result; job state CANCELLED.*\); its log: ", text), text[-3000:]
    assert f"1 of 2 jobs of the sweep in {sweep_dir} failed (the others ran)" in text
    states = _states(slurm, [array], {f"{array}_0": "CANCELLED by 0", f"{array}_1": "COMPLETED"})
    assert states[f"{array}_0"].startswith("CANCELLED") and states[f"{array}_1"] == "COMPLETED", states
    (run_dir,) = sweep_dir.glob("000-*")  # marked failed, once the cancelled task's process had let go of it
    assert read_metrics(run_dir).status == "failed" and "job state CANCELLED" in read_metrics(run_dir).error

    # The printed command, whose task 0 is signalled at step 5 as Slurm signals a job before its time limit:
    # submitit requeues it, and the sweep waits for the requeued task rather than taking it for ended.
    log, held = tmp_path / "again.log", tmp_path / "5.held"
    command = text.splitlines()[-1].split("): ", 1)[1].rsplit(" (make sweep: ", 1)[0]
    again = subprocess.Popen([sys.executable, *shlex.split(command)[1:]], cwd=REPO,
                             stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                             env=_slurm_env(slurm, PCAF_SITE_HOLD_AT_STEP="5", PCAF_SITE_HOLD_MARKER=str(held)))
    _wait_for(held.exists, "the continued task 0 to reach step 5", again, log, timeout=300)
    # One job, not an array: #1's run is complete with its config, so no job is submitted for it.
    (second,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.name.isdigit() and p.name != array]
    assert "is finished with this config: kept, no job submitted" in log.read_text()
    subprocess.run(["scancel", "--signal=USR2", second], env=slurm, check=True, timeout=30)
    assert again.wait(300) == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text() and "ended without finishing" not in log.read_text()
    with (sweep_dir / "sweep_memory.top_k.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["memory.top_k"], r["n_runs"]) for r in rows] == [("4", "1"), ("16", "1")] and all(
        r["best_ppl"] for r in rows)
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.extra["segments"] == 3  # killed, continued, requeued
    assert [r["step"] for r in read_curve(run_dir)] == [1, 2, 4, 6, 8]
    assert log.read_text().count(f"sweep output: {sweep_dir}/sweep_memory.top_k.md") == 1


def test_a_cancelled_job_is_resubmitted_and_a_signalled_one_requeued_by_slurm_both_resuming(slurm, tmp_path):
    """scancel ends the job training the row at step 3 (after the step-2 checkpoint): sacct says CANCELLED, the
    command reports it and exits 1; the same command again submits the run again and its job resumes from step 2.
    That job gets USR2 at step 5, as Slurm signals a job before its time limit: submitit asks Slurm to requeue it
    (scontrol requeue), Slurm holds it pending (tests/local_slurm.py: cred_expire), and the requeued job resumes
    from step 4 in the same directory."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.reproduce", *TABLE_ARGS, "--launcher", "slurm", "--output-root",
           str(out), *ON_THE_NODE]
    runs = out / "wt2-nt-1024" / "smoke" / "torch" / "pcaf_context"
    logs = {n: tmp_path / f"{n}.log" for n in ("first", "again")}

    held = tmp_path / "3.held"
    first = subprocess.Popen(cmd, cwd=REPO, stdout=logs["first"].open("w"), stderr=subprocess.STDOUT, text=True,
                             env=_slurm_env(slurm, PCAF_SITE_HOLD_AT_STEP="3", PCAF_SITE_HOLD_MARKER=str(held)))
    _wait_for(held.exists, "the job to reach step 3", first, logs["first"], timeout=300)
    (job,) = _submitted(logs["first"].read_text())
    subprocess.run(["scancel", job], env=slurm, check=True, timeout=30)
    assert first.wait(300) == 1, logs["first"].read_text()[-3000:]
    text = logs["first"].read_text()
    assert re.search(rf"job {job} ended without finishing its run \(no result; job state CANCELLED.*\); its log: "
                     r".*; run the same command again to resume the run from its last checkpoint", text), text[-3000:]
    assert _states(slurm, [job])[job].startswith("CANCELLED")
    (run_dir,) = runs.iterdir()
    rec = read_metrics(run_dir)  # marked once the cancelled job's process had let go of the run
    assert rec.status == "failed" and rec.extra["resumable"] and f"job {job} ended without finishing" in rec.error

    held = tmp_path / "5.held"
    again = subprocess.Popen(cmd, cwd=REPO, stdout=logs["again"].open("w"), stderr=subprocess.STDOUT, text=True,
                             env=_slurm_env(slurm, PCAF_SITE_HOLD_AT_STEP="5", PCAF_SITE_HOLD_MARKER=str(held)))
    _wait_for(held.exists, "the resubmitted job to reach step 5", again, logs["again"], timeout=300)
    (second,) = _submitted(logs["again"].read_text())
    job_log = Path(re.search(r"submitted job \d+: .*; its log: (\S+)", logs["again"].read_text()).group(1))
    assert f"resuming {run_dir} from step 2" in job_log.read_text()
    # What Slurm sends a job signal_delay_s before its time limit (sbatch --signal=USR2@120), sent to the job's
    # steps as Slurm sends it.
    subprocess.run(["scancel", "--signal=USR2", second], env=slurm, check=True, timeout=30)
    assert again.wait(300) == 0, logs["again"].read_text()[-3000:]

    assert list(runs.iterdir()) == [run_dir]
    log = job_log.read_text()
    assert "Requeued job" in log and f"resuming {run_dir} from step 4" in log
    assert _states(slurm, [second], want := {second: "COMPLETED"}) == want
    # Slurm's accounting has both instances of the job: the one requeued, then the one that finished.
    instances = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-o", "State", "-j", second], env=slurm,
                               capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert instances == ["REQUEUED", "COMPLETED"]
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.steps_done == 8 and rec.extra["segments"] == 3
    assert [r["step"] for r in read_curve(run_dir)] == [1, 2, 4, 6, 8]
