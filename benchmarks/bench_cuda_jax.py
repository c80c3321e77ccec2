"""The JAX full-AR step at the paper's 41M shape on one GPU, timed and profiled: ``benchmarks.bench_cuda``'s
``jax41m`` section.

The shape is the paper's 41M S-sweep row ``sweeps-41m/pcaf_semantic_ar_s256`` at ``scale=paper`` (d=224, 14
blocks, V=32,000, K=32, S=256, profile ``reference_jax``), full AR at T=2048 and batch 8; the context route is the
same row with ``memory.route=context``. Each route runs at JAX's default matmul precision (TF32 passes on a GPU)
and at ``highest`` (``train.matmul_precision``); ``JaxBackend("gpu").train_step``, host batch in and the loss on
the host at the end of each step, the cases' timed steps interleaved one per round. Fraction of peak: the model's
FLOPs a step (``pcaf_core.flops.train_step_flops``) over the median step time, against the GEMM peak of the
precision that ran, from the same run's ``gemm.csv`` (:func:`peak_dtype`).

Each route also runs at the default precision with the head's logits in one tile (``train.head_loss=full``; the
row's ``auto`` tiles them at this shape): :data:`CASES`.

Then three steps of the semantic route at the default precision (the row's head loss) under
``jax.profiler.trace``, read back with ``jax.profiler.ProfileData`` and summed by op name (:func:`op_times`): on a
GPU the device plane's ``XLA Ops`` line (each HLO op's time on the device), on a CPU (``--smoke``) the XLA CPU
thunks.
``jax_profile.txt`` holds the op table by time; ``jax_profile.csv`` the profiled step's wall time beside the
ops' summed time.
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

TABLE, ROW = "sweeps-41m", "pcaf_semantic_ar_s256"
ROUTES = ("semantic", "context")
PRECISIONS = ("default", "highest")
CASES = (*((r, p, "auto") for r in ROUTES for p in PRECISIONS), *((r, "default", "full") for r in ROUTES))
"""(route, matmul precision, ``train.head_loss``): every route at both precisions with the row's own head loss
(``auto``, which tiles this shape's 524M logits: 2 GB in float32, past ``pcaf_core.config.HEAD_LOSS_AUTO_LOGITS``),
and each route at the default precision with the logits in one tile (``full``): three of the head's products
instead of four, for 2 GB that a GPU can hold."""
SMOKE_CASES = (("semantic", "default", "auto"), ("context", "highest", "full"))
"""``--smoke``: both routes, both precisions and both head losses, each once (every case is an XLA compilation
of its own; at the smoke shape ``auto`` is one tile too)."""
T, BATCH = 2048, 8
SMOKE_T, SMOKE_BATCH = 64, 2
PROFILED_STEPS = 3
CPU_IDLE_EVENTS = ("Await", "ThunkExecutor", "ThreadpoolListener")
"""Events of the XLA CPU lines that wait, keep books or wrap the ops (``ThunkExecutor::Execute`` spans the thunks
it runs), not one op's work."""


def peak_dtype(matmul_precision: str, device: str) -> str:
    """The ``gemm.csv`` dtype whose peak a step at ``matmul_precision`` is measured against: JAX's ``default`` is
    TF32 passes on a GPU and float32 on a CPU; ``high`` is TF32 on a GPU; ``highest`` is float32."""
    if device != "cpu" and matmul_precision in ("default", "high"):
        return "tf32"
    return "fp32"


def case_config(route: str, precision: str, smoke: bool, head_loss: str = "auto"):
    """The row composed as the table driver composes it, with this case's route, precision, head loss and
    shape."""
    from experiments.table_plan import compose_row

    shape = (SMOKE_T, SMOKE_BATCH) if smoke else (T, BATCH)
    overrides = [f"memory.route={route}", f"train.matmul_precision={precision}", "train.precision=fp32",
                 f"train.head_loss={head_loss}", f"train.seq_len={shape[0]}", f"train.batch_size={shape[1]}"]
    return compose_row(TABLE, ROW, "smoke" if smoke else "paper", "jax", overrides)[0].run


def op_times(xspace: Path) -> tuple[dict[str, tuple[float, int]], str]:
    """``{op name: (total ns, count)}`` from a ``jax.profiler`` trace file, and where the ops were read: the GPU
    device planes' ``XLA Ops`` lines, else their stream lines (kernels), else the XLA CPU lines (the client's
    thread and its thread pool's) less :data:`CPU_IDLE_EVENTS`."""
    import jax

    data = jax.profiler.ProfileData.from_file(str(xspace))
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])

    def add(events) -> None:
        for ev in events:
            totals[ev.name][0] += ev.duration_ns
            totals[ev.name][1] += 1

    device = [plane for plane in data.planes if plane.name.startswith("/device:")]
    ops_lines = [line for plane in device for line in plane.lines if line.name == "XLA Ops"]
    kernel_lines = [line for plane in device for line in plane.lines if line.name.startswith("Stream")]
    if ops_lines:
        for line in ops_lines:
            add(line.events)
        source = "the device's XLA Ops line"
    elif kernel_lines:  # a trace without the per-op line: the kernels the streams ran
        for line in kernel_lines:
            add(line.events)
        source = "the device's stream lines (kernels)"
    else:
        for plane in data.planes:
            for line in plane.lines:
                if line.name.startswith("tf_XLA"):  # the client's thread and its Eigen pool's threads
                    add(ev for ev in line.events if ev.duration_ns > 0 and not ev.name.startswith("end:")
                        and not any(s in ev.name for s in CPU_IDLE_EVENTS))
        source = "the XLA CPU thunks"
    return {name: (ns, int(n)) for name, (ns, n) in totals.items()}, source


