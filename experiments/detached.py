"""A command that outlives the shell that started it, and its small files, collected while it runs.

A GPU machine reached through commands of limited length (a job step, a remote shell that ends its processes
when it returns) can hold a run longer than one command: ``start`` runs the command under a small supervisor in
its own process session, so the end of the command that started it does not end it, and each later command
waits for it a while and takes what it has written so far (``collect``)::

    python3 -m experiments.detached start --out gpu_out -- python3 -m experiments.gpu_paper_rows --out gpu_out ROW ...
    python3 -m experiments.detached collect --out gpu_out --dest DEST --wait-s 560 [--pack bench/cuda ...]

The folder ``out`` holds:

- ``driver.json``: the run's state, written atomically by its supervisor (:func:`mark`): ``{"state": "running" |
  "ended", "pid" (the supervisor's), "argv", "started", "ended", "exit"}``, times as UTC ISO-8601;
- ``driver.log``: everything the command prints (standard output and error), after a line naming it;
- whatever the command writes there (``experiments.gpu_paper_rows``: ``records.tar.gz``,
  ``compile_cache.tar.gz``, ``step_cost/<table>.csv``).

``collect`` waits up to ``--wait-s`` seconds for the run to end, then copies ``out``'s plain top-level files and
``step_cost/*.csv`` into ``DEST``, packs each ``--pack`` folder or file (paths relative to the working directory,
e.g. a benchmark's output folder) into ``DEST/packed.tar.gz``, and prints the log's last lines and the run's
state: running, ended (``collect`` exits with the command's status), or lost (exit 1: the supervisor is gone
without recording an end, killed with ``SIGKILL`` or with its machine). ``SIGTERM`` or ``SIGINT`` to the
supervisor reaches the command's whole process group (a training run then saves its checkpoint and leaves an
interrupted record) and is recorded as the command's exit. Standard library only: this runs before a machine's
Python path is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

STATE_FILE = "driver.json"
LOG_FILE = "driver.log"
PACKED = "packed.tar.gz"
COLLECTED_GLOBS = ("*", "step_cost/*.csv")
"""What ``collect`` copies, relative to ``out``: its plain top-level files and the step costs (one folder down),
never the runs themselves (checkpoints)."""
POLL_S = 1.0
"""How often ``collect`` looks at the run's state while it waits."""


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
    """``none`` (no state file), ``running``, ``ended`` or ``lost`` (``running`` written, its supervisor gone)."""
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


def start(cmd: list[str], out: Path, cwd: Path | None = None) -> int:
    """Start ``cmd`` under :func:`supervise` in a new process session (it survives the end of this command and
    its shell), standard input closed, its output appended to ``out/driver.log``; returns the supervisor's pid.
    Refused with one line while a run recorded in ``out`` is still running."""
    if not cmd:
        raise SystemExit("no command to start: give it after --, e.g. start --out gpu_out -- python3 -m ...")
    if state(out) == "running":
        pid = read_state(out)["pid"]
        raise SystemExit(f"a run is already going in {out} (pid {pid}, log {out / LOG_FILE}): wait for it with "
                         f"collect, or give another --out")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOG_FILE, "ab") as log:  # appended: an earlier run's lines stay, above a line naming this one
        log.write(f"[detached] {_now()}: {shlex.join(cmd)}\n".encode())
        log.flush()
        # This file by its path: it needs only the standard library, whatever the working directory is.
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "supervise", "--out", str(out), "--",
                                 *cmd], cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    # Running from now, before the supervisor says so itself: a collect in between must not read an earlier end.
    mark(out, cmd, pid=proc.pid)
    return proc.pid


