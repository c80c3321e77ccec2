"""``experiments.detached``: a run started in its own session, its state (running, ended, lost, none), the refusal
of a second run in the same folder, and the collection of its small files; and ``experiments.gpu_paper_rows
--detach`` / ``--collect`` end to end on a run without rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import detached

REPO = Path(__file__).resolve().parents[1]


def test_state_is_running_until_the_process_is_gone_then_lost(tmp_path: Path, capsys) -> None:
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        detached.mark(tmp_path, ["a", "b"], pid=sleeper.pid)
        assert detached.state(tmp_path) == "running"
        with pytest.raises(SystemExit, match=rf"already going .*pid {sleeper.pid}.*--collect"):
            detached.detach("experiments.gpu_paper_rows", [], tmp_path, REPO)
        assert detached.collect(tmp_path, tmp_path / "dest", wait_s=0.2, poll_s=0.05) == ("running", 0)
        assert "still running" in capsys.readouterr().out
    finally:
        sleeper.kill()
        sleeper.wait()
    assert detached.state(tmp_path) == "lost"
    assert detached.collect(tmp_path, tmp_path / "dest", wait_s=5) == ("lost", 1)
    assert "lost: pid" in capsys.readouterr().out


def test_an_ended_run_gives_its_own_exit_and_no_run_gives_one(tmp_path: Path, capsys) -> None:
    assert detached.state(tmp_path) == "none"
    assert detached.collect(tmp_path, tmp_path / "dest", wait_s=0) == ("none", 1)
    started = detached.mark(tmp_path, ["x"])
    detached.mark(tmp_path, ["x"], 3, started)
    recorded = detached.read_state(tmp_path)
    assert recorded["state"] == "ended" and recorded["exit"] == 3 and recorded["started"] == started
    assert detached.collect(tmp_path, tmp_path / "dest", wait_s=0) == ("ended", 3)
    assert "with exit 3" in capsys.readouterr().out


def test_collect_copies_top_level_files_and_step_costs_but_not_runs(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    detached.mark(out, [], 0)
    for name in ("records.tar.gz", "driver.log", "step_cost/wt2-nt-1024.csv", "runs/t/paper/torch/r/x/ckpt.pt",
                 ".records.tar.gz.tmp"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    detached.collect(out, dest, wait_s=0)
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert got == ["driver.json", "driver.log", "records.tar.gz", "step_cost/wt2-nt-1024.csv"]
    assert (dest / "step_cost/wt2-nt-1024.csv").read_text() == "step_cost/wt2-nt-1024.csv"


def test_gpu_paper_rows_detaches_and_collect_waits_for_its_end(tmp_path: Path) -> None:
    """The starter returns at once; the run (no rows, no step costs) records its own start and end; ``--collect``
    waits for the end and brings back the log, the state and the archive the run left."""
    out, dest = tmp_path / "out", tmp_path / "dest"
    out.mkdir()
    (out / "records.tar.gz").write_bytes(b"records")
    cmd = [sys.executable, "-m", "experiments.gpu_paper_rows", "--out", str(out), "--output-root",
           str(tmp_path / "runs"), "--compile-cache", "", "--step-cost", ""]
    started = subprocess.run([*cmd, "--detach"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0 and "in its own session" in started.stdout
    collected = subprocess.run([*cmd, "--collect", str(dest), "--wait-s", "60"], cwd=REPO, capture_output=True,
                               text=True, timeout=90)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "ended" in collected.stdout and "with exit 0" in collected.stdout
    recorded = json.loads((dest / "driver.json").read_text())
    assert recorded["state"] == "ended" and recorded["exit"] == 0 and "--detach" not in recorded["argv"]
    assert recorded["argv"][recorded["argv"].index("--out") + 1] == str(out)
    log = (dest / "driver.log").read_text()
    assert "[detached]" in log and "done in" in log
    assert (dest / "records.tar.gz").read_bytes() == b"records"
