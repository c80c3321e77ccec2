"""The backend-neutral training and evaluation loop (DESIGN.md §3, §7; REFERENCE.md §5).

A backend (``backends.torch.train``, ``backends.jax``) plugs in the numerics through the
:class:`Backend` protocol: build a train state, take one optimiser step, score one evaluation batch,
save and load its state. This module owns everything else, identically for every backend:

* the data stream: one global :class:`~pcaf_core.data.WindowSampler` for training and one for
  evaluation; under data parallelism every rank draws the same global batch and keeps its own
  contiguous slice, so ``N`` processes see exactly the windows one process with the same global batch
  sees;
* the learning-rate schedule (:func:`pcaf_core.schedule.lr_at_step`, one value per step);
* the cadence: a ``reference`` evaluation at step 1, every ``eval.every`` steps and at the last step;
  a ``full`` evaluation after the last step; checkpoints every ``train.checkpoint_every`` steps and
  at the end;
* the bookkeeping: best/final PPL and accuracies, the learning curve, throughput, ``metrics.json``;
* checkpoints that resume bit-exactly (loop state here, backend state through the backend), config
  hash checks, divergence detection, and a run record that says ``failed`` when a run fails.

NumPy/stdlib only: this module never imports torch or jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pcaf_core import results
from pcaf_core.config import (
    DataConfig,
    EvalConfig,
    MemoryConfig,
    ModelConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    validate,
)
from pcaf_core.results import RunMetrics
from pcaf_core.schedule import lr_for

log = logging.getLogger("pcaf.loop")

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
LOOP_STATE_FILE = "loop_state.json"
LOOP_STATE_VERSION = 1

THROUGHPUT_WARMUP_STEPS = 3
"""Optimiser steps at the start of every process segment left out of the throughput measurement
(allocator warm-up, kernel autotuning, JIT compilation)."""

THROUGHPUT_DEFINITION = (
    "tokens/s = global_batch*T / mean train-step seconds; a train step covers host-side window "
    "sampling, forward, backward and the optimiser update; evaluation and checkpoint time are excluded; "
    "the first {warmup} steps of each process are excluded as warm-up; NT counts all T input tokens "
    "of a window (REFERENCE.md §5.6)"
)

# Config fields that say where files live, not what is computed: a run may be resumed after its
# data or cache directory moved.
_LOCATION_FIELDS = (("data", "data_dir"), ("data", "cache_dir"))


# --------------------------------------------------------------------------- errors


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite. The message names the step and the last good
    checkpoint."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (wrong config, unreadable, incomplete). The message says what to do."""


class RunInterrupted(BaseException):
    """The process was asked to stop (SIGTERM). Derives from BaseException like KeyboardInterrupt,
    so ``except Exception`` blocks in backends do not swallow it."""


# --------------------------------------------------------------------------- backend protocol


@runtime_checkable
class Backend(Protocol):
    """What the loop needs from a framework. ``state`` is opaque to the loop.

    Single-process backends inherit the distributed members from :class:`SingleProcess`.
    """

    name: str  # "torch" or "jax"
    device: str  # accelerator description for the run record
    rank: int  # this process's data-parallel rank (0 when alone)
    world_size: int  # number of data-parallel processes

    def init(self, cfg: RunConfig) -> Any:
        """Build model + optimiser state from ``cfg`` (seeded by ``cfg.train.seed``)."""

    def train_step(self, state: Any, inputs: np.ndarray, targets: np.ndarray, lr: float) -> tuple[Any, float]:
        """One optimiser step at learning rate ``lr`` on this rank's slice ``inputs [b, T]`` int32,
        ``targets [b]`` (NT) or ``[b, T]`` (AR). Gradients are averaged over ranks. Returns the new
        state and this rank's mean training loss (a Python float; the loop averages over ranks)."""

    def eval_batch(
        self, state: Any, inputs: np.ndarray, targets: np.ndarray, mode: str, mask: np.ndarray | None = None
    ) -> tuple[float, int, int, int]:
        """Score one evaluation slice without updating anything (dropout off).

        Returns ``(sum_nll, n_targets, n_correct_mixture, n_correct_param)``: the summed negative
        log-likelihood in nats, the number of predicted targets, and the number of targets equal to
        the argmax of the model's predictive (mixture) distribution and of the parametric head.
        ``mask`` (shaped like ``targets``, bool; full protocol only) selects the targets that count:
        padding rows and already-scored positions are False."""

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


