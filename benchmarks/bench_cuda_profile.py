"""The ``profile`` section of ``benchmarks.bench_cuda``: where a training step's time goes on the GPU.

Three steps of the full-AR PCAF-context case (T=1024, batch 8; T=64, batch 2 with ``--smoke``) run under
``torch.profiler`` for each step kind (eager, inductor, CUDA graphs) and precision (fp32, bf16). Each gives an op
table by device time, a row of ``profile.csv`` (wall time, the GPU's busy time, kernels a step, and where the GPU
waits) and, for bf16, the Chrome timeline. Then the paper's longest row, next-token global-local attention with
FlexAttention (T=1024, batch 32, fp32, eager, as ``wt2-nt-1024`` trains it): three training steps and three
evaluation batches, ``profile_windowed.csv`` and ``profile_windowed_<train|eval>.txt``, instead of the full-AR
steps with ``--only-windowed``. The interval arithmetic (:func:`covered_us`, :func:`step_gaps`) is plain Python so
that tests check it on synthetic timelines.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_cuda_cases import SMOKE_SCALE, GpuCase, case_config, device_config, failure_row
from benchmarks.bench_cuda_report import COMPILES


def profile_section(out: Path, device: str = "cuda", smoke: bool = False,
                    compiles: tuple[str, ...] = COMPILES) -> tuple[list[dict], list[dict]]:
    """The profiled rows (and op tables under ``out``) of the eager, compiled and CUDA-graph steps in ``compiles``,
    and the compiled cases that failed (as in :func:`benchmarks.bench_cuda.models_section`)."""
    import torch

    from backends.torch.backend import TorchBackend
    from benchmarks.bench_models import Case, _batch

    rows, failures = [], []
    T, batch = (64, 2) if smoke else (1024, 8)
    profiled = [c for c in (("eager",) if device == "cpu" else COMPILES) if c in compiles]
    for compile_, precision in ((c, p) for c in profiled for p in ("fp32", "bf16")):
        case = Case("PCAF-context", "ar", T, batch, 0.1, compile_, precision)
        cfg = case_config(GpuCase(case.model, "ar", T, batch, precision, compile_), case,
                          SMOKE_SCALE if smoke else "paper")
        try:
            backend = TorchBackend(device)
            state = backend.init(cfg)
            x, y, _ = _batch(cfg)
            for _ in range(3 if compile_ == "eager" else 5):  # compiled: the compile (and capture), then replays
                state, _ = backend.train_step(state, x, y, 1e-4)
        except (RuntimeError, ValueError, torch._dynamo.exc.TorchDynamoException) as err:
            if compile_ == "eager":
                raise
            failures.append(failure_row(GpuCase(case.model, "ar", T, batch, precision, compile_), "profile", err))
            continue
        step = training_steps(backend, state, x, y)
        name = f"profile_{precision}.txt" if compile_ == "eager" else f"profile_{precision}_{compile_}.txt"
        trace = out / f"trace_{precision}_{compile_}.json.gz" if precision == "bf16" else None
        timed = profiled_steps(step, out / name, device, trace)
        rows.append({"model": case.model, "mode": case.mode, "T": T, "batch": batch, "dtype": precision,
                     "compile": compile_, **timed})
        print(f"[bench_cuda profile {precision} {compile_}] step {timed['step_wall_ms']:.2f} ms, GPU busy "
              f"{timed['gpu_busy_ms']:.2f} ms, {timed['kernels_per_step']:.0f} kernels a step", file=sys.stderr,
              flush=True)
        del backend, state, step
        torch._dynamo.reset()
    return rows, failures


WINDOWED_PROFILED = "global-local Transformer (FlexAttention)"
"""The windowed case profiled: the paper's longest row (``wt2-nt-1024/transformer_global_local``)."""


