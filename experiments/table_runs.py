"""One planned run of a table: its directory claimed by identity, the run trained, and how it ended.

:func:`run_planned` is the one code path of every launcher: ``experiments.reproduce`` calls it for each run in
turn, and a cluster job (:mod:`experiments.cluster_jobs`) calls it in the job's process. A run's directory is the
newest of its row and seed whose resolved config has the run's identity (:mod:`pcaf_core.run_identity`); it is
reused when complete, resumed when stopped, and otherwise kept as it is beside a new one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from experiments import app, runner
from pcaf_core.checkpoints import RunRefused
from pcaf_core.record_check import DAMAGED, check_run
from pcaf_core.results import RunMetrics, read_metrics
from pcaf_core.run_identity import read_run_config, resume_diff, same_identity
from pcaf_core.run_record import run_lock


def existing_runs(resolved: app.ResolvedRun, root: Path) -> list[Path]:
    """Run dirs of this row and seed under ``root`` with ``resolved``'s identity, newest first."""
    parent = root / resolved.table / resolved.scale / resolved.backend / resolved.row
    candidates = sorted(parent.glob(f"seed{resolved.run.train.seed}-*"), reverse=True) if parent.exists() else []
    want = app.config_dict(resolved)
    found = []
    for run_dir in candidates:
        config = read_run_config(run_dir)
        if config is not None and same_identity(config, want):
            found.append(run_dir)
    return found