# --------------------------------------------------------------------------- config helpers


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "memory": MemoryConfig,
    "profile": ProfileConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
}


RUN_SECTIONS = tuple(_SECTIONS)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of ``cfg`` (JSON-compatible)."""
    return asdict(cfg)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Inverse of :func:`config_to_dict`; unknown keys raise (the dataclasses reject them)."""
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"config dict has unknown sections {unknown}; expected {sorted(_SECTIONS)}")
    return RunConfig(**{name: cls(**data.get(name, {})) for name, cls in _SECTIONS.items()})


def _hashable_config(cfg: RunConfig) -> dict[str, Any]:
    data = config_to_dict(cfg)
    for section, name in _LOCATION_FIELDS:
        data[section].pop(name, None)
    return data


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything in ``cfg`` that affects the computation (file locations excluded)."""
    return results.hash_config(_hashable_config(cfg))


def _config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                out.append(f"{section}.{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out


# --------------------------------------------------------------------------- evaluation results


@dataclass
class EvalResult:
    """One evaluation. ``loss`` in nats/target; ``ppl = exp(min(cap, loss))`` for the reference
    protocol, ``exp(loss)`` for the full protocol; accuracies are fractions."""

    step: int
    protocol: str
    loss: float
    ppl: float
    acc: float
    acc_param: float
    n_targets: int
    windows: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def capped_ppl(loss: float, cap_log: float) -> float:
    """The reference's ``exp(min(cap, loss))``; NaN stays NaN (``min`` would hide it)."""
    if math.isnan(loss):
        return math.nan
    return math.exp(min(cap_log, loss))


