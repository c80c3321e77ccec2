"""Data parallelism with ``jax.sharding``: the device mesh, array placement, and multi-host start-up.

One mesh axis, ``"data"``: a global batch ``[B, ...]`` is split row-wise over the mesh's devices
(``NamedSharding(mesh, P("data"))``), parameters and optimiser state are replicated
(``NamedSharding(mesh, P())``). A jitted step over such arrays computes the gradient of the global mean
loss; XLA inserts the all-reduce of the gradients, so N devices take the same step as one device with
the same global batch (up to float summation order).

Multi-host (a TPU pod slice, several GPU hosts): one process per host, started with
:func:`initialize_distributed`; the mesh then spans every process's devices, ordered by process so
that process ``p`` holds the contiguous rows ``p*B/P .. (p+1)*B/P`` of the global batch, which is the
slice :mod:`pcaf_core.loop` hands rank ``p``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger("pcaf.jax")
# JAX logs every platform plugin it probes and does not find (e.g. "Unable to initialize backend 'tpu'") at
# INFO; the run logs INFO, and on a CPU machine those lines read like failures. Real failures still raise.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

DATA_AXIS = "data"
PLATFORMS = ("cpu", "gpu", "tpu")
PLATFORM_ALIASES = {"cuda": "gpu"}
"""Device names the suite's configs share with the torch backend (``backend.device=cuda``): JAX's platform."""


# --------------------------------------------------------------------------- multi-host start-up


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def cluster_detected() -> bool:
    """Whether the environment describes a multi-process job that ``jax.distributed.initialize()`` can
    join on its own: ``JAX_COORDINATOR_ADDRESS`` set, a SLURM step or Open MPI job of more than one task,
    or a GKE TPU slice of more than one host (``TPU_WORKER_HOSTNAMES``). A Cloud TPU VM pod slice
    started with ``gcloud ... --worker=all`` is not visible from the environment: pass
    ``--distributed on`` there (JAX then asks the TPU metadata server)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if "SLURM_JOB_ID" in os.environ and max(_int_env("SLURM_STEP_NUM_TASKS"), _int_env("SLURM_NTASKS")) > 1:
        return True
    if _int_env("OMPI_COMM_WORLD_SIZE") > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize_distributed(
    mode: str = "auto",
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Join the multi-host job with ``jax.distributed.initialize`` (before any other JAX call).

    mode: ``"off"`` (one process), ``"on"`` (always initialise; JAX detects Cloud TPU, SLURM, Open MPI
    and Kubernetes jobs itself), ``"auto"`` (initialise when explicit arguments are given or
    :func:`cluster_detected`). Explicit ``coordinator_address`` (``host:port`` of process 0),
    ``num_processes`` and ``process_id`` override detection. Returns whether JAX runs distributed.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed mode {mode!r} is invalid: use 'auto', 'on' or 'off'")
    if jax.distributed.is_initialized():
        return True
    explicit = coordinator_address is not None or num_processes is not None or process_id is not None
    if mode == "off" or (mode == "auto" and not explicit and not cluster_detected()):
        return False
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


# --------------------------------------------------------------------------- devices and mesh


def select_devices(platform: str | None = None, num_devices: int | None = 1) -> list[jax.Device]:
    """The devices of the data mesh, ordered by (process, id).

    platform: ``None`` (JAX's default backend), ``"cpu"``, ``"gpu"`` (or ``"cuda"``, as torch names it) or
    ``"tpu"``.
    num_devices: how many devices of this process to use (``None``: every device of every process).
    In a multi-process job the mesh must span every process, so only ``None`` (or the global count)
    is accepted there.
    """
    platform = PLATFORM_ALIASES.get(platform, platform)
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"device={platform!r} is invalid for the JAX backend: use one of {list(PLATFORMS)}, "
                         "'auto' or None")
    try:
        every = jax.devices(platform) if platform else jax.devices()
    except RuntimeError as exc:
        raise ValueError(f"no JAX {platform} device is available ({exc}); "
                         f"available: {sorted({d.platform for d in jax.devices()})}") from exc
    every = sorted(every, key=lambda d: (d.process_index, d.id))
    if jax.process_count() > 1:
        if num_devices not in (None, len(every)):
            raise ValueError(f"num_devices={num_devices} is invalid in a {jax.process_count()}-process job: the mesh "
                             f"spans every process's devices ({len(every)}); pass None")
        return every
    if num_devices is None:
        return every
    if num_devices < 1:
        raise ValueError(f"world_size={num_devices} is invalid: use at least one device")
    if num_devices > len(every):
        raise ValueError(
            f"world_size={num_devices} exceeds the {len(every)} {every[0].platform} device(s) available; on a CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} (set before JAX starts) emulates more"
        )
    return every[:num_devices]