def supervise(cmd: list[str], out: Path) -> int:
    """Run ``cmd`` (this process's output is the log), recording its start and its exit in ``out/driver.json``;
    ``SIGTERM`` and ``SIGINT`` are passed to the command's whole process group (this process leads it) and the
    command's own exit is recorded. Returns that exit status (128 + the signal's number where a signal ended it)."""
    proc = None

    def forward(signum, frame):  # to every process of the group :func:`start` made, so a training run checkpoints
        if os.getpgrp() == os.getpid():
            signal.signal(signum, signal.SIG_IGN)
            os.killpg(os.getpgrp(), signum)
        elif proc is not None:  # run by hand inside another group: the command alone
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):  # before the command starts: no signal finds it unforwarded
        signal.signal(sig, forward)
    started = mark(out, cmd)
    code = 1
    try:
        proc = subprocess.Popen(cmd)
        rc = proc.wait()
        code = 128 - rc if rc < 0 else rc
    except OSError as exc:  # the command could not start: said in the log, recorded as exit 127
        print(f"[detached] cannot start {shlex.join(cmd)}: {exc}", flush=True)
        code = 127
    finally:
        mark(out, cmd, code, started)
    return code


def write_tar(files: list[Path], root: Path, archive: Path) -> None:
    """``files`` (paths under ``root``) into the gzipped tar ``archive`` under their paths relative to ``root``,
    written atomically (a temporary file renamed over it: a copy taken meanwhile is the previous archive, whole)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{archive.name}.", dir=archive.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f.relative_to(root).as_posix())
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pack(paths: list[str], archive: Path) -> int:
    """Every plain file under ``paths`` (folders or files, relative to the working directory) into the gzipped tar
    ``archive`` under the same relative paths, written atomically; returns the number of files. A path that does
    not exist (yet) is left out."""
    files = []
    for p in map(Path, paths):
        if p.is_absolute() or ".." in p.parts:
            raise SystemExit(f"--pack {p}: give a path under the working directory, relative to it")
        files += [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    write_tar(files, Path("."), archive)
    return len(files)


def collect(out: Path, dest: Path, wait_s: float, packed: list[str] = (), tail: int = 20,
            poll_s: float = POLL_S) -> tuple[str, int]:
    """Wait until the run recorded in ``out`` is no longer running, or ``wait_s`` seconds have passed; copy
    :data:`COLLECTED_GLOBS` of ``out`` into ``dest`` (the same paths under it), pack ``packed`` into
    ``dest/packed.tar.gz`` (:func:`pack`), and print the last ``tail`` lines of the log and the run's state.
    Returns (state, exit status): the command's own where it ended, 0 while it runs, 1 where it was lost or never
    started."""
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
    if packed:
        copied.append(f"{PACKED} ({pack(list(packed), dest / PACKED)} file(s) of {', '.join(packed)})")
    recorded = read_state(out) or {}
    log = out / LOG_FILE
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []
    for line in lines[-tail:]:
        print(f"  | {line}")
    said = {"running": f"still running (pid {recorded.get('pid')}, since {recorded.get('started')}): collect again",
            "ended": f"ended {recorded.get('ended')} with exit {recorded.get('exit')}",
            "lost": f"lost: pid {recorded.get('pid')} is gone without recording its end (killed, or its machine "
                    "restarted); what it finished is in what was copied",
            "none": f"no run has started in {out} (no {STATE_FILE})"}[now]
    print(f"[detached] {out}: {said}; copied to {dest}: {', '.join(copied) or 'nothing'}", flush=True)
    code = {"running": 0, "ended": int(recorded.get("exit", 1)), "lost": 1, "none": 1}[now]
    return now, code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    for verb, text in (("start", "start the command after -- in its own session and return at once"),
                       ("supervise", "run the command after -- and record its end (what start runs)"),
                       ("collect", "wait for the run, then copy what it has written so far")):
        sub = verbs.add_parser(verb, help=text)
        sub.add_argument("--out", required=True, help="the run's folder: its state, its log, its small files")
        if verb == "collect":
            sub.add_argument("--dest", required=True, help="where the copies go")
            sub.add_argument("--wait-s", type=float, default=0.0, help="seconds to wait for the run to end")
            sub.add_argument("--pack", action="append", default=[], metavar="PATH",
                             help=f"a folder or file packed into DEST/{PACKED} (repeatable)")
        else:
            sub.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if args.verb == "collect":
        return collect(out, Path(args.dest).resolve(), args.wait_s, args.pack)[1]
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.verb == "supervise":
        return supervise(cmd, out)
    pid = start(cmd, out)
    print(f"[detached] started pid {pid} in its own session; log {out / LOG_FILE}; then: python3 -m "
          f"experiments.detached collect --out {args.out} --dest DEST --wait-s S", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