def exact_ppl(loss: float) -> float:
    """``exp(loss)``, infinite instead of an OverflowError for huge losses."""
    if math.isnan(loss):
        return math.nan
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def unigram_ppl(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> float:
    """Validation PPL under the training split's add-one-smoothed unigram distribution (the floor
    any model that learned anything beats; add-one keeps tokens unseen in training finite)."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - math.log(float(counts.sum()))
    return exact_ppl(float(-log_p[np.asarray(valid, dtype=np.int64)].mean()))


# --------------------------------------------------------------------------- loop state


@dataclass
class LoopState:
    """Everything the loop itself needs to resume bit-exactly (the backend saves the rest)."""

    step: int = 0
    train_sampler: dict[str, Any] = field(default_factory=dict)
    eval_sampler: dict[str, Any] = field(default_factory=dict)
    best: dict[str, Any] | None = None  # EvalResult.as_dict() of the best reference evaluation
    final: dict[str, Any] | None = None  # the latest reference evaluation
    curve: list[dict[str, Any]] = field(default_factory=list)
    pending_loss_sum: float = 0.0  # training losses since the last curve row
    pending_loss_count: int = 0
    timed_steps: int = 0  # steps in the throughput measurement
    timed_seconds: float = 0.0
    train_seconds: float = 0.0  # every train step, warm-up included
    elapsed_seconds: float = 0.0  # wall time of the previous process segments
    segments: int = 0  # process segments that ran this training (1 + resumes)
    config_hash: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    version: int = LOOP_STATE_VERSION


def _to_jsonable(value: Any) -> Any:
    """Sampler states may hold NumPy scalars or arrays; JSON them losslessly and tag arrays."""
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__ndarray__", "dtype"}:
            return np.asarray(value["__ndarray__"], dtype=value["dtype"])
        return {k: _from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_jsonable(v) for v in value]
    return value


def _dump_json(data: Any) -> str:
    # Python's float repr round-trips exactly, so losses and timings come back bit-identical.
    return json.dumps(results._encode_nonfinite(_to_jsonable(data)), indent=1, allow_nan=False)


def _load_json(text: str) -> Any:
    return results._decode_nonfinite(json.loads(text))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates the file 0600; a run directory is meant to be readable like any other output.
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# --------------------------------------------------------------------------- checkpoint files


def checkpoint_root(run_dir: Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINT_DIR


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_"):
        return None
    try:
        return int(name[len("step_"):])
    except ValueError:
        return None


def _checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be used, or None when it is complete."""
    state_file = path / LOOP_STATE_FILE
    if not state_file.is_file():
        return f"{state_file} is missing (the checkpoint was not finished)"
    try:
        data = _load_json(state_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return f"{state_file} is unreadable ({exc})"
    manifest = data.get("files")
    if not isinstance(manifest, dict):
        return f"{state_file} has no file manifest"
    for name, entry in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != entry.get("bytes"):
            return f"{f} has {f.stat().st_size} bytes, the manifest says {entry.get('bytes')}"
        if _sha256(f) != entry.get("sha256"):
            return f"{f} does not match its sha256 in the manifest"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of ``run_dir`` (complete or not), newest step first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``: the one ``checkpoints/latest`` names when it is
    complete, otherwise the highest-step complete one (a crash can leave the pointer behind or a
    directory half-written). None when there is none."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        problem = _checkpoint_problem(named)
        if problem is None:
            return named
        log.warning("checkpoints/latest points at an unusable checkpoint: %s; scanning for another", problem)
    for path in list_checkpoints(run_dir):
        problem = _checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def read_loop_state(path: Path) -> LoopState:
    """The loop state stored in checkpoint directory ``path``."""
    data = _load_json((path / LOOP_STATE_FILE).read_text(encoding="utf-8"))
    if data.get("version") != LOOP_STATE_VERSION:
        raise CheckpointError(
            f"{path / LOOP_STATE_FILE} has loop-state version {data.get('version')!r}, this code reads "
            f"{LOOP_STATE_VERSION}; start a new run directory (or pass resume=False)"
        )
    data.pop("files", None)
    data["train_sampler"] = _from_jsonable(data.get("train_sampler", {}))
    data["eval_sampler"] = _from_jsonable(data.get("eval_sampler", {}))
    names = {f.name for f in dataclasses.fields(LoopState)}
    return LoopState(**{k: v for k, v in data.items() if k in names})


# --------------------------------------------------------------------------- data adapters


def _load_corpus(cfg: RunConfig) -> Any:
    from pcaf_core.data import load_corpus

    return load_corpus(cfg.data)


def _eval_tokens(corpus: Any) -> np.ndarray:
    """The evaluation split: ``corpus.eval`` (the split ``data.eval_split`` names) when the corpus
    has one, else ``corpus.valid``."""
    tokens = getattr(corpus, "eval", None)
    return corpus.valid if tokens is None else tokens


def _make_sampler(tokens: np.ndarray, seq_len: int, batch_size: int, mode: str, seed: int, split: str) -> Any:
    from pcaf_core.data import WindowSampler

    return WindowSampler(tokens, seq_len, batch_size, mode, seed=seed, split=split)


def _full_windows(tokens: np.ndarray, cfg: RunConfig, batch_size: int, capped: bool) -> Any:
    from pcaf_core.data import FullEvalWindows

    return FullEvalWindows(
        tokens, cfg.train.seq_len, batch_size, cfg.train.mode,
        stride=cfg.eval.full_nt_stride if cfg.train.mode == "nt" else None,
        max_windows=cfg.eval.full_max_windows if capped else 0,
        split=cfg.data.eval_split,
    )


# --------------------------------------------------------------------------- the loop


def _progress_enabled(progress: bool | None) -> bool:
    if os.environ.get("PCAF_NO_PROGRESS", "") == "1":
        return False
    if progress is not None:
        return progress
    return sys.stderr.isatty()


class _SigtermGuard:
    """Turn SIGTERM (cluster pre-emption, ``kill``) into :class:`RunInterrupted` so the run record
    says the run was interrupted; only the main thread may install signal handlers."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _SigtermGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            if self._previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, self._handler)
                self._installed = True
        return self

    @staticmethod
    def _handler(signum: int, frame: Any) -> None:
        raise RunInterrupted(f"received signal {signal.Signals(signum).name}")

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)


class TrainingLoop:
    """One run: ``TrainingLoop(cfg, backend, run_dir).run()``. See :func:`run_training`."""

    def __init__(
        self,
        cfg: RunConfig,
        backend: Backend,
        run_dir: str | os.PathLike[str],
        *,
        corpus: Any = None,
        resume: bool = True,
        progress: bool | None = None,
        record: RunMetrics | None = None,
        keep_checkpoints: int = 2,
    ) -> None:
        self.cfg = cfg  # validated in run(), so that an invalid config also leaves a failed record
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.progress = progress
        self.keep_checkpoints = max(1, int(keep_checkpoints))
        self.rank = int(getattr(backend, "rank", 0))
        self.world = int(getattr(backend, "world_size", 1))
        self.is_main = self.rank == 0
        self._corpus = corpus
        self._template = record
        self.state: Any = None
        self.ls = LoopState()
        self.last_good_checkpoint: Path | None = None
        self.full: EvalResult | None = None
        self.full_total_windows: int | None = None
        self._segment_start = time.perf_counter()

    # ----------------------------------------------------------------- setup

    @property
    def global_batch(self) -> int:
        return self.cfg.train.batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.cfg.eval.batch_size or self.cfg.train.batch_size

    def _local(self, arr: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a global batch."""
        if self.world == 1:
            return arr
        per = arr.shape[0] // self.world
        return arr[self.rank * per : (self.rank + 1) * per]

    def _check_setup(self) -> None:
        cfg = self.cfg
        for what, size in (("train.batch_size", self.global_batch), ("eval batch size", self.eval_batch_size)):
            if size % self.world:
                raise ValueError(
                    f"{what}={size} is not divisible by the {self.world} data-parallel processes; "
                    "the global batch is split evenly across ranks"
                )
        from pcaf_core.data import check_token_ids

        V = int(self.corpus.vocab_size)
        if V > cfg.model.vocab_size:
            raise ValueError(
                f"the corpus vocabulary has {V} ids but model.vocab_size={cfg.model.vocab_size}; "
                f"set model.vocab_size >= {V} (the run's vocabulary is data.max_vocab={cfg.data.max_vocab})"
            )
        # One scan of each split here; the backend checks every batch again before using it.
        check_token_ids(self.corpus.train, cfg.model.vocab_size, what="train split")
        check_token_ids(_eval_tokens(self.corpus), cfg.model.vocab_size, what=f"{cfg.data.eval_split} split")

    def _identity(self) -> RunMetrics:
        """The record template: the caller's, else the identity of an earlier record in ``run_dir``."""
        if self._template is not None:
            return dataclasses.replace(self._template)
        try:
            old = results.read_metrics(self.run_dir)
            return RunMetrics(
                table=old.table, row=old.row, scale=old.scale, deviations=list(old.deviations),
                git_commit=old.git_commit, overrides=list(old.overrides), versions=dict(old.versions),
            )
        except (FileNotFoundError, results.SchemaError):
            return RunMetrics(table="adhoc", row=self.run_dir.name or "run")

    # ----------------------------------------------------------------- evaluation

    def _reduce_batches(self, sums: list[tuple[float, int, int, int]]) -> list[tuple[float, ...]]:
        flat = [float(x) for s in sums for x in s]
        total = self.backend.all_reduce_sum(flat)
        return [tuple(total[i : i + 4]) for i in range(0, len(total), 4)]

    def evaluate_reference(self, step: int) -> EvalResult:
        """``eval.batches`` fresh random validation batches from the continuing eval stream; loss is
        the mean of per-batch mean losses, accuracy the mean of per-batch accuracies."""
        sums = []
        for _ in range(self.cfg.eval.batches):
            inputs, targets = next(self._eval_iter)
            sums.append(self.backend.eval_batch(self.state, self._local(inputs), self._local(targets),
                                                self.cfg.train.mode))
        per_batch = self._reduce_batches(sums)
        losses = [s[0] / s[1] for s in per_batch]
        loss = float(np.mean(losses))
        return EvalResult(
            step=step,
            protocol="reference",
            loss=loss,
            ppl=capped_ppl(loss, self.cfg.eval.ppl_cap_log),
            acc=float(np.mean([s[2] / s[1] for s in per_batch])),
            acc_param=float(np.mean([s[3] / s[1] for s in per_batch])),
            n_targets=int(sum(s[1] for s in per_batch)),
            windows=self.cfg.eval.batches * self.eval_batch_size,
        )

    def evaluate_full(self, step: int) -> EvalResult:
        """One deterministic pass over the evaluation split (``pcaf_core.data.FullEvalWindows``; the
        first ``eval.full_max_windows`` windows when capped): token-weighted loss, exact PPL. Batches
        are dealt round-robin to ranks and the sums all-reduced."""
        tokens = _eval_tokens(self.corpus)
        windows = _full_windows(tokens, self.cfg, self.eval_batch_size, capped=True)
        self.full_total_windows = (windows.num_windows if self.cfg.eval.full_max_windows == 0
                                   else _full_windows(tokens, self.cfg, self.eval_batch_size, False).num_windows)
        acc = np.zeros(4, dtype=np.float64)
        for i in range(self.rank, len(windows), self.world):
            b = windows.batch(i)
            acc += np.asarray(self.backend.eval_batch(self.state, b.inputs, b.targets, self.cfg.train.mode,
                                                      mask=b.mask), dtype=np.float64)
        s_nll, n, c_mix, c_param = self.backend.all_reduce_sum(acc.tolist())
        if int(n) != windows.num_targets:
            raise RuntimeError(f"full evaluation scored {int(n)} targets, expected {windows.num_targets}: "
                               f"the backend's eval_batch ignores the mask")
        loss = s_nll / n
        return EvalResult(step=step, protocol="full", loss=loss, ppl=exact_ppl(loss), acc=c_mix / n,
                          acc_param=c_param / n, n_targets=int(n), windows=windows.num_windows)

    # ----------------------------------------------------------------- checkpoints

    def _save_checkpoint(self) -> Path:
        step = self.ls.step
        root = checkpoint_root(self.run_dir)
        final = root / f"step_{step}"
        tmp = root / f".tmp_step_{step}"
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        self.backend.barrier()
        self.backend.save(self.state, tmp)
        self.backend.barrier()
        if self.is_main:
            files = {}
            for f in sorted(p for p in tmp.iterdir() if p.is_file()):
                _fsync_path(f)
                files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            self.ls.train_sampler = self.train_sampler.state_dict()
            self.ls.eval_sampler = self.eval_sampler.state_dict()
            payload = asdict(self.ls)
            payload["elapsed_seconds"] = self._elapsed()  # wall time up to this checkpoint
            payload["files"] = files
            _atomic_write(tmp / LOOP_STATE_FILE, _dump_json(payload))
            if final.exists():  # a resumed run passes the same step again
                trash = root / f".old_step_{step}"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_path(root)
            # The pointer moves only once the directory is complete and in place.
            _atomic_write(root / LATEST_FILE, final.name + "\n")
            self._prune(keep=final)
        self.backend.barrier()
        self.last_good_checkpoint = final
        return final

    def _prune(self, keep: Path) -> None:
        for path in list_checkpoints(self.run_dir)[self.keep_checkpoints :]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def _restore(self, path: Path) -> None:
        ls = read_loop_state(path)
        want = config_hash(self.cfg)
        if ls.config_hash != want:
            diff = _config_diff(ls.config, _hashable_config(self.cfg))
            raise CheckpointError(
                f"cannot resume from {path}: it was written for a different config (hash {ls.config_hash}, "
                f"this run's config hashes to {want}); differing fields: {'; '.join(diff) or 'unknown'}. "
                "Use a new run directory, restore the original config, or pass resume=False to start over."
            )
        self.state = self.backend.load(path, self.cfg)
        self.ls = ls
        self.train_sampler.load_state_dict(ls.train_sampler)
        self.eval_sampler.load_state_dict(ls.eval_sampler)
        self.last_good_checkpoint = path
        if self.is_main:
            self._rewrite_curve(ls.curve)
        log.info("resumed from %s at step %d", path, ls.step)

    def _rewrite_curve(self, rows: list[dict[str, Any]]) -> None:
        """Replace curve.csv by the rows a checkpoint holds (a killed run may have appended rows past
        its last checkpoint). Written beside the run and moved in place atomically."""
        target = results.curve_path(self.run_dir)
        with tempfile.TemporaryDirectory(dir=self.run_dir, prefix=".curve.") as tmp:
            for row in rows:
                results.append_curve_row(tmp, row)
            staged = results.curve_path(tmp)
            if staged.exists():
                os.replace(staged, target)
            elif target.exists():
                target.unlink()

    def _fresh_start(self) -> None:
        if self.is_main:
            # Old checkpoints of an abandoned run must not be mistaken for this run's.
            shutil.rmtree(checkpoint_root(self.run_dir), ignore_errors=True)
            results.curve_path(self.run_dir).unlink(missing_ok=True)
        self.backend.barrier()
        self.state = self.backend.init(self.cfg)
        self.ls = LoopState(config_hash=config_hash(self.cfg), config=_hashable_config(self.cfg))

    # ----------------------------------------------------------------- records

    def _elapsed(self) -> float:
        return self.ls.elapsed_seconds + (time.perf_counter() - self._segment_start)

    def tokens_per_sec(self) -> float | None:
        steps, secs = self.ls.timed_steps, self.ls.timed_seconds
        if steps == 0 or secs <= 0:
            return None
        return self.global_batch * self.cfg.train.seq_len * steps / secs

    def _metrics(self, status: str, error: str | None = None) -> RunMetrics:
        cfg = self.cfg
        rec = self._identity()
        corpus = self._corpus  # None when loading it was what failed
        best, final, full = self.ls.best, self.ls.final, self.full
        deviations = list(rec.deviations)
        extra = dict(rec.extra)
        extra.update(
            {
                "segments": self.ls.segments,
                "world_size": self.world,
                "timed_steps": self.ls.timed_steps,
                "last_checkpoint": str(self.last_good_checkpoint) if self.last_good_checkpoint else None,
                "full_protocol_label": None,
            }
        )
        if full is not None:
            split = cfg.data.eval_split
            capped = full.windows < (self.full_total_windows or full.windows)
            strided = cfg.train.mode == "nt" and cfg.eval.full_nt_stride > 1
            parts = []
            if capped:
                parts.append(f"capped: first {full.windows} of {self.full_total_windows} {split} windows")
            if strided:
                parts.append(f"subsampled: one NT target every {cfg.eval.full_nt_stride} positions")
            extra["full_protocol_label"] = f"full ({'; '.join(parts)})" if parts else "full"
            extra["full_loss"] = full.loss
            extra["full_targets"] = full.n_targets
            notes = []
            if capped:
                notes.append(f"full evaluation capped at {full.windows} of {self.full_total_windows} {split} "
                             "windows (eval.full_max_windows)")
            if strided:
                notes.append(f"full NT evaluation scores every {cfg.eval.full_nt_stride}-th position "
                             "(eval.full_nt_stride), not every position")
            deviations += [n for n in notes if n not in deviations]
        if best is not None:
            extra["best_loss"] = best["loss"]
            extra["final_loss"] = final["loss"] if final else None
        versions = {"python": platform.python_version(), "numpy": np.__version__, **rec.versions}
        versions.update(self.backend.versions())
        describe = getattr(corpus, "record", None)
        if callable(describe):
            extra["data"] = _to_jsonable(describe())
        return dataclasses.replace(
            rec,
            status=status,
            error=error,
            backend=self.backend.name,
            profile=cfg.profile.name,
            seed=cfg.train.seed,
            mode=cfg.train.mode,
            seq_len=cfg.train.seq_len,
            batch_size=self.global_batch,
            steps_done=self.ls.step,
            steps_planned=cfg.train.steps,
            params=self._params,
            precision=cfg.train.precision,
            device=self.backend.device,
            protocol=cfg.eval.protocol,
            eval_every=cfg.eval.every,
            eval_batches=cfg.eval.batches,
            full_windows=full.windows if full else None,
            final_ppl=final["ppl"] if final else None,
            best_ppl=best["ppl"] if best else None,
            best_step=best["step"] if best else None,
            acc_at_best=best["acc"] if best else None,
            acc_param_at_best=best["acc_param"] if best else None,
            final_acc=final["acc"] if final else None,
            final_acc_param=final["acc_param"] if final else None,
            full_ppl=full.ppl if full else None,
            full_acc=full.acc if full else None,
            full_acc_param=full.acc_param if full else None,
            unigram_ppl=self._unigram,
            tokens_per_sec=self.tokens_per_sec(),
            throughput_definition=THROUGHPUT_DEFINITION.format(warmup=THROUGHPUT_WARMUP_STEPS),
            peak_mem_mb=self.backend.peak_memory_mb(),
            wall_time_s=self._elapsed(),
            train_time_s=self.ls.train_seconds,
            dataset=cfg.data.name,
            data_layout=cfg.data.layout,
            vocab_size=cfg.model.vocab_size,
            train_tokens=int(len(corpus.train)) if corpus is not None else None,
            eval_tokens=int(len(_eval_tokens(corpus))) if corpus is not None else None,
            deviations=deviations,
            versions=versions,
            config_hash=config_hash(cfg),
            extra=extra,
        )

    def _write_record(self, status: str, error: str | None = None) -> RunMetrics:
        rec = self._metrics(status, error)
        if self.is_main:
            results.write_metrics(self.run_dir, rec)
        return rec

    def _write_failure(self, error: str) -> None:
        """Best effort: a failure while recording the failure must not hide the original error."""
        if not self.is_main:
            return
        try:
            self._write_record("failed", error)
        except Exception as exc:  # noqa: BLE001 - the original exception is re-raised by the caller
            log.error("could not write the failed run record: %s", exc)
            try:
                rec = dataclasses.replace(self._identity(), status="failed", error=error,
                                          steps_done=self.ls.step, steps_planned=self.cfg.train.steps)
                results.write_metrics(self.run_dir, rec)
            except Exception as exc2:  # noqa: BLE001
                log.error("could not write a minimal failed record either: %s", exc2)

    # ----------------------------------------------------------------- main

    @property
    def corpus(self) -> Any:
        if self._corpus is None:
            self._corpus = _load_corpus(self.cfg)
        return self._corpus

    def run(self) -> RunMetrics:
        """Train (or resume), evaluate, checkpoint and write the record. Returns the final record."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._params: int | None = None
        self._unigram: float | None = None
        try:
            with _SigtermGuard():
                return self._run()
        except TrainingDiverged as exc:
            self._write_failure(str(exc))
            raise
        except (KeyboardInterrupt, RunInterrupted) as exc:
            where = self.last_good_checkpoint or "none written yet"
            self._write_failure(f"interrupted ({type(exc).__name__}: {exc}) after step {self.ls.step}; "
                                f"resume from the last checkpoint: {where}")
            raise
        except Exception as exc:
            self._write_failure(f"{type(exc).__name__}: {exc}")
            raise

    def _run(self) -> RunMetrics:
        cfg = validate(self.cfg)
        self._check_setup()
        corpus = self.corpus
        self._unigram = unigram_ppl(corpus.train, _eval_tokens(corpus), cfg.model.vocab_size)
        self.train_sampler = _make_sampler(corpus.train, cfg.train.seq_len, self.global_batch, cfg.train.mode,
                                           cfg.train.train_sample_seed, "train")
        self.eval_sampler = _make_sampler(_eval_tokens(corpus), cfg.train.seq_len, self.eval_batch_size,
                                          cfg.train.mode, cfg.eval.eval_sample_seed, cfg.data.eval_split)
        ckpt = latest_checkpoint(self.run_dir) if self.resume else None
        if self.world > 1:
            # Every rank picks the checkpoint itself; a disagreement (a file system that does not show
            # all ranks the same files) would silently desynchronise them.
            mine = float(_step_of(ckpt) if ckpt is not None else -1)
            total = self.backend.all_reduce_sum([mine, mine * mine])
            if total[0] != self.world * mine or total[1] != self.world * mine * mine:
                raise CheckpointError(
                    f"data-parallel ranks found different checkpoints in {checkpoint_root(self.run_dir)} "
                    f"(rank {self.rank}: {ckpt}); the run directory must be on a file system all ranks share"
                )
        if ckpt is not None:
            self._restore(ckpt)
        else:
            self._fresh_start()
        self.ls.segments += 1
        self._params = int(self.backend.param_count(self.state))
        self._train_iter = iter(self.train_sampler)
        self._eval_iter = iter(self.eval_sampler)
        self._segment_start = time.perf_counter()
        self._write_record("running")

        do_ref = cfg.eval.protocol in ("reference", "both")
        do_full = cfg.eval.protocol in ("full", "both")
        steps = cfg.train.steps
        bar = None
        if self.is_main and _progress_enabled(self.progress):
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=self.ls.step, desc=f"{self.backend.name} train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        try:
            segment_steps = 0
            while self.ls.step < steps:
                step = self.ls.step + 1
                lr = lr_for(cfg.train, step)
                t0 = time.perf_counter()
                inputs, targets = next(self._train_iter)
                self.state, loss = self.backend.train_step(self.state, self._local(inputs), self._local(targets), lr)
                if self.world > 1:
                    loss = self.backend.all_reduce_sum([loss])[0] / self.world
                dt = time.perf_counter() - t0
                loss = float(loss)
                if not math.isfinite(loss):
                    where = self.last_good_checkpoint or "none (no checkpoint was written before the failure)"
                    raise TrainingDiverged(
                        f"training diverged: non-finite loss {loss} at step {step} (lr={lr:.6g}). "
                        f"Last good checkpoint: {where}. Lower train.lr, add warm-up or gradient clipping "
                        "(profile.grad_clip_norm), then resume or restart."
                    )
                self.ls.step = step
                segment_steps += 1
                self.ls.train_seconds += dt
                if segment_steps > THROUGHPUT_WARMUP_STEPS:
                    self.ls.timed_steps += 1
                    self.ls.timed_seconds += dt
                self.ls.pending_loss_sum += loss
                self.ls.pending_loss_count += 1

                ev = None
                if do_ref and (step == 1 or step % cfg.eval.every == 0 or step == steps):
                    ev = self.evaluate_reference(step)
                    self.ls.final = ev.as_dict()
                    best = self.ls.best
                    # Strictly lower: ties keep the earlier evaluation; NaN never becomes best.
                    if best is None or (not math.isnan(ev.ppl) and (math.isnan(best["ppl"]) or ev.ppl < best["ppl"])):
                        self.ls.best = ev.as_dict()
                log_row = ev is not None or (cfg.train.log_every > 0 and step % cfg.train.log_every == 0)
                if log_row or step == steps:
                    self._append_row(step, lr, ev)
                ckpt_due = step == steps or (cfg.train.checkpoint_every > 0 and step % cfg.train.checkpoint_every == 0)
                if ckpt_due:
                    self._save_checkpoint()
                if ev is not None or ckpt_due:
                    self._write_record("running")
                if bar is not None:
                    bar.update(1)
                    post = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}"}
                    if self.ls.final is not None:
                        post["val_ppl"] = f"{self.ls.final['ppl']:.2f}"
                    bar.set_postfix(post, refresh=False)
        finally:
            if bar is not None:
                bar.close()
        if do_full:
            self.full = self.evaluate_full(steps)
        return self._write_record("completed")

    def _append_row(self, step: int, lr: float, ev: EvalResult | None) -> None:
        n = self.ls.pending_loss_count
        row: dict[str, Any] = {
            "step": step,
            "tokens_seen": step * self.global_batch * self.cfg.train.seq_len,
            "train_loss": self.ls.pending_loss_sum / n if n else None,
            "eval_loss_reference": ev.loss if ev else None,
            "eval_ppl_reference": ev.ppl if ev else None,
            "eval_acc_reference": ev.acc if ev else None,
            "eval_acc_param_reference": ev.acc_param if ev else None,
            "elapsed_s": round(self._elapsed(), 3),
            "lr": lr,
        }
        self.ls.pending_loss_sum = 0.0
        self.ls.pending_loss_count = 0
        self.ls.curve.append(row)
        if self.is_main:
            results.append_curve_row(self.run_dir, row)


def run_training(
    cfg: RunConfig,
    backend: Backend,
    run_dir: str | os.PathLike[str],
    *,
    corpus: Any = None,
    resume: bool = True,
    progress: bool | None = None,
    record: RunMetrics | None = None,
    keep_checkpoints: int = 2,
) -> RunMetrics:
    """Train ``backend`` under ``cfg`` in ``run_dir`` and return the run record.

    corpus: an object with ``train``/``valid`` token arrays and ``vocab_size`` (default:
    ``pcaf_core.data.load_corpus(cfg.data)``). resume: continue from the newest complete checkpoint
    in ``run_dir`` when there is one (its config must hash like ``cfg``); False starts over and
    deletes the directory's old checkpoints. progress: tqdm bar (None: only on a TTY;
    ``PCAF_NO_PROGRESS=1`` always disables it). record: identity/provenance fields (table, row,
    scale, deviations, ...) for ``metrics.json``. keep_checkpoints: how many recent checkpoints stay
    on disk.

    Raises :class:`TrainingDiverged` on a non-finite training loss, :class:`CheckpointError` when the
    checkpoint does not fit ``cfg``; any failure leaves ``metrics.json`` with ``status="failed"``.
    """
    return TrainingLoop(cfg, backend, run_dir, corpus=corpus, resume=resume, progress=progress,
                        record=record, keep_checkpoints=keep_checkpoints).run()
