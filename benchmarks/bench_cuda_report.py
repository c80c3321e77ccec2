"""The page of a ``benchmarks.bench_cuda`` run: ``docs/results/bench_cuda.md`` from its CSVs, with the targets
judged, and the bf16 verdicts that ``benchmarks/bench_report`` cites in the CPU report. Needs no GPU.

    python -m benchmarks.bench_cuda --render docs/results/bench_cuda --doc docs/results/bench_cuda.md
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import late_curve_gap, paired_speedup, read_csv

BF16_TARGET, SDPA_TARGET = 2.5, 6.1
BF16_PEAK_TARGET, NO_GRAPHS_TARGET = 50.0, 2.0
"""The bf16 full-AR step's targets (T=1024, batch 8): % of the bf16 GEMM peak (model FLOPs, the best step), and
the speed-up of the best step without CUDA graphs over the eager step with ATen's passes."""
ATEN_PASSES = "ATen passes"
"""The label of a ``benchmarks.bench_cuda`` case whose step takes none of the fused ``pcaf::`` kernels an eager CUDA
step would (the head loss's 16-bit passes, dropout alone and fused, the memory read's row passes, the L2
normalisation: ``benchmarks.op_census.aten_forms``) but ATen's forms: the eager step as it was before those kernels,
timed beside it."""
ATEN_PASSES_MODEL = f"PCAF-context, {ATEN_PASSES}"
"""That case's row: the full-AR PCAF-context step."""
CHUNKED_HEAD_MODEL = "PCAF-context, chunked head"
"""The row of the full-AR PCAF-context case trained with the head loss in tiles (``train.head_loss=chunked``),
beside the row of the same case with the default head loss (``auto``)."""
JAX_PEAK_TARGET = 50.0
"""%: the JAX full-AR step at the 41M shape against the GEMM peak of the matmul precision it ran at."""
COMPILES = ("eager", "inductor", "cudagraphs")
"""The ``compile`` labels of ``benchmarks.bench_cuda`` rows: eager, ``torch.compile`` (inductor), and inductor
replayed as CUDA graphs."""
CURVE_RUNS = (("precision", "eager"), ("precision_cudagraphs", "cudagraphs"),
              ("precision_chunked", "eager, chunked head"), ("precision_jax", "JAX"))
"""The bf16-against-fp32 learning-curve runs of ``make bench-cuda``: the file stem of each (``<stem>.csv`` and
``<stem>.md`` from ``benchmarks/precision_check.py``) and the step both of its runs trained with: torch's eager
step, the same replayed as CUDA graphs, the eager step with the head loss in tiles (``train.head_loss=chunked``),
and the JAX backend's step (where JAX computes on the GPU)."""
CURVE_TOLERANCE = 0.01
"""nats: bf16 and fp32 validation losses "match within noise" when no evaluation after the first third of the
run differs by more (a PPL factor of 1.01)."""


def _f(x: str | float, nd: int = 2) -> str:
    return f"{float(x):,.{nd}f}"


def _verdict(ok: bool, by: float) -> str:
    return "**met**" if ok else f"**missed by {by:.2f}x**"


def _head(r: dict) -> str:
    """A JAX 41M row's head loss (``one tile``, ``1024x8192 tiles``); empty for rows from before the column."""
    return r.get("head_loss", "").removeprefix("head loss in ")


