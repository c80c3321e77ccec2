"""Hydra callbacks: a multirun sweep ends in one table and one plot over the swept values, and says which
jobs failed (the command then exits 1)."""

from __future__ import annotations

import logging
import shlex
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
    there), list the failed jobs (and, through the suite's submitit launchers, those that ended without a result:
    :func:`experiments.sweep_jobs.lost_jobs`) and exit 1 when there are any."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments.sweep_jobs import continue_sweep_command, lost_jobs

        sweep_dir = Path(config.hydra.sweep.dir)
        params = [k for k in swept_keys(list(config.hydra.overrides.task)) if k != "experiment"]
        if params:
            from paper_tables.sweep import render_sweep  # imported lazily: pandas/matplotlib

            outputs = render_sweep(sweep_dir, params, sweep_dir)
            for path in outputs:
                print(f"sweep output: {path}")
        lost = lost_jobs(sweep_dir)
        failed = []
        for run_dir, reason in failed_jobs(sweep_dir):
            number = int(run_dir.name.split("-", 1)[0]) if run_dir.name[:3].isdigit() else None
            # A lost job: the line said when it died (its record, when it has one, holds the same line).
            failed.append((run_dir.name, lost.pop(number, None) or " ".join(reason.split())[:300]))
        failed += [(f"#{number} (it left no run record)", line) for number, line in sorted(lost.items())]
        if failed:
            n = len(list(sweep_dir.glob("*/metrics.json"))) + sum(name.startswith("#") for name, _ in failed)
            for name, reason in failed:
                print(f"failed job {name}: {reason}", file=sys.stderr)
            print(f"{len(failed)} of {n} jobs of the sweep in {sweep_dir} failed (the others ran)", file=sys.stderr)
            if lost_jobs(sweep_dir):
                print(f"continue the sweep there (finished runs kept, stopped ones resumed from their last "
                      f"checkpoint): {continue_sweep_command(sys.argv[1:], sweep_dir.resolve())} (make sweep: the "
                      f"same command with SWEEP_DIR={shlex.quote(str(sweep_dir.resolve()))})", file=sys.stderr)
            sys.exit(1)
