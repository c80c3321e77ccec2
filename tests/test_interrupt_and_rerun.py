"""Runs that are interrupted, repeated, run side by side, damaged or starved of disk, through the real entry
points (docs/EXPERIMENTS.md, "Interrupting and rerunning", names these tests for each guarantee).

Faults come from ``tests/fixtures/faulty_entry.py``, which runs ``python -m <module>`` with a hold at a chosen
training step (so a real signal lands at a known point) or a full disk. Everything runs at smoke scale. Commands
whose claim is what they print and do, not their process, run in this process (tests/entry_points.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from experiments.allocator import TUNABLES
from pcaf_core.results import read_curve, read_metrics, write_metrics
from tests.entry_points import run_app, run_main

REPO = Path(__file__).resolve().parents[1]
FAULTY = REPO / "tests" / "fixtures" / "faulty_entry.py"
WT2_ARCHIVE = REPO / "data" / "wikitext-2-v1.tar.xz"
FIXTURE_DATA = REPO / "tests" / "fixtures" / "data"
# One row, 8 steps, a checkpoint every 2 steps, no full-split pass: a few seconds per process.
RUN_ARGS = ["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context", "--no-render",
            "train.steps=8", "train.checkpoint_every=2", "eval.protocol=reference"]


def _env(**extra: str) -> dict[str, str]:
    # The malloc settings the Makefile exports: the entry points then need not re-execute themselves.
    return {**os.environ, "PCAF_NO_PROGRESS": "1", "GLIBC_TUNABLES": TUNABLES, **extra}


def _reproduce(out: Path, *more: str) -> list[str]:
    return [sys.executable, str(FAULTY), "experiments.reproduce", *RUN_ARGS, "--output-root", str(out), *more]


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=_env(**env))


def _wait_for(check: Callable[[], bool], what: str, proc: subprocess.Popen | None = None, log: Path | None = None,
              timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f"; output:\n{log.read_text()[-3000:]}" if log else ""))


def _run_dirs(out: Path) -> list[Path]:
    return sorted(p.parent for p in out.glob("wt2-nt-1024/smoke/torch/pcaf_context/*/config.yaml"))


def _held(tmp_path: Path, name: str, step: int) -> dict[str, str]:
    return {"PCAF_FAULT_HOLD_AT_STEP": str(step), "PCAF_FAULT_MARKER": str(tmp_path / f"{name}.held")}


# --------------------------------------------------------------------------- items 1 and 2


@pytest.mark.slow
def test_a_live_run_is_locked_and_the_same_command_resumes_it_after_sigkill_sigterm_and_ctrl_c(tmp_path, monkeypatch,
                                                                                              capsys):
    """Item 1 (lock) and item 2 (resume however stopped): A trains and holds at step 3; B, the identical
    command, waits for A's directory instead of writing into it; A is SIGKILLed (its lock goes with it) and B
    resumes A's run from step 2; B is stopped with SIGTERM; the command run again (here in this process)
    resumes from step 4 and gets a real SIGINT (Ctrl-C) at step 7; run again, it resumes from step 6 and
    finishes. One run directory, one curve without repeated rows."""
    import pcaf_core.loop as loop
    from experiments import reproduce

    out = tmp_path / "out"
    logs = {n: tmp_path / f"{n}.log" for n in "AB"}
    a = _start(_reproduce(out), logs["A"], **_held(tmp_path, "A", 3))
    _wait_for(lambda: (tmp_path / "A.held").exists(), "A to reach step 3", a, logs["A"])
    (run_dir,) = _run_dirs(out)
    b = _start(_reproduce(out), logs["B"], **_held(tmp_path, "B", 5))
    _wait_for(lambda: "waiting for" in logs["B"].read_text(), "B to wait for A", b, logs["B"])
    assert f"waiting for {run_dir}: it is being run by process {a.pid}" in logs["B"].read_text()
    assert not (tmp_path / "B.held").exists() and a.poll() is None
    a.send_signal(signal.SIGKILL)
    a.wait(30)
    _wait_for(lambda: (tmp_path / "B.held").exists(), "B to resume A's run and reach step 5", b, logs["B"])
    assert f"resuming {run_dir} from step 2" in logs["B"].read_text()
    b.send_signal(signal.SIGTERM)
    assert b.wait(60) == 128 + signal.SIGTERM, logs["B"].read_text()[-2000:]
    assert f"interrupted: {run_dir} stopped after step 4; run the same command again" in logs["B"].read_text()
    rec = read_metrics(run_dir)
    assert rec.status == "failed" and rec.extra["resumable"] and "SIGTERM" in rec.error
    capsys.readouterr()

    real_lr_for = loop.lr_for

    def ctrl_c_at_7(train, step):
        if step == 7:
            signal.raise_signal(signal.SIGINT)  # what a terminal's Ctrl-C delivers
        return real_lr_for(train, step)

    monkeypatch.setattr(loop, "lr_for", ctrl_c_at_7)
    # A terminal's SIGINT handler, whatever an earlier test in this worker process left installed (a run of
    # make test saw the Ctrl-C ignored and the run finish).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert reproduce.main([*RUN_ARGS, "--output-root", str(out)]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    printed = capsys.readouterr()
    assert f"resuming {run_dir} from step 4" in printed.out
    assert f"interrupted: {run_dir} stopped after step 6; run the same command again" in printed.err
    assert "Ctrl-C" in read_metrics(run_dir).error

    assert reproduce.main([*RUN_ARGS, "--output-root", str(out)]) == 0
    assert f"resuming {run_dir} from step 6" in capsys.readouterr().out
    assert _run_dirs(out) == [run_dir]
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.steps_done == 8 and rec.extra["segments"] == 4
    assert [r["step"] for r in read_curve(run_dir)] == [1, 2, 4, 6, 8]
    assert not (run_dir / "error.txt").exists() and not list(run_dir.rglob(".tmp_step_*"))


@pytest.mark.slow
def test_sweeps_started_together_get_their_own_directories_and_a_failing_job_does_not_stop_them(tmp_path):
    """Item 1 (two ``-m`` sweeps in the same second) and item 5 (jobs failing at run time): the sweeps get
    their own directories; every job of each runs although the one before it failed; the summary marks the
    failed jobs and the command exits 1."""
    base = [sys.executable, "-m", "experiments.run", "-m", "experiment=wt2-nt-1024/pcaf_context", "scale=smoke",
            f"output_root={tmp_path}"]
    # A model vocabulary smaller than the corpus's passes validation and fails when the data is loaded.
    procs = [subprocess.Popen(base + [values], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for values in ("model.vocab_size=100,200", "model.vocab_size=300")]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (stdout, stderr) in zip(procs, results):
        assert proc.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert "2 of 2 jobs of the sweep" in results[0][1] and "1 of 1 jobs of the sweep" in results[1][1]
    sweeps = sorted((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 2, sweeps
    records = [read_metrics(p) for p in sorted((tmp_path / "multirun").glob("*/*/metrics.json"))]
    assert sorted(r.error.split("model.vocab_size=")[1][:3] for r in records) == ["100", "200", "300"]
    assert all(r.status == "failed" for r in records)
    (summary,) = [p for p in (tmp_path / "multirun").glob("*/sweep_model.vocab_size.md")]
    assert summary.read_text().count("1 failed: ValueError: the corpus vocabulary has 2000 ids") == 2


@pytest.mark.slow
def test_a_stopped_sweep_says_how_to_continue_it_in_its_directory_and_that_command_does(tmp_path):
    """Item 2 for sweeps: the same ``-m`` command would start a new sweep directory and train every job again. A
    sweep stopped by SIGTERM in its first job prints the command that runs it again in its own directory; that
    command resumes the stopped job from its last checkpoint, runs the job that never started, and the summary
    covers both."""
    sweep = ["experiments.run", "-m", "experiment=wt2-nt-1024/pcaf_context", "scale=smoke", "train.steps=8",
             "train.checkpoint_every=2", "eval.protocol=reference", "memory.top_k=4,16", f"output_root={tmp_path}"]
    log = tmp_path / "sweep.log"
    proc = _start([sys.executable, str(FAULTY), *sweep], log, **_held(tmp_path, "sweep", 3))
    _wait_for(lambda: (tmp_path / "sweep.held").exists(), "the sweep's first job to reach step 3", proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, log.read_text()[-2000:]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    said = re.search(rf"the sweep in {re.escape(str(sweep_dir))} stopped at job 0; continue it there \(finished "
                     r"jobs reused, this one resumed, the rest run\): (.+) \(make sweep: the same command with "
                     rf"SWEEP_DIR={re.escape(str(sweep_dir))}\)$", log.read_text(), re.M)
    assert said, log.read_text()[-2000:]
    command = shlex.split(said.group(1))
    assert command[:3] == ["python", "-m", "experiments.run"] and command[-1] == f"hydra.sweep.dir={sweep_dir}"
    again = subprocess.run([sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, env=_env(),
                           timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming {sweep_dir / '000-pcaf_context-seed1234'} from step 2" in again.stdout + again.stderr
    assert list((tmp_path / "multirun").iterdir()) == [sweep_dir]
    records = [read_metrics(p.parent) for p in sorted(sweep_dir.glob("*/metrics.json"))]
    assert [(r.status, r.steps_done, r.extra["segments"]) for r in records] == [("completed", 8, 2),
                                                                                 ("completed", 8, 1)]
    summary = (sweep_dir / "sweep_memory.top_k.md").read_text()
    assert "| 4 |" in summary and "| 16 |" in summary and summary.count("ok (n=1)") == 2


# --------------------------------------------------------------------------- item 3


def _flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_every_checkpoint_damaged_is_refused_with_the_files_named_and_restarted_only_on_request(tmp_path, capsys):
    from experiments import reproduce

    out = tmp_path / "out"
    assert reproduce.main([*RUN_ARGS, "--output-root", str(out)]) == 0
    (run_dir,) = _run_dirs(out)
    # As SIGKILL after the last checkpoint leaves it, then both checkpoints (keep=2) damaged on disk.
    write_metrics(run_dir, dataclasses.replace(read_metrics(run_dir), status="running"))
    damaged = [run_dir / "checkpoints" / s / "model.safetensors" for s in ("step_6", "step_8")]
    for path in damaged:
        _flip_byte(path)
    before = {p: p.read_bytes() for p in damaged}

    capsys.readouterr()
    assert reproduce.main([*RUN_ARGS, "--output-root", str(out)]) == 1
    refusal = next(line for line in capsys.readouterr().err.splitlines() if "refused:" in line)
    assert "every checkpoint" in refusal and "--restart-damaged" in refusal
    assert all(str(p) in refusal for p in damaged)
    assert {p: p.read_bytes() for p in damaged} == before  # nothing deleted or rewritten
    assert read_metrics(run_dir).status == "running" and _run_dirs(out) == [run_dir]

    assert reproduce.main([*RUN_ARGS, "--output-root", str(out), "--restart-damaged"]) == 0
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.steps_done == 8 and _run_dirs(out) == [run_dir]
    (incident,) = rec.extra["incidents"]
    assert "every checkpoint was damaged; restarted from step 0" in incident["what"]
    kept = Path(incident["kept"])
    assert {p.name for p in kept.iterdir()} == {"step_6", "step_8", "curve.csv"}
    assert (kept / "step_8" / "model.safetensors").read_bytes() == before[damaged[1]]
    capsys.readouterr()


# --------------------------------------------------------------------------- item 4


def test_a_flipped_byte_in_a_token_cache_is_caught_on_open_and_old_manifests_are_rebuilt(tmp_path):
    """A changed id that stays in range would be trained on silently: the manifest's sha256 of each array
    catches it on the next open (here ``python -m pcaf_core.data summary``), which rebuilds with a warning."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "pcaf_core.data", "summary", "data=wikitext103", "data.min_freq=1",
           f"data.data_dir={FIXTURE_DATA}", f"data.cache_dir={cache}", "--json"]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (cache_dir,) = cache.glob("wikitext103-*")
    train = cache_dir / "train.npy"
    original = np.load(train).copy()
    arr = np.load(train, mmap_mode="r+")
    i = len(arr) // 2
    arr[i] = 4 if arr[i] == 3 else 3  # still a valid id: nothing but the digest can tell
    arr.flush()
    del arr
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"{train} does not match the sha256 in its manifest" in second.stderr
    np.testing.assert_array_equal(np.load(train), original)

    manifest = json.loads((cache_dir / "manifest.json").read_text())
    for info in manifest["splits"].values():
        del info["sha256"]  # a cache built before the digests existed
    (cache_dir / "manifest.json").write_text(json.dumps(manifest))
    third = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=300)
    assert third.returncode == 0 and "has no checksums of the token arrays" in third.stderr
    assert all("sha256" in i for i in json.loads((cache_dir / "manifest.json").read_text())["splits"].values())


