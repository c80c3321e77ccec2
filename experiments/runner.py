"""Train one resolved run in its directory: the record it starts from, the failure it leaves, its summary line.

:func:`run_one` is what every entry point calls to train (``experiments.run``, a table's runs through
:mod:`experiments.table_runs`, ``benchmarks.precision_check``): it holds the run directory's lock, writes the
resolved config and environment when it creates the run (:func:`experiments.app.write_run_files`), refuses a
command that would change an existing run (:func:`experiments.app.check_resume`), and calls the backend's
``train``. A failure leaves a ``failed`` record and its traceback in ``error.txt``; a refused resume leaves the
directory as it was.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from experiments import table_plan
from experiments.app import (
    ResolvedRun,
    check_resume,
    config_dict,
    labels,
    new_run_dir,
    resume_command,
    say,
    write_run_files,
)
from pcaf_core.checkpoints import RunRefused, newest_step
from pcaf_core.fsutil import atomic_write_text
from pcaf_core.results import CONFIG_FILE, RunMetrics, SchemaError, read_metrics
from pcaf_core.run_identity import identity_digest, read_run_config
from pcaf_core.run_record import mark_failed, run_lock


def initial_record(resolved: ResolvedRun, run_dir: Path | None = None) -> RunMetrics:
    """The identity and provenance a backend stamps on every version of the run's record (with ``run_dir``:
    ``extra.resume_command``, the command that continues it)."""
    record = RunMetrics(table=resolved.table, row=resolved.row, status="running")
    for key, value in labels(resolved).items():
        setattr(record, key, value)
    if run_dir is not None:
        record.extra["resume_command"] = resume_command(resolved, run_dir)
    # The run's identity is its config.yaml's (written once; a resume after a divergence may lower train.lr,
    # recorded as a deviation); the row's is what the row composes to at this scale and backend.
    existing = read_run_config(run_dir) if run_dir is not None else None
    record.identity = {"config": identity_digest(existing if existing is not None else config_dict(resolved)),
                       "row": row_identities(resolved)}
    return record


def row_identities(resolved: ResolvedRun) -> list[str]:
    """Identity digests of ``resolved``'s table row as composed at its scale and backend without command-line
    overrides, one per seed entry; ``[]`` for a run that is no paper row."""
    if resolved.row_identities is None:
        resolved.row_identities = table_plan.row_identities(resolved.table, resolved.row, resolved.scale,
                                                            resolved.backend)
    return list(resolved.row_identities)


def _record_bytes(run_dir: Path) -> bytes | None:
    try:
        return (run_dir / "metrics.json").read_bytes()
    except OSError:
        return None


def _failed(run_dir: Path, resolved: ResolvedRun, error: str, *, resumable: bool = False,
            before: bytes | None = None, trace: str = "") -> RunMetrics:
    """The record of a run that raised: the loop's own ``failed`` record when it wrote one, else one
    written here (the run failed before the loop could start, or a worker died without recording), with
    ``trace`` appended to ``error.txt``. ``before``: the run's record before this command; when this command
    failed without the loop touching it, the run's files are left as they were (the failure is the
    command's, not the run's) and the returned record is not written."""
    if before is not None and _record_bytes(run_dir) == before:
        return RunMetrics(table=resolved.table, row=resolved.row, status="failed", error=error)
    if trace:
        _write_error_file(run_dir, trace)
    with contextlib.suppress(FileNotFoundError, SchemaError):  # no record yet, or an unreadable one: write ours
        metrics = read_metrics(run_dir)
        if metrics.status == "failed":
            return metrics
    try:
        return mark_failed(run_dir, initial_record(resolved, run_dir), error, cfg=resolved.run, resumable=resumable)
    except OSError as exc:  # e.g. the disk is still full: say so rather than hide the run's own failure
        say(f"could not write the failed record of {run_dir}: {exc}")
        return RunMetrics(table=resolved.table, row=resolved.row, status="failed", error=error)


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A metric for a log line: ``n/a`` when it was not measured."""
    return "n/a" if value is None else format(value, spec)