def jax41m_lines(bench_dir: Path) -> tuple[list[str], list[str]]:
    """The JAX 41M rows' target lines and their section (``benchmarks/bench_cuda_jax.py``); empty without them."""
    if not (bench_dir / "jax41m.csv").exists():
        return [], []
    rows = read_csv(bench_dir / "jax41m.csv")
    targets = [f"| JAX full-AR step at the 41M shape (T={r['T']}, batch {r['batch']}, {r['route']} route, matmul "
               f"precision {r['matmul_precision']}{', head loss in ' + _head(r) if _head(r) else ''}) "
               f">= {JAX_PEAK_TARGET:.0f}% of the {r['peak_dtype']} "
               "GEMM peak | "
               f"{r['model_pct']}% ({r['step_ms']} ms a step; {_f(r['model_gflops'], 0)} of "
               f"{_f(r['peak_gflops'], 0)} GFLOP/s) | "
               f"{_verdict(float(r['model_pct']) >= JAX_PEAK_TARGET, JAX_PEAK_TARGET / float(r['model_pct']))} |"
               for r in rows]
    out = ["", "## The JAX full-AR step at the 41M shape", "",
           f"`{rows[0]['row']}` at the paper's scale (d={rows[0]['d']}, "
           f"{rows[0]['layers']} blocks, V={rows[0]['V']}, K={rows[0]['K']}, profile {rows[0]['profile']}), the "
           "context route the same row with `memory.route=context`; one `JaxBackend(\"gpu\").train_step` per step, "
           "the cases' steps interleaved, median; % of peak: analytic model FLOPs / step time / the GEMM peak of "
           "the precision the step ran at (JAX's `default` is TF32 passes on a GPU). The head loss runs as the row "
           "has it (`auto`: in tiles at this shape, which recompute the logits: a fourth product of the head) or "
           "in one tile (`train.head_loss=full`); the model FLOPs count three.", "",
           "| model | matmul precision | head loss | T | batch | step (ms) | tokens/s | model GFLOP/s | peak | "
           "% of peak | first step (s) | peak (MB) |", "|---" * 12 + "|"]
    out += [f"| {r['model']} | {r['matmul_precision']} | {_head(r) or 'row default'} | {r['T']} | {r['batch']} | "
            f"{r['step_ms']} | {_f(r['tokens_per_s'], 0)} | {_f(r['model_gflops'], 0)} | {r['peak_dtype']} "
            f"{_f(r['peak_gflops'], 0)} | {r['model_pct']} | {r['first_step_s']} | {r['peak_mb']} |" for r in rows]
    profile = bench_dir / "jax_profile.csv"
    if profile.exists():
        (p,) = read_csv(profile)
        table = (bench_dir / "jax_profile.txt").read_text(encoding="utf-8").splitlines()
        out += ["", f"Where the step's time goes ({p['case']}; `jax.profiler`, ops read from {p['source']}): a "
                f"profiled step takes {p['step_wall_ms']} ms, its ops {p['ops_ms']} ms ({p['ops_pct']}%, "
                f"{_f(p['ops_per_step'], 0)} op runs a step); the rest is the host's share. The 15 longest ops "
                "(the first 40 in `jax_profile.txt`):", "", "```", *table[3:19], "```"]
    return targets, out


def _head_pair_part(label: str, auto: dict, other: dict) -> tuple[str, bool]:
    """One (auto, other head loss) pair of rows timed in the same rounds: its text and whether auto's form is the
    faster one or a tie (:func:`benchmarks.common.paired_speedup`)."""
    x, note, tie = paired_speedup(auto, other)
    ok = tie or x < 1.0
    return (f"{label}: {_head(auto)} {auto['step_ms']} ms (auto) against {_head(other)} {other['step_ms']} ms, the "
            f"latter at {x:.2f}x auto's speed{' (' + note + ')' if note else ''}"), ok


def head_default_lines(models: list[dict], jax_rows: list[dict]) -> list[str]:
    """Whether ``train.head_loss=auto`` picks the faster head loss where a run timed both forms
    (``head_loss_setting`` ``auto`` beside another setting): the full-AR PCAF-context step (T=1024, batch 8) against
    :data:`CHUNKED_HEAD_MODEL` for each dtype and compile, and the JAX 41M rows (the row's head loss against
    ``train.head_loss=full``) for each route and precision. One line per backend; none where a run has no such
    pair (runs from before the column), or where both settings ran the same form at that shape."""
    def pairs(rows: list[dict], keys: tuple[str, ...], label) -> list[tuple[str, bool]]:
        out = []
        for alt in (r for r in rows if r.get("head_loss_setting") not in (None, "", "auto")):
            auto = next((r for r in rows if r.get("head_loss_setting") == "auto"
                         and all(r[k] == alt[k] for k in keys)), None)
            if auto and auto["head_loss"] != alt["head_loss"]:
                out.append(_head_pair_part(label(alt), auto, alt))
        return out

    torch_rows = [r for r in models if r["model"] in ("PCAF-context", CHUNKED_HEAD_MODEL) and r["mode"] == "ar"
                  and r.get("backend", "torch") == "torch" and int(r["T"]) == 1024 and int(r["batch"]) == 8]
    found = (("torch", "T=1024, batch 8", pairs(torch_rows, ("dtype", "compile"),
                                                lambda r: f"{r['dtype']} {r['compile']}")),
             ("JAX", "41M, T=2048, batch 8", pairs(jax_rows, ("route", "matmul_precision"),
                                                   lambda r: f"{r['route']} route, precision {r['matmul_precision']}")))
    out = []
    for backend, shape, found_pairs in found:
        if found_pairs:
            missed = [text.split(":")[0] for text, good in found_pairs if not good]
            out.append(f"| The head loss's default (`train.head_loss=auto`) is the faster form, where both were timed "
                       f"({backend}, full AR, {shape}; paired rounds) | {'; '.join(t for t, _ in found_pairs)} | "
                       + (f"**missed** ({', '.join(missed)}) |" if missed else "**met** |"))
    return out


