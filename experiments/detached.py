"""A command that outlives the shell that started it, and the small files it leaves, collected while it runs.

A GPU machine reached through commands of limited length (a job step, a remote shell that ends its processes
when it returns) can hold a run longer than one command: the run starts in its own process session
(:func:`detach`), so the end of the command that started it does not end it, and each later command waits for it
a while and takes what it has written so far (:func:`collect`). The run's folder ``out`` holds:

- ``driver.json``: the run's state, written atomically by the run itself (:func:`mark`): ``{"state": "running" |
  "ended", "pid", "argv", "started", "ended", "exit"}``, times as UTC ISO-8601;
- ``driver.log``: everything the run prints (standard output and error);
- whatever the run writes (``experiments.gpu_paper_rows``: ``records.tar.gz``, ``compile_cache.tar.gz``,
  ``step_cost/<table>.csv``).

A run killed by a signal cannot say so: its state stays ``running`` with a process that no longer exists, which
:func:`state` reports as ``lost``. Standard library only: this runs before the machine's Python path is set.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

STATE_FILE = "driver.json"
LOG_FILE = "driver.log"
COLLECTED_GLOBS = ("*", "step_cost/*.csv")
"""What :func:`collect` copies, relative to ``out``: its plain top-level files and the step costs (one folder
down), never the runs themselves (checkpoints)."""
POLL_S = 5.0
"""How often :func:`collect` looks at the run's state while it waits."""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write_json(path: Path, payload: dict) -> None:
    """``payload`` to ``path`` atomically (a temporary file renamed over it): a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1)
    os.replace(tmp, path)


def read_state(out: Path) -> dict | None:
    """``out/driver.json``, or None where no run has written one."""
    try:
        return json.loads((out / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    # A child of this process that has exited but is not yet reaped still answers: reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


def state(out: Path) -> str:
    """``none`` (no state file), ``running``, ``ended`` or ``lost`` (``running`` written, its process gone: killed
    by a signal, or its machine restarted)."""
    recorded = read_state(out)
    if recorded is None:
        return "none"
    if recorded["state"] == "running" and not _alive(int(recorded["pid"])):
        return "lost"
    return recorded["state"]


def mark(out: Path, argv: list[str], exit_code: int | None = None, started: str | None = None,
         pid: int | None = None) -> str:
    """Write the state of process ``pid`` (default: this one) to ``out/driver.json``: running (``exit_code`` None)
    or ended with ``exit_code``. Returns the start time written (pass it back when marking the end)."""
    started = started or _now()
    payload = {"state": "running" if exit_code is None else "ended", "pid": pid or os.getpid(), "argv": argv,
               "started": started}
    if exit_code is not None:
        payload |= {"ended": _now(), "exit": exit_code}
    _write_json(out / STATE_FILE, payload)
    return started


def detach(module: str, argv: list[str], out: Path, cwd: Path, env: dict[str, str] | None = None) -> int:
    """Start ``python -m module *argv`` in a new process session (it survives the end of this command and its
    shell), standard input closed and its output to ``out/driver.log``; returns its pid. Refused with one line
    while a run recorded in ``out`` is still running."""
    if state(out) == "running":
        pid = read_state(out)["pid"]
        raise SystemExit(f"a run is already going in {out} (pid {pid}, log {out / LOG_FILE}): wait for it with "
                         f"--collect, or give another --out")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOG_FILE, "ab") as log:  # appended: an earlier run's lines stay, below a line naming this one
        log.write(f"[detached] {_now()}: python -m {module} {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # Running from now, before the run says so itself: a collect in between must not read an earlier run's end.
    mark(out, argv, pid=proc.pid)
    return proc.pid


def collect(out: Path, dest: Path, wait_s: float, tail: int = 20, poll_s: float = POLL_S) -> tuple[str, int]:
    """Wait until the run recorded in ``out`` is no longer running, or ``wait_s`` seconds have passed; then copy
    :data:`COLLECTED_GLOBS` of ``out`` into ``dest`` (the same paths under it) and print the run's state, the
    files copied and the last ``tail`` lines of its log. Returns (state, exit status): the run's own exit where it
    ended, 0 while it is still running, 1 where it was lost or never started."""
    deadline = time.monotonic() + wait_s
    while state(out) == "running" and time.monotonic() < deadline:
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
    now = state(out)
    copied = []
    if out.resolve() != dest.resolve():
        for pattern in COLLECTED_GLOBS:
            for src in sorted(out.glob(pattern)):
                if src.is_file() and not src.is_symlink() and not src.name.startswith("."):
                    target = dest / src.relative_to(out)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
                    copied.append(target.relative_to(dest).as_posix())
    recorded = read_state(out) or {}
    log = out / LOG_FILE
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []
    for line in lines[-tail:]:
        print(f"  | {line}")
    said = {"running": f"still running (pid {recorded.get('pid')}, since {recorded.get('started')}): collect again",
            "ended": f"ended {recorded.get('ended')} with exit {recorded.get('exit')}",
            "lost": f"lost: pid {recorded.get('pid')} is gone without recording its end (killed, or its machine "
                    "restarted); its finished rows are in what was copied",
            "none": f"no run has started in {out} (no {STATE_FILE})"}[now]
    print(f"[detached] {out}: {said}; copied to {dest}: {', '.join(copied) or 'nothing'}", flush=True)
    code = {"running": 0, "ended": int(recorded.get("exit", 1)), "lost": 1, "none": 1}[now]
    return now, code
