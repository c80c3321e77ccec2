"""Say up front when a command would train for hours on a CPU, and start it only when asked to.

``scale=paper`` on a laptop is a command that looks like any other and would run for weeks. Before the first
job starts, :func:`assess` estimates the training time of every run of the command that trains on a CPU:
the analytic FLOPs of one training step (:func:`pcaf_core.flops.train_step_flops`, the count a step executes:
receptive-field next-token steps, full windows otherwise) times the run's steps, divided by this CPU's
measured fp32 matrix-product rate. Real steps carry work the FLOP count leaves out and never reach the peak
(a next-token PCAF step's routing and gathers, in particular), and evaluation is not counted, so the estimate
is a lower bound (but for torch's next-token ``topk_score`` context rows, whose selection pass it overcounts:
:func:`train_seconds`). Above :data:`NOTICE_MINUTES` the command prints it before it starts; above
:data:`LONG_RUN_HOURS` the command is refused with one line that gives the estimate and the flag that starts
it anyway (``--yes`` for ``experiments.reproduce``, ``confirm=true`` for ``experiments.run``). ``make
step-cost`` times real steps of a table's rows for a closer figure. Runs on an accelerator are not estimated here.
"""

from __future__ import annotations

import functools
import importlib
import time

import numpy as np

from pcaf_core.flops import train_step_flops

LONG_RUN_HOURS = 4.0
"""A command predicted to train longer than this on a CPU needs confirmation."""

NOTICE_MINUTES = 10.0
"""A command predicted to train longer than this on a CPU says so before it starts."""


@functools.lru_cache(maxsize=1)
def matmul_flops_per_s(n: int = 768, repeats: int = 3) -> float:
    """This CPU's fp32 ``[n, n] x [n, n]`` product rate (FLOP/s, best of ``repeats``; about 50 ms)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # the first product loads the BLAS and its threads
    best = min(_timed(a, b) for _ in range(repeats))
    return 2.0 * n ** 3 / max(best, 1e-9)


def _timed(a: np.ndarray, b: np.ndarray) -> float:
    t0 = time.perf_counter()
    a @ b
    return time.perf_counter() - t0


def runs_on_cpu(backend: str, device: str) -> bool:
    """True when a run of ``backend`` with ``backend.device=device`` trains on the CPU (``auto``: no
    accelerator is present)."""
    if device == "cpu":
        return True
    if device not in ("auto", "", None):
        return False
    if backend == "torch":
        return not importlib.import_module("torch").cuda.is_available()
    return importlib.import_module("jax").default_backend() == "cpu"


def train_seconds(run, rate: float) -> float:
    """The training time of a :class:`~pcaf_core.config.RunConfig` at ``rate`` FLOP/s: a lower bound, except for
    torch's next-token ``topk_score`` context rows, whose selection the count bounds from above
    (:mod:`pcaf_core.flops`)."""
    # Every next-token step computes from receptive fields (both backends turn nt_receptive_field on for each
    # model that has one; linear attention's count is its full window), so the count is the executed one.
    flops = train_step_flops(run.model, run.memory, run.train.mode, run.train.seq_len, run.train.batch_size,
                             nt_count="receptive_field")
    return run.train.steps * flops / rate


def assess(resolved_runs: list, flag: str, *, confirmed: bool = False) -> tuple[str | None, str | None]:
    """``(notice, refusal)`` for a command's runs: ``notice`` says how long the command's CPU runs would train
    at least (when that is over :data:`NOTICE_MINUTES`); ``refusal`` refuses the command when it is over
    :data:`LONG_RUN_HOURS` and not confirmed (``confirmed``, or the override ``confirm=true``), naming ``flag``.
    Each is one line or None."""
    rate = matmul_flops_per_s()
    cost = [(train_seconds(r.run, rate), r) for r in resolved_runs]
    if sum(s for s, _ in cost) <= NOTICE_MINUTES * 60:
        return None, None
    cpu = [(s, r) for s, r in cost if runs_on_cpu(r.backend, str(r.cfg.backend.device))]
    total = sum(s for s, _ in cpu)
    if total <= NOTICE_MINUTES * 60:
        return None, None
    worst_s, worst = max(cpu, key=lambda c: c[0])
    estimate = (f"{len(cpu)} run(s) of this command would train on this CPU for at least {_duration(total)} "
                f"({worst.table}/{worst.row} scale={worst.scale}: {_duration(worst_s)}; each step's analytic FLOPs at "
                f"this CPU's measured fp32 matmul rate of {rate / 1e9:,.0f} GFLOP/s, evaluation not counted; make "
                f"step-cost TABLE={worst.table} SCALE={worst.scale} times real steps)")
    confirmed = confirmed or any(bool(r.cfg.get("confirm", False)) for r in resolved_runs)
    if total > LONG_RUN_HOURS * 3600 and not confirmed:
        return None, f"{estimate}: add {flag} to start it anyway, or choose a smaller scale (scale=cpu)"
    return f"note: {estimate}", None


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} hours" if seconds >= 3600 else f"{seconds / 60:,.0f} minutes"
