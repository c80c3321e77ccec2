"""The backend-neutral training loop (docs/DESIGN.md §3, §7; docs/REFERENCE_CODE.md §5).

A backend plugs in the numerics through :class:`pcaf_core.backend.Backend`; this module drives a run,
identically for every backend:

* the data stream: one global :class:`~pcaf_core.data.WindowSampler` for training and one for
  evaluation; under data parallelism every rank draws the same global batch and keeps its own
  contiguous slice, so ``N`` processes see exactly the windows one process with the same global batch
  sees; every batch is validated once here (:func:`pcaf_core.batches.check_batch`);
* the learning-rate schedule (:func:`pcaf_core.schedule.lr_at_step`, one value per step);
* the cadence: a ``reference`` evaluation at step 1, every ``eval.every`` steps and at the last step;
  a ``full`` evaluation after the last step (:mod:`pcaf_core.evaluation`); checkpoints every
  ``train.checkpoint_every`` steps and at the end (:mod:`pcaf_core.checkpoints`); one process launches
  each step before it reads the previous one's loss, except after a step whose end reads its state
  (:mod:`pcaf_core.cadence`);
* the bookkeeping: best/final PPL and accuracies, the learning curve, throughput, and the run record
  (:mod:`pcaf_core.run_record`, the only writer of ``metrics.json``), which says ``failed`` with the
  reason when a run fails;
* resume: bit-exact from the newest complete checkpoint, config hash and backend checked; divergence
  detection. Checkpoints that cannot be used are moved aside, never deleted; when every checkpoint is
  damaged the run is refused (:class:`RunRefused`) unless ``resume="restart_damaged"``; a checkpoint of
  another backend or config is refused before anything in the directory changes; a diverged run may be
  resumed with a lower ``train.lr`` (recorded as a deviation) from its newest checkpoint whose
  evaluation was finite. A record or curve that fails its check (:mod:`pcaf_core.record_check`) is kept
  beside the run as ``<file>.damaged-<UTC time>`` when the run rebuilds it, and the record says so;
* contention: the other training processes seen on the machine during the timed steps
  (:mod:`pcaf_core.contention`), recorded with the throughput.

NumPy/stdlib only: this module never imports torch or jax. Besides its own names it re-exports what a
caller of :func:`run_training` handles (``RunInterrupted``, ``TrainingDiverged``, ``RESTART_DAMAGED``, ...);
everything else is imported from its own module.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from pcaf_core import results
from pcaf_core.backend import Backend
from pcaf_core.batches import check_batch, check_setup
from pcaf_core.cadence import LaunchedStep, checkpoint_due, reads_state
from pcaf_core.checkpoints import (
    CheckpointError,
    LoopState,
    RunRefused,
    checkpoint_root,
    loop_state_payload,
    partial_checkpoints,
    read_loop_state,
    step_of,
    write_checkpoint,
)
from pcaf_core.config import RunConfig, validate
from pcaf_core.config_io import config_hash, hashable_config
from pcaf_core.contention import ContentionSampler
from pcaf_core.evaluation import (
    EvalResult,
    eval_batch_size,
    evaluate_full,
    evaluate_reference,
    evaluation_tokens,
    full_batch_size,
    reference_due,
    unigram_ppl,
)
from pcaf_core.fsutil import DiskFullError, is_disk_full
from pcaf_core.interrupts import RunInterrupted, SigtermGuard, TrainingDiverged
from pcaf_core.progress import OFF, Progress, progress_style
from pcaf_core.results import RunMetrics
from pcaf_core.resume import (
    RESTART_DAMAGED,
    accept_config,
    divergence_message,
    finished_record,
    keep_damaged_record,
    previous_divergence,
    refuse_if_all_damaged,
    refuse_other_backend,
    restore_curve,
    resume_hint,
    scan_checkpoints,
    set_aside_unusable,
)
from pcaf_core.run_record import (
    THROUGHPUT_WARMUP_STEPS,
    build_record,
    curve_row,
    identity,
    record_failure,
    write_record,
)
from pcaf_core.schedule import lr_for

__all__ = [
    "RESTART_DAMAGED", "THROUGHPUT_WARMUP_STEPS", "Backend", "CheckpointError", "EvalResult", "LoopState",
    "RunInterrupted", "RunRefused", "TrainingDiverged", "TrainingLoop", "checkpoint_root", "config_hash",
    "read_loop_state", "run_training", "unigram_ppl",
]

log = logging.getLogger("pcaf.loop")

# --------------------------------------------------------------------------- the loop


class TrainingLoop:
    """One run: ``TrainingLoop(cfg, backend, run_dir).run()``. See :func:`run_training`."""

    def __init__(
        self,
        cfg: RunConfig,
        backend: Backend,
        run_dir: str | os.PathLike[str],
        *,
        corpus: Any = None,
        resume: bool | str = True,
        progress: bool | None = None,
        record: RunMetrics | None = None,
        keep_checkpoints: int = 2,
    ) -> None:
        if resume not in (True, False, RESTART_DAMAGED):
            raise ValueError(f"resume={resume!r}: expected True, False or {RESTART_DAMAGED!r}")
        if cfg.train.precision == "auto":  # the record and the resume check see what actually runs
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=backend.auto_precision()[0]))
        self.cfg = cfg  # validated in run(), so that an invalid config also leaves a failed record
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.progress = progress
        self.keep_checkpoints = max(1, int(keep_checkpoints))
        self.rank = int(getattr(backend, "rank", 0))
        self.world = int(getattr(backend, "world_size", 1))
        self.is_main = self.rank == 0
        self._corpus = corpus
        self._template = record
        self.state: Any = None
        self.ls = LoopState()
        self.last_good_checkpoint: Path | None = None
        self.full: EvalResult | None = None
        self.full_total_windows: int | None = None
        self._params: int | None = None
        self._unigram: float | None = None
        self._segment_start = time.perf_counter()
        self._diverged: dict[str, Any] | None = None  # what the previous record says about a divergence
        self._contention: ContentionSampler | None = None

    # ----------------------------------------------------------------- setup

    @property
    def global_batch(self) -> int:
        return self.cfg.train.batch_size

    @property
    def eval_batch_size(self) -> int:
        return eval_batch_size(self.cfg)

    @property
    def corpus(self) -> Any:
        if self._corpus is None:
            from pcaf_core.data import load_corpus  # the data layer loads on first use

            self._corpus = load_corpus(self.cfg.data)
        return self._corpus

    def _local(self, arr: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a global batch."""
        if self.world == 1:
            return arr
        per = arr.shape[0] // self.world
        return arr[self.rank * per : (self.rank + 1) * per]

    # ----------------------------------------------------------------- evaluation

    def evaluate_reference(self, step: int) -> EvalResult:
        """See :func:`pcaf_core.evaluation.evaluate_reference`."""
        return evaluate_reference(self.backend, self.state, self.cfg, self._eval_iter, self._local, step,
                                  self.eval_batch_size)

    def evaluate_full(self, step: int) -> EvalResult:
        """See :func:`pcaf_core.evaluation.evaluate_full`."""
        result, self.full_total_windows = evaluate_full(self.backend, self.state, self.cfg,
                                                        evaluation_tokens(self.corpus), full_batch_size(self.cfg),
                                                        step)
        return result

    # ----------------------------------------------------------------- checkpoints

    def _save_checkpoint(self) -> Path:
        def payload() -> dict[str, Any]:
            return loop_state_payload(self.ls, train_sampler=self.train_sampler.state_dict(),
                                      eval_sampler=self.eval_sampler.state_dict(),
                                      elapsed_seconds=self._elapsed())  # wall time up to this checkpoint

        self.last_good_checkpoint = write_checkpoint(
            self.run_dir, self.ls.step, is_main=self.is_main, barrier=self.backend.barrier,
            save_backend=lambda path: self.backend.save(self.state, path), loop_payload=payload,
            keep=self.keep_checkpoints)
        return self.last_good_checkpoint

    def _restore(self, path: Path) -> None:
        ls = read_loop_state(path)
        accept_config(ls, self.cfg, path, self.run_dir, self._diverged)
        self.state = self.backend.load(path, self.cfg)
        self.ls = ls
        self.ls.backend, self.ls.checkpoint_format = self.backend.name, self._checkpoint_format()
        self.train_sampler.load_state_dict(ls.train_sampler)
        self.eval_sampler.load_state_dict(ls.eval_sampler)
        self.last_good_checkpoint = path
        if self.is_main:
            restore_curve(self.run_dir, ls.curve)
        log.info("resumed from %s at step %d", path, ls.step)

    def _fresh_start(self, incidents: list[dict[str, Any]] | None = None) -> None:
        if self.is_main:
            # Old checkpoints of an abandoned run must not be mistaken for this run's (resume=False asks
            # for this; every checkpoint that could be evidence was moved aside before).
            shutil.rmtree(checkpoint_root(self.run_dir), ignore_errors=True)
            results.curve_path(self.run_dir).unlink(missing_ok=True)
        self.backend.barrier()
        self.state = self.backend.init(self.cfg)
        self.ls = LoopState(config_hash=config_hash(self.cfg), config=hashable_config(self.cfg),
                            incidents=list(incidents or []), backend=self.backend.name,
                            checkpoint_format=self._checkpoint_format())

    def _checkpoint_format(self) -> str:
        return str(getattr(self.backend, "checkpoint_format", self.backend.name))

    # ----------------------------------------------------------------- records

    def _tag(self) -> str:
        """Who a progress line is about: the row, scale, backend and seed of the record."""
        t = identity(self.run_dir, self._template)
        return f"{t.table}/{t.row} scale={t.scale} backend={self.backend.name} seed={self.cfg.train.seed}"

    def _elapsed(self) -> float:
        return self.ls.elapsed_seconds + (time.perf_counter() - self._segment_start)

    def tokens_per_sec(self) -> float | None:
        steps, secs = self.ls.timed_steps, self.ls.timed_seconds
        if steps == 0 or secs <= 0:
            return None
        return self.global_batch * self.cfg.train.seq_len * steps / secs

    def _record(self, status: str, error: str | None = None, extra: dict[str, Any] | None = None) -> RunMetrics:
        template = identity(self.run_dir, self._template)
        template.extra.update(extra or {})
        if self.ls.shared_machine:
            template.extra["shared_machine"] = dict(self.ls.shared_machine)
        return build_record(
            template, self.cfg, self.ls, status=status, error=error,
            backend_name=self.backend.name, device=self.backend.device, backend_versions=self.backend.versions(),
            peak_mem_mb=self.backend.peak_memory_mb(), world_size=self.world, corpus=self._corpus,
            full=self.full, full_total_windows=self.full_total_windows, params=self._params,
            unigram=self._unigram, last_checkpoint=self.last_good_checkpoint, elapsed=self._elapsed(),
            tokens_per_sec=self.tokens_per_sec())

    def _write_record(self, status: str, error: str | None = None,
                      extra: dict[str, Any] | None = None) -> RunMetrics:
        rec = self._record(status, error, extra)
        if self.is_main:
            write_record(self.run_dir, rec)
        return rec

    def _write_failure(self, error: str, **extra: Any) -> None:
        """Best effort (:func:`pcaf_core.run_record.record_failure`): the caller re-raises the original error.

        ``extra`` goes into the record's ``extra``: ``resumable=True`` tells the entry points that
        running the same command again continues this run (an interruption, a full disk);
        ``diverged={step, loss, lr}`` lets a resume with a lower ``train.lr`` through."""
        if self.is_main:
            record_failure(self.run_dir, lambda: self._record("failed", error, extra), self._template, error,
                           cfg=self.cfg, steps_done=self.ls.step, extra=extra)

    def _resume_hint(self) -> str:
        return resume_hint(self.run_dir, self.last_good_checkpoint, self._template)

    # ----------------------------------------------------------------- main

    def run(self) -> RunMetrics:
        """Train (or resume), evaluate, checkpoint and write the record. Returns the final record."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            with SigtermGuard():
                return self._run()
        except RunRefused:
            raise  # nothing was started: the directory's record keeps what it said
        except TrainingDiverged as exc:
            self._write_failure(str(exc), diverged=exc.details)
            raise
        except (KeyboardInterrupt, RunInterrupted) as exc:
            how = ("Ctrl-C (SIGINT)" if isinstance(exc, KeyboardInterrupt)
                   else signal.Signals(getattr(exc, "signum", signal.SIGTERM)).name)
            self._write_failure(f"interrupted by {how} after step {self.ls.step}; {self._resume_hint()}",
                                resumable=True)
            raise
        except DiskFullError as exc:
            self._write_failure(f"{type(exc).__name__}: {exc}; then {self._resume_hint()}", resumable=True)
            raise
        except OSError as exc:  # a file-system failure: fix the cause and resume
            what = f"no space left on device ({exc})" if is_disk_full(exc) else f"{type(exc).__name__}: {exc}"
            self._write_failure(f"{what}; {self._resume_hint()}", resumable=True)
            raise
        except Exception as exc:
            self._write_failure(f"{type(exc).__name__}: {exc}")
            raise

    def _choose_checkpoint(self) -> tuple[Path | None, list[dict[str, Any]]]:
        """The checkpoint to resume from (None: start from step 0) and the incidents to record
        (:mod:`pcaf_core.resume`): unusable newer checkpoints are moved aside; every checkpoint damaged
        is refused unless ``resume="restart_damaged"``."""
        if not self.resume:
            return None, []
        self._diverged = previous_divergence(self.run_dir)
        ckpt, skipped = scan_checkpoints(self.run_dir, self._diverged is not None)
        refuse_if_all_damaged(self.run_dir, ckpt, skipped, self.resume)
        if ckpt is not None:  # refused here, before a checkpoint is set aside or a file rewritten
            refuse_other_backend(ckpt, self.backend.name, self.run_dir)
            accept_config(read_loop_state(ckpt), self.cfg, ckpt, self.run_dir, self._diverged)
        self._check_ranks_agree(ckpt)
        incidents = set_aside_unusable(self.run_dir, ckpt, skipped) if self.is_main else []
        self.backend.barrier()
        return ckpt, incidents

    def _check_ranks_agree(self, ckpt: Path | None) -> None:
        if self.world > 1:
            # Every rank picks the checkpoint itself; a disagreement (a file system that does not show
            # all ranks the same files) would silently desynchronise them.
            mine = float(step_of(ckpt) if ckpt is not None else -1)
            total = self.backend.all_reduce_sum([mine, mine * mine])
            if total[0] != self.world * mine or total[1] != self.world * mine * mine:
                raise CheckpointError(
                    f"data-parallel ranks found different checkpoints in {checkpoint_root(self.run_dir)} "
                    f"(rank {self.rank}: {ckpt}); the run directory must be on a file system all ranks share"
                )

    def _run(self) -> RunMetrics:
        cfg = validate(self.cfg)
        check_setup(self.cfg, self.corpus, evaluation_tokens(self.corpus), self.eval_batch_size, self.world)
        corpus = self.corpus
        self._unigram = unigram_ppl(corpus.train, evaluation_tokens(corpus), cfg.model.vocab_size)
        from pcaf_core.data import WindowSampler

        self.train_sampler = WindowSampler(corpus.train, cfg.train.seq_len, self.global_batch, cfg.train.mode,
                                           seed=cfg.train.train_sample_seed, split="train")
        self.eval_sampler = WindowSampler(evaluation_tokens(corpus), cfg.train.seq_len, self.eval_batch_size,
                                          cfg.train.mode, seed=cfg.eval.eval_sample_seed, split=cfg.data.eval_split)
        if self.is_main:
            for partial in partial_checkpoints(self.run_dir):  # writes a killed process never finished
                shutil.rmtree(partial, ignore_errors=True)
        self.backend.barrier()
        ckpt, incidents = self._choose_checkpoint()
        finished = finished_record(self.run_dir, ckpt, cfg.train.steps, incidents)
        if finished is not None:
            return finished
        damaged = keep_damaged_record(self.run_dir, ckpt) if self.is_main else []
        if ckpt is not None:
            self._restore(ckpt)
            self.ls.incidents += incidents + damaged
        else:
            self._fresh_start(incidents + damaged)
        self.ls.segments += 1
        if self.is_main:
            self._contention = ContentionSampler(self.ls.shared_machine, exclude_siblings=self.world > 1)
        self._params = int(self.backend.param_count(self.state))
        self._train_iter = iter(self.train_sampler)
        self._eval_iter = iter(self.eval_sampler)
        self._segment_start = time.perf_counter()
        self._write_record("running")

        do_ref = cfg.eval.protocol in ("reference", "both")
        do_full = cfg.eval.protocol in ("full", "both")
        steps = cfg.train.steps
        report = Progress(progress_style(self.progress) if self.is_main else OFF, self._tag(), steps, self.ls.step,
                          self.backend.name)
        # One process launches the next step before it reads this step's loss, so the host samples, uploads and
        # launches while the device computes (reading a loss waits for its step). Several processes read each
        # step's loss at once: their mean is a collective, kept out of the next step's.
        pipelined = self.world == 1
        try:
            segment_steps = 0
            launched: LaunchedStep | None = None
            while self.ls.step < steps:
                if launched is None:
                    launched = self._launch(self.ls.step + 1, wait=not pipelined)
                step, lr = launched.step, launched.lr
                # An evaluation, a checkpoint and the last step read the weights this step leaves: the next step
                # waits for them.
                following, failed_next = None, None
                if pipelined and not reads_state(cfg, step):
                    try:
                        following = self._launch(step + 1, wait=False)
                    except BaseException as exc:  # the next step failed to start: this one is still counted first
                        failed_next = exc
                t0 = time.perf_counter()
                loss = launched.loss
                if self.world > 1:
                    loss = self.backend.all_reduce_sum([loss])[0] / self.world
                loss = float(loss)  # waits for the step
                dt = launched.launch_s + (time.perf_counter() - t0)
                launched = following
                if not math.isfinite(loss):
                    raise TrainingDiverged(
                        divergence_message(loss, step, lr, self.cfg, self.last_good_checkpoint, self.run_dir,
                                           self._template), {"step": step, "loss": loss, "lr": lr})
                self.ls.step = step
                segment_steps += 1
                self.ls.train_seconds += dt
                if segment_steps > THROUGHPUT_WARMUP_STEPS:
                    self.ls.timed_steps += 1
                    self.ls.timed_seconds += dt
                    if self._contention is not None:  # outside the timed interval, which ended above
                        self._contention.sample(force=segment_steps == THROUGHPUT_WARMUP_STEPS + 1 or step == steps)
                self.ls.pending_loss_sum += loss
                self.ls.pending_loss_count += 1

                ev = None
                if do_ref and reference_due(step, cfg):
                    ev = self.evaluate_reference(step)
                    self.ls.final = ev.as_dict()
                    best = self.ls.best
                    # Strictly lower: ties keep the earlier evaluation; NaN never becomes best.
                    if best is None or (not math.isnan(ev.ppl) and (math.isnan(best["ppl"]) or ev.ppl < best["ppl"])):
                        self.ls.best = ev.as_dict()
                log_row = ev is not None or (cfg.train.log_every > 0 and step % cfg.train.log_every == 0)
                if log_row or step == steps:
                    self._append_row(step, lr, ev)
                ckpt_due = checkpoint_due(cfg, step)
                if ckpt_due:
                    self._save_checkpoint()
                if ev is not None or ckpt_due:
                    self._write_record("running")
                report.step(loss, lr, self.ls.final["ppl"] if self.ls.final is not None else None)
                if ev is not None:
                    report.evaluation(step, self.ls.curve[-1]["train_loss"], ev.ppl, self.tokens_per_sec(),
                                      self._elapsed(), (time.perf_counter() - self._segment_start) / segment_steps)
                if failed_next is not None:
                    raise failed_next
        finally:
            report.close()
        if do_full:
            self.full = self.evaluate_full(steps)
        return self._write_record("completed")

    def _launch(self, step: int, wait: bool) -> LaunchedStep:
        """Draw step ``step``'s batch and start its training step (``wait=False``: without waiting for it)."""
        lr = lr_for(self.cfg.train, step)
        t0 = time.perf_counter()
        inputs, targets = next(self._train_iter)
        inputs, targets = self._local(inputs), self._local(targets)
        check_batch(inputs, targets, self.cfg)
        self.state, loss = self.backend.train_step(self.state, inputs, targets, lr, wait=wait)
        return LaunchedStep(step, lr, loss, time.perf_counter() - t0)

    def _append_row(self, step: int, lr: float, ev: EvalResult | None) -> None:
        row = curve_row(step, step * self.global_batch * self.cfg.train.seq_len, self.ls.pending_loss_sum,
                        self.ls.pending_loss_count, ev, self._elapsed(), lr)
        self.ls.pending_loss_sum = 0.0
        self.ls.pending_loss_count = 0
        self.ls.curve.append(row)
        if self.is_main:
            results.append_curve_row(self.run_dir, row)


