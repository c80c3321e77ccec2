"""Training throughput, step memory and fraction of the matmul peak of every model at the WikiText-2 paper shapes.

Models (rows of ``wt2-nt-1024`` at ``scale=paper``, profile ``reference_torch``: d=256, h=1000, 2 conv blocks,
V=20,000, K=16; the Transformers d=192, h=1024, 4 layers, 4 heads, window 128):

- PCAF-context (``first`` policy, as the row), PCAF-semantic with the bucketed index (``recent`` on argmax
  buckets, S=256), local conv;
- the dense Transformer: ``F.scaled_dot_product_attention(is_causal=True)`` (fused SDPA; on a CPU only at
  dropout 0: PyTorch's fused CPU kernel has no dropout, so dropout 0.1 runs the unfused math path, and the
  ``policy`` column names the kernel that ran, read from the profiler);
- the local Transformer: the same SDPA call with a ``[T, T]`` boolean window mask, i.e. a masked dense
  attention (the suite has no blockwise windowed kernel; its cost is the dense one's, as in the paper's code).

Each case is one ``TorchBackend`` training step (``init`` + ``train_step``: host batch in, loss on the host out,
the step a run of the suite times), with windows of WikiText-2 train text. Cases of the same mode and T are
built together and their timed steps interleaved (one step of each per round), so ratios between them are
taken side by side. Compiled cases (``train.compile=on``: ``torch.compile`` with inductor) compile in their
warm-up step (``first_step_s``). A slow case (a dense-attention step takes 10-30 s here) is timed fewer
times, about ``TIMED_SECONDS`` in all and at least once; ``steps`` records how many. Each eager case also
runs one step under ``benchmarks.torch_memory``:
``step_peak_mb`` is the peak of the buffers a step allocates (activations, saved tensors, gradients,
temporaries); ``state_mb`` is the weights and AdamW moments (16 bytes a parameter).

Fraction of peak: the fp32 matmul FLOP/s of two GEMMs (the head's product ``[B·T, h] @ [h, V]`` and the block
MLP's ``[B·T, d] @ [d, h]``; the larger is the peak) against ``pcaf_core.flops.train_step_flops`` per step /
step seconds. The GEMMs are timed once at the start (``gemm.csv``) and again after every round of a group's
timed steps; a fp32 row's ``peak_gflops`` is the median of its group's readings (``peak_readings`` of them),
so the fraction compares the step with the GEMM on the machine as it was while the step ran (one reading at
the start differed from the run's typical one by up to 20%). Next-token steps get two figures:
``model_pct`` counts the full-window formulation (the backbone over all B·T positions, as the paper's code
computes it) and ``executed_pct`` the receptive-field step's actual work (``PCAFModel.nt_receptive_read``,
``TransformerLM.nt_receptive_read`` for windowed attention);
the first exceeds 100% when the step skips work the formulation counts.

bf16: on a CPU without a bf16 matrix unit (AMX) bf16 products are slower than float32 (``pcaf_core.sysinfo``),
so the bf16 cases shrink to one demonstration pair (full-AR PCAF-context, T=128, batch 1, fp32 beside bf16)
and one small bf16 GEMM; with such a unit the main full-AR cases also run in bf16.

    python -m benchmarks.bench_models [--quick] [--out bench/models.csv] [--profile-dir bench]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import TEXT_VOCAB, environment_labels, median_seconds, text_tokens, write_csv
from pcaf_core.config import CACHE_VARIANTS, TRANSFORMER_VARIANTS, WINDOWED_VARIANTS
from pcaf_core.flops import train_step_flops
from pcaf_core.sysinfo import cpu_has_bf16_matmul

MODELS = {  # label -> (table, row, overrides)
    "PCAF-context": ("wt2-nt-1024", "pcaf_context", []),
    "PCAF-semantic (bucketed)": ("wt2-nt-1024", "pcaf_context",
                                 ["memory.route=semantic", "memory.semantic_index=bucketed"]),
    "local conv": ("wt2-nt-1024", "local_conv", []),
    "dense Transformer (SDPA)": ("wt2-nt-1024", "transformer_dense", []),
    "local Transformer (masked dense SDPA)": ("wt2-nt-1024", "transformer_local", ["model.attention_impl=masked"]),
    # GPU only (benchmarks/bench_cuda): FlexAttention trains on CUDA, not on a CPU.
    "local Transformer (FlexAttention)": ("wt2-nt-1024", "transformer_local", ["model.attention_impl=banded"]),
    "global-local Transformer (FlexAttention)": ("wt2-nt-1024", "transformer_global_local",
                                                 ["model.attention_impl=banded"]),
    # GPU only too: blocked SDPA trains on a CPU as well, but the CPU benchmark times the masked form it trains.
    "local Transformer (blocked SDPA)": ("wt2-nt-1024", "transformer_local", ["model.attention_impl=blocked"]),
    "global-local Transformer (blocked SDPA)": ("wt2-nt-1024", "transformer_global_local",
                                                ["model.attention_impl=blocked"]),
}
PROFILED_MODEL, PROFILED_T, PROFILED_T_QUICK = "PCAF-context", 1024, 256
"""The eager fp32 PCAF-context cases (dropout 0.1) at this T also run one step under ``torch.profiler``, in
both modes: where the time of the targets' cases goes."""


