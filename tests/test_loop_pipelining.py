"""One step in flight (:mod:`pcaf_core.cadence`): a one-process run launches step N+1 before it reads step N's loss,
except after a step whose end reads its state (an evaluation, a checkpoint, the last step). Checked with the NumPy
bigram backend (the order of launches, reads, evaluations and saves; failures; the step timer) and with the torch
and JAX backends on a CPU (a pipelined run trains exactly as one that reads every loss at once)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from pcaf_core import loop
from pcaf_core.cadence import checkpoint_due, reads_state
from pcaf_core.config import MemoryConfig
from pcaf_core.loop import TrainingDiverged, run_training
from pcaf_core.profiles import get_profile
from pcaf_core.results import read_curve, read_metrics
from tests.bigram_backend import BigramBackend, markov_corpus, small_cfg


class _DeviceLoss:
    """A loss still on the device: reading it is an event of the run."""

    def __init__(self, value: float, step: int, events: list[tuple[str, int]]) -> None:
        self.value, self.step, self.events = value, step, events

    def __float__(self) -> float:
        self.events.append(("read", self.step))
        return self.value


class _Logged(BigramBackend):
    """The bigram backend whose ``wait=False`` steps return :class:`_DeviceLoss`, logging launches, reads,
    evaluations and saves in the order they happen."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events: list[tuple[str, int]] = []
        self.waited: list[bool] = []

    def train_step(self, state, inputs, targets, lr, *, wait=True):
        self.events.append(("launch", state["step"] + 1))
        self.waited.append(wait)
        state, loss = super().train_step(state, inputs, targets, lr)
        return state, (loss if wait else _DeviceLoss(loss, state["step"], self.events))

    def eval_batch(self, state, inputs, targets, mode):
        if not self.events or self.events[-1] != ("eval", state["step"]):
            self.events.append(("eval", state["step"]))
        return super().eval_batch(state, inputs, targets, mode)

    def save(self, state, path) -> None:
        self.events.append(("save", state["step"]))
        super().save(state, path)


def _run(tmp_path, backend, **over):
    cfg = small_cfg(**{"steps": 7, "checkpoint_every": 5, "eval": {"every": 3, "batches": 1,
                                                                   "protocol": "reference"}, **over})
    return cfg, run_training(cfg, backend, tmp_path, corpus=markov_corpus(), progress=False)


def test_the_next_step_is_launched_before_a_steps_loss_is_read(tmp_path) -> None:
    """Steps 2 and 4 are read after their successors launched; steps 1, 3 and 6 evaluate, 5 and 7 save, 7 is the
    last: each of those is read, evaluated and saved before anything else launches."""
    backend = _Logged()
    cfg, _ = _run(tmp_path, backend)
    assert backend.events == [
        ("launch", 1), ("read", 1), ("eval", 1),
        ("launch", 2), ("launch", 3), ("read", 2), ("read", 3), ("eval", 3),
        ("launch", 4), ("launch", 5), ("read", 4), ("read", 5), ("save", 5),
        ("launch", 6), ("read", 6), ("eval", 6),
        ("launch", 7), ("read", 7), ("eval", 7), ("save", 7),
    ]
    assert not any(backend.waited)
    assert [s for s in range(1, 8) if reads_state(cfg, s)] == [1, 3, 5, 6, 7]
    assert [s for s in range(1, 8) if checkpoint_due(cfg, s)] == [5, 7]


def test_a_pipelined_run_records_what_a_synchronous_one_does(tmp_path, monkeypatch) -> None:
    """The same curve, evaluations and checkpoints as when every step's loss is read before the next launches."""
    _, piped = _run(tmp_path / "piped", _Logged(), log_every=1)
    monkeypatch.setattr(loop, "reads_state", lambda cfg, step: True)
    backend = _Logged()
    _, synced = _run(tmp_path / "synced", backend, log_every=1)
    assert all(e[0] != "launch" or i == 0 or backend.events[i - 1][0] != "launch" for i, e in enumerate(
        backend.events))  # the synchronous order really was synchronous
    drop = ("elapsed_s",)
    rows = [[{k: v for k, v in r.items() if k not in drop} for r in read_curve(tmp_path / d)]
            for d in ("piped", "synced")]
    assert rows[0] == rows[1] and len(rows[0]) == 7
    assert (piped.best_ppl, piped.final_ppl, piped.steps_done) == (synced.best_ppl, synced.final_ppl, 7)
    for step in (5, 7):
        w = [np.load(tmp_path / d / "checkpoints" / f"step_{step}" / "W.npy") for d in ("piped", "synced")]
        assert np.array_equal(w[0], w[1])


def test_a_step_that_fails_to_launch_is_reported_after_the_step_before_it_is_counted(tmp_path) -> None:
    backend = _Logged(raise_at_step=5)
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        _run(tmp_path, backend, checkpoint_every=0, log_every=1)
    assert backend.events[-2:] == [("launch", 5), ("read", 4)]
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and rec.steps_done == 4 and "step 5" in rec.error
    assert [r["step"] for r in read_curve(tmp_path)] == [1, 2, 3, 4]


def test_a_diverged_step_is_reported_as_itself_with_its_successor_in_flight(tmp_path) -> None:
    backend = _Logged(nan_at_step=4)
    with pytest.raises(TrainingDiverged, match="at step 4"):
        _run(tmp_path, backend)
    assert backend.events[-2:] == [("launch", 5), ("read", 4)]
    assert read_metrics(tmp_path).steps_done == 3


