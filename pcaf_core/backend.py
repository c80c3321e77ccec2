"""The backend contract: what the shared loop needs from a framework, and the entry point the app calls.

Two protocols, implemented by every backend (``backends.torch``, ``backends.jax``):

* :class:`Backend` — the numerics of one run: build a train state, take one optimiser step, score one
  evaluation batch, save and load the state. The loop (:mod:`pcaf_core.loop`) owns everything else:
  data, schedule, cadence, input validation, the evaluation reduction, checkpoints and the run record.
* :class:`TrainEntry` — ``backends.<name>.train.train(cfg, run_dir, ...)``, which the Hydra app
  (``experiments.app``) imports by backend name. It builds the backend (one process, or several
  data-parallel ones) and runs :func:`pcaf_core.loop.run_training`.

NumPy/stdlib only: this module never imports torch or jax.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pcaf_core.config import RunConfig
from pcaf_core.results import RunMetrics


@dataclass
class EvalOutputs:
    """What a backend returns for one evaluation batch; the loop reduces it (:mod:`pcaf_core.evaluation`).

    target_log_prob: ``[b, Q]`` float, log p(target) as the loss uses it (the profile's floors and
        normalisation included); Q = 1 in NT mode, T in AR mode.
    prediction: ``[b, Q]`` int, argmax of the model's predictive distribution (the mixture for cache
        models, the head otherwise), independent of the profile's accuracy definition.
    prediction_param: ``[b, Q]`` int, argmax of the parametric head.
    """

    target_log_prob: np.ndarray
    prediction: np.ndarray
    prediction_param: np.ndarray


@runtime_checkable
class Backend(Protocol):
    """What the loop needs from a framework. ``state`` is opaque to the loop.

    Single-process backends inherit the distributed members from :class:`SingleProcess`.
    """

    name: str  # "torch" or "jax"
    checkpoint_format: str  # what save() writes, e.g. "torch-1: model.safetensors, optimizer.pt, ..."
    device: str  # accelerator description for the run record
    rank: int  # this process's data-parallel rank (0 when alone)
    world_size: int  # number of data-parallel processes

    def init(self, cfg: RunConfig) -> Any:
        """Build model + optimiser state from ``cfg`` (seeded by ``cfg.train.seed``)."""

    def train_step(self, state: Any, inputs: np.ndarray, targets: np.ndarray, lr: float, *,
                   wait: bool = True) -> tuple[Any, Any]:
        """One optimiser step at learning rate ``lr`` on this rank's slice ``inputs [b, T]`` int32,
        ``targets [b]`` (NT) or ``[b, T]`` (AR), already validated by the loop. Gradients are averaged
        over ranks. Returns the new state and this rank's mean training loss: a Python float, after the
        step has finished. ``wait=False`` may return before the device has run the step: the loss is then a
        0-d value whose ``float()`` waits for it (the loop launches the next step first), and nothing the call
        was given may be overwritten by the next call before that step has run."""

    def eval_batch(self, state: Any, inputs: np.ndarray, targets: np.ndarray, mode: str) -> EvalOutputs:
        """Score one evaluation slice without updating anything (dropout off)."""

    def save(self, state: Any, path: Path) -> None:
        """Write the backend state (weights, optimiser, RNG) into the existing directory ``path``.
        Called on every rank; each rank writes what only it holds (e.g. its RNG state)."""

    def load(self, path: Path, cfg: RunConfig) -> Any:
        """Rebuild the state written by :meth:`save` into ``path`` for config ``cfg``."""

    def param_count(self, state: Any) -> int:
        """Trainable parameter count (as the paper counts it)."""

    def peak_memory_mb(self) -> float | None:
        """Peak accelerator memory in MiB since start (None when the device does not report it)."""

    def barrier(self) -> None:
        """Wait until every rank arrives (no-op alone)."""

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks, in float64 (identity alone)."""

    def versions(self) -> dict[str, str]:
        """Framework package versions for the run record."""

    def auto_precision(self) -> tuple[str, str]:
        """What ``train.precision=auto`` means on this backend's device: ``("bf16" | "fp32", why)``."""


class SingleProcess:
    """Defaults for the distributed members of :class:`Backend` in a one-process backend."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    def barrier(self) -> None:
        """Nothing to wait for."""

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """One rank: the sum is the input."""
        return [float(v) for v in values]

    def versions(self) -> dict[str, str]:
        """No framework packages."""
        return {}


class TrainEntry(Protocol):
    """``backends.<name>.train.train``: run one experiment and return its record.

    Args:
        cfg: the validated run config.
        run_dir: the run directory (created if needed); the loop writes ``metrics.json``, ``curve.csv``
            and ``checkpoints/`` there.
        resume: continue from the newest complete checkpoint in ``run_dir`` (same config required);
            ``"restart_damaged"``: start over when every checkpoint is damaged (``pcaf_core.loop.run_training``).
        progress: tqdm bar (None: only on a TTY; ``PCAF_NO_PROGRESS=1`` disables).
        record: identity and provenance fields for ``metrics.json`` (table, row, scale, deviations, ...).
        device: ``None``/``"auto"`` (the backend's accelerator when present), ``"cpu"``, or a
            backend-specific name (``"cuda:1"``, ``"tpu"``).
        corpus: token arrays to use instead of ``pcaf_core.data.load_corpus(cfg.data)``.
        world_size: data-parallel width (torch: local processes; JAX: local devices of the mesh).
    Every failure leaves ``metrics.json`` with ``status="failed"`` and re-raises.
    """

    def __call__(
        self,
        cfg: RunConfig,
        run_dir: str | os.PathLike[str],
        *,
        resume: bool | str = True,
        progress: bool | None = None,
        record: RunMetrics | None = None,
        device: Any = None,
        corpus: Any = None,
        world_size: int = 1,
    ) -> RunMetrics: ...