# --------------------------------------------------------------------------- item 5


@pytest.mark.slow
def test_a_sweep_with_an_invalid_job_starts_no_job(tmp_path):
    res = run_app(["-m", "experiment=wt2-nt-1024/pcaf_context", "scale=smoke", "memory.top_k=4,0,8",
                   f"output_root={tmp_path}"])
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "config error: memory.top_k=0 is invalid: K must be >= 1 (job 1: memory.top_k=0)" in res.stderr
    assert "no job was started" in res.stderr and "Traceback" not in res.stderr
    assert not list(tmp_path.rglob("metrics.json")) and not (tmp_path / "multirun").exists()


# --------------------------------------------------------------------------- item 6


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_is_reported_recorded_and_cleaned_up(tmp_path, monkeypatch):
    from experiments.reproduce import main as reproduce
    from tests.fixtures.faulty_entry import disk_full_fsync

    out = tmp_path / "out"
    monkeypatch.setattr(os, "fsync", disk_full_fsync(out.resolve()))  # faulty_entry's PCAF_FAULT_DISK_FULL, here
    res = run_main(reproduce, [*RUN_ARGS, "--output-root", str(out)])
    monkeypatch.undo()
    # The row is failed, the table goes on; the command says so last and exits 1.
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].endswith("1 failed of 1 runs (their rows show why)")
    (run_dir,) = _run_dirs(out)
    rec = read_metrics(run_dir)
    assert rec.status == "failed" and rec.extra["resumable"], rec.error
    assert re.search(r"no space left on device writing \S+/checkpoints/\.tmp_step_2/\S+", rec.error), rec.error
    assert "bytes free" in rec.error and "resume" in rec.error
    assert "no space left on device" in (run_dir / "error.txt").read_text()
    assert not list(out.rglob(".tmp_step_*")) and not list(out.rglob("*.tmp"))
    assert "FAILED: DiskFullError: no space left on device" in res.stdout


