"""``torchrun`` entry point for data-parallel torch training.

    torchrun --nproc_per_node=2 -m backends.torch.train_ddp --config run_config.json --run-dir runs/x

``--config`` is a JSON file holding the resolved :class:`~pcaf_core.config.RunConfig` as a nested
dict (``pcaf_core.config_io.config_to_dict``), or a YAML file with the same sections (e.g. the
``config.yaml`` the Hydra app writes into a run directory; sections other than the run's are
ignored). The process group uses NCCL when CUDA is available (one GPU per local rank) and gloo
otherwise. Semantics as :mod:`backends.torch.ddp`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from backends.torch.ddp import default_threads, exit_completed_rank, leave_process_group, run_rank
from pcaf_core.config_io import read_config


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, join the process group torchrun set up, train, leave the group."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="resolved RunConfig (JSON or YAML)")
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory (shared by all ranks)")
    parser.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if var not in os.environ:
            parser.error(f"${var} is not set: start this module with torchrun (see the module docstring)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cfg = read_config(args.config)
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device: str = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        torch.set_num_threads(default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        device = "cpu"
        dist.init_process_group("gloo")
    finished = False
    try:
        run_rank(rank, world, cfg, args.run_dir, device=device, resume=not args.no_resume,
                 progress=False if args.no_progress else None)
        finished = True
    finally:
        leave_process_group(finished)
    return 0


if __name__ == "__main__":
    main()  # a failure raises, with its traceback and exit status
    exit_completed_rank()
