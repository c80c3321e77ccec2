"""File-system helpers for the whole project: atomic writes, fsync, inter-process locks, full disks.

Every file the suite writes that a reader may open while it is being replaced (run records, curves,
checkpoints' loop state, weights, token caches, configs) goes through :func:`atomic_write_bytes`,
:func:`atomic_write_text` or :func:`atomic_path`: the new content is written to a temporary file in
the same directory, flushed to stable storage and renamed over the target, so a reader sees either
the old file or the complete new one, and a failure (a full disk, a signal) removes the temporary
and leaves the old file untouched. New files are mode 0644 like any other output.

A write that fails because the file system is full raises :class:`DiskFullError`, whose message names
the path, the bytes the write needed (when known) and the bytes free, instead of a bare ``OSError``.

:func:`file_lock` is the one inter-process lock (``flock``): run directories, token caches and
unpacked archives are all serialised with it. The kernel releases it when its process exits, however
it exits, so a crashed or killed holder never leaves it taken.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: writes stay atomic, only concurrent writers are not serialised
    fcntl = None  # type: ignore[assignment]

FILE_MODE = 0o644
LOW_SPACE_BYTES = 1 << 20
"""A write that fails while less than this is free on its file system is reported as a full disk."""

_DISK_FULL_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_FSYNC_FATAL_ERRNOS = (*_DISK_FULL_ERRNOS, errno.EIO)


# --------------------------------------------------------------------------- full disks


class DiskFullError(OSError):
    """A write failed for lack of space. ``str()`` is one line: the path, the bytes needed (when known),
    the bytes free, and what to do."""

    def __init__(self, path: str | os.PathLike[str], needed: int | None = None, free: int | None = None, *,
                 doing: str = "writing", cause: str = "") -> None:
        self.path, self.needed, self.free = Path(path), needed, free
        sizes = [f"about {needed:,} bytes needed" if needed is not None else "",
                 f"{free:,} bytes free on that file system" if free is not None else ""]
        detail = "; ".join(s for s in sizes if s)
        self.message = (f"no space left on device {doing} {self.path}" + (f" ({detail})" if detail else "")
                        + (f" [{cause}]" if cause else "") + ": free space there, then run the command again")
        super().__init__(errno.ENOSPC, self.message, str(self.path))

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # picklable across processes (DDP workers) with its message
        return (_rebuild_disk_full, (str(self.path), self.needed, self.free, self.message))


def _rebuild_disk_full(path: str, needed: int | None, free: int | None, message: str) -> DiskFullError:
    exc = DiskFullError(path, needed, free)
    exc.message = message
    return exc


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free on the file system holding ``path`` (its nearest existing parent); None if unknown."""
    p = Path(path)
    for candidate in (p, *p.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def is_disk_full(exc: BaseException) -> bool:
    """True for an ``OSError`` that says the file system (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS


def disk_full_error(path: str | os.PathLike[str], exc: BaseException, needed: int | None = None, *,
                    doing: str = "writing") -> DiskFullError | None:
    """The :class:`DiskFullError` a failed write of ``path`` amounts to, or None when ``exc`` is something
    else. Writers outside Python's ``OSError`` (torch's file writer, safetensors) report a full disk as a
    generic error, so any failure while less than :data:`LOW_SPACE_BYTES` is free counts as one too."""
    if isinstance(exc, DiskFullError):
        return exc
    if not isinstance(exc, Exception):
        return None
    free = free_bytes(path)
    if is_disk_full(exc):
        return DiskFullError(path, needed, free, doing=doing)
    if free is not None and free < LOW_SPACE_BYTES:
        return DiskFullError(path, needed, free, doing=doing,
                             cause=" ".join(f"{type(exc).__name__}: {exc}".split())[:200])
    return None


# --------------------------------------------------------------------------- locks

_HELD: dict[str, int] = {}  # resolved lock path -> nesting depth in this process


def _holder_text(fh) -> str:
    try:
        fh.seek(0)
        info = json.loads(fh.read() or "{}")
    except (OSError, ValueError):
        return "another process"
    if not isinstance(info, dict) or "pid" not in info:
        return "another process"
    return (f"process {info.get('pid')} on {info.get('host', '?')} since {info.get('since', '?')}"
            + (f" ({info['command']})" if info.get("command") else ""))


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], *, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the ``with`` block.

    When another process holds it, ``on_wait`` (e.g. ``print``) is called once with who holds it, and the
    call blocks until it is free. The holder writes its pid, host, start time and command into the file
    for that message. Re-entrant within a process (``flock`` locks belong to an open file, so a second
    open in the same process would wait for itself). The OS releases the lock when the process exits
    however it exits, so a crashed holder never leaves it taken.
    """
    path = Path(path)
    key = str(path.resolve())
    if _HELD.get(key):
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait(_holder_text(fh))
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            with contextlib.suppress(OSError):  # the holder's note is informative only
                fh.seek(0)
                fh.truncate()
                fh.write(json.dumps({"pid": os.getpid(), "host": platform.node(),
                                     "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     "command": " ".join(sys.argv)[:300]}))
                fh.flush()
            _HELD[key] = 1
            yield
        finally:
            _HELD.pop(key, None)
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- atomic writes


def fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage.

    Best effort where the file system refuses (directories on some file systems); a full disk or an I/O
    error while flushing a file is raised, since the file's data may not have reached the disk."""
    path = Path(path)
    is_dir = path.is_dir()
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if not is_dir and exc.errno in _FSYNC_FATAL_ERRNOS:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, size_hint: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that needs a file name (safetensors, NumPy);
    on a clean exit the file is fsynced, made 0644 and renamed over ``path``; on any exception it is
    removed and ``path`` is left as it was. A failure for lack of space is raised as
    :class:`DiskFullError` (``size_hint``: the bytes the file needs, for its message)."""
    path = Path(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        full = disk_full_error(path, exc, size_hint)
        if full is not None:
            raise full from exc
        raise
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        full = disk_full_error(path, exc, size_hint)
        if full is not None and full is not exc:
            raise full from exc
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_path(path, size_hint=len(data)) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