def profile_step(backend, state, x, y, out: Path, label: str) -> dict:
    """:data:`PROFILED_STEPS` steps under ``jax.profiler.trace``: ``jax_profile.txt`` (the op table) under ``out``,
    and the row for ``jax_profile.csv``."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            for _ in range(PROFILED_STEPS):
                state, _ = backend.train_step(state, x, y, 1e-4)
            wall = (time.perf_counter() - t0) / PROFILED_STEPS
        traces = sorted(Path(trace_dir).rglob("*.xplane.pb"))
        if not traces:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
        ops, source = op_times(traces[-1])
    busy_ms = sum(ns for ns, _ in ops.values()) / 1e6 / PROFILED_STEPS
    lines = [f"{label}: {PROFILED_STEPS} steps under jax.profiler; ops read from {source}",
             f"step wall {wall * 1e3:.2f} ms (profiled), ops {busy_ms:.2f} ms a step", "",
             f"{'ms/step':>9} {'% ops':>6} {'calls/step':>10}  op"]
    for name, (ns, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:40]:
        ms = ns / 1e6 / PROFILED_STEPS
        lines.append(f"{ms:9.3f} {100 * ms / busy_ms if busy_ms else 0.0:6.1f} {n / PROFILED_STEPS:10.1f}  {name}")
    (out / "jax_profile.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"[bench_cuda jax41m profile] step {wall * 1e3:.2f} ms, ops {busy_ms:.2f} ms ({source})",
          file=sys.stderr, flush=True)
    return {"case": label, "step_wall_ms": round(wall * 1e3, 2), "ops_ms": round(busy_ms, 2),
            "ops_pct": round(100 * busy_ms / (wall * 1e3), 1), "ops_per_step": round(
                sum(n for _, n in ops.values()) / PROFILED_STEPS, 1), "source": source}


def jax41m_section(peaks: dict[str, float], out: Path, warmup: int, steps: int, device: str = "cuda",
                   smoke: bool = False) -> tuple[list[dict], list[dict]]:
    """The timed rows (``jax41m.csv``) and the profile row (``jax_profile.csv``; op table ``jax_profile.txt``)."""
    from backends.jax.backend import JaxBackend
    from benchmarks.bench_models import _batch
    from benchmarks.common import first_and_warm_steps
    from pcaf_core.config import head_loss_chunks, head_loss_label
    from pcaf_core.flops import train_step_flops
    from pcaf_core.profiles import matmul_precision

    backend = JaxBackend("cpu" if device == "cpu" else "gpu")
    entries = []
    for route, precision, head_loss in SMOKE_CASES if smoke else CASES:
        cfg = case_config(route, precision, smoke, head_loss)
        state = backend.init(cfg)
        x, y, source = _batch(cfg)
        state, loss, first = first_and_warm_steps(backend, state, x, y, warmup)
        entries.append([cfg, state, x, y, {"first_step_s": round(first, 2), "first_loss": round(float(loss), 4),
                                           "tokens_source": source}, []])
        print(f"[bench_cuda jax41m {route} {precision} head_loss={head_loss}] ready (first step {first:.1f} s)",
              file=sys.stderr, flush=True)
    for _ in range(steps):
        for entry in entries:
            t0 = time.perf_counter()
            entry[1], _ = backend.train_step(entry[1], entry[2], entry[3], 1e-4)
            entry[5].append(time.perf_counter() - t0)
    rows = []
    for cfg, state, _, _, extra, times in entries:
        step_s = statistics.median(times)
        flops = train_step_flops(cfg.model, cfg.memory, "ar", cfg.train.seq_len, cfg.train.batch_size)
        precision = matmul_precision(cfg)
        dtype = peak_dtype(precision, device)
        gflops = flops / step_s / 1e9
        rows.append({"model": f"PCAF-{cfg.memory.route} 41M (JAX)", "row": f"{TABLE}/{ROW}", "route": cfg.memory.route,
                     "matmul_precision": precision, "head_loss": head_loss_label(head_loss_chunks(cfg)),
                     "head_loss_setting": cfg.train.head_loss,
                     "mode": "ar", "T": cfg.train.seq_len,
                     "batch": cfg.train.batch_size, "d": cfg.model.d_model, "layers": cfg.model.n_layers,
                     "V": cfg.model.vocab_size, "K": cfg.memory.top_k, "profile": cfg.profile.name,
                     "step_ms": round(step_s * 1e3, 2), "steps": len(times),
                     "step_times_ms": ";".join(f"{t * 1e3:.1f}" for t in times),
                     "tokens_per_s": round(cfg.train.seq_len * cfg.train.batch_size / step_s, 1),
                     "model_gflop_per_step": round(flops / 1e9, 3), "model_gflops": round(gflops, 2),
                     "peak_dtype": dtype, "peak_gflops": peaks[dtype],
                     "model_pct": round(100 * gflops / peaks[dtype], 2), **extra,
                     "peak_mb": round(backend.peak_memory_mb() or 0.0, 1), "params": backend.param_count(state)})
        r = rows[-1]
        print(f"[bench_cuda jax41m {r['route']} {r['matmul_precision']}, {r['head_loss']}] {r['step_ms']:.2f} ms/step, "
              f"{r['model_pct']}% of the {dtype} peak", file=sys.stderr, flush=True)
    cfg, state, x, y, _, _ = entries[0]  # the semantic route at the default precision, the row's head loss
    out.mkdir(parents=True, exist_ok=True)
    profile = profile_step(backend, state, x, y, out,
                           f"PCAF-semantic 41M (JAX) full AR T={cfg.train.seq_len} batch {cfg.train.batch_size}, "
                           f"matmul precision {matmul_precision(cfg)}")
    return rows, [profile]
