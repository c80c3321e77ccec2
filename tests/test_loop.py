"""The backend-neutral loop (pcaf_core.loop) driven by a small NumPy backend.

The backend is a bigram model (a ``[V, V]`` logit table trained by plain SGD on the NLL of the
target given the previous token), enough to learn, diverge on demand and save/load exactly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pcaf_core import loop
from pcaf_core.backend import EvalOutputs, SingleProcess
from pcaf_core.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, read_loop_state
from pcaf_core.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from pcaf_core.config_io import config_from_dict, config_to_dict
from pcaf_core.evaluation import capped_ppl
from pcaf_core.loop import TrainingDiverged, run_training
from pcaf_core.results import CURVE_COLUMNS, read_curve, read_metrics
from pcaf_core.run_record import THROUGHPUT_TIMED_TO_LOSS
from pcaf_core.schedule import lr_at_step

V = 24


def markov_corpus(n_train: int = 4000, n_valid: int = 1200, vocab: int = V, seed: int = 0) -> SimpleNamespace:
    """Tokens from a sparse first-order Markov chain (3 successors per token): learnable structure."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(3, vocab, size=(vocab, 3))

    def chain(n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int32)
        out[0] = 3
        for i in range(1, n):
            out[i] = succ[out[i - 1], rng.integers(0, 3)]
        return out

    return SimpleNamespace(train=chain(n_train), valid=chain(n_valid), vocab_size=vocab)


def small_cfg(**train_over: Any) -> RunConfig:
    eval_over = train_over.pop("eval", {})
    train = dict(mode="nt", seq_len=8, batch_size=4, steps=12, lr=0.5, seed=7)
    train.update(train_over)
    ev = dict(protocol="both", every=4, batches=3, full_max_windows=0)
    ev.update(eval_over)
    return RunConfig(
        model=ModelConfig(variant="local_conv", vocab_size=V, d_model=8, d_hidden=8, n_layers=1),
        data=DataConfig(max_vocab=V),
        train=TrainConfig(**train),
        eval=EvalConfig(**ev),
    )


