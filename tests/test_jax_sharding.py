"""Data parallelism with jax.sharding: a 4-device mesh (emulated on the CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in a subprocess) takes the steps one device takes
on the same global batch, within float summation order.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy

from backends.jax import sharding
from pcaf_core.checkpoints import latest_checkpoint
from pcaf_core.results import read_curve, read_metrics
from tests.env_helpers import xla_flags

TOL = 1e-5

RUNNER = r"""
import json, sys
from pathlib import Path

import jax
import numpy as np

from backends.jax.backend import JaxBackend
from backends.jax.train import train
from tests.test_jax_train import CORPUS, batch, tiny_cfg

assert jax.device_count() == 4, jax.devices()
out = Path(sys.argv[1])
from tests.test_jax_sharding import mesh_cfg

cfg = mesh_cfg()
report = {}
for n in (1, 4):
    m = train(cfg, out / f"dev{n}", progress=False, corpus=CORPUS, world_size=n)
    report[f"device{n}"] = m.device

# Placement: the state is replicated over the mesh; an evaluation batch of 6 rows is padded to 8 and cut.
backend = JaxBackend("cpu", num_devices=4)
state = backend.init(cfg)
leaf = jax.tree_util.tree_leaves(state.params)[0]
report["replicated"] = bool(leaf.sharding.is_fully_replicated) and len(leaf.sharding.device_set) == 4
x, y = batch(9, b=6)
one = JaxBackend("cpu", num_devices=1)
e4, e1 = backend.eval_batch(state, x, y, "nt"), one.eval_batch(one.init(cfg), x, y, "nt")
report["eval_rows"] = int(e4.target_log_prob.shape[0])
report["eval_diff"] = float(np.abs(e4.target_log_prob - e1.target_log_prob).max())
report["eval_pred_equal"] = bool(np.array_equal(e4.prediction, e1.prediction))
try:
    JaxBackend("cpu", num_devices=4).init(tiny_cfg(train={"batch_size": 6}))
except ValueError as exc:
    report["indivisible"] = str(exc)
(out / "report.json").write_text(json.dumps(report))
"""


MULTIHOST = r"""
import sys
from pathlib import Path

from backends.jax.sharding import initialize_distributed

initialize_distributed("on", coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))

import jax

from backends.jax.train import train
from tests.test_jax_sharding import mesh_cfg
from tests.test_jax_train import CORPUS

assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
train(mesh_cfg(), Path(sys.argv[3]), progress=False, corpus=CORPUS)
"""


def mesh_cfg():
    """reference_jax: its context-route PCAF carries an unused router; clipping on. No dropout: a mask
    does not depend on the split either, but without it the check is about the gradient all-reduce alone."""
    from tests.test_jax_train import tiny_cfg

    return tiny_cfg(profile="reference_jax", grad_clip_norm=0.5,
                    train={"steps": 6, "batch_size": 8, "log_every": 1, "checkpoint_every": 3},
                    eval={"every": 3, "batches": 2, "full_max_windows": 12})


def assert_same_run(a, b) -> None:
    """Two run directories of :func:`mesh_cfg` trained alike: per-step losses, evaluations and final
    weights within ``TOL``."""
    ca, cb = read_curve(a), read_curve(b)
    assert [r["step"] for r in ca] == [r["step"] for r in cb] == list(range(1, 7))
    for ra, rb in zip(ca, cb):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= TOL, (ra["step"], ra["train_loss"], rb["train_loss"])
        if ra["eval_loss_reference"] is not None:
            assert abs(ra["eval_loss_reference"] - rb["eval_loss_reference"]) <= TOL
    ma, mb = read_metrics(a), read_metrics(b)
    assert ma.status == mb.status == "completed"
    assert abs(ma.extra["full_loss"] - mb.extra["full_loss"]) <= TOL
    assert ma.extra["full_targets"] == mb.extra["full_targets"]
    wa = safetensors.numpy.load_file(str(latest_checkpoint(a) / "model.safetensors"))
    wb = safetensors.numpy.load_file(str(latest_checkpoint(b) / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=TOL, err_msg=k)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    script = out / "runner.py"
    script.write_text(RUNNER)
    env = {**os.environ, "XLA_FLAGS": xla_flags(4)}
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_four_devices_match_one_device(mesh_runs):
    out, report = mesh_runs
    assert "1 device;" in report["device1"] and "4 devices;" in report["device4"]
    assert_same_run(out / "dev1", out / "dev4")


@pytest.mark.slow
def test_two_processes_of_two_devices_match_one_device(mesh_runs, tmp_path):
    # jax.distributed on the CPU (gloo collectives): each process feeds its half of every global batch.
    out, _ = mesh_runs
    script = tmp_path / "multihost.py"
    script.write_text(MULTIHOST)
    env = {**os.environ, "XLA_FLAGS": xla_flags(2)}
    address = f"localhost:{_free_port()}"
    run_dir = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, str(script), address, str(pid), str(run_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for pid in (0, 1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    m = read_metrics(run_dir)
    assert "4 devices over 2 processes" in m.device
    assert_same_run(out / "dev1", run_dir)
    # Process 0 alone wrote the checkpoint files (the state is replicated).
    assert sorted(p.name for p in latest_checkpoint(run_dir).iterdir()) == [
        "loop_state.json", "model.safetensors", "optimizer.safetensors"]


@pytest.mark.slow  # its fixture trains on four emulated devices
def test_state_is_replicated_and_uneven_eval_batches_are_padded(mesh_runs):
    _, report = mesh_runs
    assert report["replicated"]
    assert report["eval_rows"] == 6 and report["eval_diff"] <= TOL and report["eval_pred_equal"]
    assert "train.batch_size=6 is not divisible by the 4 devices" in report["indivisible"]


def test_single_process_collectives_and_start_up():
    assert sharding.all_reduce_sum([1.5, 2.0]) == [1.5, 2.0]
    sharding.barrier()  # a no-op alone
    assert sharding.initialize_distributed("off") is False
    env_keys = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")
    if not any(k in os.environ for k in env_keys):
        assert sharding.initialize_distributed("auto") is False
    with pytest.raises(ValueError, match="distributed mode 'yes' is invalid"):
        sharding.initialize_distributed("yes")
    # One more device than this process has (XLA_FLAGS may emulate several).
    too_many = len(jax.devices("cpu")) + 1
    with pytest.raises(ValueError, match=f"xla_force_host_platform_device_count={too_many}"):
        sharding.select_devices("cpu", too_many)
    # "cuda", as the torch backend and the suite's configs name the GPU, is JAX's gpu platform.
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError, match="no JAX gpu device is available"):
            sharding.select_devices("cuda")
    with pytest.raises(ValueError, match="device='cuda:0' is invalid for the JAX backend"):
        sharding.select_devices("cuda:0")
