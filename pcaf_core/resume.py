"""Which checkpoint a run continues from, and what a resume may change (used by :mod:`pcaf_core.loop`).

* Checkpoints are tried newest first; one whose manifest does not match its files is damaged. Damaged
  checkpoints newer than the one chosen are moved to ``<run_dir>/checkpoints_set_aside/<UTC time>/``
  (kept, never deleted) and the move is recorded as an *incident* in the run record.
* When every checkpoint is damaged the run is refused (:class:`~pcaf_core.checkpoints.RunRefused`, the
  directory untouched) unless the caller asked for :data:`RESTART_DAMAGED`: then the damaged checkpoints
  and the abandoned curve are set aside, the run starts from step 0 and the restart is recorded.
* A run whose record says it diverged resumes from its newest checkpoint whose last evaluation was finite,
  and may change ``train.lr`` (only that) on the way, recorded as a deviation from that step on.
* A checkpoint written by another backend is refused by name (:func:`refuse_other_backend`).
* A ``metrics.json`` or ``curve.csv`` that fails its check (:mod:`pcaf_core.record_check`) is kept beside the
  run as ``<file>.damaged-<UTC time>`` before the run rebuilds it (:func:`keep_damaged_record`).
* A resumed run's ``curve.csv`` is the checkpoint's curve (:func:`restore_curve`).

NumPy/stdlib only, like the loop.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pcaf_core import results
from pcaf_core.checkpoints import (
    SET_ASIDE_DIR,
    LoopState,
    RunRefused,
    checkpoint_backend,
    checkpoint_problem,
    list_checkpoints,
    read_loop_state,
    set_aside,
    step_of,
)
from pcaf_core.config import RunConfig
from pcaf_core.config_io import config_diff, config_hash, hashable_config
from pcaf_core.record_check import DAMAGED, check_run
from pcaf_core.results import CURVE_FILE, METRICS_FILE, RunMetrics

log = logging.getLogger("pcaf.loop")

RESTART_DAMAGED = "restart_damaged"
"""``resume=`` value that starts a run over from step 0 when every checkpoint it has is damaged (the damaged
ones are moved to ``checkpoints_set_aside/`` and the restart is written into the run record)."""

NOT_FINITE = "its evaluation was not finite (written after the divergence began)"


def previous_divergence(run_dir: Path) -> dict[str, Any] | None:
    """``{step, loss, lr}`` when the directory's record says its run diverged, else None."""
    try:
        old = results.read_metrics(run_dir)
    except (FileNotFoundError, results.SchemaError):
        return None
    diverged = old.extra.get("diverged") if old.status == "failed" else None
    return diverged if isinstance(diverged, dict) else None


def _finite_eval(path: Path) -> bool:
    final = read_loop_state(path).final
    return final is None or math.isfinite(float(final.get("loss", math.nan)))


