"""``experiments.detached``: a command started in its own session under a supervisor, its state (running, ended,
lost, none), its exit and its signals recorded, a second run in the same folder refused, and the collection of
its small files and packed folders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from experiments import detached

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "experiments.detached", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_started_command_outlives_its_starter_and_collect_waits_for_its_end(tmp_path: Path) -> None:
    """The starter returns at once; the command runs on (here it writes a file after the starter has returned);
    ``collect`` waits for its end and brings back its log, its state and the files it left in ``out``."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    script = (f"import time, pathlib; time.sleep(1); pathlib.Path({str(out)!r}, 'records.tar.gz').write_text('r'); "
              "print('finished')")
    started = _cli("start", "--out", str(out), "--", PY, "-c", script)
    assert started.returncode == 0 and "in its own session" in started.stdout
    assert not (out / "records.tar.gz").exists()
    collected = _cli("collect", "--out", str(out), "--dest", str(dest), "--wait-s", "60")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "with exit 0" in collected.stdout and "| finished" in collected.stdout
    recorded = json.loads((dest / "driver.json").read_text())
    assert recorded["state"] == "ended" and recorded["exit"] == 0 and recorded["argv"][:2] == [PY, "-c"]
    assert (dest / "records.tar.gz").read_text() == "r"
    log = (dest / "driver.log").read_text()
    assert log.startswith("[detached] ") and "finished" in log


def test_the_commands_exit_and_a_signal_are_recorded(tmp_path: Path) -> None:
    out = tmp_path / "failed"
    detached.start([PY, "-c", "raise SystemExit(3)"], out)
    _wait_for(lambda: detached.state(out) == "ended")
    assert detached.read_state(out)["exit"] == 3
    assert detached.collect(out, tmp_path / "dest", wait_s=0) == ("ended", 3)

    # SIGTERM to the supervisor reaches the command, whose own handling (here: a clean exit 5) is what is recorded.
    out = tmp_path / "terminated"
    script = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(5)); print('up', "
              "flush=True); time.sleep(60)")
    pid = detached.start([PY, "-c", script], out)
    _wait_for(lambda: "\nup\n" in (out / detached.LOG_FILE).read_text())  # the line, not the command's
    os.kill(pid, signal.SIGTERM)
    _wait_for(lambda: detached.state(out) == "ended")
    assert detached.read_state(out)["exit"] == 5


def test_a_running_run_refuses_a_second_and_a_killed_supervisor_is_lost(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    pid = detached.start([PY, "-c", "import time; print('up', flush=True); time.sleep(60)"], out)
    try:
        _wait_for(lambda: "\nup\n" in (out / detached.LOG_FILE).read_text())  # the line, not the command's
        assert detached.state(out) == "running" and detached.read_state(out)["pid"] == pid
        with pytest.raises(SystemExit, match=rf"already going .*pid {pid}.*collect"):
            detached.start([PY, "-c", "pass"], out)
        assert detached.collect(out, tmp_path / "dest", wait_s=0.2, poll_s=0.05) == ("running", 0)
        assert "still running" in capsys.readouterr().out
    finally:
        os.killpg(pid, signal.SIGKILL)  # the supervisor and its command, as a machine going away would
    _wait_for(lambda: detached.state(out) == "lost")
    assert detached.collect(out, tmp_path / "dest", wait_s=5) == ("lost", 1)
    assert "lost: pid" in capsys.readouterr().out


def test_no_run_and_a_missing_command_say_so(tmp_path: Path) -> None:
    assert detached.state(tmp_path) == "none"
    assert detached.collect(tmp_path, tmp_path / "dest", wait_s=0) == ("none", 1)
    with pytest.raises(SystemExit, match="no command to start"):
        detached.start([], tmp_path)
    detached.start(["no-such-command-here"], tmp_path / "bad")
    _wait_for(lambda: detached.state(tmp_path / "bad") == "ended")
    assert detached.read_state(tmp_path / "bad")["exit"] == 127
    assert "cannot start" in (tmp_path / "bad" / detached.LOG_FILE).read_text()


def test_collect_copies_top_level_files_and_step_costs_and_packs_what_is_asked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out, dest = tmp_path / "out", tmp_path / "dest"
    detached.mark(out, [], 0)
    in_out = ("records.tar.gz", "driver.log", "step_cost/wt2-nt-1024.csv", "runs/t/paper/torch/r/x/ckpt.pt",
              ".records.tar.gz.tmp")
    in_checkout = ("bench/cuda/gemm.csv", "bench/cuda/sub/profile.txt", "notes/page.txt")
    for path in [out / n for n in in_out] + [tmp_path / n for n in in_checkout]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(path.name)
    detached.collect(out, dest, wait_s=0, packed=["bench/cuda", "notes/page.txt", "not/there"])
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert got == ["driver.json", "driver.log", "packed.tar.gz", "records.tar.gz", "step_cost/wt2-nt-1024.csv"]
    with tarfile.open(dest / "packed.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["bench/cuda/gemm.csv", "bench/cuda/sub/profile.txt", "notes/page.txt"]
    with pytest.raises(SystemExit, match="relative to it"):
        detached.collect(out, dest, wait_s=0, packed=["../elsewhere"])