class BigramBackend(SingleProcess):
    """NumPy bigram model: ``p(y | previous token) = softmax(W[prev])``; SGD on the mean NLL."""

    name = "numpy-bigram"

    def __init__(self, nan_at_step: int | None = None, raise_at_step: int | None = None,
                 raise_type: type[BaseException] = RuntimeError) -> None:
        self.nan_at_step = nan_at_step
        self.raise_at_step = raise_at_step
        self.raise_type = raise_type
        self.calls: list[tuple[str, int]] = []
        self.lrs: list[float] = []

    def init(self, cfg: RunConfig) -> dict[str, Any]:
        rng = np.random.default_rng(cfg.train.seed)
        return {"W": rng.normal(0, 0.1, (cfg.model.vocab_size, cfg.model.vocab_size)), "step": 0}

    @staticmethod
    def _pairs(inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if targets.ndim == 1:
            return inputs[:, -1].astype(np.int64), targets.astype(np.int64)
        return inputs.reshape(-1).astype(np.int64), targets.reshape(-1).astype(np.int64)

    @staticmethod
    def _log_probs(W: np.ndarray, prev: np.ndarray) -> np.ndarray:
        z = W[prev]
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    def train_step(self, state: dict[str, Any], inputs: np.ndarray, targets: np.ndarray,
                   lr: float) -> tuple[dict[str, Any], float]:
        step = state["step"] + 1
        self.calls.append(("train", step))
        self.lrs.append(lr)
        if self.raise_at_step == step:
            raise self.raise_type(f"injected failure at step {step}")
        prev, y = self._pairs(inputs, targets)
        lp = self._log_probs(state["W"], prev)
        loss = float(-lp[np.arange(len(y)), y].mean())
        grad = np.exp(lp)
        grad[np.arange(len(y)), y] -= 1.0
        G = np.zeros_like(state["W"])
        np.add.at(G, prev, grad / len(y))
        W = state["W"] - lr * G
        if self.nan_at_step is not None and step >= self.nan_at_step:
            loss = math.nan
            W = W * np.nan
        return {"W": W, "step": step}, loss

    def eval_batch(self, state: dict[str, Any], inputs: np.ndarray, targets: np.ndarray,
                   mode: str) -> EvalOutputs:
        self.calls.append(("eval", state["step"]))
        prev, y = self._pairs(inputs, targets)
        lp = self._log_probs(state["W"], prev)
        shape = (len(inputs), -1)
        pred = lp.argmax(-1).reshape(shape)
        return EvalOutputs(target_log_prob=lp[np.arange(len(y)), y].reshape(shape), prediction=pred,
                           prediction_param=pred)

    def save(self, state: dict[str, Any], path: Path) -> None:
        np.save(Path(path) / "W.npy", state["W"])
        (Path(path) / "step.txt").write_text(str(state["step"]))

    def load(self, path: Path, cfg: RunConfig) -> dict[str, Any]:
        return {"W": np.load(Path(path) / "W.npy"), "step": int((Path(path) / "step.txt").read_text())}

    def param_count(self, state: dict[str, Any]) -> int:
        return int(state["W"].size)

    def peak_memory_mb(self) -> float | None:
        return None


class ScriptedEvalBackend(BigramBackend):
    """Evaluation returns scripted losses/accuracies, one entry per reference evaluation."""

    def __init__(self, losses: list[float], accs: list[float], batches: int) -> None:
        super().__init__()
        self.script = list(zip(losses, accs))
        self.batches = batches
        self.n_eval_calls = 0

    def eval_batch(self, state, inputs, targets, mode):
        y = np.asarray(targets).reshape(len(inputs), -1)
        n = y.size
        if self.n_eval_calls >= len(self.script) * self.batches:  # the full protocol: 25 nats (beyond the cap)
            loss, hits, hits_param = 25.0, 0, 0
        else:
            loss, acc = self.script[self.n_eval_calls // self.batches]
            hits, hits_param = round(acc * n), round(acc * n / 2)
        self.n_eval_calls += 1
        miss = (y + 1) % V
        first = np.arange(n).reshape(y.shape)
        return EvalOutputs(target_log_prob=np.full(y.shape, -loss), prediction=np.where(first < hits, y, miss),
                           prediction_param=np.where(first < hits_param, y, miss))


QUALITY_FIELDS = ("final_ppl", "best_ppl", "best_step", "acc_at_best", "acc_param_at_best", "final_acc",
                  "final_acc_param", "full_ppl", "full_acc", "full_acc_param", "full_windows", "steps_done",
                  "params", "unigram_ppl", "train_tokens", "eval_tokens", "config_hash")


# --------------------------------------------------------------------------- schedule


def test_schedule_warmup_then_cosine_to_min_ratio():
    lr, W, S, rho = 2.0, 4, 12, 0.1
    assert lr_at_step(1, lr, W, S, rho) == pytest.approx(0.5)
    assert lr_at_step(2, lr, W, S, rho) == pytest.approx(1.0)
    assert lr_at_step(4, lr, W, S, rho) == pytest.approx(2.0)  # end of warm-up: the peak
    # Half-way through the cosine: lr * (rho + (1 - rho) / 2).
    assert lr_at_step(8, lr, W, S, rho) == pytest.approx(lr * (rho + (1 - rho) * 0.5))
    assert lr_at_step(S, lr, W, S, rho) == pytest.approx(rho * lr)  # cosine end = min_lr_ratio * lr
    values = [lr_at_step(s, lr, W, S, rho) for s in range(W, S + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_schedule_matches_reference_formula_exactly():
    lr, W, S, rho = 7.5e-5, 1500, 12000, 0.02
    for step in (1, 2, 750, 1500, 1501, 6000, 11999, 12000):
        if step <= W:
            want = lr * step / W
        else:
            want = lr * (rho + (1 - rho) * 0.5 * (1 + math.cos(math.pi * (step - W) / (S - W))))
        assert lr_at_step(step, lr, W, S, rho) == want


def test_schedule_constant_default_and_no_warmup_cosine():
    assert {lr_at_step(s, 3e-4, 0, 100, 1.0) for s in range(1, 101)} == {3e-4}
    assert lr_at_step(100, 1.0, 0, 100, 0.02) == pytest.approx(0.02)
    assert lr_at_step(1, 1.0, 0, 100, 0.0) < 1.0  # step 1 is already past the (empty) warm-up
    assert lr_at_step(5, 1.0, 5, 5, 0.0) == 1.0  # warm-up covering the whole run
    with pytest.raises(ValueError, match="1-based"):
        lr_at_step(0, 1.0, 0, 10, 1.0)


def test_loop_feeds_the_schedule_to_the_backend(tmp_path):
    cfg = small_cfg(steps=10, warmup_steps=3, min_lr_ratio=0.2, eval={"protocol": "reference"})
    backend = BigramBackend()
    run_training(cfg, backend, tmp_path, corpus=markov_corpus(), progress=False)
    assert backend.lrs == [lr_at_step(s, 0.5, 3, 10, 0.2) for s in range(1, 11)]
    assert [r["lr"] for r in read_curve(tmp_path)] == [lr_at_step(s, 0.5, 3, 10, 0.2) for s in (1, 4, 8, 10)]


# --------------------------------------------------------------------------- cadence and bookkeeping


def test_eval_cadence_step1_every_n_and_last(tmp_path):
    cfg = small_cfg(steps=10, eval={"every": 4, "batches": 3, "protocol": "reference"})
    backend = BigramBackend()
    run_training(cfg, backend, tmp_path, corpus=markov_corpus(), progress=False)
    eval_steps = [s for kind, s in backend.calls if kind == "eval"]
    assert eval_steps == [1] * 3 + [4] * 3 + [8] * 3 + [10] * 3
    assert [r["step"] for r in read_curve(tmp_path)] == [1, 4, 8, 10]


def test_eval_windows_are_fresh_at_every_evaluation(tmp_path):
    seen: list[bytes] = []

    class Recording(BigramBackend):
        def eval_batch(self, state, inputs, targets, mode):
            seen.append(inputs.tobytes())
            return super().eval_batch(state, inputs, targets, mode)

    run_training(small_cfg(steps=8, eval={"every": 4, "batches": 2, "protocol": "reference"}), Recording(),
                 tmp_path, corpus=markov_corpus(), progress=False)
    assert len(seen) == 6 and len(set(seen)) == 6  # a continuing stream: no evaluation repeats windows


def test_best_final_and_acc_at_best(tmp_path):
    # Evaluations at steps 1, 4, 8, 10 with scripted losses; a tie keeps the earlier evaluation.
    losses, accs = [5.0, 3.0, 4.0, 3.0], [0.1, 0.4, 0.3, 0.45]
    backend = ScriptedEvalBackend(losses, accs, batches=3)
    m = run_training(small_cfg(steps=10, eval={"every": 4, "batches": 3, "protocol": "reference"}), backend,
                     tmp_path, corpus=markov_corpus(), progress=False)
    assert m.best_step == 4
    assert m.best_ppl == pytest.approx(math.exp(3.0))
    assert m.acc_at_best == pytest.approx(0.5)  # round(0.4 * 4) / 4
    assert m.acc_param_at_best == pytest.approx(0.25)
    assert m.final_ppl == pytest.approx(math.exp(3.0))
    assert m.final_acc == pytest.approx(0.5)  # round(0.45 * 4) = 2
    assert m.full_ppl is None and m.protocol == "reference"


def test_ppl_cap_reference_only(tmp_path):
    backend = ScriptedEvalBackend([25.0, 22.0, 30.0], [0.0, 0.0, 0.0], batches=2)
    m = run_training(small_cfg(steps=8, eval={"every": 4, "batches": 2, "protocol": "both"}), backend,
                     tmp_path, corpus=markov_corpus(), progress=False)
    assert m.final_ppl == math.exp(20.0) and m.best_ppl == math.exp(20.0)
    assert m.best_step == 1  # every evaluation hits the cap: the first stays best
    assert m.extra["final_loss"] == 30.0  # the raw loss is kept
    assert m.full_ppl == pytest.approx(math.exp(25.0))  # the full protocol reports the exact PPL
    assert capped_ppl(math.nan, 20.0) != capped_ppl(math.nan, 20.0)  # NaN is not capped away


def test_curve_csv_rows_and_columns(tmp_path):
    cfg = small_cfg(steps=10, log_every=2, eval={"every": 5, "batches": 2})
    run_training(cfg, BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False)
    header = (tmp_path / "curve.csv").read_text().splitlines()[0].split(",")
    assert header == list(CURVE_COLUMNS)
    rows = read_curve(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 4, 5, 6, 8, 10]
    assert [r["tokens_seen"] for r in rows] == [s * 4 * 8 for s in (1, 2, 4, 5, 6, 8, 10)]
    evals = [r["step"] for r in rows if r["eval_loss_reference"] is not None]
    assert evals == [1, 5, 10]
    for r in rows:
        if r["eval_loss_reference"] is not None:
            assert r["eval_ppl_reference"] == pytest.approx(math.exp(r["eval_loss_reference"]))
        assert math.isfinite(r["train_loss"]) and r["elapsed_s"] >= 0


def test_train_loss_in_curve_is_the_mean_since_the_previous_row(tmp_path):
    losses: list[float] = []

    class Tap(BigramBackend):
        def train_step(self, state, inputs, targets, lr):
            state, loss = super().train_step(state, inputs, targets, lr)
            losses.append(loss)
            return state, loss

    run_training(small_cfg(steps=6, eval={"every": 3, "batches": 1, "protocol": "reference"}), Tap(), tmp_path,
                 corpus=markov_corpus(), progress=False)
    rows = read_curve(tmp_path)
    assert [r["step"] for r in rows] == [1, 3, 6]
    assert rows[0]["train_loss"] == losses[0]
    assert rows[1]["train_loss"] == pytest.approx(np.mean(losses[1:3]))
    assert rows[2]["train_loss"] == pytest.approx(np.mean(losses[3:6]))


def test_a_step_is_timed_until_its_loss_is_on_the_host(tmp_path):
    """An accelerator runs a step after train_step returns; its loss arrives when that work is done. The loss
    stands in here for such a device value: reading it takes 20 ms, and the step's time includes them."""

    class DeviceLoss:
        def __init__(self, value: float) -> None:
            self.value = value

        def __float__(self) -> float:
            time.sleep(0.02)
            return self.value

    class Async(BigramBackend):
        def train_step(self, state, inputs, targets, lr):
            state, loss = super().train_step(state, inputs, targets, lr)
            return state, DeviceLoss(loss)

    steps = loop.THROUGHPUT_WARMUP_STEPS + 4
    rec = run_training(small_cfg(steps=steps, eval={"every": 100, "batches": 1, "protocol": "reference"}), Async(),
                       tmp_path, corpus=markov_corpus(), progress=False)
    assert rec.train_time_s >= 0.02 * steps
    assert rec.tokens_per_sec <= rec.batch_size * rec.seq_len / 0.02
    assert THROUGHPUT_TIMED_TO_LOSS in rec.throughput_definition


def test_metrics_json_content(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=30, lr=20.0, batch_size=16, eval={"every": 10, "batches": 3})
    m = run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    rec = read_metrics(tmp_path)
    assert rec == m
    raw = json.loads((tmp_path / "metrics.json").read_text())
    assert raw["status"] == "completed" and raw["error"] is None
    assert rec.backend == "numpy-bigram" and rec.steps_done == rec.steps_planned == 30
    assert rec.mode == "nt" and rec.seq_len == 8 and rec.batch_size == 16 and rec.seed == 7
    assert rec.params == V * V and rec.vocab_size == V
    assert rec.protocol == "both" and rec.eval_every == 10 and rec.eval_batches == 3
    assert rec.train_tokens == 4000 and rec.eval_tokens == 1200
    assert rec.config_hash == loop.config_hash(cfg)
    # The model learns the chain: far below the unigram floor.
    assert rec.unigram_ppl > 10 and rec.best_ppl < rec.unigram_ppl / 2 and rec.full_ppl < rec.unigram_ppl / 2
    for name in ("final_ppl", "best_ppl", "acc_at_best", "acc_param_at_best", "full_ppl", "full_acc"):
        assert getattr(rec, name) is not None, name
    # NT full protocol, stride 1: one window per position with a full context.
    assert rec.full_windows == 1200 - 8 and rec.extra["full_targets"] == 1200 - 8
    assert rec.extra["full_protocol_label"] == "full"
    assert rec.tokens_per_sec > 0 and rec.extra["timed_steps"] == 30 - loop.THROUGHPUT_WARMUP_STEPS
    assert "global_batch*T" in rec.throughput_definition and "excluded" in rec.throughput_definition
    assert rec.wall_time_s >= rec.train_time_s > 0
    assert rec.table == "adhoc" and rec.row == tmp_path.name


def test_full_protocol_ar_and_cap_is_labelled(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(mode="ar", steps=4, eval={"protocol": "full", "full_max_windows": 10, "batch_size": 4})
    m = run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    assert m.best_ppl is None and m.final_ppl is None  # no reference evaluation was run
    assert m.full_windows == 10 and m.extra["full_targets"] == 10 * 8
    assert m.extra["full_protocol_label"] == "full (capped: first 10 of 150 validation windows)"
    assert any("capped at 10 of 150" in d for d in m.deviations)
    # Uncapped AR: every position 1..N-1 scored once, the last window's overlap masked out.
    m2 = run_training(small_cfg(mode="ar", steps=4, eval={"protocol": "full"}), BigramBackend(), tmp_path / "u",
                      corpus=corpus, progress=False)
    assert m2.extra["full_targets"] == 1200 - 1 and m2.extra["full_protocol_label"] == "full"


def test_record_template_identity_is_kept(tmp_path):
    from pcaf_core.results import RunMetrics

    tmpl = RunMetrics(table="wt2-nt-1024", row="pcaf_context", scale="smoke", deviations=["steps 5000 -> 12"])
    m = run_training(small_cfg(), BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False, record=tmpl)
    assert (m.table, m.row, m.scale) == ("wt2-nt-1024", "pcaf_context", "smoke")
    assert m.deviations[0] == "steps 5000 -> 12"


def test_record_names_the_matmul_precision_that_ran(tmp_path):
    """``train.matmul_precision=profile`` reaches the record as the profile's precision (config and hash keep
    what the caller built); a set value is recorded as set."""
    from pcaf_core.profiles import get_profile

    expected = {("corrected", "profile"): "highest", ("reference_jax", "profile"): "default",
                ("reference_jax", "high"): "high"}
    for (profile, setting), want in expected.items():
        cfg = small_cfg(steps=2, matmul_precision=setting)
        cfg.profile = get_profile(profile)
        run_dir = tmp_path / f"{profile}-{setting}"
        m = run_training(cfg, BigramBackend(), run_dir, corpus=markov_corpus(), progress=False)
        assert m.matmul_precision == read_metrics(run_dir).matmul_precision == want, (profile, setting)
        assert m.config_hash == loop.config_hash(cfg)


# --------------------------------------------------------------------------- checkpoints and resume


def test_checkpoint_cadence_layout_and_pruning(tmp_path):
    cfg = small_cfg(steps=10, checkpoint_every=3)
    run_training(cfg, BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False, keep_checkpoints=2)
    names = sorted(p.name for p in list_checkpoints(tmp_path))
    assert names == ["step_10", "step_9"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_10"
    ck = latest_checkpoint(tmp_path)
    assert ck.name == "step_10"
    assert {p.name for p in ck.iterdir()} == {"W.npy", "step.txt", "loop_state.json"}
    ls = read_loop_state(ck)
    assert ls.step == 10 and ls.config_hash == loop.config_hash(cfg) and len(ls.curve) == 4
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())


def _quality(m) -> dict[str, Any]:
    return {k: getattr(m, k) for k in QUALITY_FIELDS}


def _curve_without_time(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_curve(run_dir)]


def test_resume_after_failure_is_bit_exact(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=14, checkpoint_every=4, log_every=1, eval={"every": 5, "batches": 2})
    ref = run_training(cfg, BigramBackend(), tmp_path / "ref", corpus=corpus, progress=False)

    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure at step 11"):
        run_training(cfg, BigramBackend(raise_at_step=11), run, corpus=corpus, progress=False)
    failed = read_metrics(run)
    assert failed.status == "failed" and "injected failure at step 11" in failed.error
    assert failed.steps_done == 10
    assert len(read_curve(run)) == 10  # rows past the last checkpoint (step 8) were written...
    resumed_backend = BigramBackend()
    m = run_training(cfg, resumed_backend, run, corpus=corpus, progress=False)
    assert resumed_backend.calls[0] == ("train", 9)  # ...and the resumed run continued after step 8
    assert m.status == "completed" and m.extra["segments"] == 2
    assert _quality(m) == _quality(ref)
    assert _curve_without_time(run) == _curve_without_time(tmp_path / "ref")
    np.testing.assert_array_equal(np.load(run / "checkpoints/step_14/W.npy"),
                                  np.load(tmp_path / "ref/checkpoints/step_14/W.npy"))


def test_resume_of_a_completed_run_reruns_nothing_but_the_record(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=6)
    first = run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    again = BigramBackend()
    second = run_training(cfg, again, tmp_path, corpus=corpus, progress=False)
    assert not [c for c in again.calls if c[0] == "train"]
    assert _quality(second) == _quality(first)


def test_resume_with_a_different_config_names_the_fields(tmp_path):
    corpus = markov_corpus()
    run_training(small_cfg(steps=6, checkpoint_every=3), BigramBackend(), tmp_path, corpus=corpus, progress=False)
    changed = small_cfg(steps=6, checkpoint_every=3, lr=0.25)
    with pytest.raises(CheckpointError, match=r"train\.lr: 0\.5 -> 0\.25") as err:
        run_training(changed, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    assert "different config" in str(err.value) and "Nothing in" in str(err.value)
    assert "resume=False" not in str(err.value)  # no option the command line lacks
    assert read_metrics(tmp_path).status == "completed"  # refused before anything changed: the record stands
    # The checkpoint is untouched; resume=False starts over and replaces it.
    assert latest_checkpoint(tmp_path).name == "step_6"
    m = run_training(changed, BigramBackend(), tmp_path, corpus=corpus, progress=False, resume=False)
    assert m.status == "completed" and read_loop_state(latest_checkpoint(tmp_path)).config["train"]["lr"] == 0.25


def test_data_location_does_not_change_the_config_hash():
    a, b = small_cfg(), small_cfg()
    b.data.data_dir = "/elsewhere"
    b.data.cache_dir = "/tmp/cache"
    assert loop.config_hash(a) == loop.config_hash(b)
    b.data.max_vocab = V + 1
    assert loop.config_hash(a) != loop.config_hash(b)


def test_incomplete_or_corrupt_checkpoint_falls_back_to_the_previous(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=9, checkpoint_every=3)
    run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False, keep_checkpoints=3)
    root = tmp_path / "checkpoints"
    (root / "step_9" / "W.npy").write_bytes(b"truncated")
    assert latest_checkpoint(tmp_path).name == "step_6"
    (root / "step_6" / "loop_state.json").unlink()  # never finished
    assert latest_checkpoint(tmp_path).name == "step_3"
    backend = BigramBackend()
    run_training(cfg, backend, tmp_path, corpus=corpus, progress=False)
    assert backend.calls[0] == ("train", 4)


def test_config_round_trip_through_dict():
    cfg = small_cfg(lr=0.125)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    with pytest.raises(ValueError, match="unknown sections"):
        config_from_dict({"bogus": {}})


# --------------------------------------------------------------------------- failures


def test_nan_loss_stops_with_step_and_last_good_checkpoint(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=12, checkpoint_every=4)
    with pytest.raises(TrainingDiverged) as err:
        run_training(cfg, BigramBackend(nan_at_step=7), tmp_path, corpus=corpus, progress=False)
    msg = str(err.value)
    good = tmp_path / "checkpoints" / "step_4"
    assert "non-finite loss nan at step 7" in msg and str(good) in msg
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and "step 7" in rec.error and str(good) in rec.error
    assert rec.steps_done == 6
    # The last good checkpoint survives, is complete and loads with finite weights.
    assert latest_checkpoint(tmp_path) == good
    state = BigramBackend().load(good, cfg)
    assert np.isfinite(state["W"]).all() and state["step"] == 4


def test_nan_before_any_checkpoint_says_so(tmp_path):
    with pytest.raises(TrainingDiverged, match="none"):
        run_training(small_cfg(steps=5), BigramBackend(nan_at_step=2), tmp_path, corpus=markov_corpus(),
                     progress=False)
    assert read_metrics(tmp_path).status == "failed" and latest_checkpoint(tmp_path) is None


def test_interrupt_leaves_a_record_that_says_so(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_training(small_cfg(steps=8, checkpoint_every=2), BigramBackend(raise_at_step=5,
                     raise_type=KeyboardInterrupt), tmp_path, corpus=markov_corpus(), progress=False)
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and rec.error.startswith("interrupted by Ctrl-C (SIGINT) after step 4")
    assert "step_4" in rec.error and "resume " in rec.error and rec.extra["resumable"] is True


def test_invalid_config_and_vocab_mismatch_fail_clearly(tmp_path):
    cfg = small_cfg()
    cfg.train.seq_len = 1  # mutated after construction: the loop re-validates
    with pytest.raises(ConfigError, match="train.seq_len=1"):
        run_training(cfg, BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False)
    big = markov_corpus(vocab=V + 10)
    with pytest.raises(ValueError, match=f"corpus vocabulary has {V + 10} ids but model.vocab_size={V}"):
        run_training(small_cfg(), BigramBackend(), tmp_path / "b", corpus=big, progress=False)
    assert read_metrics(tmp_path / "b").status == "failed"
    bad = markov_corpus()
    bad.train[5] = V + 3  # an id the declared vocabulary does not have
    with pytest.raises(Exception, match=str(V + 3)):
        run_training(small_cfg(), BigramBackend(), tmp_path / "c", corpus=bad, progress=False)


def test_batch_must_split_evenly_across_ranks(tmp_path):
    class TwoRanks(BigramBackend):
        world_size = 2

    with pytest.raises(ValueError, match="not divisible by the 2 data-parallel processes"):
        run_training(small_cfg(batch_size=3), TwoRanks(), tmp_path, corpus=markov_corpus(), progress=False)


def test_progress_bar_renders(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PCAF_NO_PROGRESS", raising=False)
    run_training(small_cfg(steps=4), BigramBackend(), tmp_path, corpus=markov_corpus(), progress=True)
    err = capsys.readouterr().err
    assert "numpy-bigram train" in err and "4/4" in err


def test_progress_without_a_terminal_is_one_line_per_evaluation(tmp_path, monkeypatch, capsys):
    """Redirected to a file (a cluster job, nohup), a run prints one line per evaluation with step/total, train
    loss, eval PPL, tokens/s, elapsed and ETA; on a terminal it draws the bar instead; PCAF_NO_PROGRESS=1 and
    progress=False print neither."""
    import io

    from pcaf_core.progress import BAR, LINES, OFF, progress_line, progress_style

    monkeypatch.delenv("PCAF_NO_PROGRESS", raising=False)
    tty, log = io.StringIO(), io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    assert (progress_style(None, tty), progress_style(None, log)) == (BAR, LINES)
    assert (progress_style(True, log), progress_style(False, tty)) == (BAR, OFF)
    monkeypatch.setenv("PCAF_NO_PROGRESS", "1")
    assert progress_style(None, log) == progress_style(True, tty) == OFF
    monkeypatch.delenv("PCAF_NO_PROGRESS")

    line = progress_line("t/r scale=cpu backend=numpy seed=7", 500, 5000, 5.4123, 281.374, 3912.4, 252.0, 2268.0)
    assert line == ("[t/r scale=cpu backend=numpy seed=7] step 500/5000 · train loss 5.412 · eval PPL 281.37 "
                    "(reference) · 3,912 tok/s · elapsed 4m12s · ETA 37m48s")

    cfg = small_cfg()  # stderr under pytest is not a terminal: progress=None gives the lines
    run_training(cfg, BigramBackend(), tmp_path / "run", corpus=markov_corpus(), progress=None)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if " step " in x and "eval PPL" in x]
    evals = [r for r in read_curve(tmp_path / "run") if r.get("eval_ppl_reference") is not None]
    assert len(lines) == len(evals) > 1
    assert lines[-1].startswith(f"[adhoc/run scale=paper backend=numpy-bigram seed={cfg.train.seed}] "
                                f"step {cfg.train.steps}/{cfg.train.steps} · train loss ")
    assert "ETA 0s" in lines[-1] and "elapsed " in lines[0]
    run_training(cfg, BigramBackend(), tmp_path / "quiet", corpus=markov_corpus(), progress=False)
    assert "eval PPL" not in capsys.readouterr().err