def scan_checkpoints(run_dir: Path, diverged: bool) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(newest usable checkpoint, the newer ones that cannot be used, each with why). Read only."""
    skipped: list[tuple[Path, str]] = []
    for path in list_checkpoints(run_dir):
        problem = checkpoint_problem(path)
        if problem is None and (not diverged or _finite_eval(path)):
            return path, skipped
        skipped.append((path, problem or NOT_FINITE))
    return None, skipped


def refuse_if_all_damaged(run_dir: Path, ckpt: Path | None, skipped: list[tuple[Path, str]], resume: Any) -> None:
    """Raise :class:`RunRefused` naming the damaged files when no checkpoint is usable because every one is
    damaged and ``resume`` is not :data:`RESTART_DAMAGED`."""
    damaged = [why for _, why in skipped if why != NOT_FINITE]
    if ckpt is None and damaged and resume != RESTART_DAMAGED:
        raise RunRefused(
            f"every checkpoint of {run_dir} is damaged ({'; '.join(damaged)}); nothing was changed or deleted. "
            f"To start this run over from step 0 (the damaged checkpoints are kept under {run_dir / SET_ASIDE_DIR}), "
            f"pass --restart-damaged to python -m experiments.reproduce, restart_damaged=true to python -m "
            f"experiments.run, or resume={RESTART_DAMAGED!r} to run_training"
        )


def set_aside_unusable(run_dir: Path, ckpt: Path | None, skipped: list[tuple[Path, str]]) -> list[dict[str, Any]]:
    """Move the checkpoints in ``skipped`` aside (with the curve when the run starts over) and return the
    incident to record (empty when nothing was skipped). Main rank only."""
    if not skipped:
        return []
    moved = [p for p, _ in skipped]
    if ckpt is None and results.curve_path(run_dir).exists():
        moved.append(results.curve_path(run_dir))  # the abandoned curve is evidence too
    kept = set_aside(run_dir, moved)
    damaged = any(why != NOT_FINITE for _, why in skipped)
    what = (f"every checkpoint was damaged; restarted from step 0 ({RESTART_DAMAGED})" if ckpt is None and damaged
            else f"resumed from {ckpt.name if ckpt else 'step 0'}")
    log.warning("%s; unusable checkpoints moved to %s: %s", what, kept, "; ".join(w for _, w in skipped))
    return [{"utc": kept.name, "what": what, "kept": str(kept), "set_aside": [f"{p.name}: {w}" for p, w in skipped]}]


def refuse_other_backend(ckpt: Path, backend: str, run_dir: Path) -> None:
    """Raise :class:`RunRefused` when checkpoint ``ckpt`` was written by another backend than ``backend``."""
    written_by, fmt = checkpoint_backend(ckpt)
    if written_by and written_by != backend:
        raise RunRefused(
            f"{ckpt} was written by the {written_by} backend (checkpoint format {fmt or written_by}); the {backend} "
            f"backend cannot resume it (only the weights, model.safetensors, are common to both backends): resume "
            f"{run_dir} with backend={written_by}. Nothing in {run_dir} was changed.")


def finished_record(run_dir: Path, ckpt: Path | None, steps: int, incidents: list[dict[str, Any]]) -> RunMetrics | None:
    """The run's record, as it is, when the run is finished: its newest checkpoint ``ckpt`` is at the last step
    ``steps``, nothing was set aside on the way (``incidents``), and ``metrics.json`` says completed and passes its
    check. Running it again would only evaluate again and rewrite a finished record, and an interruption during
    that evaluation would mark it failed. None otherwise (a damaged record is rebuilt from the checkpoint)."""
    if ckpt is None or incidents or step_of(ckpt) != steps:
        return None
    try:
        record = results.read_metrics(run_dir)
    except (FileNotFoundError, results.SchemaError):
        return None
    if record.status != "completed" or check_run(run_dir).state == DAMAGED:
        return None
    log.info("%s is finished (step %d of %d): its record is kept as it is", run_dir, steps, steps)
    return record


def keep_damaged_record(run_dir: Path, ckpt: Path | None) -> list[dict[str, Any]]:
    """Move a ``metrics.json`` or ``curve.csv`` of ``run_dir`` that fails its check aside (kept as
    ``<name>.damaged-<UTC time>``) before the run rewrites it; say so on stderr and return the incident to
    record (empty when nothing was damaged). Main rank only."""
    if not results.metrics_path(run_dir).exists():
        return []
    check = check_run(run_dir)
    names = [n for n in check.damaged_files() if n in (METRICS_FILE, CURVE_FILE) and (run_dir / n).is_file()]
    if check.state != DAMAGED or not names:
        return []
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = []
    for name in names:
        target = run_dir / f"{name}.damaged-{stamp}"
        os.replace(run_dir / name, target)
        kept.append(target.name)
    source = f"checkpoint {ckpt.name}" if ckpt is not None else "step 0 (there is no usable checkpoint)"
    what = (f"{', '.join(names)} failed the record check ({check.text()}); kept as {', '.join(kept)}; the record "
            f"is rebuilt from {source}")
    print(f"warning: {run_dir}: {what}", file=sys.stderr, flush=True)
    return [{"utc": stamp, "what": what, "kept": kept}]


def restore_curve(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``curve.csv`` by the rows a checkpoint holds (a killed run may have appended rows past its last
    checkpoint): written beside the run and moved in place atomically, so a reader sees the old curve or the
    new one, never a mix."""
    target = results.curve_path(run_dir)
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".curve.") as tmp:
        for row in rows:
            results.append_curve_row(tmp, row)
        staged = results.curve_path(tmp)
        if staged.exists():
            os.replace(staged, target)
        elif target.exists():
            target.unlink()


