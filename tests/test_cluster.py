"""Sweeps and tables as submitit jobs (docs/EXPERIMENTS.md, "On a cluster"), with the real executor: submitit's
local executor runs every job as its own process here, so the cluster path is tested for real; the sbatch script
of a Slurm job is checked here, and tests/test_slurm.py submits such jobs to a one-node Slurm.

Faults inside job processes come from ``tests/fixtures/site/sitecustomize.py`` (on ``PYTHONPATH``, inherited by
every process a job starts): a one-time hold at a training step, or modules made unimportable. Commands that only
check their jobs, and the basic launcher's sweep the local one is compared with, run in this process
(tests/entry_points.py).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.allocator import TUNABLES
from pcaf_core.results import read_curve, read_metrics
from tests.entry_points import run_app, run_main

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "tests" / "fixtures" / "site"
# One row, 8 steps, a checkpoint every 2 steps, no full-split pass: a few seconds a job.
TABLE_ARGS = ["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context", "--no-render",
              "train.steps=8", "train.checkpoint_every=2", "eval.protocol=reference"]
SWEEP = ["experiment=wt2-nt-1024/pcaf_context", "scale=smoke", "memory.top_k=4,16"]
CLUSTER_MODULES = "submitit,hydra_plugins.hydra_submitit_launcher"


def _env(**extra: str) -> dict[str, str]:
    # One intra-op thread in every process: the two launchers' runs must compute the same numbers.
    path = os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PCAF_NO_PROGRESS": "1", "GLIBC_TUNABLES": TUNABLES, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path, **extra}


def _run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(**env), timeout=timeout)


def _wait_for(check, what: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; output:\n{log.read_text()[-3000:]}")


def _holder_pid(run_dir: Path) -> int:
    """The process training ``run_dir``: its lock file names it."""
    return int(json.loads((run_dir / ".lock").read_text())["pid"])


def _parent_command(pid: int) -> str:
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_text().replace("\0", " ")


# --------------------------------------------------------------------------- without the extra, without Slurm


def test_a_launcher_without_the_cluster_extra_is_refused_in_one_line_naming_it(tmp_path):
    out = tmp_path / "out"
    commands = [
        [sys.executable, "-m", "experiments.reproduce", *TABLE_ARGS, "--launcher", "slurm", "--output-root", str(out)],
        [sys.executable, "-m", "experiments.run", "-m", *SWEEP, "hydra/launcher=slurm", f"output_root={out}"],
        [sys.executable, "-m", "experiments.run", "-m", *SWEEP, "hydra/launcher=submitit_local", f"output_root={out}"],
    ]
    for cmd in commands:
        res = _run(cmd, PCAF_SITE_BLOCK=CLUSTER_MODULES)
        assert res.returncode == 2, res.stdout + res.stderr
        (line,) = res.stderr.splitlines()
        assert line.startswith("config error: ") and "needs the cluster extra" in line, line
        assert "pip install -e '.[cluster]' (or make setup EXTRAS=cluster)" in line
    assert not out.exists()
    # With the extra, Slurm's absence is the next thing said, as one line (PATH: this environment's tools alone,
    # whether or not the machine has Slurm's clients).
    res = _run(commands[0], PATH=os.path.dirname(sys.executable))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "sbatch, which is not on PATH" in res.stderr


def test_a_job_sbatch_refuses_stops_the_table_in_one_line_after_the_jobs_already_submitted(tmp_path, monkeypatch):
    """sbatch on PATH but refusing (no cluster reachable, a bad partition or account): the table command says so in
    one line naming the run and sbatch's reason, exit 2, rather than with submitit's traceback; jobs it submitted
    before that one go on, and the line says so."""
    from experiments.reproduce import main as reproduce

    tools = tmp_path / "bin"
    tools.mkdir()
    # The first submission is accepted (job 4242), the next refused as Slurm refuses an unknown partition.
    (tools / "sbatch").write_text(
        f"#!/bin/sh\nif [ -e {tmp_path}/once ]; then echo 'sbatch: error: Batch job submission failed: Invalid "
        f"partition name specified' >&2; exit 1; fi\ntouch {tmp_path}/once; echo 'Submitted batch job 4242'\n")
    (tools / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    res = run_main(reproduce, ["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context,local_conv",
                               "--launcher", "slurm", "--output-root", str(tmp_path / "out"), "--no-render"])
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.splitlines()[-1]
    assert line.startswith("config error: sbatch refused the job of [2/2] wt2-nt-1024/local_conv seed=1234"), line
    assert "profile=reference_torch: sbatch: error: Batch job submission failed: Invalid partition name" in line
    assert "the 1 job(s) submitted before it go on (jobs: " in line and "run again, waits for them" in line
    assert "submitted job 4242" in res.stdout
    # The command's poll interval on Slurm, when set, must be seconds: said before anything is submitted.
    monkeypatch.setenv("PCAF_SLURM_POLL_S", "soon")
    res = run_main(reproduce, ["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context",
                               "--launcher", "slurm", "--output-root", str(tmp_path / "out2"), "--no-render"])
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "config error: PCAF_SLURM_POLL_S='soon' is not a number of seconds above 0: unset it (30 s) or set e.g. "
        "PCAF_SLURM_POLL_S=10"]


def test_a_sweep_whose_jobs_sbatch_refuses_stops_in_one_line_naming_them(tmp_path, monkeypatch):
    """The same for a sweep through hydra/launcher=slurm: sbatch's reason and the jobs it refused in the command's
    last line, exit 2, rather than submitit's traceback; nothing was submitted, and the line says so."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account or "
                                  "account/partition combination specified' >&2\nexit 1\n")
    (tools / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    sweep_dir = tmp_path / "sweep"
    res = run_app(["-m", *SWEEP, "hydra/launcher=slurm", "hydra.launcher.account=nobody",
                   f"hydra.sweep.dir={sweep_dir}"])
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.splitlines()[-1] == (
        "config error: sbatch refused the sweep's jobs #0, #1: sbatch: error: Batch job submission failed: Invalid "
        "account or account/partition combination specified; no job of the sweep was submitted")
    assert not list(sweep_dir.glob("0*"))  # no run directory: no job ran


def _launch_with(executor, tmp_path: Path, monkeypatch, job_overrides: list[list[str]], initial_job_idx: int,
                 ends: bool = True):
    """experiments.sweep_jobs.launch of a Slurm sweep (memory.top_k=4,8,16 in batches of 2) through ``executor``
    in place of submitit's: the SystemExit it ends with (``ends``), else what it returns."""
    from types import SimpleNamespace

    import submitit
    from omegaconf import OmegaConf

    from experiments import sweep_jobs

    monkeypatch.setattr(submitit, "AutoExecutor", executor)
    sweep_dir = tmp_path / "sweep"
    launcher = SimpleNamespace(_EXECUTOR="slurm", params={"submitit_folder": str(sweep_dir / ".submitit" / "%j")},
                               config=OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}}))
    monkeypatch.setattr(sys, "argv", ["run.py", "-m", "memory.top_k=4,8,16", "hydra/launcher=slurm",
                                      "hydra.sweeper.max_batch_size=2"])
    if not ends:
        return sweep_jobs.launch(launcher, job_overrides, initial_job_idx=initial_job_idx)
    with pytest.raises(SystemExit) as stop:
        sweep_jobs.launch(launcher, job_overrides, initial_job_idx=initial_job_idx)
    return stop.value