def test_a_full_disk_while_unpacking_is_not_blamed_on_the_archive_and_killed_unpacks_are_removed(tmp_path):
    data_dir, cache = tmp_path / "data", tmp_path / "cache"
    data_dir.mkdir()
    (data_dir / WT2_ARCHIVE.name).symlink_to(WT2_ARCHIVE)
    orphan = cache / "sources" / ".wikitext-2-v1-4aab04411068.tmp-99999-deadbeef"  # what a killed unpack leaves
    (orphan / "wikitext-2").mkdir(parents=True)
    (orphan / "wikitext-2" / "wiki.train.tokens").write_text("half")
    res = subprocess.run([sys.executable, str(FAULTY), "pcaf_core.data", "prepare", "data=wikitext2",
                          f"data.data_dir={data_dir}", f"data.cache_dir={cache}"],
                         cwd=REPO, capture_output=True, text=True, env=_env(PCAF_FAULT_UNPACK_ENOSPC="1"), timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("error: no space left on device unpacking wikitext-2-v1.tar.xz into"), error
    assert "bytes needed" in error and "damaged" not in error
    assert not orphan.exists() and not list((cache / "sources").iterdir())


# --------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("override", ["memory.topk=3", "memory.top_k=many"])
def test_the_table_driver_reports_a_bad_key_or_type_in_one_line_with_exit_2(override, tmp_path, capsys):
    from experiments import reproduce

    assert reproduce.main([*RUN_ARGS, "--output-root", str(tmp_path), override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("config error: memory.top") and "Traceback" not in err


@pytest.mark.slow
def test_an_unwritable_output_root_is_one_line_with_exit_2_on_every_entry_point(tmp_path, capsys):
    from experiments import reproduce

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a directory is needed (chmod does not stop root)
    assert reproduce.main([*RUN_ARGS, "--output-root", str(blocker / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: --output-root={blocker / 'out'} is not a writable directory")
    res = run_app(["experiment=wt2-nt-1024/pcaf_context", "scale=smoke", f"output_root={blocker / 'out'}"])
    assert res.returncode == 2 and res.stderr.strip().startswith(f"config error: output_root={blocker / 'out'}")
    assert len(res.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- item 8


@pytest.mark.slow
def test_a_diverged_run_continues_from_its_last_finite_checkpoint_with_the_printed_command(tmp_path, monkeypatch,
                                                                                         capsys):
    """The divergence message prints a command; run as printed with a lower ``train.lr`` it resumes from the
    newest checkpoint whose evaluation was finite (step 2: step 4's evaluation was already infinite), and
    the change is recorded as a deviation."""
    import math

    import backends.torch.backend as torch_backend
    import pcaf_core.loop as loop
    from experiments import reproduce

    now = {"step": 0}
    real_lr_for, real_eval, real_step = loop.lr_for, loop.evaluate_reference, torch_backend.TorchBackend.train_step

    def lr_for(train, step):
        now["step"] = step
        return real_lr_for(train, step)

    def evaluate_reference(*args, **kwargs):
        res = real_eval(*args, **kwargs)
        return dataclasses.replace(res, loss=math.inf, ppl=math.inf) if now["step"] == 4 else res

    def train_step(self, state, inputs, targets, lr, **kwargs):
        state, loss = real_step(self, state, inputs, targets, lr, **kwargs)
        return state, (math.nan if now["step"] == 5 else loss)

    monkeypatch.setattr(loop, "lr_for", lr_for)
    monkeypatch.setattr(loop, "evaluate_reference", evaluate_reference)
    monkeypatch.setattr(torch_backend.TorchBackend, "train_step", train_step)
    out = tmp_path / "out"
    assert reproduce.main([*RUN_ARGS, "--output-root", str(out)]) == 1  # the row failed
    monkeypatch.undo()
    (run_dir,) = _run_dirs(out)
    rec = read_metrics(run_dir)
    assert rec.status == "failed" and "non-finite loss nan at step 5" in rec.error
    command = re.search(r"(python -m experiments\.run .*?) train\.lr=<below ([0-9.e-]+)>", rec.error)
    assert command, rec.error
    lower = float(command.group(2)) / 2
    argv = shlex.split(command.group(1))
    assert argv[:3] == ["python", "-m", "experiments.run"], argv
    res = run_app([*argv[3:], f"train.lr={lower}"])  # the printed command, in this process
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.steps_done == 8 and rec.extra["segments"] == 2
    assert any(d.startswith(f"train.lr: {float(command.group(2))!r} -> {lower!r} from step 2 (changed on resume")
               for d in rec.deviations), rec.deviations
    (incident,) = rec.extra["incidents"]
    assert incident["set_aside"] == ["step_4: its evaluation was not finite (written after the divergence began)"]
    capsys.readouterr()


# --------------------------------------------------------------------------- item 9


@pytest.mark.slow
def test_weights_are_0644_bad_weights_are_refused_by_name_and_a_mistyped_runs_root_is_an_error(tmp_path, capsys):
    import safetensors.numpy

    from experiments import runner, table_plan
    from paper_tables.__main__ import main as tables_main
    from pcaf_core.checkpoints import LOOP_STATE_FILE, dump_json, load_json, sha256_file

    assert tables_main(["render", "--table", "wt2-nt-1024", "--scale", "smoke", "--backend", "torch",
                        "--runs", str(tmp_path / "ouputs"), "--out", str(tmp_path / "tables")]) == 1
    assert "no run found: --runs" in capsys.readouterr().err and not (tmp_path / "tables").exists()

    resolved = table_plan.compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch",
                                      ["train.steps=2", "eval.protocol=reference"])[0]
    run_dir = tmp_path / "run"
    assert runner.run_one(resolved, run_dir, progress=False).status == "completed"
    modes = {p.relative_to(run_dir).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in run_dir.rglob("*")
             if p.is_file() and p.name != ".lock"}
    assert modes and set(modes.values()) == {0o644}, modes

    ckpt = run_dir / "checkpoints" / "step_2"
    weights = ckpt / "model.safetensors"
    good = safetensors.numpy.load_file(str(weights))
    meta = {"format": "pcaf-canonical"}
    for name, bad, expected in (("nan", np.nan, "NaN or infinite values"), ("int", None, "non-float parameters")):
        tensors = dict(good)
        key = sorted(tensors)[0]
        tensors[key] = (tensors[key].astype(np.int32) if bad is None else np.full_like(tensors[key], bad))
        safetensors.numpy.save_file(tensors, str(weights), metadata=meta)
        state = load_json((ckpt / LOOP_STATE_FILE).read_text())
        state["files"]["model.safetensors"] = {"bytes": weights.stat().st_size, "sha256": sha256_file(weights)}
        (ckpt / LOOP_STATE_FILE).write_text(dump_json(state))  # an intact checkpoint holding bad weights
        write_metrics(run_dir, dataclasses.replace(read_metrics(run_dir), status="running"))
        rec = runner.run_one(resolved, run_dir, progress=False)
        assert rec.status == "failed" and str(weights) in rec.error and expected in rec.error, (name, rec.error)
