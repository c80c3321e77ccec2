"""Decode cost per generated token against context length: PCAF-context, the dense Transformer with a KV
cache and local conv, at the cpu-scale shapes (d=128, d_hidden=512, 2 layers, 4 heads, V=20,000, K=32,
B=32,768 buckets), batch 1 and 8, contexts 1K, 4K, 16K, 64K.

For every (model, batch) the streams of every context c are brought to c tokens first, then ``--steps``
greedy decode steps of each are timed one by one in interleaved rounds after ``--warmup`` untimed ones
(per-token time = the median step; tokens/s = batch / that), so machine load falls on every context alike.
How the state reaches c tokens:

* PCAF and local conv: ``TorchStream.prefill`` of c tokens of WikiText-2 train text (real bucket
  occupancy), one parallel pass.
* dense Transformer: the KV cache is filled with c random keys and values. A step's cost depends on the
  cache's length, not on its values, and a real prefill of 64K tokens is an O(c²) pass of minutes; the
  model's positional table is sized to c + steps (its size does not enter a step's cost).

Memory: ``state_mb`` is what the state needs at c tokens (growing buffers' spare room excluded) per
sequence; ``bytes_per_token`` is its growth per generated token per sequence. A configuration that runs
out of memory is recorded as such and the model's larger contexts are skipped.

    python -m benchmarks.bench_decode [--quick] [--out bench/decode.csv] [--results-dir docs/results]

``--quick`` (contexts 256 and 1K, batch 1, 4 steps) checks that it runs; the full run is the measurement.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from backends.torch import build_model
from backends.torch.streaming import TorchStream
from benchmarks.bench_plots import log_panel
from benchmarks.common import text_tokens, write_csv
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile

MODELS = (("PCAF-context", "pcaf"), ("dense Transformer (KV cache)", "transformer_dense"), ("local conv", "local_conv"))
CONTEXTS = (1024, 4096, 16384, 65536)
BATCHES = (1, 8)
SHAPES = dict(vocab_size=20000, d_model=128, d_hidden=512, n_layers=2, n_heads=4, window=64, n_global=8)


def build(variant: str, max_context: int) -> TorchStream:
    model = ModelConfig(variant=variant, max_seq_len=max(max_context, 16), **SHAPES)
    memory = MemoryConfig(route="context", candidate_policy="recent", num_buckets=32768, top_k=32)
    net = build_model(model, memory, get_profile("reference_jax"), seed=0).eval()
    # Recency unit of the cpu-scale training window (T = 256); it does not change a step's cost.
    return TorchStream(net, window=256)


def fill_kv(stream: TorchStream, batch: int, context: int, capacity: int) -> tuple:
    """A dense Transformer state whose caches hold ``context`` random keys/values (see the module docstring)."""
    state = stream.init(batch, capacity=capacity)
    g = torch.Generator().manual_seed(0)
    for cache in state.kv:
        cache.keys[:, :, :context] = torch.randn(cache.keys[:, :, :context].shape, generator=g)
        cache.values[:, :, :context] = torch.randn(cache.values[:, :, :context].shape, generator=g)
        cache.pos[:context] = range(context)
        cache.length = context
    state.t = context
    return state, torch.randint(3, 20000, (batch,), generator=g)


def prepare(stream: TorchStream, variant: str, batch: int, context: int, capacity: int) -> tuple:
    """The state at ``context`` tokens, the next token, seconds and how it was filled."""
    start = time.perf_counter()
    if variant.startswith("transformer"):
        state, token = fill_kv(stream, batch, context, capacity)
        fill = "random KV cache"
    else:
        tokens, source = text_tokens(context, batch)
        state, out = stream.prefill(stream.init(batch, capacity=capacity), torch.as_tensor(tokens))
        token = torch.argmax(out.log_probs, dim=-1)
        fill = f"prefill of {source}"
    return state, token, time.perf_counter() - start, fill


def measure_contexts(label: str, variant: str, batch: int, contexts: tuple[int, ...], steps: int, warmup: int
                     ) -> list[dict]:
    """One row per context. The states of every context are built first and their decode steps are timed in
    interleaved rounds (one step of each context per round), so machine load falls on every context alike
    and the flatness ratio compares like with like. A context that runs out of memory ends the list."""
    stream = build(variant, max(contexts) + steps + warmup + 8)
    states, rows = {}, {}
    for c in contexts:
        try:
            state, token, seconds, fill = prepare(stream, variant, batch, c, c + steps + warmup + 1)
        except (MemoryError, RuntimeError) as exc:
            if "memory" not in str(exc).lower() and not isinstance(exc, MemoryError):
                raise
            rows[c] = {"model": label, "batch": batch, "context": c, "status": f"out of memory ({exc})"[:80]}
            print(f"[decode {label} batch={batch} context={c}] out of memory; larger contexts skipped", file=sys.stderr)
            break
        states[c] = [state, token, state.used_nbytes(), []]
        rows[c] = {"model": label, "batch": batch, "context": c, "status": "ok", "prefill_s": round(seconds, 2),
                   "state_fill": fill, "steps": steps}
    with torch.no_grad():
        for i in range(warmup + steps):
            for entry in states.values():
                t0 = time.perf_counter()
                entry[0], out = stream.step(entry[0], entry[1])
                entry[1] = torch.argmax(out.log_probs, dim=-1)
                if i >= warmup:
                    entry[3].append(time.perf_counter() - t0)
    for c, (state, _, used0, times) in states.items():
        per_token = statistics.median(times)
        rows[c].update({"per_token_ms": round(1000 * per_token, 3), "tokens_per_s": round(batch / per_token, 1),
                        "state_mb_per_seq": round(used0 / batch / 2**20, 3),
                        "bytes_per_token_per_seq": round((state.used_nbytes() - used0) / (warmup + steps) / batch, 1)})
    return [rows[c] for c in contexts if c in rows]


def write_results(rows: list[dict], results_dir: Path, env: str, command: str) -> Path:
    """``decode_cpu.csv``, ``decode_cpu.png`` and ``decode_cpu.md`` (table, flatness ratio) in ``results_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "decode_cpu.csv", rows)
    ok = [r for r in rows if r["status"] == "ok"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 6.4), squeeze=False)
    for j, b in enumerate(batches):
        for label, _ in MODELS:
            pts = sorted((r["context"], r) for r in ok if r["model"] == label and r["batch"] == b)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            axes[0][j].plot(xs, [r["per_token_ms"] for _, r in pts], "o-", label=label)
            axes[1][j].plot(xs, [r["state_mb_per_seq"] for _, r in pts], "o-", label=label)
        for i, ylabel in enumerate(("ms per decode step", "state MB per sequence")):
            log_panel(axes[i][j], "context (tokens)", ylabel, f"batch {b}")
    fig.suptitle(f"decode cost, cpu-scale shapes ({env})", fontsize=9)
    fig.tight_layout()
    png = results_dir / "decode_cpu.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    lines = ["# Decode cost against context length (cpu-scale shapes)", "",
             f"- environment: {env}", f"- command: `{command}`",
             "- shapes: d=128, d_hidden=512, 2 layers, 4 heads, V=20,000; PCAF-context with K=32, B=32,768, "
             "`recent` policy (the streamable policy); greedy decoding; per-token time = median step",
             "- state: PCAF / local conv prefilled with WikiText-2 text; the dense Transformer's KV cache filled "
             "with random keys and values of the context's length (benchmarks/bench_decode.py says why)", ""]
    for b in batches:
        pcaf = {r["context"]: r for r in ok if r["model"] == MODELS[0][0] and r["batch"] == b}
        if pcaf:
            lo, hi = min(pcaf), max(pcaf)
            ratio = pcaf[hi]["per_token_ms"] / pcaf[lo]["per_token_ms"]
            lines.append(f"**Flatness, batch {b}:** PCAF's per-token time at {hi:,} tokens is {ratio:.2f}x its time at "
                         f"{lo:,} (target <= 1.2: {'met' if ratio <= 1.2 else 'missed by ' + f'{ratio / 1.2:.2f}x'}).")
            lines.append("")
    lines += ["| model | batch | context | ms / token step | tokens/s | state MB / seq | bytes / generated token / seq "
              "| status |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']:,} | {r.get('per_token_ms', '')} | "
                     f"{r.get('tokens_per_s', '')} | {r.get('state_mb_per_seq', '')} | "
                     f"{r.get('bytes_per_token_per_seq', '')} | {r['status']} |")
    lines += ["", f"![decode cost]({png.name})"]
    md = results_dir / "decode_cpu.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/decode.csv")
    parser.add_argument("--results-dir", default="", help="also write decode_cpu.{csv,png,md} here")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--quick", action="store_true", help="contexts 256 and 1K, batch 1, 4 steps")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts, batches, steps = CONTEXTS, BATCHES, args.steps
    if args.quick:
        contexts, batches, steps = (256, 1024), (1,), 4
    env = (f"torch {torch.__version__} fp32, {torch.get_num_threads()} threads, {platform.machine()} "
           f"{platform.processor() or ''}".strip())
    rows = []
    for label, variant in MODELS:
        for b in batches:
            for row in measure_contexts(label, variant, b, contexts, steps, args.warmup):
                rows.append(row)
                if row["status"] == "ok":
                    print(f"[decode {label} batch={b} context={row['context']} backend=torch fp32] "
                          f"{row['per_token_ms']:.2f} ms/step, {row['tokens_per_s']:.0f} tokens/s, state "
                          f"{row['state_mb_per_seq']:.2f} MB/seq, +{row['bytes_per_token_per_seq']:.0f} B/token/seq",
                          file=sys.stderr)
    for r in rows:
        r["backend"], r["dtype"], r["threads"] = "torch", "fp32", torch.get_num_threads()
    write_csv(args.out, rows)
    print(args.out)
    if args.results_dir:
        command = "python -m benchmarks.bench_decode " + " ".join(sys.argv[1:] if argv is None else argv)
        print(write_results(rows, Path(args.results_dir), env, command))
    pcaf = {(r["batch"], r["context"]): r["per_token_ms"] for r in rows
            if r["model"] == MODELS[0][0] and r["status"] == "ok"}
    for b in batches:
        have = sorted(c for bb, c in pcaf if bb == b)
        if len(have) > 1:
            print(f"PCAF flatness, batch {b}: {pcaf[(b, have[-1])] / pcaf[(b, have[0])]:.2f}x "
                  f"({have[-1]} vs {have[0]} tokens)")
    return 0 if all(math.isfinite(v) for v in pcaf.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