@dataclass(frozen=True)
class Case:
    model: str
    mode: str
    T: int
    batch: int
    dropout: float
    compile: str = "eager"  # eager | inductor | cudagraphs (inductor replayed as CUDA graphs: GPU only)
    precision: str = "fp32"
    note: str = ""

    @property
    def key(self) -> tuple:
        return (self.model, self.mode, self.T, self.dropout, self.compile)


AR_TOKENS = 4096
"""Tokens a full-AR step trains on (batch ``AR_TOKENS // T``: 4 at T=1024, the shape the paper's PyTorch code was
timed at, 2 at 2048, 1 at 4096): the steps of every T then do the same work, and the per-step costs (AdamW,
clipping) weigh on a full-AR step as on one of a training run rather than on a single sequence."""


def ar_batch(T: int) -> int:
    """The full-AR batch at context ``T`` (:data:`AR_TOKENS` a step, at least one sequence)."""
    return max(1, AR_TOKENS // T)


def cases(quick: bool, bf16_unit: bool) -> list[Case]:
    """The measured matrix (pruned to fit about 10 minutes on 2 cores; docs/EXPERIMENTS.md says what was left
    out): compiled only next-token (T=1024) and full-AR (T=1024, 2048) PCAF-context, each compile costing 20-70 s.
    ``quick``: T=256 stand-ins of the main cases, no compile, no bf16."""
    P, S, L, D, W = list(MODELS)[:5]
    if quick:
        return [Case(P, "nt", 256, 8, 0.1), Case(L, "nt", 256, 8, 0.1), Case(D, "nt", 256, 8, 0.1),
                Case(P, "ar", 256, 1, 0.1), Case(D, "ar", 256, 1, 0.1)]
    out = []
    for T in (1024, 2048, 4096):
        out += [Case(P, "nt", T, 8, 0.1), Case(P, "nt", T, 8, 0.0), Case(S, "nt", T, 8, 0.1), Case(L, "nt", T, 8, 0.1)]
        out += [Case(D, "nt", T, 8 if T <= 2048 else 2, 0.1)]
        if T == 2048:  # the dropout-matched ratio at dropout 0, where SDPA runs its fused kernel on a CPU
            out += [Case(D, "nt", T, 8, 0.0)]
        out += [Case(P, "ar", T, ar_batch(T), 0.1), Case(D, "ar", T, ar_batch(T), 0.1)]
    out += [Case(P, "nt", 1024, 8, 0.1, "inductor"), Case(W, "nt", 1024, 8, 0.1), Case(W, "nt", 2048, 8, 0.1)]
    b1, b2 = ar_batch(1024), ar_batch(2048)
    out += [Case(P, "ar", 1024, b1, 0.0), Case(P, "ar", 1024, b1, 0.1, "inductor"), Case(S, "ar", 1024, b1, 0.1),
            Case(L, "ar", 1024, b1, 0.1), Case(W, "ar", 1024, b1, 0.1), Case(P, "ar", 2048, b2, 0.1, "inductor")]
    if bf16_unit:
        out += [Case(P, "ar", T, ar_batch(T), 0.1, precision="bf16") for T in (1024, 2048)]
        out += [Case(D, "ar", 1024, b1, 0.1, precision="bf16"), Case(P, "nt", 1024, 8, 0.1, precision="bf16")]
    else:
        demo = "bf16 demonstration: this CPU has no bf16 matrix unit"
        out += [Case(P, "ar", 128, 1, 0.1, note=demo), Case(P, "ar", 128, 1, 0.1, precision="bf16", note=demo)]
    return out


TRAIN_COMPILE = {"eager": "off", "inductor": "on", "cudagraphs": "cudagraphs"}
"""``train.compile`` of each case's ``compile`` label."""


def run_config(case: Case, backend: str = "torch", extra_overrides: tuple[str, ...] = (), scale: str = "paper"):
    """The composed run config of ``case`` (the row at ``scale``, paper unless a smoke check asks for ``smoke``,
    plus the case's overrides) on ``backend`` (``train.compile`` is torch's; a JAX step is always compiled by
    XLA)."""
    from experiments.table_plan import compose_row

    table, row, extra = MODELS[case.model]
    overrides = [*extra, f"train.mode={case.mode}", f"train.seq_len={case.T}", f"train.batch_size={case.batch}",
                 f"profile.dropout={case.dropout}", f"train.precision={case.precision}", *extra_overrides]
    if backend == "torch":
        overrides.append(f"train.compile={TRAIN_COMPILE[case.compile]}")
    return compose_row(table, row, scale, backend, overrides)[0].run


def products(a: torch.Tensor, b: torch.Tensor) -> list:
    """The ways a training step may multiply ``a @ b`` here: ``torch.mm`` (oneMKL on a CPU), and oneDNN where the
    step's head uses it (``backends.torch.cpu_gemm``: float32 on AMD CPUs). A peak is the fastest of them."""
    from backends.torch import cpu_gemm

    ways = [lambda: torch.mm(a, b)]
    if cpu_gemm.uses_onednn(a, b):
        ways.append(lambda: cpu_gemm.linear(a, b.t()))
    return ways


def gemm_flops_per_s(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in ``dtype``, the fastest of :func:`products` (each the median of ``repeats``
    after one warm-up)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    sec = min(median_seconds(way, 1, repeats)[0] for way in products(a, b))
    return 2.0 * m * k * n / sec


def peak_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of the fraction-of-peak GEMMs: the head's and the block MLP's products."""
    tokens = 256 if quick else 1024
    return [("head", tokens, 1000, 20000), ("block MLP", 8 * tokens, 256, 1000)]


class PeakProbe:
    """The fp32 peak GEMMs with operands allocated once, read between a group's timed steps: each
    :meth:`read` times every shape once in each of :func:`products` and returns the largest FLOP/s."""

    def __init__(self, quick: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.operands = [(torch.randn(m, k, generator=g), torch.randn(k, n, generator=g))
                         for _, m, k, n in peak_shapes(quick)]
        self.read()  # warm-up: first touch of the operands and of the GEMM's buffers

    def read(self) -> float:
        best = 0.0
        for a, b in self.operands:
            for way in products(a, b):
                t0 = time.perf_counter()
                way()
                best = max(best, 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t0))
        return best


def matmul_peaks(quick: bool, bf16_unit: bool) -> list[dict]:
    """The GEMMs of the fraction of peak: head and block-MLP shapes in fp32 (bf16 too: full shapes with a bf16
    matrix unit, one small shape without)."""
    shapes = peak_shapes(quick)
    rows = []
    for name, m, k, n in shapes:
        rows.append({"gemm": name, "dtype": "fp32", "m": m, "k": k, "n": n,
                     "gflops": round(gemm_flops_per_s(m, k, n, torch.float32, 3) / 1e9, 2)})
    bf16_shapes = shapes if bf16_unit else [("bf16 demonstration", 128, 1000, 1000)]
    for name, m, k, n in bf16_shapes:
        rows.append({"gemm": name, "dtype": "bf16", "m": m, "k": k, "n": n,
                     "gflops": round(gemm_flops_per_s(m, k, n, torch.bfloat16, 1 if not bf16_unit else 3) / 1e9, 2)})
    for r in rows:
        print(f"[gemm {r['gemm']} {r['dtype']} {r['m']}x{r['k']} @ {r['k']}x{r['n']}] {r['gflops']} GFLOP/s",
              file=sys.stderr, flush=True)
    return rows


def _batch(cfg) -> tuple[np.ndarray, np.ndarray, str]:
    """Inputs ``[B, T]`` and targets (``[B, T]`` full AR, ``[B]`` next-token) from WikiText-2 train text (a model
    narrower than its cache's vocabulary, the smoke scale's, draws from a cache of its own width)."""
    B, T = cfg.train.batch_size, cfg.train.seq_len
    tokens, source = text_tokens(T + 1, B, min(cfg.model.vocab_size, TEXT_VOCAB))
    targets = tokens[:, 1:] if cfg.train.mode == "ar" else tokens[:, T]
    return tokens[:, :T].astype(np.int32), np.ascontiguousarray(targets).astype(np.int32), source


def _profile_step(backend, state, x, y, path: Path) -> str:
    """One training step under ``torch.profiler``; the op table goes to ``path``, the top ops (share of self
    CPU time) come back as one line."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backend.train_step(state, x, y, 1e-4)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="self_cpu_time_total", row_limit=25))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    return "; ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.0f}%" for e in top)


def _slug(case: Case) -> str:
    return re.sub(r"[^a-z0-9]+", "_", f"{case.model} {case.mode} T{case.T} p{case.dropout} {case.compile}".lower())


def _profiled(case: Case, profile_T: int) -> bool:
    return (case.model, case.T, case.dropout, case.compile, case.precision) == (
        PROFILED_MODEL, profile_T, 0.1, "eager", "fp32")


TIMED_SECONDS = 20.0
"""Timed seconds a slow case gets at most: a step that takes longer than a third of it is timed fewer than
3 times (at least once, after its warm-up and memory steps), which keeps the report's wall time bounded
where one dense-attention step takes 10-30 s and its relative noise is small."""


def step_budget(case: Case, warmup: int, steps: int) -> tuple[int, int]:
    """(warm-up, timed) steps of ``case``: next-token steps of the conv-backbone models cost a fraction of a second
    and take the full budget; full-AR and Transformer steps cost seconds and take one warm-up step (plus the
    memory step) and the same budget, cut for slow steps by :func:`timed_steps` (3 timed steps of a 0.5-1.2 s
    full-AR step let one run read 76% of peak where the next read 85%); bf16 without a bf16
    matrix unit takes one timed step. A compiled case warms up at least twice: its first step is the compile,
    and the timed-step count is cut by the last warm-up step's time, which must be a steady step."""
    if case.precision == "bf16" and not cpu_has_bf16_matmul():
        return 1, 1
    if case.mode == "nt" and not MODELS[case.model][1].startswith("transformer"):
        return max(warmup, 2) if case.compile != "eager" else warmup, steps
    return 2 if case.compile != "eager" else 1, steps


NT_MIN_TIMED_SECONDS, NT_MAX_STEPS = 3.0, 40
"""A next-token conv-backbone step takes 0.1-0.5 s, so 5 timed steps were under a second, too few for the
compiled/eager ratio on a machine with ±10-20% noise (one full run read 0.94 where 30 interleaved rounds read
1.12): such cases get at least this many timed seconds (at most ``NT_MAX_STEPS`` steps), except in ``--quick``."""


def timed_steps(budget: int, step_s: float) -> int:
    """``budget`` timed steps, cut so that they take about :data:`TIMED_SECONDS` when one step (the last
    untimed one) took ``step_s``; at least one."""
    return max(1, min(budget, round(TIMED_SECONDS / max(step_s, 1e-9))))


def measure_group(group: list[Case], warmup: int, steps: int, profile_dir: Path | None, profile_T: int,
                  peak_probe: PeakProbe | None = None, nt_min_seconds: float = 0.0) -> list[dict]:
    """Build every case of ``group`` (one mode and T), warm each up, then time their steps interleaved
    (:func:`step_budget` says how many; cheap next-token cases at least ``nt_min_seconds`` of them), with a
    ``peak_probe`` reading of the fp32 GEMM peak after every round."""
    from backends.torch.backend import TorchBackend
    from backends.torch.compile import compile_pays_off
    from benchmarks.torch_memory import PeakLiveBytes
    from pcaf_core.config import head_loss_chunks, head_loss_label
    from pcaf_core.profiles import matmul_precision

    entries = []
    for case in group:
        cfg = run_config(case)
        backend = TorchBackend("cpu")
        state = backend.init(cfg)
        x, y, source = _batch(cfg)
        row = {"model": case.model, "variant": cfg.model.variant, "backend": "torch", "dtype": case.precision,
               "mode": case.mode, "T": case.T, "batch": case.batch, "d": cfg.model.d_model,
               "d_hidden": cfg.model.d_hidden, "layers": cfg.model.n_layers, "V": cfg.model.vocab_size,
               "policy": _policy(cfg), "dropout": case.dropout, "compile": case.compile,
               "profile": cfg.profile.name, "matmul_precision": matmul_precision(cfg),
               "head_loss": head_loss_label(head_loss_chunks(cfg)), "tokens_source": source, "note": case.note,
               "auto_compiles": compile_pays_off(cfg, torch.device("cpu")), "params": backend.param_count(state)}
        t0 = time.perf_counter()
        state, loss = backend.train_step(state, x, y, 1e-4)
        row["first_step_s"] = round(time.perf_counter() - t0, 2)
        row["first_loss"] = round(loss, 4)
        case_warmup, case_steps = step_budget(case, warmup, steps)
        last_s = row["first_step_s"]
        for _ in range(max(0, case_warmup - 1)):
            t0 = time.perf_counter()
            state, _ = backend.train_step(state, x, y, 1e-4)
            last_s = time.perf_counter() - t0
        if case.compile == "eager" and case.precision == "fp32":
            t0 = time.perf_counter()
            with PeakLiveBytes() as probe:
                state, _ = backend.train_step(state, x, y, 1e-4)
            last_s = time.perf_counter() - t0
            row["step_peak_mb"] = round(probe.peak_bytes / 2**20, 1)
        case_steps = timed_steps(case_steps, last_s)
        if nt_min_seconds and case.mode == "nt" and not MODELS[case.model][1].startswith("transformer"):
            case_steps = max(case_steps, min(NT_MAX_STEPS, round(nt_min_seconds / max(last_s, 1e-9))))
        row["state_mb"] = round(16 * row["params"] / 2**20, 1)
        if profile_dir is not None and _profiled(case, profile_T):
            path = profile_dir / f"profile_{_slug(case)}.txt"
            row["profile_top"] = _profile_step(backend, state, x, y, path)
            row["profile_file"] = str(path)
        entries.append([case, cfg, backend, state, x, y, row, [], case_steps])
        print(f"[models {case.model} {case.mode} T={case.T} batch={case.batch} p={case.dropout} {case.compile} "
              f"{case.precision}] ready (first step {row['first_step_s']} s)", file=sys.stderr, flush=True)
    readings = []
    for _ in range(max(e[8] for e in entries)):
        for entry in entries:
            case, cfg, backend, state, x, y, row, times, n = entry
            if len(times) >= n:
                continue
            t0 = time.perf_counter()
            entry[3], _ = backend.train_step(state, x, y, 1e-4)
            times.append(time.perf_counter() - t0)
        if peak_probe is not None:
            readings.append(peak_probe.read())
    rows = [finish(case, cfg, row, times) for case, cfg, _, _, _, _, row, times, _ in entries]
    if readings:
        for row in rows:
            row.update(peak_gflops=round(float(np.median(readings)) / 1e9, 2), peak_readings=len(readings))
    return rows


def sdpa_kernel(dropout: float, masked: bool) -> str:
    """Which kernel ``F.scaled_dot_product_attention`` runs in training with this dropout and mask, read from the
    profiler on a tiny call: PyTorch's fused CPU kernel (``flash``) has no dropout, so with dropout > 0 a CPU
    falls back to the unfused ``math`` path, which materialises the ``[B, H, T, T]`` weights."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    mask = torch.ones(16, 16, dtype=torch.bool).tril() if masked else None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=dropout, is_causal=not masked)
        out.sum().backward()
    names = " ".join(e.key for e in prof.key_averages())
    if "flash" in names:
        return "flash (fused)"
    return "math (unfused)" if "math" in names else "other"


def _policy(cfg) -> str:
    if cfg.model.variant in TRANSFORMER_VARIANTS:
        kernel = sdpa_kernel(cfg.profile.dropout, cfg.model.variant != "transformer_dense")
        return {"transformer_dense": f"causal SDPA, {kernel}",
                "transformer_local": f"window {cfg.model.window}, masked dense SDPA, {kernel}"
                }.get(cfg.model.variant, cfg.model.variant)
    if cfg.model.variant not in CACHE_VARIANTS:
        return "no cache"
    m = cfg.memory
    if m.route == "context":
        return f"context/{m.candidate_policy}"
    return f"{m.route}/{m.semantic_index}"


def finish(case: Case, cfg, row: dict, times: list[float]) -> dict:
    """Median step time, tokens/s and the FLOP counts of a measured case; ``step_times_ms`` keeps every timed
    step in round order (the cases of a group step in turn, so the i-th times of two cases are one round's)."""
    step_s = float(np.median(times))
    B, T = case.batch, case.T
    full = train_step_flops(cfg.model, cfg.memory, case.mode, T, B, nt_count="full_window")
    # What the step executes: next-token steps compute receptive fields (the conv models' and windowed attention's
    # sub-windows; dense and linear attention the whole window, which the count gives them).
    count = "receptive_field" if case.mode == "nt" else "full_window"
    executed = train_step_flops(cfg.model, cfg.memory, case.mode, T, B, nt_count=count)
    if cfg.model.variant in WINDOWED_VARIANTS and cfg.model.attention_impl not in ("banded", "blocked"):
        # Masked windowed attention computes every [T, T] score of what it runs (auto is masked on a CPU).
        # FlexAttention's and the blocked band's are the model's count (their partial blocks compute a little more).
        executed = train_step_flops(cfg.model, cfg.memory, case.mode, T, B, nt_count=count, attention_keys="computed")
    row.update(step_ms=round(step_s * 1e3, 2), steps=len(times), tokens_per_s=round(B * T / step_s, 1),
               step_times_ms=";".join(f"{t * 1e3:.1f}" for t in times),
               targets_per_s=round((B * T if case.mode == "ar" else B) / step_s, 1),
               model_gflop_per_step=round(full / 1e9, 3), executed_gflop_per_step=round(executed / 1e9, 3),
               model_gflops=round(full / step_s / 1e9, 2), executed_gflops=round(executed / step_s / 1e9, 2))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/models.csv")
    parser.add_argument("--gemm-out", default="", help="GEMM peaks CSV (default: <out dir>/gemm.csv)")
    parser.add_argument("--profile-dir", default="bench", help="where the profiled steps' op tables go")
    parser.add_argument("--quick", action="store_true", help="T=256 stand-ins, no compile, no bf16")
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps of a cheap case (default 5; quick 2; see step_budget)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up steps of a cheap case (default 2; quick 1)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    bf16_unit = cpu_has_bf16_matmul()
    steps = args.steps or (2 if args.quick else 5)
    warmup = args.warmup or (1 if args.quick else 2)
    labels = environment_labels(torch.get_num_threads(), quick=args.quick)
    peaks = matmul_peaks(args.quick, bf16_unit)
    bf16_peak = max(r["gflops"] for r in peaks if r["dtype"] == "bf16")
    groups: dict[tuple, list[Case]] = {}
    for case in cases(args.quick, bf16_unit):
        groups.setdefault((case.mode, case.T), []).append(case)
    rows = []
    probe = PeakProbe(args.quick)
    for group in groups.values():
        rows += measure_group(group, warmup, steps, Path(args.profile_dir) if args.profile_dir else None,
                              PROFILED_T_QUICK if args.quick else PROFILED_T, probe,
                              nt_min_seconds=0.0 if args.quick or args.steps else NT_MIN_TIMED_SECONDS)
    wall = round(time.perf_counter() - start, 1)
    for r in rows:
        peak = r["peak_gflops"] if r["dtype"] == "fp32" else bf16_peak
        if r["dtype"] != "fp32":
            r["peak_readings"] = 1  # the start-of-run bf16 GEMM
        r.update(peak_gflops=peak, model_pct=round(100 * r["model_gflops"] / peak, 1),
                 executed_pct=round(100 * r["executed_gflops"] / peak, 1), section_wall_s=wall, **labels)
        print(f"[models {r['model']} {r['mode']} T={r['T']} batch={r['batch']} {r['dtype']} p={r['dropout']} "
              f"{r['compile']}] {r['tokens_per_s']:.0f} tokens/s, {r['step_ms']:.0f} ms/step, model "
              f"{r['model_pct']}% / executed {r['executed_pct']}% of {peak} GFLOP/s")
    write_csv(args.out, rows)
    gemm_out = args.gemm_out or str(Path(args.out).with_name("gemm.csv"))
    write_csv(gemm_out, [{**r, **labels} for r in peaks])
    print(f"{args.out}, {gemm_out} ({wall} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