class _Executor:
    """submitit's executor as the launcher uses it, keeping the parameters it is given."""

    def __init__(self, **kwargs):
        self.parameters = dict(kwargs)

    def update_parameters(self, **kwargs):
        self.parameters.update(kwargs)


CONTINUE = ("python -m experiments.run -m memory.top_k=4,8,16 hydra/launcher=slurm hydra.sweeper.max_batch_size=2 "
            "hydra.sweep.dir={}")


def test_a_later_batch_sbatch_refuses_says_how_to_continue_the_sweep(tmp_path, monkeypatch, capsys):
    """When sbatch refuses a batch after earlier ones ran (hydra.sweeper.max_batch_size), the line gives the command
    that continues the sweep in its directory. The executor is one that refuses, as sbatch does at a QOS limit."""
    import submitit

    class Refusing(_Executor):
        def map_array(self, *args):
            raise submitit.core.utils.FailedJobError("sbatch: error: QOSMaxSubmitJobPerUserLimit\n")

    assert _launch_with(Refusing, tmp_path, monkeypatch, [["memory.top_k=16"]], 2).code == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: sbatch refused the sweep's job #2: sbatch: error: QOSMaxSubmitJobPerUserLimit; the sweep's 2 "
        f"earlier job(s) ran: continue the sweep in its directory with {CONTINUE.format(tmp_path / 'sweep')}"]


