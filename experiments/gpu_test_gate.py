"""The gpu test tier as a gate: run some of its tests on the GPU machine, read which passed, and say whether a
setting that depends on them may be used.

A GPU session has minutes, not hours, so its first few minutes run the ``gpu``-marked tests that have never run on
a GPU, and what the rest of the session does may turn on them: e.g. training the windowed rows as CUDA graphs only
once the test that the replayed windowed step trains like eager has passed on this machine
(``experiments.gpu_paper_rows --gpu-tests ... --try-if-passed ...``).

* :func:`run_gpu_tests`: ``make test-gpu`` (the ``gpu`` tier: ``-m gpu`` over the files that mark tests so) with
  ``-k <select>``, its output in ``<out>/gpu_tests.log`` and a JUnit report in ``<out>/gpu_tests.xml``, stopped
  after ``timeout_s`` (the whole process group: pytest's own children too);
* :func:`read_junit`: ``{test id: outcome}`` of such a report;
* :func:`gate`: whether every test whose id contains a name passed (and at least one ran), with the line that says
  why or why not.

The standard library only: it runs on the GPU machine before Hydra's path is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from pathlib import Path

LOG_NAME, JUNIT_NAME = "gpu_tests.log", "gpu_tests.xml"
"""The files :func:`run_gpu_tests` writes under its ``out`` folder (top-level files, which
``experiments.detached collect`` copies back)."""
OUTCOMES = ("passed", "failed", "error", "skipped")


def gpu_tests_command(select: str, junit: Path, python: str) -> list[str]:
    """``make test-gpu`` with this interpreter, the tests whose ids match ``-k select``, a JUnit report to ``junit``
    and every file that imports run; the same pytest call without make where there is none."""
    if "'" in select or '"' in select:
        raise SystemExit(f"--gpu-tests {select!r}: give a pytest -k expression without quotes, "
                         "e.g. 'windowed_flex_cudagraph or agree_on_one_cuda_device'")
    # A file that fails to import on that machine (a package it lacks) is reported in the log and the report, and
    # the other files' tests still run: by default pytest runs nothing once any file fails to collect.
    args = f"-k '{select}' --junitxml={junit} --continue-on-collection-errors"
    if shutil.which("make"):
        return ["make", "test-gpu", f"GPU_PY={python}", f"PYTEST_ARGS={args}"]
    return [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", "tests", "-k", select,
            f"--junitxml={junit}", "--continue-on-collection-errors"]


def read_junit(path: Path) -> dict[str, str]:
    """``{"<module path>::<test name>": outcome}`` of a pytest JUnit report, outcome one of :data:`OUTCOMES`;
    ``{}`` when there is no report or it cannot be read (a run killed before pytest wrote it)."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    outcomes = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        outcome = next((o for tag, o in (("error", "error"), ("failure", "failed"), ("skipped", "skipped"))
                        if tag in tags), "passed")
        outcomes[f"{case.get('classname', '')}::{case.get('name', '')}"] = outcome
    return outcomes


def run_gpu_tests(select: str, out: Path, python: str, env: Mapping[str, str], timeout_s: float,
                  cwd: Path) -> tuple[int | None, dict[str, str]]:
    """Run :func:`gpu_tests_command` in ``cwd`` with its output in ``out/gpu_tests.log``; returns (exit status,
    ``None`` where it ran past ``timeout_s`` and was killed, and :func:`read_junit` of its report). A report left
    by an earlier call is removed first, so the outcomes are this call's."""
    out.mkdir(parents=True, exist_ok=True)
    junit = out / JUNIT_NAME
    junit.unlink(missing_ok=True)
    cmd = gpu_tests_command(select, junit, python)
    with open(out / LOG_NAME, "w", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        # Its own process group, so that a timeout stops pytest and whatever it started, not only make.
        proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
            log.write(f"\n[gpu_test_gate] stopped after {timeout_s:g} s\n")
    return code, read_junit(junit)


def gate(outcomes: Mapping[str, str], name: str) -> tuple[bool, str]:
    """(True, line) when at least one test whose id contains ``name`` ran and every one of them passed; else
    (False, line naming what did not pass, or that none ran)."""
    matching = {test: outcome for test, outcome in outcomes.items() if name in test}
    if not matching:
        return False, f"no test matching {name!r} ran"
    bad = [f"{test} {outcome}" for test, outcome in matching.items() if outcome != "passed"]
    if bad:
        return False, f"{len(bad)} of {len(matching)} test(s) matching {name!r} did not pass: {'; '.join(bad)}"
    return True, f"{len(matching)} test(s) matching {name!r} passed"


def summary(code: int | None, outcomes: Mapping[str, str]) -> str:
    """One line: the tier's exit (or that it was stopped) and how many tests had each outcome."""
    counts = ", ".join(f"{sum(o == k for o in outcomes.values())} {k}" for k in OUTCOMES
                       if any(o == k for o in outcomes.values()))
    ended = "stopped at its time limit" if code is None else f"exit {code}"
    return f"gpu tests: {ended}; {counts or 'no test report'}"
