"""File-system helpers for the whole project: atomic writes, fsync, an inter-process lock.

Every file the suite writes that a reader may open while it is being replaced (run records, curves,
checkpoints' loop state, weights, token caches, configs) goes through :func:`atomic_write_bytes`,
:func:`atomic_write_text` or :func:`atomic_path`: the new content is written to a temporary file in
the same directory, flushed to stable storage and renamed over the target, so a reader sees either
the old file or the complete new one, and a failure (a full disk, a signal) removes the temporary
and leaves the old file untouched. New files are mode 0644 like any other output.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: writes stay atomic, only concurrent writers are not serialised
    fcntl = None  # type: ignore[assignment]

FILE_MODE = 0o644


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the ``with`` block.

    The OS releases the lock when the process exits however it exits, so a crashed holder never
    leaves it taken.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage (best effort where the file system refuses)."""
    path = Path(path)
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that needs a file name (safetensors, NumPy);
    on a clean exit the file is fsynced, made 0644 and renamed over ``path``; on any exception it is
    removed and ``path`` is left as it was."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