def test_ctrl_c_while_waiting_for_a_sweeps_jobs_says_how_to_continue_it(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the command waits for its jobs: one line naming them and the continuing command, exit 130,
    rather than Hydra's traceback."""
    from types import SimpleNamespace

    class Waiting(_Executor):
        def map_array(self, *args):
            def results():
                raise KeyboardInterrupt

            return [SimpleNamespace(job_id=f"4242_{i}", results=results) for i in range(2)]

    assert _launch_with(Waiting, tmp_path, monkeypatch, [["memory.top_k=4"], ["memory.top_k=8"]], 0).code == 130
    assert capsys.readouterr().err.splitlines() == [
        "interrupted while waiting for the sweep's jobs 4242_0, 4242_1 (Slurm jobs go on; local ones got a "
        "terminal's Ctrl-C too); continue the sweep in its directory with "
        f"{CONTINUE.format(tmp_path / 'sweep')} (a run a job still trains is waited for, then kept)"]


def test_a_sweep_job_whose_task_raised_is_said_in_one_line_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    """Hydra hands a task's exception back in a failed JobReturn, which its sweeper would raise, stopping the sweep
    in a traceback: the launcher says it in one line with the job's log, and the summary counts the job failed."""
    from types import SimpleNamespace

    from hydra.core.utils import JobReturn, JobStatus

    from experiments import sweep_jobs

    returns = [JobReturn(status=JobStatus.FAILED, _return_value=OSError("[Errno 28] No space left on device")),
               JobReturn(status=JobStatus.COMPLETED, _return_value=None)]

    class Ran(_Executor):
        def map_array(self, *args):
            return [SimpleNamespace(job_id=f"4242_{i}", results=lambda r=r: [r],
                                    paths=SimpleNamespace(stdout=f"4242_{i}.out", stderr=f"4242_{i}.err"))
                    for i, r in enumerate(returns)]

    out = _launch_with(Ran, tmp_path, monkeypatch, [["memory.top_k=4"], ["memory.top_k=8"]], 0, ends=False)
    assert [r.status for r in out] == [JobStatus.COMPLETED, JobStatus.COMPLETED]  # the sweep goes on
    line = "job 4242_0 failed: OSError: [Errno 28] No space left on device; its log: 4242_0.out and 4242_0.err"
    assert capsys.readouterr().err.splitlines() == [f"sweep job #0 (memory.top_k=4): {line}"]
    assert sweep_jobs.lost_jobs(tmp_path / "sweep") == {0: line}


# --------------------------------------------------------------------------- Slurm's sbatch script


def _slurm_tools(tmp_path: Path) -> str:
    """A ``PATH`` with ``srun``/``sbatch``, as on a login node: the commands and submitit's Slurm executor check that
    they exist. Never run: nothing is submitted here."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("srun", "sbatch"):
        (tools / name).write_text("#!/bin/sh\necho 'not a cluster' >&2\nexit 1\n")
        (tools / name).chmod(0o755)
    return f"{tools}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.slow
def test_every_job_is_validated_before_any_is_submitted_through_either_launcher(tmp_path, monkeypatch):
    from experiments.reproduce import main as reproduce

    out = tmp_path / "out"
    monkeypatch.setenv("PATH", _slurm_tools(tmp_path))
    for launcher in ("local", "slurm"):
        res = run_app(["-m", "experiment=wt2-nt-1024/pcaf_context", "scale=smoke", "memory.top_k=4,0,-1",
                       f"hydra/launcher={launcher}", f"output_root={out}"])
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stderr.splitlines() == [
            "config error: memory.top_k=0 is invalid: K must be >= 1 (job 1: memory.top_k=0)",
            "config error: memory.top_k=-1 is invalid: K must be >= 1 (job 2: memory.top_k=-1)",
            "config error: 2 of 3 jobs are invalid; no job was started"]
        res = run_main(reproduce, ["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context,local_conv",
                                   "--launcher", launcher, "--output-root", str(out), "memory.top_k=0"])
        assert res.returncode == 2 and res.stderr == "config error: memory.top_k=0 is invalid: K must be >= 1\n"
        res = run_main(reproduce, [*TABLE_ARGS, "--launcher", launcher, "--output-root", str(out),
                                   "hydra.launcher.timeout_min=soon"])
        assert res.returncode == 2 and res.stderr.startswith("config error: hydra.launcher.timeout_min: Value 'soon'")
        assert res.stderr.count("\n") == 1
    assert not out.exists()


def _sbatch(executor) -> list[str]:
    slurm = executor._executor
    return slurm._make_submission_file_text(slurm._submitit_command_str, "uid").splitlines()


def test_the_slurm_job_of_a_two_gpu_row_asks_for_two_gpus_on_one_node_and_its_estimated_time(tmp_path, monkeypatch):
    from experiments import cluster, cluster_jobs
    from experiments.table_plan import compose_row

    monkeypatch.setenv("PATH", _slurm_tools(tmp_path))
    (resolved,) = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", ["backend.world_size=2"])
    settings = cluster.launcher_settings("slurm", ["hydra.launcher.partition=gpu",
                                                   "hydra.launcher.setup=[module load cuda/12.4]"])
    run = resolved.run
    costs_csv = tmp_path / "step_cost.csv"
    with costs_csv.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["table", "row", "scale", "backend", "T", "batch", "precision",
                                                "step_ms", "device"])
        writer.writeheader()
        writer.writerow({"table": "wt2-nt-1024", "row": "pcaf_context", "scale": "smoke", "backend": "torch",
                         "T": run.train.seq_len, "batch": run.train.batch_size, "precision": run.train.precision,
                         "step_ms": 90_000, "device": "NVIDIA H100 80GB HBM3"})
    resources = cluster.row_resources(resolved, "slurm", settings, cluster.read_step_costs(costs_csv))
    # 90 s a step, measured, x 2 for what the step cost leaves out, plus the start-up allowance.
    minutes = cluster.START_MINUTES + run.train.steps * 90 * 2 // 60
    assert (resources.gpus, resources.timeout_min) == (2, minutes)
    assert "measured on NVIDIA H100 80GB HBM3" in resources.basis
    executor = cluster_jobs.make_executor("slurm", tmp_path / "jobs", settings, resources,
                                          cluster_jobs.job_name(resolved))
    lines = _sbatch(executor)
    flags = {line for line in lines if line.startswith("#SBATCH")}
    for flag in ("--gpus-per-node=2", "--ntasks-per-node=1", "--nodes=1", f"--time={minutes}",
                 f"--mem={cluster.host_memory_gb(resolved)}GB", "--partition=gpu", "--signal=USR2@120",
                 "--job-name=pcaf-wt2-nt-1024-pcaf_context-seed1234",
                 f"--output={tmp_path}/jobs/%j/%j_0_log.out"):
        assert f"#SBATCH {flag}" in flags, (flag, lines)
    assert cluster.host_memory_gb(resolved) == 17  # two DDP processes of 8 GB and a 13M-parameter model's state
    assert lines.index("module load cuda/12.4") < next(i for i, line in enumerate(lines) if line.startswith("srun"))

    # A paper-scale row without a measured step: the FLOP-based figure, longer than a job may ask for, so the job
    # asks for the partition's limit and is requeued (resuming from its checkpoint) often enough to finish.
    (paper,) = compose_row("main-303m", "pcaf_context_wt103_t1024", "paper", "torch", [])
    long = cluster.row_resources(paper, "slurm", settings)
    total = cluster.START_MINUTES + cluster.train_seconds(paper, None)[0] / 60
    assert "no measured step cost: analytic FLOPs at 48 TFLOP/s x 10" in long.basis
    assert long.timeout_min == 2880 and long.requeues >= total / 2880 > 3
    executor = cluster_jobs.make_executor("slurm", tmp_path / "jobs", settings, long, cluster_jobs.job_name(paper))
    assert executor._executor.max_num_timeout == long.requeues
    assert "#SBATCH --time=2880" in _sbatch(executor) and "#SBATCH --gpus-per-node=1" in _sbatch(executor)


# --------------------------------------------------------------------------- sweeps through submitit_local


def _sweep_table(out: Path) -> tuple[Path, list[dict[str, str]]]:
    (sweep_dir,) = (out / "multirun").iterdir()
    with (sweep_dir / "sweep_memory.top_k.csv").open() as fh:
        return sweep_dir, list(csv.DictReader(fh))


@pytest.mark.slow
def test_a_local_launcher_sweep_runs_each_job_in_its_own_process_outlives_a_killed_job_and_summarises_as_the_basic(
        tmp_path):
    """The sweep, 8 steps a run, through the basic launcher (in this process) and through hydra/launcher=local, one
    job at a time (two batches). In the local sweep job #0 is SIGKILLed at step 3 (after its step-2 checkpoint):
    the command says so in one line naming the job and its log, runs job #1, renders the summary with #0 failed,
    and exits 1 with the command that continues the sweep in its directory. That command keeps #1 without a job
    and resumes #0 from step 2, and the sweep's summary then equals the basic launcher's."""
    import torch

    args = [*SWEEP, "train.steps=8", "train.checkpoint_every=2", "eval.protocol=reference"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the local launcher's jobs (_env)
    try:
        basic = run_app(["-m", *args, f"output_root={tmp_path / 'basic'}"])
    finally:
        torch.set_num_threads(threads)
    assert basic.returncode == 0, basic.stderr[-3000:]

    sweep_dir = tmp_path / "local"
    out, err = tmp_path / "first.out", tmp_path / "first.err"
    first = subprocess.Popen([sys.executable, "-m", "experiments.run", "-m", *args, "hydra/launcher=local",
                              "hydra.sweeper.max_batch_size=1", f"hydra.sweep.dir={sweep_dir}"], cwd=REPO,
                             stdout=out.open("w"), stderr=err.open("w"), text=True,
                             env=_env(PCAF_SITE_HOLD_AT_STEP="3", PCAF_SITE_HOLD_MARKER=str(tmp_path / "3.held")))
    _wait_for(lambda: (tmp_path / "3.held").exists(), "job #0 to reach step 3", first, err)
    (run_dir,) = sweep_dir.glob("000-*")
    os.kill(_holder_pid(run_dir), signal.SIGKILL)
    assert first.wait(120) == 1, err.read_text()[-3000:]
    lines = err.read_text().splitlines()
    assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
    said = next(line for line in lines if line.startswith("sweep job #0 "))
    assert re.fullmatch(r"sweep job #0 \(experiment=\S+ scale=smoke memory.top_k=4 .*\): job \d+ ended without "
                        r"finishing its run \(.+\); its log: \S+_log.out and \S+_log.err", said), said
    assert f"failed job {run_dir.name}: {said.split(': ', 1)[1]}" in lines
    assert f"1 of 2 jobs of the sweep in {sweep_dir} failed (the others ran)" in lines
    # The summary callback ran once, in the launching process; the jobs' logs do not have it.
    assert out.read_text().count(f"sweep output: {sweep_dir}/sweep_memory.top_k.md") == 1
    assert not any("sweep output" in p.read_text() for p in (sweep_dir / ".submitit").glob("*/*_log.out"))
    with (sweep_dir / "sweep_memory.top_k.csv").open() as fh:
        rows = {r["memory.top_k"]: r for r in csv.DictReader(fh)}
    # The killed run's record, left "running" by its process, is marked failed (resumable) with the line.
    assert rows["16"]["n_runs"] == "1" and rows["16"]["best_ppl"] and (rows["4"]["n_runs"], rows["4"]["n_failed"]) == (
        "0", "1")
    rec = read_metrics(run_dir)
    assert rec.status == "failed" and rec.extra["resumable"] and rec.error.startswith(said.split(": ", 1)[1])

    assert lines[-1].startswith("continue the sweep there (finished runs kept, stopped ones resumed")
    command, make_hint = lines[-1].split("): ", 1)[1].rsplit(" (make sweep: ", 1)
    assert make_hint == f"the same command with SWEEP_DIR={sweep_dir})"
    again = _run([sys.executable, *shlex.split(command)[1:]])
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_metrics(run_dir).status == "completed" and [r["step"] for r in read_curve(run_dir)] == [1, 2, 4, 6, 8]
    job_logs = "".join(p.read_text() for p in (sweep_dir / ".submitit").glob("*/*_log.*"))
    assert f"resuming {run_dir} from step 2" in job_logs
    # #1's run is complete with its config: no job for it (no wait in a cluster's queue for nothing).
    finished = next(sweep_dir.glob("001-*"))
    assert (f"sweep job #1 (experiment=wt2-nt-1024/pcaf_context scale=smoke memory.top_k=16 train.steps=8 "
            f"train.checkpoint_every=2 eval.protocol=reference): {finished} is finished with this config: kept, no job "
            "submitted") in again.stderr.splitlines()

    basic_dir, basic_rows = _sweep_table(tmp_path / "basic")
    with (sweep_dir / "sweep_memory.top_k.csv").open() as fh:
        local_rows = list(csv.DictReader(fh))
    # The basic sweep ends in one table and one plot (the command test_experiments_e2e would run again).
    assert len(list(basic_dir.glob("*/metrics.json"))) == 2  # failing jobs: tests/test_interrupt_and_rerun.py
    assert (basic_dir / "sweep_memory.top_k.png").stat().st_size > 0
    assert sorted(int(r["memory.top_k"]) for r in basic_rows) == [4, 16] and all(r["best_ppl"] for r in basic_rows)
    same = ["memory.top_k", "n_runs", "n_failed", "best_ppl", "final_ppl", "acc_at_best", "full_ppl", "params"]
    assert [[r[k] for k in same] for r in local_rows] == [[r[k] for k in same] for r in basic_rows]
    assert [r["memory.top_k"] for r in local_rows] == ["4", "16"] and {r["n_runs"] for r in local_rows} == {"1"}
    assert (sweep_dir / "sweep_memory.top_k.png").stat().st_size > 0

    # Each job ran in a process of its own, started by submitit, not in a launching command's process (#0's
    # environment is its first job's, which the resumed run keeps).
    envs = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/environment.json"))]
    pids = {env["pid"] for env in envs}
    assert len(envs) == 2 and len(pids) == 2 and first.pid not in pids
    assert all(env["argv"][0].endswith(os.path.join("submitit", "core", "_submit.py")) for env in envs)
    assert len({p.name for p in (sweep_dir / ".submitit").iterdir()} - {"%j"}) == 3  # 2 jobs, then #0's again
    assert {p.name for p in basic_dir.glob("0*")} == {p.name for p in sweep_dir.glob("0*")}

# --------------------------------------------------------------------------- a table's jobs: killed, preempted


@pytest.mark.slow
def test_a_table_job_killed_is_resubmitted_by_the_same_command_and_a_preempted_one_requeued_both_resuming(tmp_path):
    """The job training the row is SIGKILLed at step 3 (after the step-2 checkpoint): the command reports it and
    exits 1; the same command again submits the run again and its job resumes from step 2. That job is preempted
    at step 5 (submitit's signal, SIGUSR2): submitit requeues it (RowJob.checkpoint) and it resumes from step 4 in
    the same directory. One run directory, no step trained twice past a checkpoint."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.reproduce", *TABLE_ARGS, "--launcher", "local", "--output-root", str(out)]
    runs = out / "wt2-nt-1024" / "smoke" / "torch" / "pcaf_context"

    logs = {n: tmp_path / f"{n}.log" for n in ("first", "again")}
    first = subprocess.Popen(cmd, cwd=REPO, stdout=logs["first"].open("w"), stderr=subprocess.STDOUT, text=True,
                             env=_env(PCAF_SITE_HOLD_AT_STEP="3", PCAF_SITE_HOLD_MARKER=str(tmp_path / "3.held")))
    _wait_for(lambda: (tmp_path / "3.held").exists(), "the job to reach step 3", first, logs["first"])
    (run_dir,) = runs.iterdir()
    job_pid = _holder_pid(run_dir)
    assert job_pid != first.pid and "submitit.local._local" in _parent_command(job_pid)
    os.kill(job_pid, signal.SIGKILL)
    assert first.wait(120) == 1, logs["first"].read_text()[-3000:]
    text = logs["first"].read_text()
    assert re.search(r"job \d+ ended without finishing its run \(.*\); its log: .*; run the same command again to "
                     r"resume the run from its last checkpoint", text), text[-3000:]
    assert "1 failed of 1 runs" in text
    # The record the killed process left "running" is marked failed, resumable, with the line said.
    rec = read_metrics(run_dir)
    assert rec.status == "failed" and rec.extra["resumable"] and rec.error in text
    assert re.match(r"job \d+ ended without finishing its run \(no result; its process exited without one", rec.error)

    again = subprocess.Popen(cmd, cwd=REPO, stdout=logs["again"].open("w"), stderr=subprocess.STDOUT, text=True,
                             env=_env(PCAF_SITE_HOLD_AT_STEP="5", PCAF_SITE_HOLD_MARKER=str(tmp_path / "5.held")))
    _wait_for(lambda: (tmp_path / "5.held").exists(), "the resubmitted job to reach step 5", again, logs["again"])
    job_log = Path(re.search(r"submitted job \d+: .*; its log: (\S+)", logs["again"].read_text()).group(1))
    assert f"resuming {run_dir} from step 2" in job_log.read_text()
    os.kill(_holder_pid(run_dir), signal.SIGUSR2)  # what Slurm sends before preempting or timing out a job
    assert again.wait(120) == 0, logs["again"].read_text()[-3000:]

    assert list(runs.iterdir()) == [run_dir]
    log = job_log.read_text()
    assert "Requeued job" in log and f"resuming {run_dir} from step 4" in log
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.steps_done == 8 and rec.extra["segments"] == 3
    assert [r["step"] for r in read_curve(run_dir)] == [1, 2, 4, 6, 8]
    assert json.loads((run_dir / "environment.json").read_text())["pid"] == job_pid  # made by the killed job
    assert "[1/1] [wt2-nt-1024/pcaf_context scale=smoke backend=torch" in logs["again"].read_text()
