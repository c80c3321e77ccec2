"""glibc malloc settings for CPU training processes.

A full-AR training step allocates and frees several tensors of tens to hundreds of MB (the ``[B·T, V]``
logits and their gradient). glibc serves blocks that large with ``mmap`` and returns them with
``munmap`` on free, so every step page-faults its largest tensors in afresh and the kernel zeroes them:
on the project's 2-core CPU that was about 40% of a cpu-scale training step (295 against 183 ms).
Keeping freed memory in the heap (no mmap, no trim) and backing it with transparent huge pages removes that cost
(``make bench-train-step`` measures it). The settings only change where memory comes from, never a
computed value.

``GLIBC_TUNABLES`` is read once, when a process starts, so the entry points
(``python -m experiments.run`` / ``experiments.reproduce``) re-execute themselves with it set when it is
missing; the Makefile exports it for everything it starts. ``PCAF_KEEP_MALLOC=1`` opts out.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295:"
            "glibc.malloc.hugetlb=1")
OPT_OUT = "PCAF_KEEP_MALLOC"
_REEXECUTED = "PCAF_MALLOC_REEXEC"  # set in the child: never re-execute twice


def applies() -> bool:
    """Whether this process runs on glibc Linux and the user has not opted out."""
    return (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
            and os.environ.get(OPT_OUT, "") not in ("1", "true", "yes"))


def active() -> bool:
    """Whether this process started with the suite's settings in ``GLIBC_TUNABLES``."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    return all(item in current.split(":") for item in TUNABLES.split(":"))


def describe() -> str:
    """A label for run records: the tunables in effect, or why there are none."""
    if active():
        return os.environ["GLIBC_TUNABLES"]
    return "default (opted out)" if os.environ.get(OPT_OUT) else "default"


def ensure_tunables() -> None:
    """Re-execute the current command with ``GLIBC_TUNABLES`` extended by :data:`TUNABLES`, unless the
    settings are active, do not apply, or a re-execution already happened. Call it first thing in a
    ``__main__`` block, never from library code: it replaces the running process."""
    if not applies() or active() or os.environ.get(_REEXECUTED):
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES", ""), TUNABLES]))
    env[_REEXECUTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
