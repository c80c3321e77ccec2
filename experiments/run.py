"""Hydra entry point: train one paper row (or a multirun sweep of it).

    python -m experiments.run experiment=wt2-nt-1024/pcaf_context scale=cpu backend=torch
    python -m experiments.run -m experiment=wt2-nt-1024/pcaf_context scale=smoke memory.top_k=4,8,16,32

Each run writes its own directory (see :func:`experiments.app.new_run_dir`); ``run_dir=<path>``
resumes an interrupted run from its last checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments import app
from experiments.schema import register
from pcaf_core.config import ConfigError

register()


def _run_dir(cfg: DictConfig, resolved: app.ResolvedRun) -> Path | None:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        path = Path(hc.sweep.dir) / f"{hc.job.num:03d}-{resolved.row}-seed{resolved.run.train.seed}"
        return path if path.is_absolute() else Path.cwd() / path
    return None


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        resolved = app.resolve(cfg, list(HydraConfig.get().overrides.task))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    metrics = app.run_one(resolved, _run_dir(cfg, resolved))
    print(app.summary_line(resolved, metrics), file=sys.stdout if metrics.status == "completed" else sys.stderr)
    if metrics.status != "completed" and HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(1)


if __name__ == "__main__":
    from experiments.allocator import ensure_tunables

    ensure_tunables()
    main()
