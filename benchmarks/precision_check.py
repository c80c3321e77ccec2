"""Does bf16 autocast train like fp32 at cpu scale? Side-by-side learning curves of one row.

Trains the same row (same seed, same windows) twice, fp32 and bf16 autocast, and compares the
reference-protocol validation loss at every evaluation, plus tokens/s measured in the same run.

    python -m benchmarks.precision_check --row main-303m/pcaf_context_wt103_t1024 --steps 150 \
        --out docs/results/bf16-vs-fp32.md [--scale cpu] [overrides...]

``--scale`` and trailing Hydra overrides (``key=value``) compose the row as ``experiments.reproduce`` does, e.g.
the WikiText-2 paper shape in full AR on a GPU: ``--row wt2-nt-1024/pcaf_context --scale paper train.mode=ar
train.batch_size=8 data.layout=tokens``. The run uses the backend's default device (CUDA when present).
``--backend jax`` trains on the JAX backend instead (its bf16 option: matmuls and convolutions in bf16, LayerNorm
statistics and normalisers in float32); ``--accelerator-only`` skips the check, writing nothing, where that
backend would compute on the CPU (a GPU benchmark run whose JAX has no CUDA plugin).
"""

from __future__ import annotations

import argparse
import csv
import math
import tempfile
from pathlib import Path

from benchmarks.common import environment_labels, labels_line
from experiments import runner
from experiments.table_plan import compose_row
from pcaf_core.results import SCALES, read_curve, read_metrics

BACKENDS = ("torch", "jax")


def run(row: str, precision: str, steps: int, every: int, root: Path, scale: str = "cpu",
        extra: list[str] | None = None, backend: str = "torch") -> tuple[list[dict], object]:
    table, row_id = row.split("/")
    overrides = [*(extra or []), f"train.precision={precision}", f"train.steps={steps}", f"eval.every={every}",
                 "train.warmup_steps=10", "train.checkpoint_every=0"]
    resolved = compose_row(table, row_id, scale, backend, overrides)[0]
    metrics = runner.run_one(resolved, root / precision, progress=False)
    if metrics.status != "completed":
        raise SystemExit(f"{precision} run failed: {metrics.error}")
    return read_curve(root / precision), read_metrics(root / precision)


def default_platform(backend: str) -> str:
    """Where ``backend`` computes by default: ``cuda``/``cpu`` for torch, JAX's default backend (``gpu``, ``tpu``,
    ``cpu``) for JAX."""
    if backend == "jax":
        import jax

        return jax.default_backend()
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="main-303m/pcaf_context_wt103_t1024")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--out", default="bench/bf16-vs-fp32.md")
    parser.add_argument("--csv", default="bench/bf16-vs-fp32.csv")
    parser.add_argument("--scale", default="cpu", choices=SCALES)
    parser.add_argument("--backend", default="torch", choices=BACKENDS)
    parser.add_argument("--accelerator-only", action="store_true",
                        help="skip (exit 0, nothing written) where the backend would compute on the CPU")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the row (key=value)")
    args = parser.parse_intermixed_args()
    if args.accelerator_only and (where := default_platform(args.backend)) == "cpu":
        print(f"precision_check: skipped: the {args.backend} backend computes on the CPU here ({where}); "
              f"{args.out} not written")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        curves, metrics = {}, {}
        for precision in ("fp32", "bf16"):
            curves[precision], metrics[precision] = run(args.row, precision, args.steps, args.every, Path(tmp),
                                                        args.scale, args.overrides, args.backend)
    evals = {p: {int(r["step"]): float(r["eval_loss_reference"]) for r in c if r.get("eval_loss_reference") not in
                 (None, "")} for p, c in curves.items()}
    steps = sorted(set(evals["fp32"]) & set(evals["bf16"]))
    fp, bf = metrics["fp32"], metrics["bf16"]
    # Every row carries the run's labels, so that a report citing the CSV can say where the curves come from.
    labels = {**environment_labels(), "row": args.row, "scale": args.scale, "backend": args.backend,
              "steps": args.steps,
              "device": fp.device, "fp32_tokens_per_s": round(fp.tokens_per_sec, 1),
              "bf16_tokens_per_s": round(bf.tokens_per_sec, 1)}
    rows = [{"step": s, "fp32_eval_loss": evals["fp32"][s], "bf16_eval_loss": evals["bf16"][s],
             "abs_diff": abs(evals["fp32"][s] - evals["bf16"][s]), **labels} for s in steps]
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    late = [r["abs_diff"] for r in rows if r["step"] > args.steps // 3]
    lines = [
        f"# bf16 vs fp32 at {args.scale} scale: `{args.row}` on the {args.backend} backend",
        "",
        f"Command: `python -m benchmarks.precision_check --row {args.row} --steps {args.steps} --every {args.every}"
        f" --scale {args.scale}{'' if args.backend == 'torch' else ' --backend ' + args.backend}"
        f"{''.join(' ' + o for o in args.overrides)}`; device: {fp.device}",
        "",
        f"- {labels_line(labels)}",
        "",
        f"Same seed and windows; {args.steps} steps; validation loss under the reference protocol "
        f"({fp.eval_batches} random batches per evaluation, the same windows for both runs).",
        "",
        "| step | fp32 eval loss | bf16 eval loss | abs diff (nats) |",
        "|---|---|---|---|",
        *[f"| {r['step']} | {r['fp32_eval_loss']:.4f} | {r['bf16_eval_loss']:.4f} | {r['abs_diff']:.4f} |"
          for r in rows],
        "",
        f"- Best PPL: fp32 {fp.best_ppl:.2f}, bf16 {bf.best_ppl:.2f} "
        f"(ratio {bf.best_ppl / fp.best_ppl:.3f}).",
        f"- Largest eval-loss difference after step {args.steps // 3}: {max(late):.4f} nats "
        f"(PPL factor {math.exp(max(late)):.3f}).",
        f"- Training throughput (the two runs one after the other in one process): fp32 {fp.tokens_per_sec:.0f} tok/s, "
        f"bf16 {bf.tokens_per_sec:.0f} tok/s (x{bf.tokens_per_sec / fp.tokens_per_sec:.2f}).",
        "",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