def test_a_synchronous_backends_step_is_timed_as_its_own_work(tmp_path) -> None:
    """A backend that computes in the call (a CPU) is timed per step as before, its launch included: the first timed
    step's 40 ms count, although that step was launched before the last warm-up step's loss was read."""
    first_timed = loop.THROUGHPUT_WARMUP_STEPS + 1

    class Slow(BigramBackend):
        def train_step(self, state, inputs, targets, lr, *, wait=True):
            time.sleep(0.04 if state["step"] + 1 == first_timed else 0.001)
            return super().train_step(state, inputs, targets, lr)

    steps = first_timed + 3
    cfg = small_cfg(steps=steps, eval={"every": 100, "batches": 1, "protocol": "reference"})
    rec = run_training(cfg, Slow(), tmp_path, corpus=markov_corpus(), progress=False)
    timed_seconds = (steps - loop.THROUGHPUT_WARMUP_STEPS) * rec.batch_size * rec.seq_len / rec.tokens_per_sec
    assert timed_seconds >= 0.04 + 0.001 * 3


def test_data_parallel_runs_read_every_loss_before_the_next_launch(tmp_path) -> None:
    """Several processes average each step's loss (a collective) before the next step starts."""

    class TwoRanks(_Logged):
        world_size = 2

        def train_step(self, state, inputs, targets, lr, *, wait=True):
            state, loss = super().train_step(state, inputs, targets, lr, wait=False)  # its reads are logged
            self.waited[-1] = wait
            return state, loss

        def all_reduce_sum(self, values):  # two ranks of the same values
            return [2.0 * float(v) for v in values]

    backend = TwoRanks()
    _run(tmp_path, backend, batch_size=4)
    assert all(backend.waited)
    steps = [e for e in backend.events if e[0] in ("launch", "read")]
    assert steps == [(what, s) for s in range(1, 8) for what in ("launch", "read")]


# --------------------------------------------------------------------------- the real backends, on a CPU

def _torch_or_jax_cfg(steps: int = 9):
    cfg = small_cfg(steps=steps, checkpoint_every=4, log_every=1, lr=3e-3,
                    eval={"every": 3, "batches": 2, "protocol": "reference"})
    model = dataclasses.replace(cfg.model, variant="pcaf", d_model=16, d_hidden=16)
    # Dropout on: both orders must draw the same masks in the same order.
    return dataclasses.replace(cfg, model=model, memory=MemoryConfig(num_buckets=64, top_k=4),
                               profile=get_profile("reference_torch"))


def _same_runs(tmp_path, monkeypatch, make_backend, weights) -> None:
    cfg = _torch_or_jax_cfg()
    corpus = markov_corpus()
    piped = run_training(cfg, make_backend(), tmp_path / "piped", corpus=corpus, progress=False, keep_checkpoints=3)
    monkeypatch.setattr(loop, "reads_state", lambda cfg, step: True)
    synced = run_training(cfg, make_backend(), tmp_path / "synced", corpus=corpus, progress=False,
                          keep_checkpoints=3)
    curves = [[{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_curve(tmp_path / d)]
              for d in ("piped", "synced")]
    assert curves[0] == curves[1] and len(curves[0]) == cfg.train.steps
    assert (piped.best_ppl, piped.final_ppl) == (synced.best_ppl, synced.final_ppl)
    for step in (4, 8, 9):
        got, want = (weights(tmp_path / d / "checkpoints" / f"step_{step}") for d in ("piped", "synced"))
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


def _safetensors_weights(path) -> dict[str, np.ndarray]:
    import safetensors.numpy

    return safetensors.numpy.load_file(str(path / "model.safetensors"))


def test_torch_trains_pipelined_exactly_as_synchronously(tmp_path, monkeypatch, one_torch_thread) -> None:
    from backends.torch.backend import TorchBackend

    _same_runs(tmp_path, monkeypatch, lambda: TorchBackend("cpu"), _safetensors_weights)


def test_torch_returns_the_loss_on_the_device_when_asked_not_to_wait(one_torch_thread) -> None:
    import torch

    from backends.torch.backend import TorchBackend

    cfg = _torch_or_jax_cfg()
    x = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 8)).astype(np.int32)
    y = x[:, -1].copy()
    losses = []
    for wait in (True, False):
        backend = TorchBackend("cpu")
        torch.manual_seed(0)
        state = backend.init(cfg)
        losses.append(backend.train_step(state, x, y, 1e-3, wait=wait)[1])
    assert isinstance(losses[0], float)
    assert isinstance(losses[1], torch.Tensor) and losses[1].shape == () and losses[1].dtype == torch.float32
    assert float(losses[1]) == losses[0]


def test_jax_trains_pipelined_exactly_as_synchronously(tmp_path, monkeypatch) -> None:
    """JAX dispatches a step and returns at once on a CPU too: its loss is read after the next step is dispatched."""
    import jax

    from backends.jax.backend import JaxBackend

    class Dispatched(JaxBackend):
        def train_step(self, state, inputs, targets, lr, *, wait=True):
            state, loss = super().train_step(state, inputs, targets, lr, wait=wait)
            assert wait or isinstance(loss, jax.Array)
            return state, loss

    _same_runs(tmp_path, monkeypatch, lambda: Dispatched("cpu"), _safetensors_weights)
