"""End to end: `make reproduce-table` at smoke scale, config errors, failed runs (a multirun sweep:
tests/test_cluster.py). The commands other than ``make`` run in this process (tests/entry_points.py): what they
print and their exit status are what is checked, not their process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from experiments import app, runner
from experiments.table_plan import compose_row
from pcaf_core.results import read_metrics
from tests.entry_points import run_app

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PCAF_NO_PROGRESS": "1"}


@pytest.mark.slow
def test_make_reproduce_table_smoke_on_the_jax_backend(tmp_path):
    """``BACKEND=jax`` runs the same rows through the JAX backend; records and table say so."""
    out = tmp_path / "outputs"
    rows = "pcaf_context_wt103_t1024,local_conv_wt103_t1024"
    res = subprocess.run(["make", "--no-print-directory", "reproduce-table", "TABLE=main-303m", f"ROWS={rows}",
                          "SCALE=smoke", "BACKEND=jax", f"OUTPUTS={out}"], cwd=REPO, capture_output=True, text=True,
                         env=_env(), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md_path = Path(res.stdout.strip().splitlines()[-1])
    # A row selection renders its own files (the whole table's are another command's).
    assert md_path == out / "tables" / "main-303m_smoke_jax_pcaf_context_wt103_t1024+local_conv_wt103_t1024.md"
    md = md_path.read_text()
    assert "Backend: jax" in md and "cpu (jax " in md
    records = [read_metrics(p.parent) for p in (out / "main-303m" / "smoke" / "jax").rglob("metrics.json")]
    assert sorted(r.row for r in records) == sorted(rows.split(","))
    for r in records:
        assert r.status == "completed" and r.backend == "jax" and "flax" in r.versions and "optax" in r.versions
        assert r.full_ppl is not None and r.params > 0
    for row in ("PCAF-context", "Local conv"):
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {row} | WikiText-103 |"))
        assert "missing" not in line and "failed" not in line


# A multirun sweep ending in one table and one plot: the basic-launcher sweep of tests/test_cluster.py (the same
# command, memory.top_k=4,16, which that test compares the local launcher's with).


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [
    ("model=no_such_shape", "model=no_such_shape"),  # unknown group option
    ("memory.top_k=many", "memory.top_k"),  # wrong type
    ("memory.top_k=0", "memory.top_k"),  # impossible value
    ("train.seq_len=1", "train.seq_len"),
    ("memory.topk=3", "memory.topk"),  # unknown key
    ("backend.device=gpu", "backend.device='gpu' is invalid for backend=torch: use auto, cpu, cuda or cuda:<index>"),
    ("backend.device=tpu", "backend.device='tpu' is invalid for backend=torch"),  # JAX's name, not torch's
    ("+memory.foo=3", "memory.foo"),  # a key Hydra adds but nothing reads
    ("train.lr=inf", "train.lr"),  # not finite
    ("memory.num_buckets=100000000000000000000", "memory.num_buckets"),  # overflows every integer type used
])
def test_config_errors_fail_before_training_and_name_the_key(override, key, tmp_path):
    """One line naming the key, exit 2, nothing trained (the table driver: tests/test_interrupt_and_rerun.py)."""
    res = run_app(["experiment=wt2-nt-1024/pcaf_context", "scale=smoke", override, f"output_root={tmp_path}"])
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and key in lines[0], res.stderr
    assert not list(tmp_path.rglob("metrics.json"))  # nothing was trained


@pytest.mark.parametrize("experiment,listed", [
    ("wt2-nt-1024/pcaf_contxt", "wt2-nt-1024/pcaf_context, wt2-nt-1024/pcaf_no_cache"),  # the table's rows
    ("wt2-nt-4096/pcaf_context", "wt2-nt-1024/<row>, wt2-nt-2048/<row>"),  # no such table: the tables
])
def test_an_unknown_experiment_lists_what_it_could_have_named(experiment, listed, tmp_path):
    res = run_app([f"experiment={experiment}", "scale=smoke", f"output_root={tmp_path}"])
    (line,) = res.stderr.strip().splitlines()
    assert res.returncode == 2 and line.startswith(f"config error: experiment={experiment}: no such option")
    assert listed in line and "_base" not in line


def test_an_unknown_option_of_a_nested_group_names_the_group(tmp_path):
    res = run_app(["-m", "experiment=wt2-nt-1024/pcaf_context", "scale=smoke", "hydra/launcher=locl",
                   f"output_root={tmp_path}"])
    assert res.returncode == 2 and res.stderr.splitlines()[0] == (
        "config error: hydra/launcher=locl: no such option in the config group hydra/launcher; available: basic, "
        "local, slurm, submitit_local, submitit_slurm")


def test_table_driver_validates_every_row_before_training(tmp_path, capsys):
    from experiments.reproduce import main

    assert main(["--table", "wt2-nt-1024", "--scale", "smoke", "--output-root", str(tmp_path),
                 "memory.top_k=-1"]) == 2
    assert "memory.top_k" in capsys.readouterr().err
    assert not list(tmp_path.rglob("metrics.json"))
    assert main(["--table", "no-such-table", "--scale", "smoke"]) == 2


@pytest.mark.slow
def test_a_config_error_creates_no_output_root(tmp_path, capsys):
    """Issue 36, defect 8: nothing is created for a command that cannot run."""
    from experiments.reproduce import main

    root = tmp_path / "new-root"
    assert main(["--table", "wt2-nt-1024", "--scale", "smoke", "--output-root", str(root), "memory.top_k=0"]) == 2
    assert "memory.top_k=0 is invalid" in capsys.readouterr().err and not root.exists()
    res = run_app(["experiment=wt2-nt-1024/pcaf_context", "scale=smoke", "memory.top_k=0", f"output_root={root}"])
    assert res.returncode == 2 and not root.exists(), res.stderr[-2000:]


@pytest.mark.slow
def test_paper_scale_on_a_cpu_says_how_long_it_would_train_and_needs_confirmation(tmp_path, capsys):
    """Issue 36, defect 8: a command predicted to train for hours on a CPU gives the estimate and starts only
    with --yes (confirm=true for experiments.run); nothing is created."""
    from experiments.long_run import LONG_RUN_HOURS
    from experiments.reproduce import main

    root = tmp_path / "paper"
    assert main(["--table", "main-303m", "--scale", "paper", "--rows", "pcaf_context_wt103_t1024",
                 "--output-root", str(root), "backend.device=cpu"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    hours = float(line.split("for at least ")[1].split(" hours")[0].replace(",", ""))
    assert line.startswith("config error: 1 run(s) of this command would train on this CPU") and hours > LONG_RUN_HOURS
    assert "make step-cost TABLE=main-303m SCALE=paper" in line and "add --yes" in line and not root.exists()
    res = run_app(["experiment=main-303m/pcaf_context_wt103_t1024", "scale=paper", "backend.device=cpu",
                   f"output_root={root}"])
    assert res.returncode == 2 and "add confirm=true to start it anyway" in res.stderr and not root.exists()


def test_a_failing_run_leaves_a_failed_record(tmp_path, monkeypatch):
    import backends.torch.train as torch_train

    def boom(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(torch_train, "train", boom)
    resolved = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", [])[0]
    metrics = runner.run_one(resolved, tmp_path / "run")
    assert metrics.status == "failed" and "simulated device failure" in metrics.error
    on_disk = read_metrics(tmp_path / "run")
    assert on_disk.status == "failed" and on_disk.table == "wt2-nt-1024" and on_disk.scale == "smoke"
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "error.txt").exists()


def test_a_command_that_fails_before_the_loop_leaves_an_existing_run_as_it_was(tmp_path, monkeypatch):
    """A failure of the command, not of the run (here: the trainer cannot start), changes no file of the run it
    was asked to continue."""
    import backends.torch.train as torch_train
    from pcaf_core.results import write_metrics

    resolved = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", [])[0]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    app.write_run_files(run_dir, resolved)
    write_metrics(run_dir, runner.initial_record(resolved, run_dir))  # a run stopped before its first checkpoint
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    def cannot_start(*args, **kwargs):
        raise RuntimeError("could not spawn the workers")

    monkeypatch.setattr(torch_train, "train", cannot_start)
    metrics = runner.run_one(resolved, run_dir)
    assert metrics.status == "failed" and "could not spawn" in metrics.error
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name != ".lock"} == before


def test_the_loop_writes_the_completed_record_and_its_deviation_lines_survive(tmp_path):
    """The app's deviations are the record's first lines, the loop's own (a capped full evaluation) follow,
    and nothing rewrites the record after the loop (the file on disk is the record the loop returned)."""
    resolved = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", [])[0]
    metrics = runner.run_one(resolved, tmp_path / "run", progress=False)
    assert metrics.status == "completed", metrics.error
    assert read_metrics(tmp_path / "run") == metrics
    n = len(resolved.deviations)
    assert metrics.deviations[:n] == resolved.deviations
    assert any("capped at 4 of" in line for line in metrics.deviations[n:])
    assert metrics.backend == "torch" and metrics.scale == "smoke" and "torch" in metrics.versions


def test_a_worker_that_died_mid_run_is_marked_failed_without_losing_its_record(tmp_path, monkeypatch):
    import dataclasses

    import backends.torch.train as torch_train
    from pcaf_core.results import write_metrics

    resolved = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", [])[0]
    partial = dataclasses.replace(runner.initial_record(resolved), status="running", steps_done=3, best_ppl=812.5)

    def died(cfg, run_dir, **kwargs):
        write_metrics(run_dir, partial)  # what a worker leaves when it is killed mid-run
        raise RuntimeError("worker 1 exited with signal 9")

    monkeypatch.setattr(torch_train, "train", died)
    metrics = runner.run_one(resolved, tmp_path / "run")
    assert metrics.status == "failed" and "signal 9" in metrics.error
    assert metrics.steps_done == 3 and metrics.best_ppl == 812.5  # kept, not replaced by a blank record
    assert read_metrics(tmp_path / "run") == metrics
