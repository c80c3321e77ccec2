"""What the training step's two fused paths buy, measured side by side in one process.

For the cpu-scale full-AR shapes (d=128, 2 layers, V=20,000, T=256, batch 8) each model trains with
(head: fused target log-softmax | full [B, T, V] log-softmax) x (AdamW: fused | per-tensor loop); the
speed-up column is against the unfused pair of the same model and precision.

    python -m benchmarks.bench_train_step [--out bench/train_step.csv] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from backends.torch import build_model
from benchmarks.common import write_csv
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile

CASES = [  # (label, variant, route, precision)
    ("dense Transformer", "transformer_dense", "context", "bf16"),
    ("PCAF-context", "pcaf", "context", "bf16"),
    ("dense Transformer", "transformer_dense", "context", "fp32"),
]
PATHS = [(False, False), (True, False), (False, True), (True, True)]  # (fused head, fused AdamW)


def step_seconds(variant: str, route: str, mode: str, T: int, batch: int, precision: str, steps: int, *,
                 fused_head: bool = True, fused_adamw: bool = True) -> float:
    """Median seconds of one training step (forward, backward, AdamW) on random tokens, after one warm-up
    step (d=128, 2 layers, V=20,000).

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