def bf16_step_lines(models: list[dict], peak: dict[str, float], floor: dict | None = None) -> list[str]:
    """The target lines of the bf16 full-AR PCAF-context step at T=1024, batch 8, from a run's model rows: its
    share of the bf16 GEMM peak (every torch case listed, the best judged, with the step's FLOPs' time at that
    peak and, given ``floor``, the ``traffic.csv`` row of the eager step, its op graph's floor), and the best step
    without CUDA graphs against the eager step with ATen's passes timed in the same run (only where the run has
    that row)."""
    rows = [r for r in models if r["model"].startswith("PCAF-context") and r.get("backend", "torch") == "torch"
            and r["mode"] == "ar" and int(r["T"]) == 1024 and r["dtype"] == "bf16"]
    if not rows or "bf16" not in peak:
        return []

    def case(r: dict) -> str:
        extra = r["model"].removeprefix("PCAF-context").removeprefix(", ")
        return r["compile"] + (f", {extra}" if extra else "")

    def pct_of(r: dict) -> float:  # the better of the step timed alone and as the run loop trains it
        return max(float(r["model_pct"]), float(r.get("pipelined_model_pct") or 0.0))

    def pct_text(r: dict) -> str:
        piped = r.get("pipelined_model_pct")
        return f"{float(r['model_pct']):.1f}%" + (f" ({float(piped):.1f}% pipelined)" if piped else "")

    best = max(rows, key=pct_of)
    floor_ms = float(best["model_gflop_per_step"]) / peak["bf16"] * 1e3
    parts = ", ".join(f"{pct_text(r)} {case(r)}" for r in rows)
    pct = pct_of(best)
    best_ms = best["step_ms"] if float(best["model_pct"]) >= pct else best["pipelined_step_ms"]
    graph = ""
    if floor is not None:
        most = float(best["model_gflop_per_step"]) / float(floor["floor_ms"]) / peak["bf16"] * 1e5
        graph = (f"; the eager step's op graph at its floor: {floor['floor_ms']} ms, {most:.0f}% of peak "
                 "([below](#the-eager-steps-floor))")
    out = [f"| Full-AR PCAF-context bf16 >= {BF16_PEAK_TARGET:.0f}% of the bf16 GEMM peak (T=1024, batch 8; model "
           f"FLOPs) | {parts} (best {best_ms} ms a step; {floor_ms:.2f} ms at the peak of "
           f"{_f(peak['bf16'], 0)} GFLOP/s{graph}) | {_verdict(pct >= BF16_PEAK_TARGET, BF16_PEAK_TARGET / pct)} |"]
    base = next((r for r in rows if r["model"] == ATEN_PASSES_MODEL and r["compile"] == "eager"), None)
    fast = [r for r in rows if r is not base and r["compile"] in ("eager", "inductor")]
    if base and fast:
        top = min(fast, key=lambda r: float(r["step_ms"]))
        ratio = float(base["step_ms"]) / float(top["step_ms"])
        others = ", ".join(f"{case(r)} {r['step_ms']} ms" for r in fast if r is not top)
        out.append(f"| Full-AR PCAF-context bf16 step without CUDA graphs >= {NO_GRAPHS_TARGET:.0f}x the eager step "
                   f"with ATen's passes (T=1024, batch 8; timed in the same run) | {base['step_ms']} / "
                   f"{top['step_ms']} ms = {ratio:.2f}x ({case(top)}" + (f"; {others}" if others else "") + ") | "
                   f"{_verdict(ratio >= NO_GRAPHS_TARGET, NO_GRAPHS_TARGET / ratio)} |")
    return out


def traffic_lines(bench_dir: Path, models: list[dict]) -> tuple[dict | None, list[str]]:
    """The eager bf16 step's ``traffic.csv`` row (None without one) and the section on the eager steps' floors
    (``benchmarks/step_traffic.py``: the traffic section of a run); empty without ``traffic.csv``."""
    if not (bench_dir / "traffic.csv").exists():
        return None, []
    steps = read_csv(bench_dir / "traffic.csv")
    measured = {(r["model"], r["dtype"]): r for r in models if r["mode"] == "ar" and r["compile"] == "eager"
                and r.get("backend", "torch") == "torch" and int(r["T"]) == int(steps[0]["T"])
                and int(r["batch"]) == int(steps[0]["batch"])}
    first = steps[0]
    out = ["", "## The eager step's floor", "",
           f"Every op of one eager full-AR PCAF-context step (T={first['T']}, batch {first['batch']}) charged "
           "the bytes of its operands and results and its FLOPs (`benchmarks/step_traffic.py`; a gather its rows, "
           "a `pcaf::` kernel one op): an op's floor is the longer of its FLOPs at its dtype's GEMM peak and its "
           f"bytes at the copy bandwidth ({_f(first['bandwidth_gb_per_s'], 0)} GB/s, measured in this run), "
           "the step's floor the sum, with no time between kernels. This op graph cannot run faster; the compiled "
           "steps run inductor's op graph, which fuses further.", "",
           "| step | dtype | ops | GB read | GB written | GFLOP | FLOPs at peak (ms) | other ops' bytes (ms) | "
           "floor (ms) | eager step (ms) | step / floor |", "|---" * 11 + "|"]
    for r in steps:
        step = measured.get((r["model"], r["dtype"]))
        ratio = f"{float(step['step_ms']) / float(r['floor_ms']):.1f}x" if step else ""
        out.append(f"| {r['model']} | {r['dtype']} | {r['ops']} | {r['read_gb']} | {r['written_gb']} | {r['gflop']} | "
                   f"{r['gemm_floor_ms']} | {r['bytes_floor_ms']} | {r['floor_ms']} | "
                   f"{step['step_ms'] if step else ''} | {ratio} |")
    ops = [r for r in read_csv(bench_dir / "traffic_ops.csv")
           if r["model"] == "PCAF-context" and r["dtype"] == "bf16"] if (bench_dir / "traffic_ops.csv").exists() else []
    if ops:
        out += ["", "The bf16 step's ops with the longest floors:", "",
                "| op | count | MB read | MB written | GFLOP | floor (ms) |", "|---" * 6 + "|"]
        out += [f"| `{r['op']}` | {r['count']} | {r['read_mb']} | {r['written_mb']} | {r['gflop']} | {r['floor_ms']} |"
                for r in ops[:10]]
    bf16 = next((r for r in steps if r["model"] == "PCAF-context" and r["dtype"] == "bf16"), None)
    return bf16, out