def windowed_profile_section(out: Path, device: str = "cuda", smoke: bool = False) -> list[dict]:
    """Where the next-token global-local attention row's time goes (:data:`WINDOWED_PROFILED`, T=1024, batch 32,
    fp32, eager, dropout 0.1; T=64, batch 2 with ``smoke``): three training steps and three evaluation batches under
    ``torch.profiler``, op tables ``profile_windowed_<train|eval>.txt``, a row each. On a CPU the model trains
    masked (FlexAttention has no backward there), and the rows' ``policy`` says so."""
    from backends.torch.backend import TorchBackend
    from benchmarks.bench_models import Case, _batch

    T, batch = (64, 2) if smoke else (1024, 32)
    case = Case(WINDOWED_PROFILED, "nt", T, batch, 0.1, "eager", "fp32")
    cfg, note = device_config(case_config(GpuCase(case.model, "nt", T, batch, "fp32", "eager"), case,
                                          SMOKE_SCALE if smoke else "paper"), device)
    backend = TorchBackend(device)
    state = backend.init(cfg)
    x, y, _ = _batch(cfg)
    rows = []
    for what, fn in (("train", training_steps(backend, state, x, y)),
                     ("eval", lambda: backend.eval_batch(state, x, y, "nt"))):
        for _ in range(3):  # the first compiles FlexAttention's kernels for each layer's rows
            fn()
        timed = profiled_steps(fn, out / f"profile_windowed_{what}.txt", device)
        rows.append({"model": case.model, "mode": "nt", "T": T, "batch": batch, "dtype": "fp32", "compile": "eager",
                     "step": what, "policy": f"model.attention_impl={cfg.model.attention_impl}{note}", **timed})
        print(f"[bench_cuda profile windowed {what}] {timed['step_wall_ms']:.2f} ms, GPU busy "
              f"{timed['gpu_busy_ms']:.2f} ms, {timed['kernels_per_step']:.0f} kernels", file=sys.stderr, flush=True)
    return rows


def training_steps(backend, state, x, y):
    """A function that takes one more training step of ``backend`` from ``state`` on ``(x, y)`` each call."""
    holder = {"state": state}

    def step() -> None:
        holder["state"], _ = backend.train_step(holder["state"], x, y, 1e-4)

    return step


def profiled_steps(step, table: Path, device: str, trace: Path | None = None, steps: int = 3) -> dict[str, object]:
    """``steps`` calls of ``step`` (each ending on the host) under ``torch.profiler``: the op table by device time
    (by CPU time on a CPU) into ``table``, the Chrome timeline into ``trace`` when given, and the row's timings: wall
    time a call, the GPU's busy time, kernels a call, and where the GPU waits (:func:`step_gaps`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with torch.profiler.record_function(STEP_MARK):
                step()
        wall = (time.perf_counter() - t0) / steps
    cuda = torch.autograd.DeviceType.CUDA
    # The GPU's timeline: kernels, copies, and the user annotations (record_function ranges, a compiled graph's
    # call) that only span kernels. The step marks' own annotations are left out (they would cover a step's
    # gaps); the rest are merged as intervals, so an annotation adds no time to the kernels it spans.
    timeline = [e for e in prof.events() if e.device_type == cuda and e.name != STEP_MARK]
    kernels = [e for e in timeline if not e.is_user_annotation]
    spans = [(e.time_range.start, e.time_range.end) for e in timeline]
    busy_ms = covered_us(spans) / 1e3 / steps
    gaps = step_gaps([(e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.name == STEP_MARK and e.device_type != cuda], spans)
    sort = "self_device_time_total" if device != "cpu" else "self_cpu_time_total"
    table.write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    if trace is not None:  # where the GPU waits on the host (Perfetto, chrome://tracing)
        trace_file(prof, trace)
    return {"step_wall_ms": round(wall * 1e3, 3), "gpu_busy_ms": round(busy_ms, 3),
            "gpu_busy_pct": round(100 * busy_ms / (wall * 1e3), 1), "kernels_per_step": round(len(kernels) / steps, 1),
            **gaps}


STEP_MARK = "bench_cuda_step"
"""The ``record_function`` label around each profiled step: where a step starts and ends on the trace."""


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time at least one of them covers."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def step_gaps(steps: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> dict[str, object]:
    """Where the GPU waits within profiled steps, from their ``(start, end)`` and the kernels' (µs, one clock):
    ``first_kernel_ms``, the median time from a step's start to its first kernel (the host's work before it
    launches anything, the device idle since the last step ended on the host), and ``gpu_idle_ms``, the median
    time within a step that no kernel covers. Empty values where the steps ran no kernel (a CPU)."""
    first, idle = [], []
    for start, end in steps:
        inside = sorted((max(a, start), min(b, end)) for a, b in kernels if b > start and a < end)
        if not inside:
            continue
        first.append(inside[0][0] - start)
        idle.append((end - start) - covered_us(inside))
    if not first:
        return {"first_kernel_ms": "", "gpu_idle_ms": ""}
    return {"first_kernel_ms": round(statistics.median(first) / 1e3, 3),
            "gpu_idle_ms": round(statistics.median(idle) / 1e3, 3)}


def trace_file(prof, path: Path) -> None:
    """``prof``'s Chrome trace, gzipped into ``path`` (a few hundred kB for three steps, where the JSON is MBs)."""
    import gzip

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
