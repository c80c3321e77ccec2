"""Learning-rate schedule (docs/REFERENCE_CODE.md §5.4), shared by every backend.

The reference JAX trainer's ``learning_rate_at_step`` is a few lines of arithmetic. It lives here as a
plain function, not as ``torch.optim.lr_scheduler`` or an Optax schedule, because both backends must
produce bit-identical learning rates at every step (the cross-backend and resume tests compare runs
exactly), and a library schedule counts steps from 0, evaluates in its own precision and differs in
the warm-up edge case. The loop computes the rate once per step in float64 and hands it to the
backend's optimiser.
"""

from __future__ import annotations

import math

from pcaf_core.config import TrainConfig


def lr_at_step(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate used by optimiser step ``step`` (1-based).

    * ``lr · step / W`` for ``step <= W`` (linear warm-up; ``W = warmup_steps``);
    * then ``lr · (ρ + (1 − ρ) · ½ (1 + cos(π · (step − W) / (S − W))))`` with ``ρ = min_lr_ratio``
      and ``S = total_steps``, which reaches ``ρ · lr`` at ``step = S``.

    ``W = 0`` and ``ρ = 1`` (the reference default) give a constant ``lr``.
    """
    if step < 1:
        raise ValueError(f"step={step} is invalid: steps are 1-based")
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        # Warm-up covers the whole run: the last step was already at the peak.
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def lr_for(train: TrainConfig, step: int) -> float:
    """:func:`lr_at_step` with the run's :class:`~pcaf_core.config.TrainConfig` values."""
    return lr_at_step(step, train.lr, train.warmup_steps, train.steps, train.min_lr_ratio)
