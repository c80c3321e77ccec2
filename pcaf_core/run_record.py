"""The run record (``metrics.json``): built from the loop's state, and the only code that writes it.

The loop writes the record at start (``running``), after every evaluation and checkpoint, at the end
(``completed``) and on any failure (``failed`` with the reason). The caller's template (the app's
labels: table, row, scale, deviations, git commit, versions) is carried into every version; the loop
adds what it learns (e.g. a deviation line for a capped full evaluation), and nothing rewrites the
record afterwards. :func:`write_failed_record` covers the one case the loop cannot: a run that fails
before the loop starts (an unavailable backend, a launcher that cannot spawn its workers).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from pcaf_core import results
from pcaf_core.checkpoints import LoopState, to_jsonable
from pcaf_core.config import RunConfig
from pcaf_core.config_io import config_hash
from pcaf_core.evaluation import EvalResult, evaluation_tokens
from pcaf_core.fsutil import file_lock
from pcaf_core.profiles import matmul_precision
from pcaf_core.results import RunMetrics

log = logging.getLogger("pcaf.run_record")

RUN_LOCK_FILE = ".lock"
"""The run directory's lock file: held (``flock``) by the process that trains the run, for its whole life."""

THROUGHPUT_WARMUP_STEPS = 3
"""Optimiser steps at the start of every process segment left out of the throughput measurement
(allocator warm-up, kernel autotuning, JIT compilation)."""

THROUGHPUT_TIMED_TO_LOSS = "timed until its loss is on the host"
"""The words of :data:`THROUGHPUT_DEFINITION` that say a step's time includes an accelerator's work: records
without them timed a step to the return of its launches (``paper_tables.collect`` sets their accelerator tokens/s
aside)."""

THROUGHPUT_DEFINITION = (
    "tokens/s = global_batch*T / mean train-step seconds; a train step covers host-side window "
    "sampling, forward, backward and the optimiser update, " + THROUGHPUT_TIMED_TO_LOSS + " (so an "
    "accelerator's queued work is included); with the next step launched before a step's loss is read, a step's "
    "time is its own launch plus the wait for its loss; evaluation and checkpoint time are excluded; "
    "the first {warmup} steps of each process are excluded as warm-up; NT counts all T input tokens "
    "of a window (docs/REFERENCE_CODE.md §5.6)"
)


def identity(run_dir: Path, template: RunMetrics | None) -> RunMetrics:
    """The record template: the caller's, else the identity of an earlier record in ``run_dir``."""
    if template is not None:
        return dataclasses.replace(template, deviations=list(template.deviations), versions=dict(template.versions),
                                   extra=dict(template.extra))
    try:
        old = results.read_metrics(run_dir)
        return RunMetrics(
            table=old.table, row=old.row, scale=old.scale, deviations=list(old.deviations),
            git_commit=old.git_commit, overrides=list(old.overrides), versions=dict(old.versions),
        )
    except (FileNotFoundError, results.SchemaError):
        # No labels were given: a config of the caller's own, not a suite row at one of its scales.
        return RunMetrics(table="adhoc", row=Path(run_dir).name or "run", scale=results.CUSTOM_SCALE)


def _full_notes(cfg: RunConfig, full: EvalResult, total_windows: int | None) -> tuple[str, list[str]]:
    """The full protocol's label and the deviation lines a capped or strided pass adds."""
    split = cfg.data.eval_split
    capped = full.windows < (total_windows or full.windows)
    strided = cfg.train.mode == "nt" and cfg.eval.full_nt_stride > 1
    parts, notes = [], []
    if capped:
        parts.append(f"capped: first {full.windows} of {total_windows} {split} windows")
        notes.append(f"full evaluation capped at {full.windows} of {total_windows} {split} "
                     "windows (eval.full_max_windows)")
    if strided:
        parts.append(f"subsampled: one NT target every {cfg.eval.full_nt_stride} positions")
        notes.append(f"full NT evaluation scores every {cfg.eval.full_nt_stride}-th position "
                     "(eval.full_nt_stride), not every position")
    return (f"full ({'; '.join(parts)})" if parts else "full"), notes