def accept_config(ls: LoopState, cfg: RunConfig, path: Path, run_dir: Path, diverged: dict[str, Any] | None) -> None:
    """Check that checkpoint ``path`` (state ``ls``) was written for ``cfg``; after a divergence a lower (or any
    other) ``train.lr`` is accepted and recorded in ``ls.deviations``. Anything else is refused."""
    want = config_hash(cfg)
    if ls.config_hash == want:
        return
    diff = config_diff(ls.config, hashable_config(cfg))
    if diverged is not None and diff and all(d.startswith("train.lr: ") for d in diff):
        ls.deviations.append(f"{diff[0]} from step {ls.step} (changed on resume after the run diverged at step "
                             f"{diverged.get('step')})")
        ls.config_hash, ls.config = want, hashable_config(cfg)
        return
    hint = (" Only train.lr may change, and only to resume a run that diverged." if diverged is None
            and any(d.startswith("train.lr: ") for d in diff) else "")
    raise RunRefused(
        f"cannot resume from {path}: it was written for a different config (hash {ls.config_hash}, this run's "
        f"config hashes to {want}); differing fields: {'; '.join(diff) or 'unknown'}. Nothing in {run_dir} was "
        f"changed.{hint} Run the new config in a new run directory, or restore the original config to resume this one."
    )


def _command(template: RunMetrics | None) -> str | None:
    return template.extra.get("resume_command") if template is not None else None


def resume_hint(run_dir: Path, ckpt: Path | None, template: RunMetrics | None) -> str:
    """``resume <dir> from <checkpoint> with: <command>`` for a stopped run's record (the command is the
    app's ``extra.resume_command`` when the template has one)."""
    where = f"from {ckpt} (step {step_of(ckpt)})" if ckpt is not None else "from step 0 (no checkpoint was written yet)"
    how = _command(template) or f"run_training(cfg, backend, {str(run_dir)!r}) (same config)"
    return f"resume {run_dir} {where} with: {how}"


def without_override(command: str, key: str) -> str:
    """``command`` (a shell-quoted command line) without its ``key=...`` words."""
    return " ".join(shlex.quote(w) for w in shlex.split(command) if not w.lstrip("+~").startswith(f"{key}="))


def divergence_message(loss: float, step: int, lr: float, cfg: RunConfig, ckpt: Path | None, run_dir: Path,
                       template: RunMetrics | None) -> str:
    """What a diverged run's record says: the step, the last good checkpoint and the command that goes on at a
    lower learning rate: continuing this run from its newest checkpoint when there is one, else a new run (the
    run's own ``train.lr`` override is replaced, not repeated)."""
    command = _command(template)
    lower = f"train.lr=<below {cfg.train.lr:g}>"
    head = (f"training diverged: non-finite loss {loss} at step {step} (lr={lr:.6g}). Last good checkpoint: "
            f"{ckpt or 'none (no checkpoint was written before the failure)'}. ")
    fresh = (f"{without_override(without_override(command, 'run_dir'), 'train.lr')} {lower}" if command else
             "run_training(cfg with a lower train.lr, run_dir=<a new directory>)")
    if ckpt is None:
        return (head + f"There is no checkpoint to continue from: start a new run with a lower learning rate: "
                f"{fresh}; or add warm-up or gradient clipping (profile.grad_clip_norm).")
    how = (f"{without_override(command, 'train.lr')} {lower}" if command else
           f"run_training(cfg with a lower train.lr, run_dir={str(run_dir)!r}, resume=True)")
    return (head + f"To continue this run from its newest checkpoint with a finite evaluation at a lower learning "
            f"rate (recorded as a deviation): {how}; or start over with a lower train.lr, warm-up or gradient "
            f"clipping (profile.grad_clip_norm) in a new run: {fresh}")
