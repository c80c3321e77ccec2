"""``experiments.gpu_test_gate``: the outcomes it reads from a real pytest JUnit report, the gate it draws from
them, and the time limit that stops the tests and everything they started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import gpu_test_gate as gate

TESTS = """
import pytest

def test_graph_step_trains_like_eager():
    pass

@pytest.mark.parametrize("variant", ["local", "global_local"])
def test_windowed_graph(variant):
    assert variant == "local"

def test_skipped_without_a_device():
    pytest.skip("no device")

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

def test_with_a_broken_fixture(broken):
    pass
"""


def test_outcomes_of_a_real_junit_report_and_the_gate_they_give(tmp_path: Path) -> None:
    """Each test of a report pytest wrote is passed, failed, error or skipped, by id; the gate opens only where
    every test matching the name passed and at least one did."""
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "test_needs_a_package.py").write_text("import a_package_this_machine_lacks\n")
    junit = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py",
                    "test_needs_a_package.py", f"--junitxml={junit}", "--continue-on-collection-errors"],
                   cwd=tmp_path, capture_output=True, check=False)
    outcomes = gate.read_junit(junit)
    assert outcomes == {
        "::test_needs_a_package": "error",  # a file that does not import: the other file's tests still ran
        "test_sample::test_graph_step_trains_like_eager": "passed",
        "test_sample::test_windowed_graph[local]": "passed",
        "test_sample::test_windowed_graph[global_local]": "failed",
        "test_sample::test_skipped_without_a_device": "skipped",
        "test_sample::test_with_a_broken_fixture": "error",
    }
    assert gate.gate(outcomes, "graph_step_trains_like_eager") == (
        True, "1 test(s) matching 'graph_step_trains_like_eager' passed")
    opened, why = gate.gate(outcomes, "windowed_graph")
    assert not opened and why == ("1 of 2 test(s) matching 'windowed_graph' did not pass: "
                                  "test_sample::test_windowed_graph[global_local] failed")
    assert gate.gate(outcomes, "skipped_without")[0] is False
    assert gate.gate(outcomes, "not_in_the_report") == (False, "no test matching 'not_in_the_report' ran")
    assert gate.summary(1, outcomes) == "gpu tests: exit 1; 2 passed, 1 failed, 2 error, 1 skipped"
    assert gate.read_junit(tmp_path / "absent.xml") == {}
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite><testcase name=")  # a run killed mid-write
    assert gate.read_junit(tmp_path / "cut.xml") == {}


def test_the_time_limit_stops_the_tests_and_what_they_started(tmp_path: Path, monkeypatch) -> None:
    """Past ``timeout_s`` the whole process group goes (make's pytest too, not make alone); the outcomes are
    none, and the log says it was stopped. A report of an earlier call is not taken for this one's."""
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    monkeypatch.setattr(gate, "gpu_tests_command", lambda select, junit, python: ["sh", "-c", script])
    (tmp_path / gate.JUNIT_NAME).write_text('<testsuite><testcase classname="old" name="t"/></testsuite>')
    start = time.monotonic()
    code, outcomes = gate.run_gpu_tests("anything", tmp_path, sys.executable, os.environ, 1.0, tmp_path)
    assert time.monotonic() - start < 30
    assert code is None and outcomes == {}
    assert "stopped after 1 s" in (tmp_path / gate.LOG_NAME).read_text()
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie where nothing reaps orphans (a container's first process)
        try:
            if Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the tests' child {grandchild} outlived the time limit")
    assert gate.summary(None, outcomes) == "gpu tests: stopped at its time limit; no test report"


def test_the_command_is_the_gpu_tier_with_a_selection_and_a_report(tmp_path: Path) -> None:
    cmd = gate.gpu_tests_command("windowed_flex_cudagraph or agree", tmp_path / "r.xml", "python3")
    if cmd[0] == "make":
        assert cmd[:3] == ["make", "test-gpu", "GPU_PY=python3"]
        assert cmd[3] == (f"PYTEST_ARGS=-k 'windowed_flex_cudagraph or agree' --junitxml={tmp_path / 'r.xml'} "
                          "--continue-on-collection-errors")
    else:
        assert "-m" in cmd and "gpu" in cmd and cmd[cmd.index("-k") + 1] == "windowed_flex_cudagraph or agree"
    with pytest.raises(SystemExit, match="without quotes"):
        gate.gpu_tests_command("it's", tmp_path / "r.xml", "python3")
