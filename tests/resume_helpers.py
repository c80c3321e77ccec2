"""What the resume tests share (tests/test_loop_resume.py, tests/test_torch_resume.py,
tests/test_jax_resume.py): the record fields a resumed run must reproduce, its learning curve without wall
times, and a training process started from a runner script, waited on until a checkpoint, and finished."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pcaf_core.results import RunMetrics, read_curve

QUALITY_FIELDS = ("final_ppl", "best_ppl", "best_step", "acc_at_best", "acc_param_at_best", "final_acc",
                  "final_acc_param", "full_ppl", "full_acc", "full_acc_param", "full_windows", "steps_done",
                  "params", "unigram_ppl", "train_tokens", "eval_tokens", "config_hash", "status")
"""Every field of a run record that does not measure time or memory: a resumed run equals the uninterrupted
one in all of them."""


def quality(metrics: RunMetrics) -> dict[str, Any]:
    """``metrics``' :data:`QUALITY_FIELDS`."""
    return {k: getattr(metrics, k) for k in QUALITY_FIELDS}


def curve_without_time(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``curve.csv`` rows without their wall-clock column."""
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_curve(run_dir)]


def start_runner(runner: Path, cfg_file: Path, run_dir: Path, delay: float,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python runner cfg_file run_dir delay`` (the runner sleeps ``delay`` s after each step, so a test can
    interrupt it part-way), its output captured."""
    return subprocess.Popen([sys.executable, str(runner), str(cfg_file), str(run_dir), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, min_step: int, timeout: float) -> int:
    """The step of the run's latest checkpoint once it is at least ``min_step``; fails the test if the process
    ends first or no such checkpoint appears within ``timeout`` s."""
    pointer = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pointer.exists():
            step = int(pointer.read_text().strip().split("_")[1])
            if step >= min_step:
                return step
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be interrupted:\n{proc.stdout.read()}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail("no checkpoint appeared in time")


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The process's output once it has exited 0 (the test fails, showing the output, otherwise)."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out
