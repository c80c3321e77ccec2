"""Data-parallel torch training (``DistributedDataParallel``; gloo on CPU, NCCL on GPUs).

Semantics (the loop implements them, see ``pcaf_core.loop``): every rank draws the same global batch
from the same seeded sampler and trains on its contiguous ``global_batch / world_size`` slice; DDP
averages the gradients, so a run on ``N`` processes sees the same windows and takes the same steps
(up to float summation order) as one process with the same global batch. Evaluation batches are
split the same way and their sums all-reduced. Only rank 0 writes the run record, the curve and the
weights; every rank writes its own generator state into each checkpoint.

Two ways in:

* :func:`launch_ddp` — spawn ``world_size`` local processes from Python (tests, a laptop);
* ``torchrun --nproc_per_node=N -m backends.torch.train_ddp --config cfg.json --run-dir DIR``
  (clusters; see :mod:`backends.torch.train_ddp`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from backends.torch.backend import TorchBackend
from pcaf_core.config import RunConfig
from pcaf_core.loop import run_training
from pcaf_core.results import RunMetrics, SchemaError, read_metrics
from pcaf_core.run_record import mark_failed


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores shared evenly (oversubscription makes gloo
    runs many times slower)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def run_rank(
    rank: int,
    world_size: int,
    cfg: RunConfig,
    run_dir: Path,
    *,
    device: str | torch.device | None = None,
    resume: bool | str = True,
    progress: bool | None = None,
    record: RunMetrics | None = None,
    corpus: Any = None,
) -> RunMetrics:
    """Train as rank ``rank`` in an already initialised process group."""
    backend = TorchBackend(device, rank=rank, world_size=world_size)
    return run_training(cfg, backend, run_dir, corpus=corpus, resume=resume, progress=progress if rank == 0 else False,
                        record=record)


def _spawned_worker(
    rank: int,
    world_size: int,
    init_file: str,
    cfg: RunConfig,
    run_dir: str,
    resume: bool | str,
    record: RunMetrics | None,
    corpus: Any,
    threads: int,
    use_cuda: bool,
) -> None:
    torch.set_num_threads(threads)
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    finished = False
    try:
        run_rank(rank, world_size, cfg, Path(run_dir), device=f"cuda:{rank}" if use_cuda else "cpu",
                 resume=resume, progress=False, record=record, corpus=corpus)
        finished = True
    finally:
        leave_process_group(finished)
    exit_completed_rank()


def exit_completed_rank() -> None:
    """End a rank whose run completed (its files written and closed) without interpreter finalization.

    Second line of defence after :func:`leave_process_group`'s barrier: any native thread still alive
    (gloo's workers, when the group object outlives ``destroy_process_group`` through a reference) that asks
    for the GIL while the interpreter finalizes is unwound and aborts the process with SIGABRT, turning a
    completed run into a failed exit status. Streams and log handlers are flushed first; only a successful
    rank comes here, so a failure still propagates with its traceback.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream has nothing left to flush
            stream.flush()
    os._exit(0)


def leave_process_group(finished: bool) -> None:
    """Leave the process group so that the interpreter can exit cleanly.

    finished: every rank completed its run (all of them reach this call). A gloo worker thread destroys a
    collective after its ``wait()`` has returned, and dropping a tensor Python has seen needs the GIL; a
    thread that asks for the GIL while the interpreter is finalizing is unwound, which aborts the process
    ("terminate called without an active exception", SIGABRT) after a run that completed. A closing
    barrier prevents it: enqueuing it waits for the queue lock, which the worker holds until it has
    destroyed the previous collective, and the barrier itself holds no Python tensor. After a failure the
    other ranks may be gone, so no barrier then.
    """
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def launch_ddp(
    cfg: RunConfig,
    run_dir: Path,
    world_size: int,
    *,
    resume: bool | str = True,
    record: RunMetrics | None = None,
    corpus: Any = None,
    threads_per_rank: int | None = None,
    device: str = "cpu",
) -> RunMetrics:
    """Train ``cfg`` on ``world_size`` local processes and return rank 0's record.

    device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank ``r`` on ``cuda:r``). ``corpus`` (optional,
    picklable) is sent to every process; without it each process loads the token cache itself
    (memory-mapped, so the ranks share the pages). A failure on any rank stops every process and
    raises here; the run record then says ``failed``.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid for launch_ddp: use 'cpu' or 'cuda'")
    use_cuda = device == "cuda"
    if use_cuda and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size={world_size} needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    threads = threads_per_rank or default_threads(world_size)
    with tempfile.TemporaryDirectory(prefix="pcaf_ddp_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.spawn(
                _spawned_worker,
                args=(world_size, init_file, cfg, str(run_dir), resume, record, corpus, threads, use_cuda),
                nprocs=world_size,
                join=True,
            )
        except ProcessException as exc:
            _record_rank_failure(run_dir, cfg, record, exc)
            raise
    return read_metrics(run_dir)


def _record_rank_failure(run_dir: Path, cfg: RunConfig, record: RunMetrics | None, exc: Exception) -> None:
    """Make sure the run record says ``failed`` after a rank died.

    Only rank 0 writes the record, and when another rank fails first ``mp.spawn`` terminates rank 0 before it
    can (every rank raises the same config error, whichever is quicker wins): the parent then marks the run
    failed with the failing rank's last error line, keeping whatever record rank 0 had written."""
    try:
        recorded = read_metrics(run_dir).status == "failed"  # rank 0's own record of it has more context
    except (FileNotFoundError, SchemaError):
        recorded = False  # no readable record: mark_failed writes a minimal one
    if recorded:
        return
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    error = lines[-1] if lines else type(exc).__name__
    rank = getattr(exc, "error_index", None)
    mark_failed(run_dir, record, f"rank {rank}: {error}" if rank is not None else error, cfg=cfg)
