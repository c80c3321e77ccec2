"""PyTorch trainer entry point: ``train(cfg, run_dir, ...)`` (the :class:`pcaf_core.backend.TrainEntry`
the Hydra app calls for ``backend=torch``).

One process (CPU or one GPU) runs :class:`backends.torch.backend.TorchBackend` in the shared loop;
``world_size > 1`` hands over to ``backends.torch.ddp.launch_ddp`` (and ``python -m
backends.torch.train_ddp`` under ``torchrun``) for data parallelism.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from backends.torch.backend import TorchBackend, TorchState, TrainingLoss
from pcaf_core.config import RunConfig
from pcaf_core.loop import run_training
from pcaf_core.results import RunMetrics

__all__ = ["TorchBackend", "TorchState", "TrainingLoss", "train"]


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool | str = True,
    progress: bool | None = None,
    record: RunMetrics | None = None,
    device: str | torch.device | None = None,
    corpus: Any = None,
    world_size: int = 1,
) -> RunMetrics:
    """Train ``cfg`` and write the run into ``run_dir``; returns the run record.

    resume: continue from the newest complete checkpoint in ``run_dir`` (same config required);
    ``"restart_damaged"``: start over when every checkpoint is damaged (see ``pcaf_core.loop.run_training``).
    progress: tqdm bar (None: only on a TTY; ``PCAF_NO_PROGRESS=1`` disables). record: identity and
    provenance fields for ``metrics.json`` (table, row, scale, deviations, overrides, git commit).
    device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or None / ``"auto"`` (CUDA when
    available). corpus: token arrays to use instead of ``pcaf_core.data.load_corpus(cfg.data)``.
    world_size: > 1 trains data-parallel on that many local processes (``backends.torch.ddp``;
    gloo on CPU, NCCL with one GPU per process).
    """
    if device == "auto":
        device = None
    if world_size > 1:
        from backends.torch.ddp import launch_ddp

        kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return launch_ddp(cfg, run_dir, world_size, resume=resume, record=record, corpus=corpus, device=kind)
    return run_training(cfg, TorchBackend(device), run_dir, corpus=corpus, resume=resume, progress=progress,
                        record=record)