def data_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis mesh ``("data",)`` over ``devices``."""
    return Mesh(np.asarray(devices, dtype=object), (DATA_AXIS,))


def local_mesh(mesh: Mesh) -> Mesh:
    """The mesh of this process's devices of ``mesh`` (the whole mesh in one process)."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return mesh if len(mine) == mesh.devices.size else data_mesh(mine)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (parameters, optimiser state, scalars)."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Rows split over the ``data`` axis (global batches)."""
    return NamedSharding(mesh, P(DATA_AXIS))


# --------------------------------------------------------------------------- placement


def put_replicated(tree: Any, mesh: Mesh) -> Any:
    """Place a pytree of host or device arrays replicated on ``mesh`` (every process passes the same
    values). Works across processes: each process fills its own devices."""
    sharding = replicated(mesh)

    def put(x: Any) -> jax.Array:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree_util.tree_map(put, tree)


def put_batch(local: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows ``local [b, ...]`` of a global batch, as the global array sharded over the
    ``data`` axis (``b`` times the number of processes rows)."""
    sharding = batch_sharded(mesh)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def to_mesh(tree: Any, mesh: Mesh) -> Any:
    """A pytree of replicated arrays re-expressed as replicated on ``mesh`` (this process's devices of
    their mesh, e.g. :func:`local_mesh`), reusing the device buffers: a computation on the result
    involves this process alone. Arrays already laid out that way are returned as they are."""
    sharding = replicated(mesh)
    wanted = set(mesh.devices.flat)

    def move(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.sharding == sharding:
            return x
        shards = [s.data for s in x.addressable_shards if s.device in wanted]
        if len(shards) != len(wanted):
            return jax.device_put(first_replica(x), sharding)
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

    return jax.tree_util.tree_map(move, tree)


def host_local(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded array (all of it in one process), as NumPy."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    seen, parts = set(), []
    for s in shards:
        start = s.index[0].start or 0
        if start not in seen:  # a row block replicated on several local devices counts once
            seen.add(start)
            parts.append(np.asarray(s.data))
    return np.concatenate(parts, axis=0)


def first_replica(x: jax.Array) -> np.ndarray:
    """A replicated array's value as NumPy (this process's first copy; no cross-host transfer)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


# --------------------------------------------------------------------------- host collectives


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise float64 sum of ``values`` over processes (identity alone).

    The values travel as their float64 bit patterns (two uint32 words each), because a float64 array
    handed to JAX without ``jax_enable_x64`` would be rounded to float32; the sum is then taken on the
    host in process order, so every process gets the same bits.
    """
    vals = np.asarray([float(v) for v in values], dtype=np.float64)
    if jax.process_count() == 1:
        return vals.tolist()
    words = vals.view(np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(words, tiled=False))
    per_process = np.ascontiguousarray(gathered.reshape(jax.process_count(), -1)).view(np.float64)
    total = np.zeros_like(vals)
    for row in per_process:
        total += row
    return total.tolist()


def barrier(name: str = "pcaf_barrier") -> None:
    """Wait until every process arrives (no-op alone)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