def build_record(
    template: RunMetrics,
    cfg: RunConfig,
    ls: LoopState,
    *,
    status: str,
    error: str | None,
    backend_name: str,
    device: str,
    backend_versions: dict[str, str],
    peak_mem_mb: float | None,
    world_size: int,
    corpus: Any,
    full: EvalResult | None,
    full_total_windows: int | None,
    params: int | None,
    unigram: float | None,
    last_checkpoint: Path | None,
    elapsed: float,
    tokens_per_sec: float | None,
) -> RunMetrics:
    """The record of a run in its current state (``template`` supplies identity and provenance)."""
    best, final = ls.best, ls.final
    deviations = list(template.deviations) + [d for d in ls.deviations if d not in template.deviations]
    extra = dict(template.extra)
    if ls.incidents:
        extra["incidents"] = list(ls.incidents)
    extra.update({
        "segments": ls.segments,
        "world_size": world_size,
        "timed_steps": ls.timed_steps,
        "last_checkpoint": str(last_checkpoint) if last_checkpoint else None,
        "full_protocol_label": None,
    })
    if full is not None:
        label, notes = _full_notes(cfg, full, full_total_windows)
        extra.update({"full_protocol_label": label, "full_loss": full.loss, "full_targets": full.n_targets})
        deviations += [n for n in notes if n not in deviations]
    if best is not None:
        extra["best_loss"] = best["loss"]
        extra["final_loss"] = final["loss"] if final else None
    versions = {"python": platform.python_version(), "numpy": np.__version__, **template.versions}
    versions.update(backend_versions)
    describe = getattr(corpus, "record", None)
    if callable(describe):
        extra["data"] = to_jsonable(describe())
    return dataclasses.replace(
        template,
        status=status,
        error=error,
        backend=backend_name,
        profile=cfg.profile.name,
        seed=cfg.train.seed,
        mode=cfg.train.mode,
        seq_len=cfg.train.seq_len,
        batch_size=cfg.train.batch_size,
        steps_done=ls.step,
        steps_planned=cfg.train.steps,
        params=params,
        precision=cfg.train.precision,
        matmul_precision=matmul_precision(cfg),  # "profile" resolved: the record names what ran
        device=device,
        protocol=cfg.eval.protocol,
        eval_every=cfg.eval.every,
        eval_batches=cfg.eval.batches,
        full_windows=full.windows if full else None,
        final_ppl=final["ppl"] if final else None,
        best_ppl=best["ppl"] if best else None,
        best_step=best["step"] if best else None,
        acc_at_best=best["acc"] if best else None,
        acc_param_at_best=best["acc_param"] if best else None,
        final_acc=final["acc"] if final else None,
        final_acc_param=final["acc_param"] if final else None,
        full_ppl=full.ppl if full else None,
        full_acc=full.acc if full else None,
        full_acc_param=full.acc_param if full else None,
        unigram_ppl=unigram,
        tokens_per_sec=tokens_per_sec,
        throughput_definition=THROUGHPUT_DEFINITION.format(warmup=THROUGHPUT_WARMUP_STEPS),
        peak_mem_mb=peak_mem_mb,
        wall_time_s=elapsed,
        train_time_s=ls.train_seconds,
        dataset=cfg.data.name,
        data_layout=cfg.data.layout,
        vocab_size=cfg.model.vocab_size,
        train_tokens=int(len(corpus.train)) if corpus is not None else None,
        eval_tokens=int(len(evaluation_tokens(corpus))) if corpus is not None else None,
        deviations=deviations,
        versions=versions,
        config_hash=config_hash(cfg),
        extra=extra,
    )


def write_record(run_dir: Path, record: RunMetrics) -> RunMetrics:
    """Write ``record`` as ``<run_dir>/metrics.json`` (validated, atomic) and return it."""
    results.write_metrics(run_dir, record)
    return record


