"""Hydra callbacks: a multirun sweep ends in one table and one plot over the swept values."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def swept_keys(task_overrides: list[str]) -> list[str]:
    """Keys given several comma-separated values on the command line (``memory.top_k=4,8``)."""
    keys = []
    for o in task_overrides:
        key, _, value = o.partition("=")
        if "," in value or value.startswith(("range(", "choice(", "glob(")):
            keys.append(key.lstrip("+~"))
    return keys


class SweepSummary(Callback):
    """After ``-m`` runs, render the sweep's table and plot into the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        params = [k for k in swept_keys(list(config.hydra.overrides.task)) if k != "experiment"]
        if not params:
            return
        from paper_tables.sweep import render_sweep  # imported lazily: pandas/matplotlib

        outputs = render_sweep(sweep_dir, params, sweep_dir)
        for path in outputs:
            print(f"sweep output: {path}")
