"""Other training processes on the machine while a run's throughput is timed.

Tokens/s measured while another training shares the cores is not the machine's speed. The loop samples the
process table a few times during its timed steps (the first timed step of each process segment, then at most
once every :data:`SAMPLE_EVERY_S` seconds, and the last step) and keeps a tally in its checkpointed state; the
record carries it as ``extra.shared_machine`` and ``paper_tables`` marks the row's tokens/s as "measured
while sharing the machine" when any sample saw another one.

A training process is one whose command line runs one of :data:`TRAINING_MODULES` (as ``-m`` module, as an
argument of a wrapper, or as the module's script) or a ``benchmarks.bench_*`` module. This run's own
processes are left out: its ancestors (``make``, the table driver that launched it) and, under data
parallelism, its sibling ranks (``torchrun`` starts every rank from one parent; ``mp.spawn`` workers run no
such command line). Linux: a scan of ``/proc`` (a few milliseconds); elsewhere ``ps``; where neither works the
tally says ``method: unavailable``.

NumPy/stdlib only.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

TRAINING_MODULES = ("experiments.run", "experiments.reproduce", "experiments.step_cost", "backends.torch.train",
                    "backends.torch.train_ddp", "backends.jax.train",
                    "submitit.core._submit")  # a sweep's or table's job (docs/EXPERIMENTS.md, "On a cluster")
SAMPLE_EVERY_S = 20.0
MAX_LISTED = 5


def _is_training(argv: list[str]) -> bool:
    for arg in argv:
        if arg in TRAINING_MODULES or arg.startswith("benchmarks.bench_"):
            return True
        if arg.endswith(".py"):
            module = arg[:-3].replace(os.sep, ".")
            if any(module.endswith(m) for m in TRAINING_MODULES) or ".benchmarks.bench_" in f".{module}":
                return True
    return False


def _proc_table() -> dict[int, tuple[int, list[str]]] | None:
    """``pid -> (ppid, argv)`` from ``/proc``; None where there is no ``/proc``."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    table = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            stat = (proc / entry.name / "stat").read_text()
            argv = (proc / entry.name / "cmdline").read_bytes().split(b"\0")
        except OSError:  # the process ended while the table was read
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        table[int(entry.name)] = (ppid, [a.decode("utf-8", "replace") for a in argv if a])
    return table


def _ps_table() -> dict[int, tuple[int, list[str]]] | None:
    """``pid -> (ppid, argv)`` from ``ps`` (arguments split on spaces); None when ``ps`` fails."""
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "args="], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    table = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), parts[2:])
    return table


def _chain(pid: int, table: dict[int, tuple[int, list[str]]]) -> list[int]:
    """``pid``'s ancestors, nearest first."""
    out, seen = [], {pid}
    while pid in table and table[pid][0] not in seen and table[pid][0] > 0:
        pid = table[pid][0]
        seen.add(pid)
        out.append(pid)
    return out


def other_training_processes(exclude_siblings: bool = False) -> tuple[str, list[str]]:
    """``(method, ["pid N: command", ...])``: the training processes outside this process's own tree
    (method ``proc``, ``ps`` or ``unavailable``, with an empty list)."""
    method, table = "proc", _proc_table()
    if table is None:
        method, table = "ps", _ps_table()
    if table is None:
        return "unavailable", []
    me = os.getpid()
    ancestors = _chain(me, table)
    mine = {me, *ancestors}
    parent = ancestors[0] if ancestors else None
    found = []
    for pid, (_, argv) in sorted(table.items()):
        if pid in mine or not _is_training(argv):
            continue
        if exclude_siblings and parent is not None and parent in _chain(pid, table):
            continue  # a sibling rank of this data-parallel run
        found.append(f"pid {pid}: {' '.join(argv)[:160]}")
    return method, found


class ContentionSampler:
    """Adds samples to ``tally`` (a dict kept in the loop's state: ``method``, ``samples``,
    ``shared_samples``, ``others``), at most once every ``every_s`` seconds unless forced."""

    def __init__(self, tally: dict[str, Any], *, exclude_siblings: bool = False, every_s: float = SAMPLE_EVERY_S):
        self.tally = tally
        self.exclude_siblings = exclude_siblings
        self.every_s = every_s
        self._last = -float("inf")

    def sample(self, force: bool = False) -> None:
        """Sample now when forced or when ``every_s`` has passed since the last sample."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        method, others = other_training_processes(self.exclude_siblings)
        t = self.tally
        t["method"] = method
        t["samples"] = int(t.get("samples", 0)) + 1
        if others:
            t["shared_samples"] = int(t.get("shared_samples", 0)) + 1
            listed = list(t.get("others", []))
            listed += [o for o in others if o not in listed]
            t["others"] = listed[:MAX_LISTED]
        else:
            t.setdefault("shared_samples", 0)
            t.setdefault("others", [])


def shared(tally: dict[str, Any] | None) -> bool:
    """True when a tally saw another training process in any sample."""
    return bool(tally) and int(tally.get("shared_samples", 0)) > 0


def describe(tally: dict[str, Any] | None) -> str:
    """One line: how many samples of the timed steps saw other training processes, and which."""
    if not tally or not tally.get("samples"):
        return "not checked"
    if tally.get("method") == "unavailable":
        return "not checked (no process list on this platform)"
    text = (f"{tally.get('shared_samples', 0)} of {tally['samples']} samples of the timed steps saw other training "
            "processes")
    return text + (f" ({'; '.join(tally.get('others', []))})" if tally.get("others") else "")
