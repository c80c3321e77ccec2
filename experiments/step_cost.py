"""Per-row training-step cost of a table at a scale: what a budget is calibrated from before a table is run.

    python -m experiments.step_cost --table wt103-nt-ablations --scale cpu [--backend torch] [--rows globs]
                                    [--warmup 2] [--steps 4] [--device cpu] [--csv FILE] [overrides...]

Each row is composed exactly as ``experiments.reproduce`` composes it (scale, row overrides, command-line
overrides), its backend built as a run builds it, and fed windows of the row's own training text (the row's
batch and T; the windows' real token statistics matter, since they fill the hash buckets the routes read).
After ``--warmup`` untimed steps (compilation, allocator) the median of ``--steps`` timed
``Backend.train_step`` calls, each timed until its loss is on the host (so an accelerator's queued work is
included, as in a run's tokens/s), is the step cost: with no step in flight, an upper bound of a one-process run's
step, which launches the next step before it reads a loss (``pcaf_core.cadence``). Printed per row: the step,
the cost per target (next-token: one target per window) or per token (full AR), and the training time the row's
configured steps take at that cost (``train_s``).

The row's whole run is predicted too (``wall_s``), since a command that must finish a row needs more than its
training time: the first step as measured (``first_step_s``: compilation included; warm caches make a run's first
step cheaper), the other steps at the step cost, and every evaluation batch the run scores (``eval_s``): the first
as measured (``first_eval_s``: an evaluation graph's compilation included), the others at the median of
``--steps`` timed ``Backend.eval_batch`` calls on the row's eval batch (``eval_batch_ms``). The batches
(``eval_batches``) are the reference protocol's ``eval.batches`` at step 1, every ``eval.every`` steps and the last
step, and the full protocol's deterministic pass (``full_batches`` of them). Where the pass batches its windows
otherwise (``eval.full_batch_size``: ``full_batch`` windows), its batches are timed at that size the same way
(``first_full_s``, ``full_batch_ms``). Data loading and process start-up are not in it.
Run it alone on the machine, as any timing.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments.table_plan import compose_row, select_rows
from pcaf_core.config import ConfigError
from pcaf_core.data import load_corpus
from pcaf_core.evaluation import eval_batch_size, evaluation_tokens, full_batch_size, full_windows, reference_due
from pcaf_core.results import SCALES

BACKEND_CLASSES = {"torch": ("backends.torch.backend", "TorchBackend"), "jax": ("backends.jax.backend", "JaxBackend")}


def spread_windows(tokens: np.ndarray, batch: int, seq_len: int, mode: str,
                   split: str = "training") -> tuple[np.ndarray, np.ndarray]:
    """``batch`` windows of ``tokens`` spread over it, ``[B, T]`` int32, and their targets: the next token
    (next-token mode, ``[B]``) or the shifted window (full AR, ``[B, T]``)."""
    tokens = np.asarray(tokens)
    if len(tokens) < seq_len + 1:
        raise ConfigError(f"the {split} split has {len(tokens)} tokens, fewer than T+1={seq_len + 1}")
    starts = (np.arange(batch) * (len(tokens) // batch)) % (len(tokens) - seq_len)
    windows = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    inputs = windows[:, :-1]
    targets = windows[:, -1] if mode == "nt" else windows[:, 1:]
    return np.ascontiguousarray(inputs), np.ascontiguousarray(targets)


def measure_row(table: str, row: str, scale: str, backend_name: str, overrides: list[str], warmup: int,
                steps: int, device: str = "cpu") -> dict:
    """The step cost of one row (its first seed entry) on ``device`` (``cpu``, ``auto``, or the backend's
    accelerator name: ``cuda`` for torch, ``gpu`` for JAX); see the module docstring."""
    cfg = compose_row(table, row, scale, backend_name, overrides)[0].run
    module, cls = BACKEND_CLASSES[backend_name]
    backend = getattr(importlib.import_module(module), cls)(device)
    state = backend.init(cfg)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    corpus = load_corpus(cfg.data)  # once: each load checks the source and the cache
    inputs, targets = spread_windows(corpus.train, B, T, cfg.train.mode)
    times, first_step_s = [], 0.0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, loss = backend.train_step(state, inputs, targets, cfg.train.lr)
        float(loss)  # the step ends when its loss is on the host: an accelerator's queued work is in the time
        if i == 0:
            first_step_s = time.perf_counter() - t0
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    batch, full_batch = eval_batch_size(cfg), full_batch_size(cfg)
    first_eval_s, eval_batch_s = eval_batch_times(backend, state, cfg, steps, corpus, batch)
    n_ref, n_full = eval_batch_counts(cfg, corpus)
    if full_batch == batch:
        first_full_s, full_batch_s = first_eval_s, eval_batch_s
        eval_s = first_eval_s + eval_batch_s * (n_ref + n_full - 1) if n_ref + n_full else 0.0
    else:  # a batch of another size: its own first call (a new shape compiles) and its own median
        first_full_s, full_batch_s = eval_batch_times(backend, state, cfg, steps, corpus, full_batch)
        eval_s = ((first_eval_s + eval_batch_s * (n_ref - 1) if n_ref else 0.0)
                  + (first_full_s + full_batch_s * (n_full - 1) if n_full else 0.0))
    unit = B if cfg.train.mode == "nt" else B * T
    return {"table": table, "row": row, "scale": scale, "backend": backend_name, "mode": cfg.train.mode, "T": T,
            "batch": B, "variant": cfg.model.variant, "route": cfg.memory.route, "top_k": cfg.memory.top_k,
            "policy": cfg.memory.candidate_policy, "profile": cfg.profile.name, "precision": cfg.train.precision,
            "step_ms": round(step_s * 1e3, 2), "unit": "target" if cfg.train.mode == "nt" else "token",
            "ms_per_unit": round(step_s * 1e3 / unit, 4), "steps": cfg.train.steps,
            "train_s": round(step_s * cfg.train.steps, 1), "timed_steps": steps, "device": backend.device,
            "first_step_s": round(first_step_s, 4), "first_eval_s": round(first_eval_s, 4),
            "eval_batch_ms": round(eval_batch_s * 1e3, 2), "eval_batches": n_ref + n_full,
            "full_batch": full_batch, "full_batches": n_full, "first_full_s": round(first_full_s, 4),
            "full_batch_ms": round(full_batch_s * 1e3, 2), "eval_s": round(eval_s, 1),
            "wall_s": round(first_step_s + step_s * (cfg.train.steps - 1) + eval_s, 1)}


def eval_batch_counts(cfg, corpus=None) -> tuple[int, int]:
    """How many batches a run of ``cfg`` scores, as :mod:`pcaf_core.loop` runs them: ``eval.batches`` at each
    reference evaluation (step 1, every ``eval.every`` steps, the last step), and the full protocol's batches of
    :func:`~pcaf_core.evaluation.full_batch_size` windows over the evaluation split of ``corpus`` (default:
    ``cfg``'s, loaded). ``(reference, full)``."""
    n_ref = n_full = 0
    if cfg.eval.protocol in ("reference", "both"):
        n_ref = sum(reference_due(step, cfg) for step in range(1, cfg.train.steps + 1)) * cfg.eval.batches
    if cfg.eval.protocol in ("full", "both"):
        tokens = evaluation_tokens(corpus if corpus is not None else load_corpus(cfg.data))
        n_full = len(full_windows(tokens, cfg, full_batch_size(cfg), capped=True))
    return n_ref, n_full


def eval_batch_times(backend, state, cfg, repeats: int, corpus, batch: int) -> tuple[float, float]:
    """The first ``Backend.eval_batch`` call's time (an evaluation graph's compilation included) and the median of
    ``repeats`` more, on ``batch`` windows of ``corpus``'s evaluation split; each call returns its outputs on the
    host, so the times are complete."""
    inputs, targets = spread_windows(evaluation_tokens(corpus), batch, cfg.train.seq_len, cfg.train.mode,
                                     "evaluation")
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        backend.eval_batch(state, inputs, targets, cfg.train.mode)
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True)
    parser.add_argument("--scale", default="cpu", choices=SCALES)
    parser.add_argument("--backend", default="torch", choices=sorted(BACKEND_CLASSES))
    parser.add_argument("--rows", default="*", help="glob over row ids, comma-separated (default: all rows)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), auto (the accelerator when there is one), cuda (torch), gpu (JAX)")
    parser.add_argument("--csv", default="", help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every row (key=value)")
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    try:
        results = []
        for row in select_rows(args.table, args.rows):
            r = measure_row(args.table, row, args.scale, args.backend, args.overrides, args.warmup, args.steps,
                            args.device)
            results.append(r)
            print(f"{row:34} {r['mode']:2} T={r['T']:<5} B={r['batch']:<4} {r['step_ms']:9.1f} ms/step "
                  f"{r['ms_per_unit']:8.3f} ms/{r['unit']:6} x {r['steps']} steps = {r['train_s']:8.1f} s; "
                  f"run {r['wall_s']:.0f} s (first step {r['first_step_s']:.1f} s, {r['eval_batches']} eval "
                  f"batches {r['eval_s']:.0f} s, the full pass's {r['full_batches']} of {r['full_batch']} windows)",
                  flush=True)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    total, wall = sum(r["train_s"] for r in results), sum(r["wall_s"] for r in results)
    label = f"{args.table} scale={args.scale} backend={args.backend} device={results[0]['device']}"
    print(f"[{label}] training time at these costs: {total:.0f} s ({total / 60:.1f} min); whole runs "
          f"{wall:.0f} s ({wall / 60:.1f} min; first steps and evaluation included, process start-up not)")
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(results[0]))
            writer.writeheader()
            writer.writerows(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
