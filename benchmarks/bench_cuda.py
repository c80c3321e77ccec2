"""The speed targets of ``make bench`` on one CUDA GPU: bf16 against fp32, fraction of peak, routing, SDPA.

A CPU without a bf16 matrix unit cannot show the bf16 target (``docs/results/bench.md``), so this script
measures it where bf16 matrix units exist, with the same models, shapes and step as ``benchmarks/bench_models``
(the WikiText-2 paper-scale rows, profile ``reference_torch``: d=256, h=1000, 2 conv blocks, V=20,000, K=16;
``TorchBackend("cuda").train_step``: host batch in, loss on the host out, so each step ends synchronised).

Sections (``--sections``, comma-separated):

- ``gemm``: the fraction-of-peak GEMMs at GPU batch sizes (the head ``[B·T, h] @ [h, V]`` and the block MLP
  ``[B·T, d] @ [d, h]``, B·T = 8,192) in fp32 (``float32_matmul_precision("highest")``: no TF32), TF32 and
  bf16; CUDA events, median of 20 after 3 warm-ups. The largest FLOP/s per dtype is that dtype's peak. Also the
  device's copy bandwidth (``bandwidth.csv``): a 1 GiB buffer copied, bytes read and written per second.
- ``models``: training steps, fp32 beside bf16 autocast (``train.precision``), eager, compiled
  (``train.compile=on``) and compiled and replayed as CUDA graphs (``train.compile=cudagraphs``), dropout 0.1
  unless stated; the local and global-local Transformers with FlexAttention (``model.attention_impl=banded``)
  beside the masked local one at T=2048, batch 32 (on a CPU, ``--smoke``, the FlexAttention cases train masked,
  labelled so: FlexAttention has no backward pass there); the full-AR PCAF-context step also with the head loss in
  tiles (``train.head_loss=chunked``, model ``PCAF-context, chunked head``) and on the JAX backend
  (``JaxBackend("gpu").train_step``, compile ``xla``, model ``PCAF-context (JAX)``). Cases of one (mode, T, batch)
  are built together and their timed steps interleaved, one of each per round, so the bf16/fp32 ratios are side
  by side. Every row names its head loss (``head_loss``) and what fp32 meant (``matmul_precision``,
  docs/SPEC.md §9). Then each case runs as many steps again as a one-process run trains them, each launched
  before the previous one's loss is read (``pipelined_step_ms``, ``pipelined_model_pct``: the wall time of the
  run of steps over their number).
  ``step_peak_mb``: ``torch.cuda.max_memory_allocated`` over one step minus what was allocated before it
  (torch rows; a JAX row's ``peak_mb`` is the device's peak bytes in use since the process started). Torch and
  JAX share the process, so JAX allocates as it goes (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set) rather
  than taking 75% of the device at its first step; ``labels.csv`` records both allocators' settings.
  Fraction of peak: ``pcaf_core.flops.train_step_flops`` per step / step seconds / the dtype's GEMM peak.
- ``routing``: the routes of ``benchmarks/bench_routing`` (d=224, K=32, 32,768 buckets, batch 1, forward +
  backward, synchronised) on the GPU at T = 4K, 8K, 16K, plus ``recent_kernel`` (the ``recent`` route's
  candidate kernels, Triton, with gathered scores) beside ``recent`` (the bucket layout's band and GEMMs,
  what the models run in full AR).
- ``profile``: three steps of the full-AR PCAF-context case (T=1024, batch 8), eager, compiled (inductor) and
  replayed as CUDA graphs, in fp32 and in bf16 under ``torch.profiler`` (CPU and CUDA):
  ``profile_<dtype>[_<compile>].txt`` holds the op table by device time, ``trace_bf16_<compile>.json.gz`` each
  bf16 step's timeline (Perfetto or chrome://tracing), and ``profile.csv`` the step's wall time beside the GPU's
  busy time (the time its kernels and copies cover) and the kernel count, i.e. how much of the step the GPU
  waits for the host, and where: before the step's first kernel, and in all (``benchmarks/bench_cuda_profile.py``).
- ``jax41m``: the JAX full-AR step at the paper's 41M shape (T=2048, batch 8), semantic and context routes, at JAX's
  default matmul precision and at ``highest``, each against the GEMM peak of its own precision, and a
  ``jax.profiler`` op table of the semantic step (``benchmarks/bench_cuda_jax.py``): ``jax41m.csv``,
  ``jax_profile.csv``, ``jax_profile.txt``.
- ``traffic``: the bytes and FLOPs of every op of one eager full-AR PCAF-context step (T=1024, batch 8), fp32 and
  bf16, with the fused kernels and with ATen's passes, and the step's floor at the GEMM peaks and the copy
  bandwidth measured in the same run (``benchmarks/step_traffic.py``): ``traffic.csv`` (a row a step) and
  ``traffic_ops.csv`` (a row an op name a step). It runs last; a case that fails goes to ``failures.csv`` and the
  others are counted.

    python -m benchmarks.bench_cuda [--out-dir bench/cuda] [--sections gemm,models,routing,profile,jax41m,traffic]
        [--compiles eager,inductor,cudagraphs] [--only-windowed]
    python -m benchmarks.bench_cuda --render docs/results/bench_cuda --doc docs/results/bench_cuda.md

``make bench-cuda`` runs both, with ``benchmarks/precision_check.py`` at the paper shape in between.

The second form renders the page from the CSVs (``benchmarks.bench_cuda_report``; anywhere, no GPU).
``--smoke --device cpu`` runs every section at toy sizes (T = 64 steps of the rows at the smoke scale's widths,
128-256 token routes, no warm-up and one timed step a case) to check the script without a GPU; its numbers mean
nothing and its rows say ``bench_set=smoke``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_cuda_cases import (
    SMOKE_SCALE,
    GpuCase,
    case_config,
    device_config,
    failure_row,
    gpu_cases,
    windowed_cases,
)
from benchmarks.bench_cuda_report import COMPILES, render
from benchmarks.common import first_and_warm_steps, package_version, pipelined_steps, read_csv, write_csv

SECTIONS = ("gemm", "models", "routing", "profile", "jax41m", "traffic")
JAX_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
TORCH_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
STEPS = (*COMPILES, "xla")
"""What ``--compiles`` selects: torch's steps (``COMPILES``) and ``xla``, the JAX backend's jitted step."""
GEMM_TOKENS = 8192
ROUTING_SEQ_LENS = (4096, 8192, 16384)
SMOKE_ROUTING_SEQ_LENS = (128, 256)
ROUTING_ROUTES = ("recent", "recent_kernel", "topk_score", "semantic_bucketed", "dense")


def _build(case: GpuCase, cpu_case, device: str, smoke: bool = False):
    """``(config, policy note, backend, state)`` of one case: ``TorchBackend(device)`` or ``JaxBackend`` on JAX's
    device of the same kind (``gpu`` for ``cuda``); the note says what a CPU ran instead (:func:`device_config`).
    ``smoke``: the row at :data:`benchmarks.bench_cuda_cases.SMOKE_SCALE`."""
    cfg, note = device_config(case_config(case, cpu_case, SMOKE_SCALE if smoke else "paper"), device)
    if case.backend == "jax":
        from backends.jax.backend import JaxBackend

        backend = JaxBackend("cpu" if device == "cpu" else "gpu")
    else:
        from backends.torch.backend import TorchBackend

        backend = TorchBackend(device)
    state = backend.init(cfg)
    if case.backend == "torch" and not case.kernels:
        backend = _AtenForms(backend)
    return cfg, note, backend, state


class _AtenForms:
    """A torch backend whose training steps take ATen's forms instead of the fused ``pcaf::`` kernels
    (:func:`benchmarks.op_census.aten_forms`, entered around each step, so that the case's steps interleave with the
    other cases' in one process); everything else is the backend's."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def train_step(self, *args, **kwargs):
        from benchmarks.op_census import aten_forms

        with aten_forms():
            return self._backend.train_step(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


def cuda_labels(device: str) -> dict[str, object]:
    import torch

    if device == "cpu":
        from pcaf_core.sysinfo import machine_label

        name, sms = f"cpu: {machine_label()}", 0
    else:
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    return {"gpu": name, "gpu_sms": sms, "torch": torch.__version__,
            "triton": package_version("triton"), "jax": package_version("jax"), "cuda": torch.version.cuda,
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "torch_alloc_conf": os.environ.get(TORCH_ALLOC_CONF, ""),
            "jax_preallocate": os.environ.get(JAX_PREALLOCATE, "")}


def event_ms(fn, warmup: int, repeats: int, device: str = "cuda") -> float:
    """Median milliseconds of ``fn()``: CUDA events around each call on the current stream; on a CPU the
    wall clock."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cpu":
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _memory(device: str):
    """(allocated bytes, reset the peak, peak bytes) of ``device``; zeros on a CPU (no allocator statistics)."""
    import torch

    if device == "cpu":
        return (lambda: 0), (lambda: None), (lambda: 0)
    return torch.cuda.memory_allocated, torch.cuda.reset_peak_memory_stats, torch.cuda.max_memory_allocated


def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def gemm_section(device: str = "cuda", smoke: bool = False) -> list[dict]:
    import torch

    rows = []
    tokens = 256 if smoke else GEMM_TOKENS
    shapes = [("head", tokens, 1000, 20000 if not smoke else 2000), ("block MLP", tokens, 256, 1000)]
    for dtype, precision in (("fp32", "highest"), ("tf32", "high"), ("bf16", "highest")):
        torch.set_float32_matmul_precision(precision)
        for name, m, k, n in shapes:
            g = torch.Generator(device=device).manual_seed(0)
            tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
            a = torch.randn(m, k, device=device, generator=g).to(tdtype)
            b = torch.randn(k, n, device=device, generator=g).to(tdtype)
            ms = event_ms(lambda a=a, b=b: torch.mm(a, b), 3 if not smoke else 1, 20 if not smoke else 2, device)
            rows.append({"gemm": name, "dtype": dtype, "m": m, "k": k, "n": n, "ms": round(ms, 4),
                         "gflops": round(2.0 * m * k * n / ms / 1e6, 1)})
            print(f"[gemm {name} {dtype} {m}x{k} @ {k}x{n}] {rows[-1]['gflops']} GFLOP/s", file=sys.stderr, flush=True)
    torch.set_float32_matmul_precision("highest")
    return rows


def bandwidth_section(device: str = "cuda", smoke: bool = False) -> list[dict]:
    """The device's copy bandwidth: a bf16 buffer of 1 GiB (8 MiB with ``smoke``) copied into another, bytes read
    and written per second (CUDA events, median of 20 after 3 warm-ups)."""
    import torch

    n = (8 if smoke else 1024) * 2**20 // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src), 3 if not smoke else 1, 20 if not smoke else 2, device)
    row = {"op": "copy", "dtype": "bf16", "mb": round(2 * n / 1e6, 1), "ms": round(ms, 4),
           "gb_per_s": round(2 * 2 * n / ms / 1e6, 1)}
    print(f"[bandwidth copy {row['mb']} MB] {row['gb_per_s']} GB/s", file=sys.stderr, flush=True)
    return [row]


def traffic_section(out: Path, device: str = "cuda", smoke: bool = False
                    ) -> tuple[list[dict], list[dict], list[dict]]:
    """``traffic.csv``'s rows (one per step: fp32 and bf16, fused kernels and ATen's passes), ``traffic_ops.csv``'s
    (one per op name of each step), the floors at the rates of ``out``'s gemm section (with ``smoke`` at the models
    section's toy widths), and the cases that failed (as in :func:`models_section`: the rest go on)."""
    from benchmarks import step_traffic

    peaks, bandwidth = step_traffic.rates(out)
    T, batch = (64, 2) if smoke else (1024, 8)
    steps, ops, failures = [], [], []
    for precision in ("fp32", "bf16"):
        for fused in (True, False):
            model = "PCAF-context" if fused else "PCAF-context, ATen passes"
            try:
                # On a CPU (--smoke) the pcaf:: ops give their outputs' shapes without running: Triton's kernels
                # do not run on CPU tensors outside its interpreter, and the count is the same.
                counted = step_traffic.count_step(precision, T, batch, fused=fused, device=device,
                                                  scale=SMOKE_SCALE if smoke else "paper", kernels=device != "cpu")
            except (RuntimeError, ValueError) as err:
                failures.append(failure_row(GpuCase(model, "ar", T, batch, precision, "eager"), "traffic", err))
                continue
            case = {"model": model, "mode": "ar", "T": T, "batch": batch, "dtype": precision, "compile": "eager"}
            total = step_traffic.summary(counted, peaks, bandwidth)
            steps.append({**case, **total, "bf16_peak_gflops": peaks["bf16"], "fp32_peak_gflops": peaks["fp32"],
                          "bandwidth_gb_per_s": bandwidth})
            ops += [{**case, **r} for r in step_traffic.by_op(counted, peaks, bandwidth)]
            print(f"[bench_cuda traffic {model} {precision}] {total['ops']} ops, {total['read_gb']} + "
                  f"{total['written_gb']} GB, {total['gflop']} GFLOP: floor {total['floor_ms']} ms",
                  file=sys.stderr, flush=True)
    return steps, ops, failures


def _policy(cfg, note: str = "") -> str:
    """``benchmarks.bench_models``' policy label, except for Transformers, whose SDPA kernel that module reads
    off a CPU profile: here the device's own choice, or FlexAttention (``note``: what a CPU ran instead)."""
    from benchmarks.bench_models import _policy as cpu_policy
    from pcaf_core.config import TRANSFORMER_VARIANTS, WINDOWED_VARIANTS

    if cfg.model.variant in WINDOWED_VARIANTS:
        if cfg.model.attention_impl == "banded":
            return "FlexAttention over the window's block mask (torch.compile)"
        if cfg.model.attention_impl == "blocked":
            return "SDPA over query blocks and their windows' keys (the kernel torch picks on the device)"
        return "SDPA under the [T, T] window mask (the kernel torch picks on the device)" + note
    if cfg.model.variant in TRANSFORMER_VARIANTS:
        return "causal SDPA (the kernel torch picks on the device)"
    return cpu_policy(cfg)


def models_section(peaks: dict[str, float], warmup: int, steps: int, device: str = "cuda",
                   smoke: bool = False, compiles: tuple[str, ...] = STEPS,
                   only_windowed: bool = False) -> tuple[list[dict], list[dict]]:
    """The timed rows of the cases whose ``compile`` is in ``compiles`` (``xla``: the JAX cases; ``only_windowed``:
    of :func:`benchmarks.bench_cuda_cases.windowed_cases`), and the compiled cases that failed to build or compile
    (an eager failure is a bug and stops the run; a compiled case's is recorded so that one case cannot cost the
    whole run)."""
    import torch

    from benchmarks.bench_models import Case, _batch, finish
    from pcaf_core.config import head_loss_chunks, head_loss_label
    from pcaf_core.profiles import matmul_precision

    allocated, reset_peak, peak = _memory(device)
    # Every compiled case of a group is live at once; past Dynamo's recompile limit a step would run eager
    # under a compiled label, so hitting it stops the run instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    groups: dict[tuple, list[GpuCase]] = {}
    cases = windowed_cases(gpu_cases(smoke)) if only_windowed else gpu_cases(smoke)
    for case in (c for c in cases if c.compile in compiles):
        groups.setdefault((case.mode, case.T, case.batch if case.model != "dense Transformer (SDPA)" else 0),
                          []).append(case)
    rows, failures = [], []
    for group in groups.values():
        entries = []
        for case in group:
            cpu_case = Case(case.model, case.mode, case.T, case.batch, case.dropout,
                            case.compile if case.backend == "torch" else "eager", case.precision)
            try:
                cfg, note, backend, state = _build(case, cpu_case, device, smoke)
                x, y, source = _batch(cfg)
                state, loss, first = first_and_warm_steps(backend, state, x, y, warmup)
            except (RuntimeError, ValueError, torch._dynamo.exc.TorchDynamoException) as err:
                if case.compile == "eager":
                    raise
                failures.append(failure_row(case, "models", err))
                continue
            _sync(device)
            before = allocated()
            reset_peak()
            state, _ = backend.train_step(state, x, y, 1e-4)
            if case.backend == "torch":
                memory = {"step_peak_mb": round((peak() - before) / 2**20, 1)}
            else:  # XLA's allocator: the device's peak since the process started
                memory = {"step_peak_mb": "", "peak_mb": round(backend.peak_memory_mb() or 0.0, 1)}
            row = {"model": case.label, "backend": case.backend, "dtype": case.precision, "mode": case.mode,
                   "T": case.T, "batch": case.batch, "d": cfg.model.d_model, "d_hidden": cfg.model.d_hidden,
                   "layers": cfg.model.n_layers, "V": cfg.model.vocab_size, "dropout": case.dropout,
                   "compile": case.compile, "profile": cfg.profile.name, "policy": _policy(cfg, note),
                   "head_loss": head_loss_label(head_loss_chunks(cfg)), "head_loss_setting": cfg.train.head_loss,
                   "matmul_precision": matmul_precision(cfg),
                   "tokens_source": source, "first_step_s": round(first, 2), "first_loss": round(loss, 4),
                   **memory, "params": backend.param_count(state)}
            entries.append([cpu_case, cfg, backend, state, x, y, row, []])
            print(f"[bench_cuda {case.label} {case.mode} T={case.T} batch={case.batch} {case.precision} "
                  f"{case.compile}] ready (first step {first:.1f} s)", file=sys.stderr, flush=True)
        for _ in range(steps):
            for entry in entries:
                _, _, backend, state, x, y, _, times = entry
                t0 = time.perf_counter()
                entry[3], _ = backend.train_step(state, x, y, 1e-4)
                times.append(time.perf_counter() - t0)
        for entry in entries:  # then as the run loop trains: the next step launched before a loss is read
            _sync(device)
            entry[3], pipelined_s = pipelined_steps(entry[2], entry[3], entry[4], entry[5], steps)
            entry[6]["pipelined_step_ms"] = round(pipelined_s * 1e3, 2)
        for cpu_case, cfg, _, _, _, _, row, times in entries:
            row = finish(cpu_case, cfg, row, times)
            dtype_peak = peaks["bf16" if row["dtype"] == "bf16" else "fp32"]
            row.update(peak_gflops=dtype_peak, model_pct=round(100 * row["model_gflops"] / dtype_peak, 2),
                       executed_pct=round(100 * row["executed_gflops"] / dtype_peak, 2),
                       pipelined_model_pct=round(100 * row["model_gflop_per_step"] * 1e3 / row["pipelined_step_ms"]
                                                 / dtype_peak, 2))
            rows.append(row)
            print(f"[bench_cuda {row['model']} {row['mode']} T={row['T']} batch={row['batch']} {row['dtype']} "
                  f"{row['compile']}] {row['tokens_per_s']:.0f} tokens/s, {row['step_ms']:.2f} ms/step, "
                  f"{row['model_pct']}% of {dtype_peak} GFLOP/s", file=sys.stderr, flush=True)
        del entries
        # The group's compiled code and CUDA graph pools go with its models.
        torch._dynamo.reset()
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows, failures


def routing_section(repeats: int, device: str = "cuda", smoke: bool = False) -> list[dict]:
    import torch

    from benchmarks.bench_routing import D, K, inputs, torch_route_step

    allocated, reset_peak, peak = _memory(device)
    rows = []
    for T in SMOKE_ROUTING_SEQ_LENS if smoke else ROUTING_SEQ_LENS:
        raw = inputs(T)
        x = {n: torch.from_numpy(v).to(device) for n, v in raw.items() if isinstance(v, np.ndarray)}
        x["rho"] = torch.tensor(1.0, device=device)
        for route in ROUTING_ROUTES:
            step = torch_route_step(route, x)
            step()
            _sync(device)
            before = allocated()
            reset_peak()
            step()
            _sync(device)
            peak_mb = (peak() - before) / 2**20
            ms = event_ms(step, 3, repeats if route != "dense" or T < 16384 else max(3, repeats // 4), device)
            rows.append({"backend": "torch", "route": route, "T": T, "batch": 1, "d": D, "K": K, "dtype": "fp32",
                         "fwd_bwd_ms": round(ms, 4), "peak_mb": round(peak_mb, 2), "tokens": raw["source"]})
            print(f"[bench_cuda routing {route} T={T}] {ms:.3f} ms, peak {peak_mb:.1f} MB", file=sys.stderr, flush=True)
    return rows


def write_failures(out: Path, section: str, failures: list[dict]) -> None:
    """``failures.csv``: this run's failed cases of ``section`` replace that section's earlier ones (a run of
    some sections keeps the others' records); no file when nothing failed."""
    path = out / "failures.csv"
    kept = [r for r in read_csv(path) if r["section"] != section] if path.exists() else []
    if kept or failures:
        write_csv(path, kept + failures)
    elif path.exists():
        path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="bench/cuda")
    parser.add_argument("--compiles", default=",".join(STEPS),
                        help="the training steps to time and profile (comma-separated; default all; xla: the JAX "
                             "cases): a subset writes models.csv and profile.csv with those rows alone, so give it "
                             "its own --out-dir")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--only-windowed", action="store_true",
                        help="models section: only the windowed-attention cases and the next-token dense SDPA ones; "
                             "profile section: the global-local attention row's training step and evaluation batch "
                             "instead of the full-AR steps (give it its own --out-dir)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of a route")
    parser.add_argument("--render", default="", help="render the page from the CSVs in this folder and stop")
    parser.add_argument("--doc", default="docs/results/bench_cuda.md")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (only with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: checks the script, measures nothing")
    args = parser.parse_args(argv)
    if args.render:
        render(Path(args.render), Path(args.doc))
        print(args.doc)
        return 0
    # Torch and JAX steps alternate in this one process: JAX's default (taking 75% of the GPU's memory at its first
    # use) would leave torch a quarter, or fail where torch already holds more. Each allocator takes what its steps
    # need instead; the labels record both settings. Set before JAX starts its GPU client.
    os.environ.setdefault(JAX_PREALLOCATE, "false")
    import torch

    if args.device == "cpu" and not args.smoke:
        raise SystemExit("--device cpu is for --smoke runs; the CPU benchmarks are `make bench`")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.bench_cuda needs a CUDA device (or --smoke --device cpu); the CPU benchmarks "
                         "are `make bench`")
    torch.set_float32_matmul_precision("highest")
    out = Path(args.out_dir)
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    compiles = tuple(args.compiles.split(","))
    if set(compiles) - set(STEPS):
        raise SystemExit(f"unknown compile mode(s) {sorted(set(compiles) - set(STEPS))}; choose from "
                         f"{', '.join(STEPS)}")
    start = time.perf_counter()
    if args.smoke:
        args.warmup, args.steps, args.repeats = 0, 1, 2  # a case's first step, its memory step and one timed
    if "gemm" in sections:
        write_csv(out / "gemm.csv", gemm_section(args.device, args.smoke))
        write_csv(out / "bandwidth.csv", bandwidth_section(args.device, args.smoke))
    if ({"models", "jax41m", "traffic"} & set(sections)) and not (out / "gemm.csv").exists():
        raise SystemExit(f"the models, jax41m and traffic sections divide by the GEMM peaks: run them with gemm (no "
                         f"{out}/gemm.csv)")
    if "models" in sections:
        peaks = {d: max(float(r["gflops"]) for r in read_csv(out / "gemm.csv") if r["dtype"] == d)
                 for d in ("fp32", "bf16")}
        model_rows, failures = models_section(peaks, args.warmup, args.steps, args.device, args.smoke, compiles,
                                              args.only_windowed)
        write_csv(out / "models.csv", model_rows)
        write_failures(out, "models", failures)
    if "routing" in sections:
        write_csv(out / "routing.csv", routing_section(args.repeats, args.device, args.smoke))
    if "profile" in sections:
        from benchmarks.bench_cuda_profile import profile_section, windowed_profile_section

        out.mkdir(parents=True, exist_ok=True)
        if args.only_windowed:
            write_csv(out / "profile_windowed.csv", windowed_profile_section(out, args.device, args.smoke))
        else:
            profile_rows, failures = profile_section(out, args.device, args.smoke, compiles)
            write_csv(out / "profile.csv", profile_rows)
            write_failures(out, "profile", failures)
    if "jax41m" in sections:
        from benchmarks.bench_cuda_jax import jax41m_section

        peaks = {d: max(float(r["gflops"]) for r in read_csv(out / "gemm.csv") if r["dtype"] == d)
                 for d in ("fp32", "tf32")}
        jax_rows, jax_profile = jax41m_section(peaks, out, args.warmup, args.steps, args.device, args.smoke)
        write_csv(out / "jax41m.csv", jax_rows)
        write_csv(out / "jax_profile.csv", jax_profile)
    if "traffic" in sections:  # last: it only states floors, and a failure leaves the other sections' files
        traffic_steps, traffic_ops, failures = traffic_section(out, args.device, args.smoke)
        for name, rows in (("traffic", traffic_steps), ("traffic_ops", traffic_ops)):
            if rows:
                write_csv(out / f"{name}.csv", rows)
            else:  # every case failed (failures.csv says why): no earlier run's floors beside this run's rows
                (out / f"{name}.csv").unlink(missing_ok=True)
        write_failures(out, "traffic", failures)
    write_csv(out / "labels.csv", [{**cuda_labels(args.device), "bench_set": "smoke" if args.smoke else "full",
                                    "wall_s": round(time.perf_counter() - start, 1)}])
    print(f"{out} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
