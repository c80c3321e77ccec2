"""Checkpoint directories: layout, the loop's own state, the file manifest, writing and finding them.

``<run_dir>/checkpoints/step_<N>/`` holds the backend's files (weights, optimiser, RNG; any layout,
subdirectories included) and ``loop_state.json``: the loop's state plus a manifest (size and sha256)
of every other file in the directory. A checkpoint is written under ``.tmp_step_<N>``, fsynced,
manifested and renamed into place; only then does ``checkpoints/latest`` move. A directory whose
manifest does not match its files is never used, and never deleted either: the loop moves checkpoints it
cannot use to ``<run_dir>/checkpoints_set_aside/<UTC time>/`` (:func:`set_aside`) and says so in the run
record. A checkpoint write that fails (a full disk, a signal) removes its ``.tmp_step_<N>`` directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from pcaf_core import results
from pcaf_core.fsutil import atomic_write_text, disk_full_error, fsync_path

log = logging.getLogger("pcaf.checkpoints")

CHECKPOINT_DIR = "checkpoints"
SET_ASIDE_DIR = "checkpoints_set_aside"
LATEST_FILE = "latest"
LOOP_STATE_FILE = "loop_state.json"
LOOP_STATE_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (wrong config, unreadable, incomplete). The message says what to do."""


class RunRefused(CheckpointError):
    """The run directory cannot be continued as asked (its checkpoints are all damaged, or were written for
    another config). Raised before anything in the directory is changed: its record keeps what it said."""


@dataclass
class LoopState:
    """Everything the loop itself needs to resume bit-exactly (the backend saves the rest)."""

    step: int = 0
    train_sampler: dict[str, Any] = field(default_factory=dict)
    eval_sampler: dict[str, Any] = field(default_factory=dict)
    best: dict[str, Any] | None = None  # EvalResult.as_dict() of the best reference evaluation
    final: dict[str, Any] | None = None  # the latest reference evaluation
    curve: list[dict[str, Any]] = field(default_factory=list)
    pending_loss_sum: float = 0.0  # training losses since the last curve row
    pending_loss_count: int = 0
    timed_steps: int = 0  # steps in the throughput measurement
    timed_seconds: float = 0.0
    train_seconds: float = 0.0  # every train step, warm-up included
    elapsed_seconds: float = 0.0  # wall time of the previous process segments
    segments: int = 0  # process segments that ran this training (1 + resumes)
    deviations: list[str] = field(default_factory=list)  # settings changed on resume (e.g. a lower train.lr)
    incidents: list[dict[str, Any]] = field(default_factory=list)  # checkpoints set aside, restarts: what, when
    config_hash: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    backend: str = ""  # the backend that wrote the state ("" in checkpoints from before this field)
    checkpoint_format: str = ""  # what the backend's files are (Backend.checkpoint_format)
    shared_machine: dict[str, Any] = field(default_factory=dict)  # pcaf_core.contention's tally of the timed steps
    version: int = LOOP_STATE_VERSION


# --------------------------------------------------------------------------- JSON


