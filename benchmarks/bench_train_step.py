"""What the training step's two fused paths buy, measured side by side in one process.

For the cpu-scale full-AR shapes (d=128, 2 layers, V=20,000, T=256, batch 8) each model trains with
(head: fused target log-softmax | full [B, T, V] log-softmax) x (AdamW: fused | per-tensor loop); the
speed-up column is against the unfused pair of the same model and precision.

    python -m benchmarks.bench_train_step [--out bench/train_step.csv] [--steps 4]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_throughput import step_seconds, write_csv

CASES = [  # (label, variant, route, precision)
    ("dense Transformer", "transformer_dense", "context", "bf16"),
    ("PCAF-context", "pcaf", "context", "bf16"),
    ("dense Transformer", "transformer_dense", "context", "fp32"),
]
PATHS = [(False, False), (True, False), (False, True), (True, True)]  # (fused head, fused AdamW)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/train_step.csv")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for label, variant, route, precision in CASES:
        base = None
        for fused_head, fused_adamw in PATHS:
            dt = step_seconds(variant, route, "ar", 256, 8, precision, args.steps,
                              fused_head=fused_head, fused_adamw=fused_adamw)
            base = base or dt
            rows.append({"model": label, "precision": precision, "fused_head": fused_head,
                         "fused_adamw": fused_adamw, "step_s": round(dt, 4),
                         "tokens_per_s": round(8 * 256 / dt, 1), "speedup": round(base / dt, 3)})
    write_csv(args.out, rows)
    print(f"{'model':18} {'prec':5} {'fused head':>10} {'fused AdamW':>11} {'tok/s':>8} {'speed-up':>8}  "
          f"(full AR, T=256, batch 8, V=20000, torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for r in rows:
        print(f"{r['model']:18} {r['precision']:5} {str(r['fused_head']):>10} {str(r['fused_adamw']):>11} "
              f"{r['tokens_per_s']:>8.0f} {r['speedup']:>8.2f}")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