def bf16_summary(bench_dir: Path) -> dict[str, str] | None:
    """The GPU's bf16 verdicts for ``benchmarks/bench_report`` (the CPU report cites them), from a committed run
    under ``bench_dir``: ``gpu``, ``speed`` (measured ratios), ``speed_verdict``, ``curves`` and
    ``curves_verdict``; None without such a run."""
    if not (bench_dir / "models.csv").exists() or not (bench_dir / "labels.csv").exists():
        return None
    labels = read_csv(bench_dir / "labels.csv")[0]
    rows = {(r["T"], r["batch"], r["compile"], r["dtype"]): r for r in read_csv(bench_dir / "models.csv")
            if r["model"] == "PCAF-context" and r["mode"] == "ar"}
    ratios: dict[str, float] = {}
    for (T, batch, comp, dtype), r in rows.items():
        fp = rows.get((T, batch, comp, "fp32"))
        if dtype == "bf16" and fp:
            ratios[f"T={T} batch {batch} {comp}"] = float(r["tokens_per_s"]) / float(fp["tokens_per_s"])
    if not ratios:
        return None
    # A run chooses its step (eager, compiled, CUDA graphs), so the target holds where its best case does; every
    # case's ratio is listed beside the verdict.
    best = max(ratios, key=ratios.get)
    verdict = "met" if ratios[best] >= BF16_TARGET else f"missed by {BF16_TARGET / ratios[best]:.2f}x"
    out = {"gpu": labels["gpu"], "speed": "; ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()),
           "speed_verdict": f"{verdict} (best case: {best})",
           "curves": "not measured", "curves_verdict": "not measured"}
    gaps = curve_gaps(bench_dir)
    if gaps:
        out.update(curves="; ".join(f"{step} step: largest eval-loss difference {gap:.4f} nats after the first third"
                                    for step, gap in gaps.items()),
                   curves_verdict="met" if max(gaps.values()) <= CURVE_TOLERANCE else "missed")
    return out


def curve_gaps(bench_dir: Path) -> dict[str, float]:
    """{step (``eager``, ``cudagraphs``): the largest bf16-fp32 eval-loss gap after the first third} for each
    learning-curve run of ``CURVE_RUNS`` present under ``bench_dir``."""
    return {step: late_curve_gap(read_csv(bench_dir / f"{stem}.csv")) for stem, step in CURVE_RUNS
            if (bench_dir / f"{stem}.csv").exists()}


FLEX_MODELS = ("local Transformer (FlexAttention)", "global-local Transformer (FlexAttention)",
               "local Transformer (blocked SDPA)", "global-local Transformer (blocked SDPA)")
"""The windowed rows the page sets beside the masked local model and the dense Transformer: FlexAttention
(``banded``) and blocked SDPA (``blocked``), each without a ``[T, T]`` array."""
MASKED_LOCAL, DENSE = "local Transformer (masked dense SDPA)", "dense Transformer (SDPA)"