def write_failed_record(run_dir: Path, template: RunMetrics | None, error: str, *,
                        cfg: RunConfig | None = None, steps_done: int = 0) -> RunMetrics:
    """A minimal ``failed`` record: for a run that failed before (or while) the loop could describe it."""
    fields: dict[str, Any] = {"status": "failed", "error": error, "steps_done": steps_done}
    if cfg is not None:
        fields.update(steps_planned=cfg.train.steps, profile=cfg.profile.name, seed=cfg.train.seed,
                      mode=cfg.train.mode, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      config_hash=config_hash(cfg))
    return write_record(run_dir, dataclasses.replace(identity(run_dir, template), **fields))


def record_failure(run_dir: Path, full_record: Callable[[], RunMetrics], template: RunMetrics | None, error: str,
                   *, cfg: RunConfig, steps_done: int, extra: dict[str, Any]) -> None:
    """Best effort, for a run failing with ``error``: write ``full_record()`` (the loop's own ``failed`` record),
    or, when building or writing it fails too, the minimal :func:`write_failed_record` with ``extra`` in its
    ``extra``. Nothing is raised: a failure while recording the failure must not hide the original error, which
    the caller re-raises; what went wrong here is logged."""
    try:
        write_record(run_dir, full_record())
    except Exception as exc:  # noqa: BLE001
        log.error("could not write the failed run record: %s", exc)
        try:
            rec = write_failed_record(run_dir, template, error, cfg=cfg, steps_done=steps_done)
            rec.extra.update(extra)
            write_record(run_dir, rec)
        except Exception as exc2:  # noqa: BLE001
            log.error("could not write a minimal failed record either: %s", exc2)


def curve_row(step: int, tokens_seen: int, loss_sum: float, loss_count: int, ev: EvalResult | None,
              elapsed_s: float, lr: float) -> dict[str, Any]:
    """One row of ``curve.csv``: the mean training loss of the ``loss_count`` steps since the last row (None for
    none), the reference evaluation ``ev`` of this step if there was one, the run's elapsed seconds and the LR."""
    return {
        "step": step,
        "tokens_seen": tokens_seen,
        "train_loss": loss_sum / loss_count if loss_count else None,
        "eval_loss_reference": ev.loss if ev else None,
        "eval_ppl_reference": ev.ppl if ev else None,
        "eval_acc_reference": ev.acc if ev else None,
        "eval_acc_param_reference": ev.acc_param if ev else None,
        "elapsed_s": round(elapsed_s, 3),
        "lr": lr,
    }


def mark_failed(run_dir: Path, template: RunMetrics | None, error: str, *,
                cfg: RunConfig | None = None, resumable: bool = False) -> RunMetrics:
    """Mark the run in ``run_dir`` as failed with ``error``, keeping everything an earlier record already
    holds (a worker that died mid-run leaves a ``running`` record with its curve); with no readable record,
    write a minimal one from ``template``. ``resumable``: running the same command again continues it."""
    try:
        old = results.read_metrics(run_dir)
    except (FileNotFoundError, results.SchemaError):
        old = write_failed_record(run_dir, template, error, cfg=cfg)
    extra = {**old.extra, "resumable": True} if resumable else old.extra
    return write_record(run_dir, dataclasses.replace(old, status="failed", error=error, extra=extra))


def run_lock(run_dir: Path, on_wait: Callable[[str], None] | None = None) -> AbstractContextManager[None]:
    """Hold the lock of ``run_dir`` for the ``with`` block: one process at a time trains in a run directory.

    When another process holds it, ``on_wait`` is called once with a line saying which process, and the
    call waits until that process ends (the kernel releases the lock however it ends, SIGKILL included).
    Re-entrant within a process."""
    run_dir = Path(run_dir)

    def waiting(holder: str) -> None:
        if on_wait is not None:
            on_wait(f"waiting for {run_dir}: it is being run by {holder}; this command goes on when that one "
                    "ends (Ctrl-C stops waiting)")

    return file_lock(run_dir / RUN_LOCK_FILE, on_wait=waiting)
