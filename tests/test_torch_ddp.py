"""Data-parallel torch training (gloo on CPU): two processes with a split global batch train like
one process with the whole batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
import torch
import torch.distributed as dist

from backends.torch.ddp import launch_ddp, leave_process_group
from backends.torch.train import TorchBackend
from pcaf_core.checkpoints import latest_checkpoint
from pcaf_core.config_io import config_to_dict
from pcaf_core.loop import run_training
from pcaf_core.results import read_curve, read_metrics
from tests.test_torch_train import tiny_cfg, wt2_cache  # noqa: F401 - wt2_cache is a fixture

TOL = 1e-5


def _cfg(cache_dir: str):
    # reference_jax: its context-route PCAF carries an unused router, which DDP must tolerate; clipping
    # on. No dropout: its random draws depend on how the batch is split, the rest of the step does not.
    return tiny_cfg(cache_dir, profile="reference_jax", grad_clip_norm=0.5,
                    train={"steps": 8, "batch_size": 4, "log_every": 1, "checkpoint_every": 4},
                    eval={"every": 4, "batches": 2, "full_max_windows": 24})


@pytest.fixture
def ddp_cfg(wt2_cache):  # noqa: F811 - the fixture parameter shadows its import
    return _cfg(wt2_cache)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, wt2_cache):  # noqa: F811
    cfg = _cfg(wt2_cache)
    run_dir = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(cfg, TorchBackend("cpu"), run_dir, progress=False)
    finally:
        torch.set_num_threads(threads)
    return run_dir


def _assert_same_run(a_dir, b_dir, tol=TOL):
    ca, cb = read_curve(a_dir), read_curve(b_dir)
    assert [r["step"] for r in ca] == [r["step"] for r in cb] == list(range(1, 9))
    for ra, rb in zip(ca, cb):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= tol, (ra["step"], ra["train_loss"], rb["train_loss"])
        if ra["eval_loss_reference"] is not None:
            assert abs(ra["eval_loss_reference"] - rb["eval_loss_reference"]) <= tol
            assert ra["eval_acc_reference"] == rb["eval_acc_reference"]
    ma, mb = read_metrics(a_dir), read_metrics(b_dir)
    assert ma.best_step == mb.best_step and ma.full_windows == mb.full_windows
    assert abs(ma.extra["full_loss"] - mb.extra["full_loss"]) <= tol
    assert ma.extra["full_targets"] == mb.extra["full_targets"]
    wa = safetensors.numpy.load_file(str(latest_checkpoint(a_dir) / "model.safetensors"))
    wb = safetensors.numpy.load_file(str(latest_checkpoint(b_dir) / "model.safetensors"))
    # Weights: Adam divides by sqrt(v) + eps, so an entry whose gradient is near zero amplifies the
    # ~1e-7 summation-order noise of the all-reduce; single entries may move by ~1e-5 while the
    # losses agree to 1e-6. Bound the worst entry loosely and the mean tightly.
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], atol=20 * tol, rtol=0, err_msg=k)
        assert np.abs(wa[k] - wb[k]).mean() <= tol / 10, k


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, ddp_cfg, single_run):
    m = launch_ddp(ddp_cfg, tmp_path, world_size=2, threads_per_rank=1)
    assert m.status == "completed" and m.extra["world_size"] == 2 and m.batch_size == 4
    _assert_same_run(single_run, tmp_path)
    # Every rank wrote its generator state; rank 0 alone wrote weights, optimiser and the record.
    ck = latest_checkpoint(tmp_path)
    assert sorted(p.name for p in ck.iterdir()) == ["loop_state.json", "model.safetensors", "optimizer.pt",
                                                     "rng_rank0.pt", "rng_rank1.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "curve.csv", "metrics.json"]


@pytest.mark.slow
def test_torchrun_entry_point(tmp_path, ddp_cfg, single_run):
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(config_to_dict(ddp_cfg)))
    run_dir = tmp_path / "run"
    # torchrun keeps its workers' logs and error files under the temporary folder: here, the test's own.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "backends.torch.train_ddp", "--config", str(cfg_file), "--run-dir", str(run_dir), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_metrics(run_dir).extra["world_size"] == 2
    _assert_same_run(single_run, run_dir)


def test_a_finished_rank_drains_the_process_group_before_leaving_it(monkeypatch):
    """The closing barrier comes before the group is destroyed, and only when every rank finished: after a
    failure the other ranks may be gone and a barrier would wait for them forever."""
    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    leave_process_group(True)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    leave_process_group(False)
    assert calls == ["destroy"]
    calls.clear()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    leave_process_group(True)
    assert calls == []


@pytest.mark.slow
def test_a_completed_rank_exits_zero_with_its_output_flushed():
    """exit_completed_rank skips interpreter finalization (os._exit) but loses nothing printed or logged."""
    code = ("import logging, sys\n"
            "from backends.torch.ddp import exit_completed_rank\n"
            "logging.basicConfig(stream=sys.stderr)\n"
            "logging.getLogger('rank').warning('logged')\n"
            "sys.stdout.write('unterminated line')\n"
            "exit_completed_rank()\n"
            "raise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "unterminated line"
    assert "logged" in proc.stderr


@pytest.mark.slow
def test_ddp_failure_is_raised_and_recorded(tmp_path, wt2_cache):  # noqa: F811
    cfg = tiny_cfg(wt2_cache, train={"steps": 2, "batch_size": 3})
    with pytest.raises(Exception, match="not divisible by the 2 data-parallel processes"):
        launch_ddp(cfg, tmp_path, world_size=2, threads_per_rank=1)
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and "train.batch_size=3" in rec.error


def test_a_rank_that_fails_first_still_leaves_a_failed_record(tmp_path, wt2_cache):  # noqa: F811
    """When rank 1 fails before rank 0 can write the record, mp.spawn terminates rank 0: the parent marks
    the run failed with rank 1's error, and never overwrites a failure rank 0 recorded itself."""
    import dataclasses

    from torch.multiprocessing.spawn import ProcessRaisedException

    from backends.torch.ddp import _record_rank_failure
    from pcaf_core.run_record import write_failed_record, write_record

    cfg = tiny_cfg(wt2_cache, train={"steps": 2, "batch_size": 3})
    trace = "Traceback (most recent call last):\n  File ...\nValueError: train.batch_size=3 is not divisible\n"
    exc = ProcessRaisedException(trace, error_index=1, error_pid=123)
    _record_rank_failure(tmp_path / "none", cfg, None, exc)  # no record at all
    rec = read_metrics(tmp_path / "none")
    assert rec.status == "failed" and rec.error == "rank 1: ValueError: train.batch_size=3 is not divisible"
    assert rec.batch_size == 3 and rec.steps_planned == 2

    running = tmp_path / "running"  # rank 0 was mid-run: its record keeps what it holds
    write_record(running, dataclasses.replace(write_failed_record(running, None, "x", cfg=cfg), status="running",
                                              error=None, steps_done=1))
    _record_rank_failure(running, cfg, None, exc)
    rec = read_metrics(running)
    assert rec.status == "failed" and rec.steps_done == 1 and rec.error.startswith("rank 1: ValueError")

    own = tmp_path / "own"  # rank 0 recorded its own failure first: left as it is
    write_failed_record(own, None, "rank 0's own words", cfg=cfg)
    _record_rank_failure(own, cfg, None, exc)
    assert read_metrics(own).error == "rank 0's own words"
