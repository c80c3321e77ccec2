"""A small NumPy backend that drives the backend-neutral loop (``pcaf_core.loop``) in tests.

The backend is a bigram model (a ``[V, V]`` logit table trained by plain SGD on the NLL of the target given the
previous token), enough to learn, diverge on demand and save/load exactly; :func:`markov_corpus` gives it a corpus
with a learnable structure and :func:`small_cfg` a run config of a few steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from pcaf_core.backend import EvalOutputs, SingleProcess
from pcaf_core.config import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)

V = 24


def markov_corpus(n_train: int = 4000, n_valid: int = 1200, vocab: int = V, seed: int = 0,
                  successors: int = 3) -> SimpleNamespace:
    """Tokens of a sparse first-order Markov chain (``successors`` successors per token, ids from 3 up, so the
    specials never occur): learnable structure. ``train`` and ``valid`` ``[n] int32``, ``vocab_size``."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(3, vocab, size=(vocab, successors))

    def chain(n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int32)
        out[0] = 3
        picks = rng.integers(0, successors, size=n)
        for i in range(1, n):
            out[i] = succ[out[i - 1], picks[i]]
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
                   lr: float, *, wait: bool = True) -> tuple[dict[str, Any], float]:
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

