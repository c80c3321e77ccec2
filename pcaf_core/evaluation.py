"""Evaluation protocols (docs/DESIGN.md §7; docs/REFERENCE_CODE.md §5.3) and the reduction of a backend's outputs.

A backend scores a batch and returns :class:`~pcaf_core.backend.EvalOutputs` (per-target log-probs and
the two argmax predictions); everything from there on is backend-neutral and lives here:

* :func:`reduce_outputs` — masked summed NLL, target count and both accuracies' hit counts;
* :func:`evaluate_reference` — ``eval.batches`` fresh random validation batches from the continuing
  eval stream; loss = mean of per-batch mean losses, PPL = ``exp(min(cap, loss))``;
* :func:`evaluate_full` — one deterministic pass over the evaluation split, token-weighted loss,
  exact PPL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pcaf_core.backend import Backend, EvalOutputs
from pcaf_core.batches import check_batch
from pcaf_core.config import RunConfig


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


def eval_batch_size(cfg: RunConfig) -> int:
    """The global batch a run evaluates with: ``eval.batch_size``, or the training batch when it is 0."""
    return cfg.eval.batch_size or cfg.train.batch_size


def full_batch_size(cfg: RunConfig) -> int:
    """Windows per batch of the full protocol's pass: ``eval.full_batch_size``, or :func:`eval_batch_size` when it
    is 0. Each window is scored on its own (dropout off, nothing carried between windows), so the batching changes
    no score beyond float rounding (a product's summation order may depend on its batch); it is left out of a
    run's identity and of its checkpoints' config hash (:data:`pcaf_core.run_identity.BATCHING_FIELDS`)."""
    return cfg.eval.full_batch_size or eval_batch_size(cfg)


def reference_due(step: int, cfg: RunConfig) -> bool:
    """Whether a run evaluates with the reference protocol after ``step`` (1-based): at step 1, every
    ``eval.every`` steps and at the last step (``train.steps``)."""
    return step == 1 or step % cfg.eval.every == 0 or step == cfg.train.steps


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


def reduce_outputs(out: EvalOutputs, targets: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """``[sum_nll, n_targets, n_correct_mixture, n_correct_param]`` (float64) over the targets ``mask``
    selects (all when None).

    targets: ``[b]`` or ``[b, Q]``; the outputs' ``[b, Q]`` arrays are matched to its shape. A masked-out
    target may score -inf (a padding row): it is excluded with ``where``, never multiplied by 0.
    """
    tlp = np.asarray(out.target_log_prob, dtype=np.float64)
    y = np.asarray(targets).reshape(tlp.shape)
    m = np.ones(tlp.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool).reshape(tlp.shape)
    hit_mix = (np.asarray(out.prediction).reshape(tlp.shape) == y) & m
    hit_param = (np.asarray(out.prediction_param).reshape(tlp.shape) == y) & m
    nll = -np.where(m, tlp, 0.0).sum()
    return np.array([nll, m.sum(), hit_mix.sum(), hit_param.sum()], dtype=np.float64)


def score_batch(backend: Backend, state: Any, cfg: RunConfig, inputs: np.ndarray, targets: np.ndarray,
                mask: np.ndarray | None = None) -> np.ndarray:
    """Validate one batch, let the backend score it and reduce the outputs (see :func:`reduce_outputs`)."""
    check_batch(inputs, targets, cfg)
    return reduce_outputs(backend.eval_batch(state, inputs, targets, cfg.train.mode), targets, mask)


def evaluate_reference(
    backend: Backend,
    state: Any,
    cfg: RunConfig,
    batches: Iterator[tuple[np.ndarray, np.ndarray]],
    local: Callable[[np.ndarray], np.ndarray],
    step: int,
    windows_per_batch: int,
) -> EvalResult:
    """The reference protocol: ``eval.batches`` fresh random batches drawn from ``batches`` (the
    continuing eval stream; ``local`` cuts this rank's slice); per-batch sums are all-reduced over ranks;
    loss is the mean of per-batch mean losses, accuracy the mean of per-batch accuracies."""
    sums = []
    for _ in range(cfg.eval.batches):
        inputs, targets = next(batches)
        sums.append(score_batch(backend, state, cfg, local(inputs), local(targets)))
    total = backend.all_reduce_sum([float(x) for s in sums for x in s])
    per_batch = [total[i : i + 4] for i in range(0, len(total), 4)]
    loss = float(np.mean([s[0] / s[1] for s in per_batch]))
    return EvalResult(
        step=step,
        protocol="reference",
        loss=loss,
        ppl=capped_ppl(loss, cfg.eval.ppl_cap_log),
        acc=float(np.mean([s[2] / s[1] for s in per_batch])),
        acc_param=float(np.mean([s[3] / s[1] for s in per_batch])),
        n_targets=int(sum(s[1] for s in per_batch)),
        windows=cfg.eval.batches * windows_per_batch,
    )


def evaluation_tokens(corpus: Any) -> np.ndarray:
    """The split a run evaluates on: ``corpus.eval`` (the split ``data.eval_split`` names) when the corpus
    has one, else ``corpus.valid``."""
    tokens = getattr(corpus, "eval", None)
    return corpus.valid if tokens is None else tokens


def full_windows(tokens: np.ndarray, cfg: RunConfig, batch_size: int, capped: bool) -> Any:
    """The full protocol's deterministic windows over ``tokens`` (``pcaf_core.data.FullEvalWindows``);
    ``capped`` applies ``eval.full_max_windows``."""
    from pcaf_core.data import FullEvalWindows

    return FullEvalWindows(
        tokens, cfg.train.seq_len, batch_size, cfg.train.mode,
        stride=cfg.eval.full_nt_stride if cfg.train.mode == "nt" else None,
        max_windows=cfg.eval.full_max_windows if capped else 0,
        split=cfg.data.eval_split,
    )


def evaluate_full(backend: Backend, state: Any, cfg: RunConfig, tokens: np.ndarray, batch_size: int,
                  step: int) -> tuple[EvalResult, int]:
    """One deterministic pass over ``tokens`` (the first ``eval.full_max_windows`` windows when capped):
    token-weighted loss, exact PPL. Batches are dealt round-robin to ranks and the sums all-reduced.

    Returns the result and the number of windows the uncapped pass would have (for the label).
    """
    windows = full_windows(tokens, cfg, batch_size, capped=True)
    total_windows = (windows.num_windows if cfg.eval.full_max_windows == 0
                     else full_windows(tokens, cfg, batch_size, capped=False).num_windows)
    acc = np.zeros(4, dtype=np.float64)
    for i in range(backend.rank, len(windows), backend.world_size):
        b = windows.batch(i)
        acc += score_batch(backend, state, cfg, b.inputs, b.targets, b.mask)
    s_nll, n, c_mix, c_param = backend.all_reduce_sum(acc.tolist())
    if int(n) != windows.num_targets:
        raise RuntimeError(f"full evaluation scored {int(n)} targets, expected {windows.num_targets}")
    loss = s_nll / n
    result = EvalResult(step=step, protocol="full", loss=loss, ppl=exact_ppl(loss), acc=c_mix / n,
                        acc_param=c_param / n, n_targets=int(n), windows=windows.num_windows)
    return result, total_windows