def summary_line(resolved: ResolvedRun, metrics: RunMetrics) -> str:
    """One labelled line per finished run."""
    tag = (f"[{resolved.table}/{resolved.row} scale={resolved.scale} backend={resolved.backend} "
           f"profile={resolved.run.profile.name} seed={resolved.run.train.seed}]")
    if metrics.status != "completed":
        return f"{tag} FAILED: {metrics.error}"
    return (f"{tag} best PPL {fmt(metrics.best_ppl)} / final {fmt(metrics.final_ppl)} (protocol=reference), "
            f"full-split PPL {fmt(metrics.full_ppl)} (protocol=full), {fmt(metrics.tokens_per_sec, '.0f')} tok/s, "
            f"{fmt(metrics.wall_time_s, '.0f')} s")


def resume_note(run_dir: Path) -> str | None:
    """``resuming <dir> from step N`` when ``run_dir`` holds an earlier, unfinished run, else None."""
    try:
        metrics = read_metrics(run_dir)
    except (FileNotFoundError, SchemaError):
        return None
    if metrics.status == "completed":
        return None
    step = newest_step(run_dir)
    return f"resuming {run_dir} from step {step}" + ("" if step else " (no checkpoint was written)")


def _write_error_file(run_dir: Path, text: str) -> None:
    """Append a failure's traceback to ``error.txt`` under a time stamp (earlier failures stay above it)."""
    path = run_dir / "error.txt"
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        atomic_write_text(path, f"{old}=== {stamp} ===\n{text}")
    except OSError as exc:  # the record still says why the run failed
        say(f"could not write {path}: {exc}")


def run_one(resolved: ResolvedRun, run_dir: Path | None = None, *, progress: bool | None = None,
            restart_damaged: bool = False, on_wait: Callable[[str], None] | None = say) -> RunMetrics:
    """Train one resolved run in ``run_dir`` (new if None), holding the directory's lock throughout
    (another process running it is waited for, with ``on_wait`` told once). Never raises for a training
    failure: the returned record (and ``metrics.json``) says ``failed`` with the error. Raises
    :class:`~pcaf_core.checkpoints.RunRefused` (the directory untouched) when its checkpoints are all
    damaged (``restart_damaged`` starts over instead, keeping them) or were written for another config,
    and re-raises an interruption (Ctrl-C, SIGTERM) after it is recorded."""
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir(resolved)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir, on_wait=on_wait):
        return _run_locked(resolved, run_dir, progress, restart_damaged)


def _run_locked(resolved: ResolvedRun, run_dir: Path, progress: bool | None, restart_damaged: bool) -> RunMetrics:
    existing = read_run_config(run_dir)
    if existing is None and not (run_dir / CONFIG_FILE).exists():
        write_run_files(run_dir, resolved)
    else:
        check_resume(resolved, run_dir, existing or {})
    before = _record_bytes(run_dir)
    try:
        backend = importlib.import_module(f"backends.{resolved.backend}.train")
    except ImportError as exc:
        return _failed(run_dir, resolved, f"backend {resolved.backend!r} is not available: {exc}", before=before)
    from pcaf_core.loop import RESTART_DAMAGED, RunInterrupted

    try:
        # The loop writes metrics.json (labels from the template, its own deviations added) and is its only
        # writer; nothing below rewrites a record the loop has written.
        return backend.train(resolved.run, run_dir, progress=progress, record=initial_record(resolved, run_dir),
                             resume=RESTART_DAMAGED if restart_damaged else True,
                             device=resolved.cfg.backend.device, world_size=int(resolved.cfg.backend.world_size))
    except RunRefused:
        raise
    except (KeyboardInterrupt, RunInterrupted):
        _failed(run_dir, resolved, f"interrupted before training started; run the same command again to resume "
                                   f"{run_dir}", resumable=True, before=before)
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, the table shows the row as failed
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return _failed(run_dir, resolved, detail, before=before, trace=traceback.format_exc())
