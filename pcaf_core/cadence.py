"""The cadence of a run's steps: which end with a checkpoint or read the state they leave, and the step in flight.

A one-process run launches step N+1 before it reads step N's loss (:mod:`pcaf_core.loop`): the host samples,
checks and launches the next step while an accelerator still computes this one, and reading a loss waits for its
step. A step whose end reads the weights it leaves (its reference evaluation, its checkpoint, the last step) is read
first, so that the evaluation and the checkpoint see exactly that step's state. NumPy/stdlib only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pcaf_core.config import RunConfig
from pcaf_core.evaluation import reference_due


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether step ``step`` ends with a checkpoint: every ``train.checkpoint_every`` steps (0: never) and the last."""
    every = cfg.train.checkpoint_every
    return step == cfg.train.steps or (every > 0 and step % every == 0)


def reads_state(cfg: RunConfig, step: int) -> bool:
    """Whether the end of step ``step`` reads the state the step leaves: its reference evaluation, its checkpoint,
    or the end of training (the full evaluation). The next step starts only after such an end."""
    evaluates = cfg.eval.protocol in ("reference", "both") and reference_due(step, cfg)
    return evaluates or checkpoint_due(cfg, step)


@dataclasses.dataclass
class LaunchedStep:
    """A training step started and not yet read: its number, learning rate, loss as the backend returned it
    (``float(loss)`` waits for the step) and the seconds its launch took (sampling, checks, the backend's call).
    The step's time in the run's throughput is ``launch_s`` plus the wait for its loss."""

    step: int
    lr: float
    loss: Any
    launch_s: float
