"""JAX trainer entry point: ``train(cfg, run_dir, ...)`` (the :class:`pcaf_core.backend.TrainEntry` the
Hydra app calls for ``backend=jax``), and ``python -m backends.jax.train`` for multi-host jobs.

One process runs :class:`backends.jax.backend.JaxBackend` in the shared loop (:mod:`pcaf_core.loop`);
``world_size`` local devices form the data-parallel mesh (on a CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX starts, emulates N devices).

Multi-host (a TPU pod slice, several GPU hosts): start one process per host with the same arguments;
each joins the job (``jax.distributed.initialize``), the mesh spans every host's devices, and every
process feeds its slice of each global batch::

    python -m backends.jax.train --config run.json --run-dir /shared/runs/x

On a Cloud TPU VM pod slice, run it on every worker (the run directory must be one file system every
host sees, e.g. a mounted bucket or NFS)::

    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \\
        --command "cd repo && python -m backends.jax.train --config run.json --run-dir /shared/runs/x --distributed on"

``--config`` is a JSON file holding the resolved :class:`~pcaf_core.config.RunConfig`
(``pcaf_core.config_io.config_to_dict``), or the YAML ``config.yaml`` the Hydra app writes into a run
directory. ``--distributed auto`` (default) joins a job the environment describes (SLURM, Open MPI,
``JAX_COORDINATOR_ADDRESS``, a GKE TPU slice); ``--coordinator HOST:PORT --num-processes N
--process-id I`` name it explicitly. Only process 0 writes the record, the curve and the checkpoints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax

from backends.jax.backend import JaxBackend, JaxState
from backends.jax.sharding import initialize_distributed
from pcaf_core.config import RunConfig
from pcaf_core.config_io import read_config
from pcaf_core.loop import run_training
from pcaf_core.results import RunMetrics

__all__ = ["JaxBackend", "JaxState", "main", "train"]


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool | str = True,
    progress: bool | None = None,
    record: RunMetrics | None = None,
    device: str | None = None,
    corpus: Any = None,
    world_size: int = 1,
) -> RunMetrics:
    """Train ``cfg`` and write the run into ``run_dir``; returns the run record.

    resume: continue from the newest complete checkpoint in ``run_dir`` (same config required);
    ``"restart_damaged"``: start over when every checkpoint is damaged (see ``pcaf_core.loop.run_training``).
    progress: tqdm bar (None: only on a TTY; ``PCAF_NO_PROGRESS=1`` disables). record: identity and
    provenance fields for ``metrics.json`` (table, row, scale, deviations, overrides, git commit).
    device: None / ``"auto"`` (JAX's default platform), ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    corpus: token arrays to use instead of ``pcaf_core.data.load_corpus(cfg.data)``.
    world_size: number of this process's devices in the data-parallel mesh (default 1; 0 = all of
    them); a ValueError says so when fewer are available. In a multi-process job the mesh always spans
    every process's devices.
    """
    if device == "auto":
        device = None
    if world_size < 0:
        raise ValueError(f"world_size={world_size} is invalid: use the number of devices (0 = all)")
    num_devices = None if (world_size == 0 or jax.process_count() > 1) else world_size
    if world_size == 0 and jax.process_count() == 1:
        num_devices = len(jax.devices(device) if device else jax.devices())
    backend = JaxBackend(device, num_devices=num_devices)
    return run_training(cfg, backend, run_dir, corpus=corpus, resume=resume,
                        progress=progress if backend.rank == 0 else False, record=record)


def main(argv: list[str] | None = None) -> int:
    """Command line: join the multi-host job when there is one, then :func:`train` on every device."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="resolved RunConfig (JSON or YAML)")
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory (shared by every process)")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "gpu", "tpu"],
                        help="platform (default: JAX's default)")
    parser.add_argument("--devices", type=int, default=0,
                        help="devices of this process in the mesh, single-process only (default 0 = all)")
    parser.add_argument("--distributed", default="auto", choices=["auto", "on", "off"],
                        help="join a multi-process job with jax.distributed.initialize")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (explicit multi-host)")
    parser.add_argument("--num-processes", type=int, default=None, help="number of processes (explicit)")
    parser.add_argument("--process-id", type=int, default=None, help="this process's index (explicit)")
    parser.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")

    cfg = read_config(args.config)  # a bad file fails before a multi-host job is joined
    # Before any JAX call touches a device (importing JAX modules does not).
    initialize_distributed(args.distributed, coordinator_address=args.coordinator,
                           num_processes=args.num_processes, process_id=args.process_id)
    train(cfg, args.run_dir, resume=not args.no_resume, progress=False if args.no_progress else None,
          device=args.device, world_size=args.devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