def run_training(
    cfg: RunConfig,
    backend: Backend,
    run_dir: str | os.PathLike[str],
    *,
    corpus: Any = None,
    resume: bool | str = True,
    progress: bool | None = None,
    record: RunMetrics | None = None,
    keep_checkpoints: int = 2,
) -> RunMetrics:
    """Train ``backend`` under ``cfg`` in ``run_dir`` and return the run record.

    corpus: an object with ``train``/``valid`` token arrays and ``vocab_size`` (default:
    ``pcaf_core.data.load_corpus(cfg.data)``). resume: continue from the newest complete checkpoint
    in ``run_dir`` when there is one (its config must hash like ``cfg``, except a lower ``train.lr``
    after a divergence); newer damaged checkpoints are moved to ``checkpoints_set_aside/``; when every
    checkpoint is damaged :class:`RunRefused` is raised, unless ``resume="restart_damaged"`` (start
    over, the damaged ones kept and the restart recorded). False starts over and deletes the
    directory's old checkpoints. progress: tqdm bar (None: only on a TTY;
    ``PCAF_NO_PROGRESS=1`` always disables it). record: identity/provenance fields (table, row,
    scale, deviations, ...) for ``metrics.json``. keep_checkpoints: how many recent checkpoints stay
    on disk.

    Raises :class:`TrainingDiverged` on a non-finite training loss, :class:`RunRefused` when the
    directory cannot be continued as asked (nothing in it is changed then); any other failure leaves
    ``metrics.json`` with ``status="failed"`` (``extra.resumable`` when the same call can continue it).
    """
    return TrainingLoop(cfg, backend, run_dir, corpus=corpus, resume=resume, progress=progress,
                        record=record, keep_checkpoints=keep_checkpoints).run()