def windowed_section(models: list[dict]) -> list[str]:
    """The page's lines on windowed attention: the next-token steps of the local and global-local Transformers with
    FlexAttention beside the masked local one and the dense SDPA Transformer, per target (they train different
    batches), each dtype; nothing when the run has no FlexAttention row."""
    rows = [r for r in models if r["model"] in (*FLEX_MODELS, MASKED_LOCAL, DENSE) and r["mode"] == "nt"
            and r["compile"] == "eager"]
    if not any(r["model"] in FLEX_MODELS for r in rows):
        return []
    out = ["", "## Windowed attention beside SDPA", "",
           "Next-token training steps of the Transformers (the WikiText-2 paper rows' model: d, layers and V in the "
           "table below; dropout on the attention weights too), eager steps: the local (w=128) and global-local "
           "(w=128, g=16) models with FlexAttention over the window's block mask (`model.attention_impl=banded`, what "
           "`auto` runs on CUDA; two FlexAttention calls a layer with dropout, docs/KERNELS.md; a next-token step of "
           "either runs the sub-window its prediction reads, the global prefix and the last layers·(w-1)+1 "
           "positions), the same models as SDPA over query blocks and their windows' keys (`blocked`: one SDPA "
           "call a layer, its own dropout), the local model under the `[T, T]` mask (`masked`), and the dense causal "
           "SDPA Transformer. Per target, since the rows train different batches (the `wt2-nt-2048` rows' 32 for "
           "the windowed models); `x masked`: targets/s over "
           "the masked local model's in the same dtype, `x dense`: over the dense Transformer's.", "",
           "| model | dtype | T | batch | step (ms) | targets/s | step peak (MB) | x masked | x dense | policy |",
           "|---" * 10 + "|"]
    for dtype in ("fp32", "bf16"):
        same = [r for r in rows if r["dtype"] == dtype]
        base = {m: next((float(r["targets_per_s"]) for r in same if r["model"] == m), 0.0)
                for m in (MASKED_LOCAL, DENSE)}
        for r in sorted(same, key=lambda r: (r["model"] not in FLEX_MODELS, r["model"])):
            tps = float(r["targets_per_s"])
            ratios = [f"{tps / base[m]:.2f}x" if base[m] else "-" for m in (MASKED_LOCAL, DENSE)]
            out.append(f"| {r['model']} | {dtype} | {r['T']} | {r['batch']} | {r['step_ms']} | {_f(tps, 0)} | "
                       f"{r['step_peak_mb']} | {ratios[0]} | {ratios[1]} | {r.get('policy', '')} |")
    return out


def windowed_profile_lines(bench_dir: Path) -> list[str]:
    """Where the global-local attention row's training step and evaluation batch spend their time
    (``profile_windowed.csv`` and the op tables of ``--sections profile --only-windowed``); empty without them."""
    if not (bench_dir / "profile_windowed.csv").exists():
        return []
    rows = read_csv(bench_dir / "profile_windowed.csv")
    first = rows[0]
    out = ["", "## Where the global-local row's time goes", "",
           f"Three training steps and three evaluation batches of the {first['model']} next-token row (T={first['T']}, "
           f"batch {first['batch']}, {first['dtype']}, {first['compile']}, as `wt2-nt-1024` trains it) under "
           "`torch.profiler` (its wall time includes the profiler's own overhead): the GPU's busy time is the time its "
           "kernels and copies cover; to the first kernel and GPU idle as in the full-AR profile; op tables by device "
           "time in `profile_windowed_<train|eval>.txt`.", "",
           "| call | attention | wall (ms, profiled) | GPU busy (ms) | GPU busy % | kernels a call | to the first "
           "kernel (ms) | GPU idle (ms) |", "|---" * 8 + "|"]
    out += [f"| {r['step']} | {r['policy']} | {r['step_wall_ms']} | {r['gpu_busy_ms']} | {r['gpu_busy_pct']} | "
            f"{r['kernels_per_step']} | {r['first_kernel_ms']} | {r['gpu_idle_ms']} |" for r in rows]
    for r in rows:
        table = bench_dir / f"profile_windowed_{r['step']}.txt"
        if table.exists():
            out += ["", f"The {r['step']} call's ops:", "", "```",
                    *table.read_text(encoding="utf-8").splitlines()[:18], "```"]
    return out


