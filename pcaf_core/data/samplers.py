"""Window samplers: the reference's i.i.d. windows and deterministic full-split windows.

Both are pure NumPy, so a torch run and a JAX run with the same seed see the same windows.

Reference protocol (docs/REFERENCE_CODE.md §5.2), :class:`WindowSampler`: every batch draws ``B``
starts ``s ~ U{0, …, N−T−2}`` with ``numpy.random.default_rng(seed).integers(0, N−T−1)``;
the block is ``ids[s : s+T+1]``; inputs ``block[:T]``; targets ``block[T]`` (``nt``: one
prediction per window) or ``block[1:T+1]`` (``ar``). Evaluation under this protocol is the
same sampler on the eval split with ``eval_sample_seed``, drawing ``eval.batches`` batches at
every evaluation from one continuing stream (so each evaluation sees fresh windows). With
several hosts the reference seeds host ``i`` with ``seed + i``.

Full protocol (docs/DESIGN.md §7), :class:`FullEvalWindows`: a deterministic pass with exact
token-weighted loss ``sum(loss·mask) / sum(mask)``.

* ``ar``: non-overlapping windows at starts ``0, T, 2T, …``; window ``s`` scores targets
  ``s+1 … s+T``. If ``N−1`` is not a multiple of ``T``, one last window is aligned to end at
  the split's final token (start ``N−1−T``, so it keeps a full ``T``-token context) and its
  targets already scored by the previous window are masked out. Every position ``1 … N−1``
  is scored exactly once; position 0 has no context and is never a target.
* ``nt``: one target per window, at positions ``T, T+stride, T+2·stride, … ≤ N−1``, each
  with its ``T`` preceding tokens as input. ``stride=1`` scores every position that has a full
  context (``N−T`` windows: exact but ``T`` times the cost of ``ar``); the default
  ``stride=T`` scores about ``N/T`` evenly spaced targets (e.g. 212 on WikiText-2 validation
  at ``T=1024``), a deterministic subsample, not the whole split.

Batches are padded to ``batch_size`` rows (padding rows: ``<pad>`` inputs, mask False) so
a compiled step sees one shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DataError
from .tokenizer import PAD_ID

MODES = ("nt", "ar")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise DataError(f"unknown mode {mode!r}: use 'nt' (next token) or 'ar' (full autoregressive)")


class WindowSampler:
    """i.i.d. random windows with replacement, the reference protocol.

    Yields ``(inputs, targets)``: ``inputs`` ``[B, T] int32``; ``targets`` ``[B] int32``
    (``mode='nt'``) or ``[B, T] int32`` (``mode='ar'``). The stream is a function of
    ``seed`` alone; :meth:`state_dict` / :meth:`load_state_dict` resume it exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, mode: str = "nt", seed: int = 0,
                 split: str = "train"):
        _check_mode(mode)
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be >= 1 (got T={seq_len}, B={batch_size})")
        n = int(tokens.shape[0])
        if n < seq_len + 2:
            raise DataError(f"the {split} split has {n:,} tokens, too few for windows of T={seq_len} (needs at "
                            f"least T+2 = {seq_len + 2:,}): lower train.seq_len or raise the token budget "
                            f"(data.max_train_tokens / data.max_eval_tokens, 0 = whole split)")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.mode = mode
        self.seed = int(seed)
        self.split = split
        self.rng = np.random.default_rng(self.seed)
        self.batches_drawn = 0
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def sample_starts(self) -> np.ndarray:
        """Draw the next batch's ``[B] int64`` window starts in ``[0, N−T−2]`` (advances the stream)."""
        starts = self.rng.integers(0, self.num_tokens - self.seq_len - 1, size=self.batch_size, dtype=np.int64)
        self.batches_drawn += 1
        return starts

    def windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, targets)`` for given ``[B]`` starts (no randomness)."""
        block = np.asarray(self.tokens[starts[:, None] + self._offsets[None, :]], dtype=np.int32)
        inputs = np.ascontiguousarray(block[:, : self.seq_len])
        if self.mode == "nt":
            targets = np.ascontiguousarray(block[:, self.seq_len])
        else:
            targets = np.ascontiguousarray(block[:, 1:])
        return inputs, targets

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next ``(inputs [B, T] int32, targets [B] or [B, T] int32)``."""
        return self.windows(self.sample_starts())

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the identical stream (JSON-serialisable)."""
        return {"bit_generator": self.rng.bit_generator.state, "batches_drawn": self.batches_drawn,
                "seed": self.seed, "seq_len": self.seq_len, "batch_size": self.batch_size, "mode": self.mode,
                "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; the window geometry must match this sampler's."""
        for key in ("seq_len", "batch_size", "mode", "num_tokens"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"cannot resume the {self.split} sampler: the checkpoint has {key}={state.get(key)!r}, "
                                f"this run has {getattr(self, key)!r}. Resume with the same data and train/eval "
                                f"settings, or start the run afresh")
        self.rng.bit_generator.state = state["bit_generator"]
        self.batches_drawn = int(state["batches_drawn"])
        self.seed = int(state.get("seed", self.seed))


