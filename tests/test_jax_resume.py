"""Kill a JAX training process mid-run, resume it in a new process, and get the uninterrupted run bit for
bit (CPU, fp32): metrics, learning curve, weights, optimiser state, step and dropout key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.numpy

from pcaf_core.checkpoints import latest_checkpoint, read_loop_state
from pcaf_core.config import DataConfig
from pcaf_core.config_io import config_to_dict
from pcaf_core.results import read_metrics
from tests.env_helpers import xla_flags
from tests.resume_helpers import curve_without_time, finish, quality, start_runner, wait_for_checkpoint
from tests.test_jax_train import tiny_cfg

RUNNER = """
import sys, time
from pathlib import Path

from backends.jax.backend import JaxBackend
from pcaf_core.config_io import read_config
from pcaf_core.loop import run_training
from tests.test_jax_train import CORPUS

cfg = read_config(sys.argv[1])
delay = float(sys.argv[3])


class Paced(JaxBackend):
    # Sleeps after each step (outside the numerics) so the test can kill the run part-way.
    def train_step(self, state, inputs, targets, lr, **kwargs):
        out = super().train_step(state, inputs, targets, lr, **kwargs)
        time.sleep(delay)
        return out


run_training(cfg, Paced("cpu"), Path(sys.argv[2]), corpus=CORPUS, progress=False)
"""

def _start(tmp_path: Path, cfg_file: Path, run_dir: Path, delay: float) -> subprocess.Popen:
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    return start_runner(script, cfg_file, run_dir, delay, env={**os.environ, "XLA_FLAGS": xla_flags(1)})


@pytest.mark.slow
def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    # reference_torch: dropout (the step's key) and gradient clipping are part of what must resume exactly.
    cfg = tiny_cfg(variant="local_conv", profile="reference_torch",
                   train={"steps": 16, "checkpoint_every": 4, "log_every": 1},
                   eval={"every": 8, "batches": 2, "full_max_windows": 16})
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(config_to_dict(cfg)))
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"

    ref = _start(tmp_path, cfg_file, ref_dir, 0.0)
    victim = _start(tmp_path, cfg_file, run_dir, 0.1)
    killed_after = wait_for_checkpoint(victim, run_dir, min_step=8, timeout=180)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    rec = read_metrics(run_dir)
    # SIGKILL cannot be caught: the record still says "running", with the progress of its last update.
    assert rec.status == "running" and rec.steps_done < 16
    assert read_loop_state(latest_checkpoint(run_dir)).step >= killed_after >= 8

    finish(_start(tmp_path, cfg_file, run_dir, 0.0), timeout=240)
    finish(ref, timeout=240)
    a, b = read_metrics(ref_dir), read_metrics(run_dir)
    assert b.status == "completed" and b.extra["segments"] == 2
    assert quality(b) == quality(a)
    assert curve_without_time(run_dir) == curve_without_time(ref_dir)
    assert len(curve_without_time(run_dir)) == 16
    ck_a, ck_b = latest_checkpoint(ref_dir), latest_checkpoint(run_dir)
    assert ck_a.name == ck_b.name == "step_16"
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta = safetensors.numpy.load_file(str(ck_a / name))
        tb = safetensors.numpy.load_file(str(ck_b / name))
        assert ta.keys() == tb.keys() and len(ta) > 10, name
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and ta[k].tobytes() == tb[k].tobytes(), (name, k)
    opt = safetensors.numpy.load_file(str(ck_b / "optimizer.safetensors"))
    assert int(opt["step"]) == 16 and int(opt["opt_state.count"]) == 16
    la, lb = read_loop_state(ck_a), read_loop_state(ck_b)
    assert la.train_sampler == lb.train_sampler and la.eval_sampler == lb.eval_sampler


@pytest.mark.slow
def test_command_line_entry_point(tmp_path, capsys):
    # The multi-host launcher in a single process: the config file names the data (a small WikiText-2 slice).
    # The entry point is under test, not the model: the conv backbone compiles fastest.
    cfg = tiny_cfg(variant="local_conv", train={"steps": 4, "checkpoint_every": 2},
                   eval={"every": 2, "batches": 1, "full_max_windows": 8})
    cfg.data = DataConfig(name="wikitext2", max_vocab=40, max_train_tokens=6000, max_eval_tokens=1500,
                          cache_dir=str(tmp_path / "cache"))
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(config_to_dict(cfg)))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "backends.jax.train", "--config", str(cfg_file), "--run-dir", str(run_dir),
           "--device", "cpu", "--no-progress"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = read_metrics(run_dir)
    assert m.status == "completed" and m.backend == "jax" and m.steps_done == 4 and m.dataset == "wikitext2"
    assert m.extra["segments"] == 1 and m.extra["world_size"] == 1
    # A missing config file is refused before JAX is touched: main() in this process (the module's
    # `sys.exit(main())` turns the SystemExit into the process's exit status, as the run above shows).
    from backends.jax.train import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        main([*cmd[3:4], str(tmp_path / "missing.json"), *cmd[5:]])
    assert bad.value.code == 2 and "missing.json does not exist" in capsys.readouterr().err
