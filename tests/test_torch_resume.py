"""Kill a torch training process mid-run, resume it in a new process, and get the uninterrupted run
bit for bit (CPU, fp32): metrics, learning curve, weights and optimiser state.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from backends.torch.train import TorchBackend
from pcaf_core.checkpoints import latest_checkpoint, read_loop_state
from pcaf_core.config_io import config_from_dict, config_to_dict
from pcaf_core.loop import run_training
from pcaf_core.results import read_metrics
from tests.resume_helpers import curve_without_time, finish, quality, start_runner, wait_for_checkpoint
from tests.test_torch_train import tiny_cfg, wt2_cache  # noqa: F401 - wt2_cache is a fixture

RUNNER = """
import json, sys, time
from pathlib import Path

import torch

from backends.torch.train import TorchBackend
from pcaf_core.config_io import config_from_dict
from pcaf_core.loop import run_training

torch.set_num_threads(1)
cfg = config_from_dict(json.loads(Path(sys.argv[1]).read_text()))
delay = float(sys.argv[3])


class Paced(TorchBackend):
    # Sleeps after each step (outside the numerics) so the test can kill the run part-way.
    def train_step(self, state, inputs, targets, lr, **kwargs):
        out = super().train_step(state, inputs, targets, lr, **kwargs)
        time.sleep(delay)
        return out


run_training(cfg, Paced("cpu"), Path(sys.argv[2]), progress=False)
"""

def _start(tmp_path: Path, cfg_file: Path, run_dir: Path, delay: float) -> subprocess.Popen:
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    return start_runner(script, cfg_file, run_dir, delay)


def _optimizer_tensors(ck: Path) -> list[torch.Tensor]:
    state = torch.load(ck / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    return [t for i in sorted(state) for t in (state[i]["exp_avg"], state[i]["exp_avg_sq"], state[i]["step"])]


STEPS = 12
"""Steps of a run: checkpoints every 3, evaluations every 4, so a run killed after its step-6 checkpoint has
evaluated (and tracked a best step) before it, and evaluates and checkpoints again after resuming. A tiny
step takes milliseconds: the processes' start-up is the cost, whatever the step count."""


@pytest.fixture
def run_cfg(tmp_path, wt2_cache):  # noqa: F811 - the fixture parameter shadows its import
    # reference_torch: dropout (RNG state) and gradient clipping are part of what must resume exactly.
    cfg = tiny_cfg(wt2_cache, profile="reference_torch",
                   train={"steps": STEPS, "checkpoint_every": 3, "log_every": 1},
                   eval={"every": 4, "batches": 3, "full_max_windows": 32})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config_to_dict(cfg)))
    return path


def _uninterrupted(run_cfg: Path, run_dir: Path) -> None:
    """The reference run, in this process (the property is about the interrupted run's processes): one torch
    thread, as the runner sets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(config_from_dict(json.loads(run_cfg.read_text())), TorchBackend("cpu"), run_dir,
                     progress=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path, run_cfg):
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"
    victim = _start(tmp_path, run_cfg, run_dir, 0.1)
    _uninterrupted(run_cfg, ref_dir)  # while the victim starts
    killed_after = wait_for_checkpoint(victim, run_dir, min_step=6, timeout=120)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    rec = read_metrics(run_dir)
    # SIGKILL cannot be caught: the record still says "running", with the progress of its last update.
    assert rec.status == "running" and rec.steps_done < STEPS
    assert read_loop_state(latest_checkpoint(run_dir)).step >= killed_after >= 6

    finish(_start(tmp_path, run_cfg, run_dir, 0.0), timeout=180)
    a, b = read_metrics(ref_dir), read_metrics(run_dir)
    assert b.status == "completed" and b.extra["segments"] == 2
    assert quality(b) == quality(a)
    assert curve_without_time(run_dir) == curve_without_time(ref_dir)
    assert len(curve_without_time(run_dir)) == STEPS
    ck_a, ck_b = latest_checkpoint(ref_dir), latest_checkpoint(run_dir)
    assert ck_a.name == ck_b.name == f"step_{STEPS}"
    wa = safetensors.numpy.load_file(str(ck_a / "model.safetensors"))
    wb = safetensors.numpy.load_file(str(ck_b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].tobytes() == wb[k].tobytes(), k
    for ta, tb in zip(_optimizer_tensors(ck_a), _optimizer_tensors(ck_b), strict=True):
        assert torch.equal(ta, tb)
    la, lb = read_loop_state(ck_a), read_loop_state(ck_b)
    assert la.train_sampler == lb.train_sampler and la.eval_sampler == lb.eval_sampler


@pytest.mark.slow
def test_sigterm_leaves_an_interrupted_record_and_resumes(tmp_path, run_cfg):
    run_dir = tmp_path / "run"
    victim = _start(tmp_path, run_cfg, run_dir, 0.1)
    wait_for_checkpoint(victim, run_dir, min_step=3, timeout=120)
    victim.send_signal(signal.SIGTERM)
    out, _ = victim.communicate(timeout=30)
    assert victim.returncode != 0, out
    rec = read_metrics(run_dir)
    assert rec.status == "failed" and rec.error.startswith("interrupted by SIGTERM after step")
    assert f"resume {run_dir} from {run_dir / 'checkpoints'}/step_" in rec.error and rec.extra["resumable"]
    finish(_start(tmp_path, run_cfg, run_dir, 0.0), timeout=180)
    done = read_metrics(run_dir)
    assert done.status == "completed" and done.error is None and done.steps_done == STEPS
    assert np.isfinite(done.final_ppl)