@dataclass
class EvalBatch:
    """One batch of full-split windows.

    ``inputs`` ``[b, T] int32``; ``targets`` and ``mask`` ``[b, T]`` (``ar``) or ``[b]``
    (``nt``), ``int32`` / ``bool``. Only masked-in targets count; ``b`` is ``batch_size``
    unless padding was turned off.
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray

    @property
    def num_targets(self) -> int:
        return int(self.mask.sum())


class FullEvalWindows:
    """Deterministic windows over a whole split (the ``full`` protocol; see the module doc).

    Attributes:
        starts: ``[W] int64`` window starts (inputs are ``tokens[s : s+T]``).
        score_from: ``[W] int64`` first scored position inside each window (``ar``; 0 except
            possibly the end-aligned last window). Zeros for ``nt``.
        num_targets: number of scored targets over all windows.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, mode: str = "ar",
                 stride: int | None = None, max_windows: int = 0, pad_batches: bool = True,
                 split: str = "validation"):
        _check_mode(mode)
        n = int(tokens.shape[0])
        T = int(seq_len)
        if T < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be >= 1 (got T={seq_len}, B={batch_size})")
        if n < T + 1:
            raise DataError(f"the {split} split has {n:,} tokens, too few for one evaluation window of T={T} "
                            f"(needs T+1 = {T + 1:,}): lower train.seq_len or raise data.max_eval_tokens")
        if mode == "ar":
            if stride is not None and stride != T:
                raise DataError("full-split AR windows do not overlap: stride must be None (= seq_len)")
            k = (n - 1) // T
            starts = np.arange(k, dtype=np.int64) * T
            score_from = np.zeros(k, dtype=np.int64)
            rem = (n - 1) - k * T
            if rem:
                starts = np.append(starts, n - 1 - T)
                score_from = np.append(score_from, T - rem)
        else:
            stride = T if stride is None else int(stride)
            if stride < 1:
                raise DataError(f"NT full-split stride must be >= 1, got {stride}")
            targets = np.arange(T, n, stride, dtype=np.int64)
            starts = targets - T
            score_from = np.zeros(starts.shape[0], dtype=np.int64)
        if max_windows > 0:
            starts, score_from = starts[:max_windows], score_from[:max_windows]
        self.tokens = tokens
        self.seq_len = T
        self.batch_size = int(batch_size)
        self.mode = mode
        self.stride = T if mode == "ar" else stride
        self.pad_batches = pad_batches
        self.starts = starts
        self.score_from = score_from
        self._offsets = np.arange(T + 1, dtype=np.int64)

    @property
    def num_windows(self) -> int:
        return int(self.starts.shape[0])

    @property
    def num_targets(self) -> int:
        if self.mode == "nt":
            return self.num_windows
        return int((self.seq_len - self.score_from).sum())

    def __len__(self) -> int:
        return -(-self.num_windows // self.batch_size)

    def target_positions(self) -> np.ndarray:
        """Positions in the split of every scored target, in window order (``[num_targets] int64``)."""
        if self.mode == "nt":
            return self.starts + self.seq_len
        out = [s + 1 + np.arange(f, self.seq_len) for s, f in zip(self.starts.tolist(), self.score_from.tolist())]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def batch(self, i: int) -> EvalBatch:
        """Batch ``i`` of ``len(self)``."""
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range [0, {len(self)})")
        T, B = self.seq_len, self.batch_size
        starts = self.starts[i * B:(i + 1) * B]
        sf = self.score_from[i * B:(i + 1) * B]
        b = starts.shape[0]
        block = np.asarray(self.tokens[starts[:, None] + self._offsets[None, :]], dtype=np.int32)
        rows = B if self.pad_batches else b
        inputs = np.full((rows, T), PAD_ID, dtype=np.int32)
        inputs[:b] = block[:, :T]
        if self.mode == "nt":
            targets = np.full(rows, PAD_ID, dtype=np.int32)
            targets[:b] = block[:, T]
            mask = np.zeros(rows, dtype=bool)
            mask[:b] = True
        else:
            targets = np.full((rows, T), PAD_ID, dtype=np.int32)
            targets[:b] = block[:, 1:]
            mask = np.zeros((rows, T), dtype=bool)
            mask[:b] = np.arange(T)[None, :] >= sf[:, None]
        return EvalBatch(inputs=inputs, targets=targets, mask=mask)

    def __iter__(self) -> Iterator[EvalBatch]:
        for i in range(len(self)):
            yield self.batch(i)
