"""Hydra callbacks: a multirun sweep ends in one table and one plot over the swept values, and says which
jobs failed (the command then exits 1)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pcaf_core.results import SchemaError, read_metrics

log = logging.getLogger(__name__)


def swept_keys(task_overrides: list[str]) -> list[str]:
    """Keys given several comma-separated values on the command line (``memory.top_k=4,8``)."""
    keys = []
    for o in task_overrides:
        key, _, value = o.partition("=")
        if "," in value or value.startswith(("range(", "choice(", "glob(")):
            keys.append(key.lstrip("+~"))
    return keys


def failed_jobs(sweep_dir: Path) -> list[tuple[Path, str]]:
    """``(run dir, reason)`` of every job under ``sweep_dir`` whose record is not ``completed``."""
    out = []
    for path in sorted(Path(sweep_dir).glob("*/metrics.json")):
        try:
            rec = read_metrics(path)
        except SchemaError as exc:
            out.append((path.parent, str(exc)))
            continue
        if rec.status != "completed":
            out.append((path.parent, rec.error or rec.status))
    return out


class SweepSummary(Callback):
    """After ``-m`` runs, render the sweep's table and plot into the sweep directory (failed jobs are marked
    there), list the failed jobs and exit 1 when there are any."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        params = [k for k in swept_keys(list(config.hydra.overrides.task)) if k != "experiment"]
        if params:
            from paper_tables.sweep import render_sweep  # imported lazily: pandas/matplotlib

            outputs = render_sweep(sweep_dir, params, sweep_dir)
            for path in outputs:
                print(f"sweep output: {path}")
        failed = failed_jobs(sweep_dir)
        if failed:
            n = len(list(sweep_dir.glob("*/metrics.json")))
            for run_dir, reason in failed:
                print(f"failed job {run_dir.name}: {' '.join(reason.split())[:300]}", file=sys.stderr)
            print(f"{len(failed)} of {n} jobs of the sweep in {sweep_dir} failed (the others ran)", file=sys.stderr)
            sys.exit(1)
