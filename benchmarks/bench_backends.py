"""One training step on each backend, side by side: torch against JAX on the same run configs.

The cases are rows of the default cpu table (``main-303m`` at ``SCALE=cpu``: full AR, T=256, V=8,000,
d=128, 2 blocks, batch 2), PCAF-context and local conv, in fp32 and bf16, plus the next-token
PCAF-context row of ``wt2-nt-1024`` (T=1024, batch 8). Each backend goes through its ``Backend``
protocol implementation (``init`` + ``train_step``: exactly the step the training loop times, host
batch in, loss on the host out), so the numbers are what a run of the suite gets.

Measurement: every (case, backend) runs in its own fresh process, and the processes alternate
(torch, jax, jax, torch, ...) for ``--rounds`` rounds so that the machine's drift falls on both sides
alike. A process takes ``--warmup`` steps (JIT compilation, allocator warm-up) and then ``--steps``
timed steps; its median is one sample, and the table reports the median over rounds. Both sides run
with the same environment (the glibc tunables of ``experiments.allocator`` when launched by make,
dropout as the row's profile says, every core of the machine: torch intra-op threads = cores, XLA's
CPU thread pool = cores).

    python -m benchmarks.bench_backends [--out bench/backends.csv] [--rounds 2] [--steps 5] [--results-dir DIR]

``--results-dir`` also writes ``bench_backends_cpu.{csv,md}`` there: every row labelled with the machine,
the library versions, threads and allocator, and the 1.5x parity target judged per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_throughput import write_csv
from pcaf_core.sysinfo import machine_label

CASES = [  # (label, table, row, precision)
    ("PCAF-context", "main-303m", "pcaf_context_wt103_t1024", "fp32"),
    ("local conv", "main-303m", "local_conv_wt103_t1024", "fp32"),
    ("PCAF-context", "main-303m", "pcaf_context_wt103_t1024", "bf16"),
    ("local conv", "main-303m", "local_conv_wt103_t1024", "bf16"),
    ("PCAF-context NT", "wt2-nt-1024", "pcaf_context", "fp32"),
]
BACKENDS = ("torch", "jax")


def _run_config(table: str, row: str, precision: str):
    from experiments.reproduce import compose_row

    return compose_row(table, row, "cpu", "torch", [f"train.precision={precision}"])[0].run


def _backend(name: str):
    if name == "torch":
        from backends.torch.backend import TorchBackend

        return TorchBackend("cpu")
    from backends.jax.backend import JaxBackend

    return JaxBackend("cpu")


def worker(backend_name: str, case: int, warmup: int, steps: int) -> dict:
    """Time ``steps`` training steps of ``CASES[case]`` on one backend; returns the median and context."""
    label, table, row, precision = CASES[case]
    cfg = _run_config(table, row, precision)
    backend = _backend(backend_name)
    state = backend.init(cfg)
    rng = np.random.default_rng(0)
    B, T, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    inputs = rng.integers(3, V, (B, T)).astype(np.int32)
    targets = rng.integers(3, V, (B, T) if cfg.train.mode == "ar" else (B,)).astype(np.int32)
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, loss = backend.train_step(state, inputs, targets, 1e-4)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    return {"step_s": statistics.median(times), "tokens": B * T, "mode": cfg.train.mode, "T": T, "batch": B,
            "dropout": cfg.profile.dropout, "profile": cfg.profile.name, "first_loss": losses[0],
            "device": backend.device, "versions": backend.versions()}


PARITY_TARGET = 1.5
"""JAX within 1.5x of torch either way (the backend issue's target)."""


def write_results(rows: list[dict], results_dir: Path, labels: dict, command: str) -> Path:
    """``bench_backends_cpu.csv`` and ``bench_backends_cpu.md`` (labels, table, target per row)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "bench_backends_cpu.csv", rows)
    lines = ["# One training step, torch beside JAX", "",
             f"- machine: {labels['machine']}; torch {labels['torch']}, jax {labels['jax']}; "
             f"{labels['threads']} threads each (torch intra-op, XLA CPU pool); malloc {labels['malloc']}",
             f"- command: `{command}`",
             "- each (case, backend) in a fresh process, backends alternating, median of the timed steps per "
             "process, median over rounds; the step is the `Backend.train_step` a run of the suite times",
             f"- target: JAX within {PARITY_TARGET}x of torch either way", "",
             "| model | table / row | mode | T | batch | precision | profile | dropout | torch ms | JAX ms "
             "| JAX / torch | target |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["jax_over_torch_time"]
        slower = max(ratio, 1 / ratio)
        verdict = "met" if slower <= PARITY_TARGET else f"missed by {slower / PARITY_TARGET:.2f}x"
        lines.append(f"| {r['model']} | {r['table']} / {r['row']} | {r['mode']} | {r['T']} | {r['batch']} | "
                     f"{r['precision']} | {r['profile']} | {r['dropout']} | {r['torch_step_ms']} | "
                     f"{r['jax_step_ms']} | {ratio:.2f} | {verdict} |")
    md = results_dir / "bench_backends_cpu.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _sample(backend_name: str, case: int, warmup: int, steps: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_backends", "--worker", backend_name, "--case", str(case),
           "--warmup", str(warmup), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{backend_name} worker for case {CASES[case][:3]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/backends.csv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                        help="comma-separated indices into CASES")
    parser.add_argument("--results-dir", default="", help="also write bench_backends_cpu.{csv,md} here")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.case, args.warmup, args.steps)))
        return 0
    cases = [int(c) for c in args.cases.split(",")]
    samples: dict[tuple[int, str], list[dict]] = {}
    for r in range(args.rounds):
        for case in cases:
            order = BACKENDS if (r + case) % 2 == 0 else BACKENDS[::-1]
            for name in order:
                s = _sample(name, case, args.warmup, args.steps)
                samples.setdefault((case, name), []).append(s)
                print(f"round {r + 1}/{args.rounds} {CASES[case][0]:16} {CASES[case][3]} {name:5} "
                      f"{s['step_s'] * 1e3:8.1f} ms", flush=True)
    tv = samples[(cases[0], "torch")][0]["versions"]
    jv = samples[(cases[0], "jax")][0]["versions"]
    labels = {"machine": machine_label(), "torch": tv.get("torch"), "jax": jv.get("jax"),
              "threads": os.cpu_count(), "malloc": "tuned" if os.environ.get("GLIBC_TUNABLES") else "default"}
    rows = []
    for case in cases:
        label, table, row, precision = CASES[case]
        med = {n: statistics.median(s["step_s"] for s in samples[(case, n)]) for n in BACKENDS}
        first = samples[(case, "torch")][0]
        rows.append({
            "model": label, "table": table, "row": row, "mode": first["mode"], "T": first["T"],
            "batch": first["batch"], "precision": precision, "profile": first["profile"], "dropout": first["dropout"],
            "torch_step_ms": round(med["torch"] * 1e3, 1), "jax_step_ms": round(med["jax"] * 1e3, 1),
            "torch_tokens_per_s": round(first["tokens"] / med["torch"], 1),
            "jax_tokens_per_s": round(first["tokens"] / med["jax"], 1),
            "jax_over_torch_time": round(med["jax"] / med["torch"], 3),
            "rounds": args.rounds, "steps_per_sample": args.steps, **labels,
        })
    write_csv(args.out, rows)
    if args.results_dir:
        command = "python -m benchmarks.bench_backends " + " ".join(argv if argv is not None else sys.argv[1:])
        print(write_results(rows, Path(args.results_dir), labels, command.strip()))
    print(f"\n{'model':16} {'mode':4} {'T':>5} {'prec':5} {'torch ms':>9} {'jax ms':>8} {'jax/torch':>9}  "
          f"(cpu scale, {labels['machine']}, torch {labels['torch']}, jax {labels['jax']}, malloc {labels['malloc']})")
    for r in rows:
        print(f"{r['model']:16} {r['mode']:4} {r['T']:>5} {r['precision']:5} {r['torch_step_ms']:>9.1f} "
              f"{r['jax_step_ms']:>8.1f} {r['jax_over_torch_time']:>9.2f}")
    print(Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
