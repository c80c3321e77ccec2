"""Training throughput of every model family, measured side by side in one process.

Each configuration takes a few optimiser steps on random tokens (V=20,000) after one warm-up step;
the median step time gives tokens/s (batch·T per step, the paper's definition). Ratios are taken
against the dense Transformer of the same mode, so machine noise largely cancels.

    python benchmarks/bench_throughput.py [--out bench/throughput.csv] [--steps 4]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

from backends.torch import build_model
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile

# (label, variant, route, mode, T, batch, precision)
CASES = [
    ("dense Transformer", "transformer_dense", "context", "ar", 256, 8, "fp32"),
    ("local Transformer", "transformer_local", "context", "ar", 256, 8, "fp32"),
    ("local conv", "local_conv", "context", "ar", 256, 8, "fp32"),
    ("PCAF-context", "pcaf", "context", "ar", 256, 8, "fp32"),
    ("PCAF-semantic", "pcaf", "semantic", "ar", 256, 8, "fp32"),
    ("dense Transformer", "transformer_dense", "context", "ar", 256, 8, "bf16"),
    ("PCAF-context", "pcaf", "context", "ar", 256, 8, "bf16"),
    ("dense Transformer", "transformer_dense", "context", "nt", 1024, 8, "fp32"),
    ("local conv", "local_conv", "context", "nt", 1024, 8, "fp32"),
    ("PCAF-context", "pcaf", "context", "nt", 1024, 8, "fp32"),
]


def step_seconds(variant: str, route: str, mode: str, T: int, batch: int, precision: str, steps: int, *,
                 fused_head: bool = True, fused_adamw: bool = True) -> float:
    """Median seconds of one training step (forward, backward, AdamW) on random tokens.

    ``fused_head=False`` trains through the full ``[B, Q, V]`` log-softmax (the evaluation path) instead
    of ``backends.torch.head_loss``; ``fused_adamw=False`` uses AdamW's per-tensor loop.
    """
    torch.manual_seed(0)
    model_cfg = ModelConfig(variant=variant, vocab_size=20000, d_model=128, d_hidden=512, n_layers=2, n_heads=4,
                            window=64, n_global=8, max_seq_len=T)
    memory = MemoryConfig(route=route, top_k=32, semantic_score_scale=0.5)
    model = build_model(model_cfg, memory, get_profile("reference_jax"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused_adamw or None, foreach=False)
    x = torch.randint(3, 20000, (batch, T))
    y = torch.randint(3, 20000, (batch, T) if mode == "ar" else (batch,))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x, y, mode, need_log_probs=not fused_head, need_predictions=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """``rows`` (dicts with the same keys) as a CSV file, parent directories created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/throughput.csv")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for label, variant, route, mode, T, batch, precision in CASES:
        dt = step_seconds(variant, route, mode, T, batch, precision, args.steps)
        rows.append({"model": label, "mode": mode, "T": T, "batch": batch, "precision": precision,
                     "step_s": round(dt, 4), "tokens_per_s": round(batch * T / dt, 1),
                     "targets_per_s": round((batch * T if mode == "ar" else batch) / dt, 1)})
    for r in rows:
        ref = next(x for x in rows if x["model"] == "dense Transformer" and x["mode"] == r["mode"]
                   and x["precision"] == r["precision"])
        r["x_dense"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
    write_csv(args.out, rows)
    print(f"{'model':18} {'mode':4} {'T':>5} {'prec':5} {'tok/s':>9} {'x dense':>8}  (d=128, 2 layers, V=20000, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for r in rows:
        print(f"{r['model']:18} {r['mode']:4} {r['T']:>5} {r['precision']:5} "
              f"{r['tokens_per_s']:>9.0f} {r['x_dense']:>8.2f}")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