def to_jsonable(value: Any) -> Any:
    """Sampler states may hold NumPy scalars or arrays; JSON them losslessly and tag arrays."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def from_jsonable(value: Any) -> Any:
    """Inverse of :func:`to_jsonable`."""
    if isinstance(value, dict):
        if set(value) == {"__ndarray__", "dtype"}:
            return np.asarray(value["__ndarray__"], dtype=value["dtype"])
        return {k: from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value


def dump_json(data: Any) -> str:
    # Python's float repr round-trips exactly, so losses and timings come back bit-identical.
    return json.dumps(results._encode_nonfinite(to_jsonable(data)), indent=1, allow_nan=False)


def load_json(text: str) -> Any:
    return results._decode_nonfinite(json.loads(text))


# --------------------------------------------------------------------------- manifest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _backend_files(directory: Path) -> list[Path]:
    """Every regular file under ``directory`` except the loop state, relative paths sorted."""
    return sorted(p.relative_to(directory) for p in directory.rglob("*")
                  if p.is_file() and p.name != LOOP_STATE_FILE)


def manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """``relative path -> {bytes, sha256}`` of the backend's files, each fsynced first."""
    out = {}
    for rel in _backend_files(directory):
        f = directory / rel
        fsync_path(f)
        out[rel.as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def checkpoint_root(run_dir: Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINT_DIR


def step_of(path: Path) -> int | None:
    """N of a ``step_<N>`` directory, None for any other name."""
    name = path.name
    if not name.startswith("step_"):
        return None
    try:
        return int(name[len("step_"):])
    except ValueError:
        return None


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be used, or None when it is complete."""
    state_file = path / LOOP_STATE_FILE
    if not state_file.is_file():
        return f"{state_file} is missing (the checkpoint was not finished)"
    try:
        data = load_json(state_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return f"{state_file} is unreadable ({exc})"
    files = data.get("files")
    if not isinstance(files, dict):
        return f"{state_file} has no file manifest"
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != entry.get("bytes"):
            return f"{f} has {f.stat().st_size} bytes, the manifest says {entry.get('bytes')}"
        if sha256_file(f) != entry.get("sha256"):
            return f"{f} does not match its sha256 in the manifest"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of ``run_dir`` (complete or not), newest step first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def partial_checkpoints(run_dir: Path) -> list[Path]:
    """Leftovers of checkpoint writes that never finished (``.tmp_step_<N>``, ``.old_step_<N>``)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith((".tmp_step_", ".old_step_")))


def set_aside(run_dir: Path, paths: list[Path]) -> Path:
    """Move ``paths`` (checkpoint directories, a curve) into ``<run_dir>/checkpoints_set_aside/<UTC time>/``
    and return that folder: what the loop cannot use is kept for inspection, never deleted."""
    dest = Path(run_dir) / SET_ASIDE_DIR / datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    dest.mkdir(parents=True, exist_ok=False)
    for p in paths:
        os.replace(p, dest / p.name)
    fsync_path(dest)
    return dest


def newest_step(run_dir: Path) -> int:
    """The step the newest checkpoint of ``run_dir`` claims (``latest``, else the highest ``step_<N>``), 0
    when there is none. Cheap (nothing is hashed): for messages; the loop verifies before it resumes."""
    pointer = checkpoint_root(run_dir) / LATEST_FILE
    try:
        step = step_of(Path(pointer.read_text(encoding="utf-8").strip()))
    except OSError:
        step = None
    if step is None:
        found = list_checkpoints(run_dir)
        step = step_of(found[0]) if found else 0
    return int(step or 0)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``: the one ``checkpoints/latest`` names when it is
    complete, otherwise the highest-step complete one (a crash can leave the pointer behind or a
    directory half-written). None when there is none."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        problem = checkpoint_problem(named)
        if problem is None:
            return named
        log.warning("checkpoints/latest points at an unusable checkpoint: %s; scanning for another", problem)
    for path in list_checkpoints(run_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


# Files that only one backend's checkpoints hold: how the backend of a checkpoint written before LoopState
# named it is told (backends/torch/checkpoint.py, backends/jax/checkpoint.py).
_BACKEND_FILES = {"optimizer.pt": "torch", "optimizer.safetensors": "jax"}


def checkpoint_backend(path: Path) -> tuple[str, str]:
    """``(backend, format)`` of the checkpoint directory ``path``: as its loop state names them, or, for a
    checkpoint from before they were named, the backend its files belong to (format ``""``); ``("", "")``
    when neither tells."""
    try:
        data = load_json((Path(path) / LOOP_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", ""
    if data.get("backend"):
        return str(data["backend"]), str(data.get("checkpoint_format") or "")
    names = {Path(name).name for name in (data.get("files") or {})}
    found = {_BACKEND_FILES[n] for n in names if n in _BACKEND_FILES}
    return (found.pop(), "") if len(found) == 1 else ("", "")


def read_loop_state(path: Path) -> LoopState:
    """The loop state stored in checkpoint directory ``path``."""
    data = load_json((path / LOOP_STATE_FILE).read_text(encoding="utf-8"))
    if data.get("version") != LOOP_STATE_VERSION:
        raise CheckpointError(
            f"{path / LOOP_STATE_FILE} has loop-state version {data.get('version')!r}, this code reads "
            f"{LOOP_STATE_VERSION}; run it with the code version that wrote it, or start a new run directory"
        )
    data.pop("files", None)
    data["train_sampler"] = from_jsonable(data.get("train_sampler", {}))
    data["eval_sampler"] = from_jsonable(data.get("eval_sampler", {}))
    names = {f.name for f in dataclasses.fields(LoopState)}
    return LoopState(**{k: v for k, v in data.items() if k in names})


# --------------------------------------------------------------------------- writing


def write_checkpoint(
    run_dir: Path,
    step: int,
    *,
    is_main: bool,
    barrier: Callable[[], None],
    save_backend: Callable[[Path], None],
    loop_payload: Callable[[], dict[str, Any]],
    keep: int,
) -> Path:
    """Write ``checkpoints/step_<step>`` and move ``latest`` to it; returns the directory.

    Every rank calls this: ``save_backend(tmp_dir)`` writes the backend's files (each rank its share);
    the main rank then manifests them, writes ``loop_payload()`` as the loop state, renames the directory
    into place, moves the pointer and prunes all but the ``keep`` newest checkpoints.

    Any failure before the rename (a full disk, a signal) removes the partial ``.tmp_step_<step>`` and
    re-raises; a full disk is raised as :class:`pcaf_core.fsutil.DiskFullError` naming the file.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    try:
        if is_main:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        barrier()
        save_backend(tmp)
        barrier()
        if is_main:
            payload = loop_payload()
            payload["files"] = manifest(tmp)
            atomic_write_text(tmp / LOOP_STATE_FILE, dump_json(payload))
    except BaseException as exc:
        # What was written so far cannot be used: remove it (it may be what filled the disk).
        full = disk_full_error(_newest_file(tmp) or tmp, exc)
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None and full is not exc:
            raise full from exc
        raise
    if is_main:
        if final.exists():  # a resumed run passes the same step again
            trash = root / f".old_step_{step}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_path(root)
        # The pointer moves only once the directory is complete and in place.
        atomic_write_text(root / LATEST_FILE, final.name + "\n")
        for path in list_checkpoints(run_dir)[max(1, keep):]:
            if path != final:
                shutil.rmtree(path, ignore_errors=True)
    barrier()
    return final


def _newest_file(directory: Path) -> Path | None:
    """The most recently modified file under ``directory`` (the one a failed write was writing)."""
    try:
        files = [p for p in directory.rglob("*") if p.is_file()]
    except OSError:
        return None
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)


def loop_state_payload(ls: LoopState, **updates: Any) -> dict[str, Any]:
    """``asdict(ls)`` with ``updates`` applied (the caller's fresh sampler states and wall time)."""
    payload = asdict(ls)
    payload.update(updates)
    return payload