def _record(run_dir: Path) -> RunMetrics | None:
    try:
        return read_metrics(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable or absent record: the run never finished
        return None


def run_state(previous: Path, resolved: app.ResolvedRun) -> tuple[str, str]:
    """What :func:`claim_run` does with an earlier run of ``resolved``'s identity, from its record: ``("reuse",
    "")`` for a completed run whose record passes its check; ``("resume", note)`` for a run that was stopped
    (SIGKILL leaves ``running``; SIGTERM, Ctrl-C and a full disk leave ``failed`` with ``extra.resumable``) or
    completed with a damaged record, when this command repeats its settings
    (:func:`pcaf_core.run_identity.resume_diff`); ``("new", why)`` otherwise."""
    rec = _record(previous)
    check = check_run(previous)
    if rec is not None and rec.status == "completed" and check.state != DAMAGED:
        return "reuse", ""
    if rec is None or rec.status in ("completed", "running") or rec.extra.get("resumable"):
        diff = resume_diff(read_run_config(previous) or {}, app.config_dict(resolved))
        if not diff:
            return "resume", (f"the record of {previous} is damaged ({check.text()}): rebuilding it from its last "
                              "checkpoint; the damaged file is kept beside it" if check.state == DAMAGED else "")
        return "new", (f"{previous} was stopped, but this command runs it with other settings ({'; '.join(diff)}); "
                       "starting a new run (it is kept as it is)")
    return "new", f"{previous} failed ({' '.join(str(rec.error).split())[:200]}); starting a new run"


def claim_run(resolved: app.ResolvedRun, root: Path, fresh: bool, stack: ExitStack,
              say: Callable[[str], None]) -> tuple[Path, str]:
    """Pick and lock the directory of one run: ``(dir, action)``, action ``reuse``, ``resume`` or ``new``.

    The newest directory of this row and seed with ``resolved``'s identity is locked (waiting, with a
    message, while another process runs it), then :func:`run_state` decides from its record; a run it does not
    reuse or resume is kept as it is and a new directory made. The lock stays held (in ``stack``) for the run's
    life."""
    tried: set[Path] = set()
    while not fresh:
        previous = next((d for d in existing_runs(resolved, root) if d not in tried), None)
        if previous is None:
            break
        tried.add(previous)
        hold = ExitStack()
        hold.enter_context(run_lock(previous, on_wait=say))
        action, note = run_state(previous, resolved)  # read under the lock: the holder may just have finished it
        if action != "new":
            if note:
                say(note)
            stack.enter_context(hold.pop_all())
            return previous, action
        hold.close()
        say(note)
        # Loop: while this command waited, another may have started a newer run of the same config.
    run_dir = app.new_run_dir(resolved, root)
    stack.enter_context(run_lock(run_dir, on_wait=say))
    app.write_run_files(run_dir, resolved)  # at once: another command looking for this run finds it
    return run_dir, "new"


def completed_run(resolved: app.ResolvedRun, root: Path) -> Path | None:
    """The run :func:`claim_run` would reuse for ``resolved`` now, read without waiting for any lock (a command
    that only reports, or decides whether to submit a job); None when it would resume a run or start one."""
    for previous in existing_runs(resolved, root):
        action, _ = run_state(previous, resolved)
        if action != "new":
            return previous if action == "reuse" else None
    return None


@dataclass
class Outcome:
    """How one planned run of a table ended, as every launcher reports it: ``status`` is ``reused`` (a completed
    run was found), ``completed``, ``failed``, ``refused`` (nothing in the run was changed), ``interrupted`` or
    ``lost`` (its job ended without a result: killed, out of memory); the same command resumes the last two.
    ``line`` is what the command prints for it."""

    status: str
    run_dir: str | None
    line: str


def run_planned(resolved: app.ResolvedRun, root: Path, *, fresh: bool, restart_damaged: bool,
                say: Callable[[str], None], run_dir: Path | None = None,
                on_claim: Callable[[Path], None] | None = None) -> Outcome:
    """Run one planned run of a table: claim its directory by identity (:func:`claim_run`: reuse, resume or new),
    train it (:func:`experiments.runner.run_one`) and say how it ended. The one code path of every launcher: the
    serial loop of ``experiments.reproduce`` and a cluster job (:mod:`experiments.cluster_jobs`) call it alike.

    ``run_dir``: continue this directory instead of claiming one (a requeued cluster job continues the run it
    claimed). ``on_claim`` is told the directory as soon as it is claimed. An interruption (Ctrl-C, SIGTERM)
    propagates after the loop has recorded it."""
    claimed = None
    try:
        with ExitStack() as stack:
            if run_dir is None:
                claimed, action = claim_run(resolved, root, fresh, stack, say)
            else:
                claimed = Path(run_dir)
                stack.enter_context(run_lock(claimed, on_wait=say))
                action = "reuse" if run_state(claimed, resolved)[0] == "reuse" else "resume"
            if on_claim is not None:
                on_claim(claimed)
            if action == "reuse":
                say(f"reusing completed run {claimed}")
                return Outcome("reused", str(claimed), f"reusing completed run {claimed}")
            say(runner.resume_note(claimed) or f"running in {claimed}")
            metrics = runner.run_one(resolved, claimed, restart_damaged=restart_damaged, on_wait=say)
    except RunRefused as exc:
        return Outcome("refused", str(claimed) if claimed else None, f"refused: {exc}")
    status = "completed" if metrics.status == "completed" else "failed"
    return Outcome(status, str(claimed), runner.summary_line(resolved, metrics))


def interrupted_line(run_dir: Path | str | None) -> str:
    """What a command says for a run it stopped: where, after which step, and that the same command resumes it."""
    rec = _record(Path(run_dir)) if run_dir is not None else None
    where = (f"{run_dir} stopped after step {rec.steps_done if rec else 0}" if run_dir is not None
             else "stopped before the run started")
    return f"interrupted: {where}; run the same command again to resume it"


def run_tag(done: int, n_runs: int, table: str, row: str, resolved: app.ResolvedRun) -> str:
    """The prefix of every line a command prints about one of its runs."""
    return f"[{done}/{n_runs}] {table}/{row} seed={resolved.run.train.seed} profile={resolved.run.profile.name}"


def report(tag: str, done: int, n_runs: int, outcome: Outcome) -> None:
    """Print how a run ended: its summary line on stdout (``FAILED: ...`` for a failed run), a refusal or an
    interruption on stderr; a reuse was said when it was found."""
    if outcome.status in ("completed", "failed"):
        print(f"[{done}/{n_runs}] {outcome.line}", flush=True)
    elif outcome.status in ("refused", "interrupted", "lost"):
        print(f"{tag}: {outcome.line}", file=sys.stderr, flush=True)