def render(bench_dir: Path, doc: Path) -> None:
    """``doc`` from the CSVs of a run under ``bench_dir`` (gemm.csv, models.csv, routing.csv, labels.csv and,
    when present, the learning-curve runs of ``CURVE_RUNS`` from ``benchmarks/precision_check.py`` on the same
    GPU)."""
    labels = read_csv(bench_dir / "labels.csv")[0]
    gemm = read_csv(bench_dir / "gemm.csv")
    models = read_csv(bench_dir / "models.csv")
    routing = read_csv(bench_dir / "routing.csv") if (bench_dir / "routing.csv").exists() else []
    peak = {d: max(float(r["gflops"]) for r in gemm if r["dtype"] == d) for d in {r["dtype"] for r in gemm}}

    def row_of(model, mode, T, dtype, compile_="eager"):
        for r in models:
            if (r["model"], r["mode"], int(r["T"]), r["dtype"], r["compile"]) == (model, mode, T, dtype, compile_):
                return r
        return None

    smoke = labels.get("bench_set") == "smoke"
    alloc_conf = labels.get("torch_alloc_conf")  # None (and no JAX setting) in a run from before they were recorded
    if alloc_conf is None and not labels.get("jax_preallocate"):
        allocators = "not recorded (the run predates their labels)"
    else:
        torch_alloc = ("torch's not recorded" if alloc_conf is None else
                       f"torch `PYTORCH_CUDA_ALLOC_CONF={alloc_conf}`" if alloc_conf else "torch's default")
        allocators = (f"{torch_alloc}, JAX `XLA_PYTHON_CLIENT_PREALLOCATE="
                      f"{labels.get('jax_preallocate') or 'not recorded'}`")
    out = [f"# Speed targets on one CUDA GPU: {labels['gpu']}" + (" (smoke run: toy sizes, no figure means "
                                                                  "anything)" if smoke else ""), "",
           f"`python -m benchmarks.bench_cuda` on {labels['gpu']} ({labels['gpu_sms']} SMs), torch {labels['torch']}, "
           f"Triton {labels['triton']}, CUDA {labels['cuda']}; fp32 means `float32_matmul_precision="
           f"\"{labels['float32_matmul_precision']}\"` (matmul TF32 {labels['matmul_tf32']}, cuDNN TF32 "
           f"{labels['cudnn_tf32']}); allocators: {allocators}; section wall time {labels['wall_s']} s. These are the "
           "GPU machine's own "
           "packages, not the project's CPU pins; the CPU report is [`bench.md`](bench.md). "
           f"Each ratio below comes from steps interleaved in one process. CSVs and op tables: `{bench_dir.name}/`.",
           "", "## Targets", "",
           "| target | measured | verdict |", "|---|---|---|"]
    for T in (1024, 2048):
        for comp in COMPILES:
            fp, bf = row_of("PCAF-context", "ar", T, "fp32", comp), row_of("PCAF-context", "ar", T, "bf16", comp)
            if fp and bf:
                ratio = float(bf["tokens_per_s"]) / float(fp["tokens_per_s"])
                out.append(f"| Full-AR PCAF-context bf16 autocast >= {BF16_TARGET}x fp32 tokens/s (T={T}, batch "
                           f"{fp['batch']}, {comp}) | {_f(bf['tokens_per_s'], 0)} / {_f(fp['tokens_per_s'], 0)} = "
                           f"{ratio:.2f}x | {_verdict(ratio >= BF16_TARGET, BF16_TARGET / ratio)} |")
    ar_fp32 = [r for r in (row_of("PCAF-context", "ar", 1024, "fp32", c) for c in COMPILES) if r]
    if ar_fp32:
        best = max(float(r["model_pct"]) for r in ar_fp32)
        parts = ", ".join(f"{float(r['model_pct']):.1f}% {r['compile']}" for r in ar_fp32)
        out.append(f"| Full-AR PCAF-context fp32 >= 80% of the fp32 GEMM peak (T=1024, batch 8) | {parts} (of "
                   f"{_f(peak['fp32'], 0)} GFLOP/s) | {_verdict(best >= 80, 80 / best)} |")
    traffic_floor, traffic_section = traffic_lines(bench_dir, models)
    out += bf16_step_lines(models, peak, traffic_floor)
    for dtype in ("fp32", "bf16"):
        p, d = row_of("PCAF-context", "nt", 2048, dtype), row_of("dense Transformer (SDPA)", "nt", 2048, dtype)
        if p and d:
            ratio = float(p["targets_per_s"]) / float(d["targets_per_s"])
            out.append(f"| Next-token T=2048, dropout {p['dropout']}: PCAF-context >= {SDPA_TARGET}x the fused-SDPA "
                       f"dense Transformer per target ({dtype}) | {_f(p['targets_per_s'], 0)} / "
                       f"{_f(d['targets_per_s'], 0)} targets/s = {ratio:.1f}x | "
                       f"{_verdict(ratio >= SDPA_TARGET, SDPA_TARGET / ratio)} |")
    jax_targets, jax_section = jax41m_lines(bench_dir)
    out += jax_targets
    out += head_default_lines(models, read_csv(bench_dir / "jax41m.csv") if (bench_dir / "jax41m.csv").exists()
                              else [])
    by = {(r["route"], int(r["T"])): float(r["fwd_bwd_ms"]) for r in routing}
    for step, worst in curve_gaps(bench_dir).items():
        out.append(f"| bf16 learning curves match fp32 within noise ({step} step; at most {CURVE_TOLERANCE} nats "
                   f"apart after the first third; [below](#bf16-learning-curves-on-the-same-gpu)) | largest "
                   f"difference {worst:.4f} nats | {'**met**' if worst <= CURVE_TOLERANCE else '**missed**'} |")
    profile = bench_dir / "profile.csv"
    if profile.exists():
        prof_rows = read_csv(profile)
        # Where the GPU waits (benchmarks.bench_cuda_profile.step_gaps): runs from before those columns leave them out.
        gaps = any(r.get("first_kernel_ms") for r in prof_rows)
        out += ["", "## Where the full-AR step's time goes", "",
                "Three steps of the full-AR PCAF-context case (T=1024, batch 8) under `torch.profiler` (its wall "
                "time includes the profiler's own overhead): " + (
                    "the GPU's busy time is the time its kernels and copies cover (overlaps counted once); to the "
                    "first kernel: from a step's start to its first kernel, while the GPU waits on the host "
                    "(medians over the steps); GPU idle: the time within a step that no kernel covers; " if gaps
                    else "the GPU's busy time is the sum of its kernels; ")
                + "the op tables by device time are `profile_<dtype>[_<compile>].txt` beside the CSVs" + (
                    ", and the bf16 steps' timelines `trace_bf16_<compile>.json.gz` (Perfetto, chrome://tracing)."
                    if any(bench_dir.glob("trace_bf16_*.json.gz")) else "."), "",
                "| dtype | compile | step wall (ms, profiled) | GPU busy (ms) | GPU busy % | kernels a step |" + (
                    " to the first kernel (ms) | GPU idle in the step (ms) |" if gaps else ""),
                "|---" * (8 if gaps else 6) + "|"]
        out += [f"| {r['dtype']} | {r.get('compile', 'eager')} | {r['step_wall_ms']} | {r['gpu_busy_ms']} | "
                f"{r['gpu_busy_pct']} | {r['kernels_per_step']} |" + (
                    f" {r['first_kernel_ms']} | {r['gpu_idle_ms']} |" if gaps else "") for r in prof_rows]
        prof = {r["dtype"]: r for r in prof_rows if r.get("compile", "eager") == "eager"}
        fp, bf = row_of("PCAF-context", "ar", 1024, "fp32"), row_of("PCAF-context", "ar", 1024, "bf16")
        busy = float(prof["bf16"]["gpu_busy_ms"]) if "bf16" in prof else 0.0
        ratio = float(bf["tokens_per_s"]) / float(fp["tokens_per_s"]) if fp and bf else 0.0
        if fp and bf and busy > 0 and ratio < BF16_TARGET:
            gemm_fp = float(fp["model_gflop_per_step"]) / peak["fp32"] * 1e3
            gemm_bf = float(bf["model_gflop_per_step"]) / peak["bf16"] * 1e3
            ceiling = float(fp["step_ms"]) / busy
            graphed = any(r["compile"] == "cudagraphs" for r in models)
            remedy = ("so 2.5x needs most of the launch gaps gone (one CUDA graph per step" +
                      (": the `cudagraphs` rows" if graphed else ", `train.compile=cudagraphs`, which this run "
                       "predates") + "); fusing the remaining elementwise kernels would add margin."
                      if ceiling >= BF16_TARGET else "so removing the launch gaps alone cannot reach 2.5x: the "
                      "non-GEMM kernels themselves must shrink (fusion).")
            out += ["", f"Why eager bf16 stops at {ratio:.2f}x: the step's "
                    f"{_f(fp['model_gflop_per_step'], 0)} model GFLOP take {gemm_fp:.1f} ms at the fp32 GEMM peak and "
                    f"{gemm_bf:.1f} ms at the bf16 one, so the fp32 step ({fp['step_ms']} ms, eager) is mostly "
                    f"matrix products while the bf16 step ({bf['step_ms']} ms) is everything else: the GPU is busy "
                    f"{busy:.2f} ms of it (the profile above) and waits for the host to launch "
                    f"{_f(prof['bf16']['kernels_per_step'], 0)} kernels the rest of the time. Even with no launch "
                    f"gaps the ratio would stop near {ceiling:.1f}x (fp32 step / bf16 GPU busy time), {remedy}"]
            gfp, gbf = (row_of("PCAF-context", "ar", 1024, d, "cudagraphs") for d in ("fp32", "bf16"))
            gprof = {r["dtype"]: r for r in prof_rows if r.get("compile") == "cudagraphs"}
            if gfp and gbf and "bf16" in gprof:
                out[-1] += (f" Replayed as CUDA graphs, the bf16 step takes {gbf['step_ms']} ms (the GPU busy "
                            f"{float(gprof['bf16']['gpu_busy_ms']):.2f} ms of a profiled step, "
                            f"{_f(gprof['bf16']['kernels_per_step'], 0)} kernels) against fp32's "
                            f"{gfp['step_ms']} ms: "
                            f"{float(gbf['tokens_per_s']) / float(gfp['tokens_per_s']):.2f}x.")
    out += traffic_section
    out += windowed_section(models)
    out += windowed_profile_lines(bench_dir)
    out += jax_section
    out += ["", "## GEMM peaks", "", "| GEMM | dtype | shape | ms | GFLOP/s |", "|---|---|---|---|---|"]
    out += [f"| {r['gemm']} | {r['dtype']} | [{r['m']}, {r['k']}] @ [{r['k']}, {r['n']}] | {r['ms']} | "
            f"{_f(r['gflops'], 0)} |" for r in gemm]
    if (bench_dir / "bandwidth.csv").exists():
        out += [""] + [f"Copy bandwidth: {_f(r['gb_per_s'], 0)} GB/s ({r['dtype']}, {r['mb']} MB copied in "
                       f"{r['ms']} ms; bytes read and written)." for r in read_csv(bench_dir / "bandwidth.csv")]
    piped = any(r.get("pipelined_step_ms") for r in models)  # runs from before the pipelined timing have none
    out += ["", "## Training steps", "",
            "WikiText-2 paper shapes (d / h / layers / V in the table), profile `reference_torch`, one "
            "`TorchBackend(\"cuda\").train_step` per step, median of the timed steps; % of peak: analytic model "
            "FLOPs (`pcaf_core.flops`, next-token counted over the full window) / step time / the same dtype's "
            "GEMM peak above."
            + (" Pipelined: as many steps again as a one-process run trains them, each launched before the previous "
               "one's loss is read, their wall time over their number." if piped else "")
            + (" A `cudagraphs` row's step peak is what one replay allocates beyond the graphs' memory pool, which "
               "holds the step's buffers from capture on." if any(r["compile"] == "cudagraphs" for r in models)
               else ""), "",
            "| model | mode | T | batch | dtype | compile | dropout | step (ms) | "
            + ("pipelined (ms) | " if piped else "") + "tokens/s | targets/s | step peak (MB) | model GFLOP/s | "
            "% of peak | first step (s) | head loss | fp32 matmuls |",
            "|---" * (17 if piped else 16) + "|"]
    for r in models:
        # Runs from before the head-loss and matmul-precision settings trained in one tile at "highest".
        head = (r.get("head_loss") or "head loss in one tile").removeprefix("head loss in ")
        out.append(f"| {r['model']} | {r['mode']} | {r['T']} | {r['batch']} | {r['dtype']} | {r['compile']} | "
                   f"{r['dropout']} | {r['step_ms']} | " + (f"{r.get('pipelined_step_ms') or ''} | " if piped else "") +
                   f"{_f(r['tokens_per_s'], 0)} | {_f(r['targets_per_s'], 0)} | "
                   f"{r['step_peak_mb'] or r.get('peak_mb', '')} | {_f(r['model_gflops'], 0)} | {r['model_pct']} | "
                   f"{r['first_step_s']} | {head} | {r.get('matmul_precision') or 'highest'} |")
    failures = read_csv(bench_dir / "failures.csv") if (bench_dir / "failures.csv").exists() else []
    if failures:
        out += ["", "## Cases that did not run", "",
                "Each failed to build, compile or run; the rest of the run went on without it.", "",
                "| section | model | mode | T | batch | dtype | compile | error |", "|---" * 8 + "|"]
        out += [f"| {r['section']} | {r['model']} | {r['mode']} | {r['T']} | {r['batch']} | {r['dtype']} | "
                f"{r['compile']} | {r['error'].replace('|', '/')} |" for r in failures]
    if routing:
        mem = {(r["route"], int(r["T"])): float(r["peak_mb"]) for r in routing}
        out += ["", "## Routing on the GPU", "",
                "Forward + backward of one window (batch 1, d = 224, K = 32, fp32), CUDA events, median; "
                "`recent_kernel` is the `recent` route through the Triton candidate kernels with gathered scores, "
                "`recent` the same route read off the bucket layout (the path the models take in full AR). The "
                "routing targets of `bench.md` (sparse >= 10x the dense route at T = 8,192, >= 20x at 16,384) are "
                "set for the 2-core CPU; the ratios here are for comparison, not verdicts.", "",
                "| route | T | fwd+bwd (ms) | dense / route (time) | step peak (MB) | dense / route (memory) |",
                "|---|---|---|---|---|---|"]
        for r in routing:
            T = int(r["T"])
            ratio = by[("dense", T)] / float(r["fwd_bwd_ms"]) if ("dense", T) in by else float("nan")
            mratio = mem[("dense", T)] / float(r["peak_mb"]) if ("dense", T) in mem and float(r["peak_mb"]) else 0
            out.append(f"| {r['route']} | {T} | {r['fwd_bwd_ms']} | {ratio:.1f}x | {r['peak_mb']} | "
                       f"{mratio:.1f}x |")
    curve_pages = [(step, bench_dir / f"{stem}.md") for stem, step in CURVE_RUNS if (bench_dir / f"{stem}.md").exists()]
    if curve_pages:
        out += ["", "## bf16 learning curves on the same GPU"]
        for step, page in curve_pages:
            out += ["", f"### {step} step", "", *page.read_text().splitlines()[2:]]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(out) + "\n")
