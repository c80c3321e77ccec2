"""One training step on each backend, side by side: torch against JAX on the same run configs.

Parity cases: every PCAF variant (context, semantic with the bucketed index, hybrid with the bucketed index,
no gate, no cache) and local conv, in both modes: full AR at the default cpu table's shapes (``main-303m`` at
``SCALE=cpu``: T=256, V=8,000, d=128, 2 blocks, batch 2, profile ``reference_jax``) and next-token at
``wt2-nt-1024``'s (T=1024, V=8,000, d=128, batch 32, profile ``reference_torch``, dropout 0.1). Torch runs
eager (``train.compile=off``: a run shorter than 5,000 steps does) except in the one case labelled
``inductor`` (next-token PCAF-context compiled, what ``train.compile=auto`` gives a long next-token run);
JAX always runs ``jax.jit``. Precision fp32; bf16 only where the CPU has a bf16 matrix unit (AMX),
otherwise one small demonstration pair (full AR, T=64, batch 1, fp32 beside bf16).

Beside them, JAX alone: the full-AR step at the 41M shape of the paper's S sweep (``sweeps-41m``
``pcaf_semantic_ar_s256`` at ``scale=paper``: d=224, 14 blocks, V=32,000, K=32, S=256, T=2048, batch 1,
the dense semantic route the paper's code uses).

Each backend goes through its ``Backend`` protocol implementation (``init`` + ``train_step``: exactly the
step the training loop times, host batch in, loss on the host out), so the numbers are what a run of the
suite gets.

Measurement: each round runs one fresh process per backend that measures every case in turn (the
import and configuration cost is paid once, not per case), and the backends alternate between rounds
(torch then JAX, then JAX then torch, ...) for ``--rounds`` rounds so that the machine's drift falls on
both sides alike. Each case takes ``--warmup`` steps (default 10: JIT compilation, then the allocator
and thread pool warming up; JAX's first ~8 steps after compilation run 2-4x slower than its steady
state here) and then ``--steps`` timed steps (default 12; more for a cheap case, up to
:data:`MIN_TIMED_SECONDS` of them); their median is one sample, and the table
reports the median over rounds. Exceptions, each written on its case: the 41M case (JAX alone, 5-7 s a
step) takes 6 + 3 steps in the first round only, then times work any such step must do with XLA
(:func:`jax_step_floor`: the least time a step of that model can take here); the bf16 demonstration
case on a CPU without a bf16 unit (torch ~0.9 s a step) takes 3 + 5. Both sides run
with the same environment (the glibc tunables of ``experiments.allocator`` when launched by make,
dropout as the row's profile says, every core of the machine: torch intra-op threads = cores, XLA's
CPU thread pool = cores).

    python -m benchmarks.bench_backends [--out bench/backends.csv] [--rounds 3] [--warmup 10] [--steps 12]
                                        [--results-dir DIR] [--quick]

``--results-dir`` also writes ``bench_backends_cpu.{csv,md}`` there: every row labelled with the machine,
the library versions, threads and allocator, and the 1.5x parity target judged per row. ``--quick``: the
two PCAF-context cases, one round, one warm-up and two timed steps (checks that it runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import environment_labels, labels_line, median_seconds, write_csv
from pcaf_core.sysinfo import cpu_has_bf16_matmul

BACKENDS = ("torch", "jax")


@dataclass(frozen=True)
class BackendCase:
    """One measured configuration: a composed row plus overrides, on ``backends``. ``kind``: ``parity`` (the
    1.5x target applies), ``bf16 demo`` or ``41M`` (JAX alone)."""

    model: str
    table: str
    row: str
    precision: str = "fp32"
    overrides: tuple[str, ...] = ()
    backends: tuple[str, ...] = BACKENDS
    kind: str = "parity"
    scale: str = "cpu"
    compile: str = "off"
    # Per-case (warm-up, timed) steps where the command line's would cost minutes per process.
    steps_override: tuple[int, int] | None = None
    # Measured in the first this-many rounds only (a one-backend case has no ratio to protect from drift).
    max_rounds: int | None = None


_AR_CTX = ("main-303m", "pcaf_context_wt103_t1024")
_NT_CTX = ("wt2-nt-1024", "pcaf_context")
_BUCKETED = ("memory.semantic_index=bucketed",)


def build_cases(bf16_unit: bool) -> list[BackendCase]:
    """Every case, in a fixed order (a worker is told its case by index)."""
    cases = [
        BackendCase("PCAF-context", *_AR_CTX),
        BackendCase("PCAF-semantic (bucketed)", "main-303m", "pcaf_semantic_wt103_t1024", overrides=_BUCKETED),
        BackendCase("PCAF-hybrid (bucketed)", *_AR_CTX, overrides=("memory.route=hybrid", *_BUCKETED)),
        BackendCase("PCAF no gate", *_AR_CTX, overrides=("model.variant=pcaf_no_gate",)),
        BackendCase("PCAF no cache", *_AR_CTX, overrides=("model.variant=pcaf_no_cache",)),
        BackendCase("local conv", "main-303m", "local_conv_wt103_t1024"),
        BackendCase("PCAF-context", *_NT_CTX),
        BackendCase("PCAF-semantic (bucketed)", *_NT_CTX, overrides=("memory.route=semantic", *_BUCKETED)),
        BackendCase("PCAF-hybrid (bucketed)", *_NT_CTX, overrides=("memory.route=hybrid", *_BUCKETED)),
        BackendCase("PCAF no gate", "wt2-nt-1024", "pcaf_no_gate"),
        BackendCase("PCAF no cache", "wt2-nt-1024", "pcaf_no_cache"),
        BackendCase("local conv", "wt2-nt-1024", "local_conv"),
        BackendCase("PCAF-context", *_NT_CTX, compile="on"),
    ]
    if bf16_unit:
        cases += [BackendCase("PCAF-context", *_AR_CTX, precision="bf16", kind="bf16"),
                  BackendCase("local conv", "main-303m", "local_conv_wt103_t1024", precision="bf16", kind="bf16")]
    else:
        small = ("train.seq_len=64", "train.batch_size=1")
        # torch's bf16 step is ~0.9 s here (no bf16 unit): a shorter sample keeps the demonstration cheap.
        cases += [BackendCase("PCAF-context", *_AR_CTX, overrides=small, kind="bf16 demo"),
                  BackendCase("PCAF-context", *_AR_CTX, precision="bf16", overrides=small, kind="bf16 demo",
                              steps_override=(3, 5))]
    cases.append(BackendCase("PCAF-semantic 41M", "sweeps-41m", "pcaf_semantic_ar_s256", scale="paper",
                             overrides=("train.batch_size=1", "train.seq_len=2048"), backends=("jax",), kind="41M",
                             steps_override=(6, 3), max_rounds=1))
    return cases


CASES = build_cases(cpu_has_bf16_matmul())
QUICK_CASES = (0, 6)


def _run_config(case: BackendCase):
    from experiments.table_plan import compose_row

    overrides = [*case.overrides, f"train.precision={case.precision}", f"train.compile={case.compile}"]
    return compose_row(case.table, case.row, case.scale, "torch", overrides)[0].run


def _backend(name: str):
    if name == "torch":
        from backends.torch.backend import TorchBackend

        return TorchBackend("cpu")
    from backends.jax.backend import JaxBackend

    return JaxBackend("cpu")


MIN_TIMED_SECONDS, MAX_TIMED_STEPS = 2.0, 200
"""A sample keeps timing steps past ``steps`` until its timed steps add up to this many seconds (at most
``MAX_TIMED_STEPS``): 12 steps of a 20-30 ms next-token step are a third of a second, and one such sample read
JAX/torch 1.64 where four rounds read 1.19 when the machine slowed for a moment. Not for cases with their own
step counts (the 41M case) nor for runs of fewer than 5 timed steps (``--quick``)."""


def worker(backend_name: str, case: int, warmup: int, steps: int) -> dict:
    """Time ``steps`` training steps of ``CASES[case]`` on one backend after ``warmup`` untimed ones (the
    case's ``steps_override`` wins), more while they add up to under :data:`MIN_TIMED_SECONDS`; returns the
    median and context."""
    override = CASES[case].steps_override
    warmup, steps = override or (warmup, steps)
    min_seconds = 0.0 if override or steps < 5 else MIN_TIMED_SECONDS
    cfg = _run_config(CASES[case])
    backend = _backend(backend_name)
    state = backend.init(cfg)
    rng = np.random.default_rng(0)
    B, T, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    inputs = rng.integers(3, V, (B, T)).astype(np.int32)
    targets = rng.integers(3, V, (B, T) if cfg.train.mode == "ar" else (B,)).astype(np.int32)
    times, losses = [], []
    i = 0
    while i < warmup + steps or (sum(times) < min_seconds and len(times) < MAX_TIMED_STEPS):
        t0 = time.perf_counter()
        state, loss = backend.train_step(state, inputs, targets, 1e-4)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
        i += 1
    from pcaf_core.flops import train_step_flops
    from pcaf_core.profiles import matmul_precision

    compiled = "jit" if backend_name == "jax" else ("inductor" if "torch.compile" in backend.device else "eager")
    flops = train_step_flops(cfg.model, cfg.memory, cfg.train.mode, T, B)  # full-window count (bench_models')
    floor = jax_step_floor(cfg, flops, state) if CASES[case].kind == "41M" and backend_name == "jax" else {}
    return {"step_s": statistics.median(times), "tokens": B * T, "mode": cfg.train.mode, "T": T, "batch": B,
            "model_mflops_per_token": round(flops / (B * T) / 1e6, 3), **floor,
            "dropout": cfg.profile.dropout, "profile": cfg.profile.name, "first_loss": losses[0],
            "matmul_precision": matmul_precision(cfg), "d": cfg.model.d_model, "layers": cfg.model.n_layers, "V": V,
            "policy": _policy(cfg),
            "compile": compiled, "device": backend.device, "versions": backend.versions()}


def jax_step_floor(cfg, step_flops: float, state=None, repeats: int = 5) -> dict:
    """A lower bound on a full-AR JAX step's time, from work any such step must do, each timed here with XLA.

    - the vocabulary head's ``[B·T, h] @ [h, V]`` product and the two of its backward pass (``g @ Wᵀ``,
      ``xᵀ @ g``), most of a large-vocabulary step's FLOPs, as jitted products of exactly those shapes;
    - the rest of the step's FLOPs (``step_flops`` less those three) at the fastest of those rates;
    - with ``state`` (a :class:`backends.jax.backend.JaxState`): the run's own optimiser update over every
      parameter, and the loss's log-sum-exp over the ``[B·T, V]`` logits with its gradient.

    LayerNorm, GELU, dropout, the conv's and the routes' non-product work count nothing, so no step of this
    model can take less time on this CPU with XLA. Each part is its fastest of ``repeats`` timings after one
    warm-up (a bound takes the best reading: on this machine one product's time moves 10-20% between calls).
    Returns ``jax_step_floor_s``, ``jax_floor_parts`` (the parts in seconds) and ``jax_head_gemm_gflops`` (the
    three rates, ``/``-separated).
    """
    import jax
    import jax.numpy as jnp

    n, h, V = cfg.train.batch_size * cfg.train.seq_len, cfg.model.d_hidden, cfg.model.vocab_size
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h, V)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(n, V)), jnp.float32)

    def timed(f, *args) -> float:
        return min(median_seconds(lambda: jax.block_until_ready(f(*args)), 1, repeats)[1])

    seconds = [timed(jax.jit(lambda a, b: a @ b), x, w), timed(jax.jit(lambda a, b: a @ b.T), g, w),
               timed(jax.jit(lambda a, b: a.T @ b), x, g)]
    one = 2.0 * n * h * V
    rates = [one / sec for sec in seconds]
    parts = {"head products": sum(seconds), "other products": max(step_flops - 3 * one, 0.0) / max(rates)}
    if state is not None:
        import optax

        from backends.jax.optim import build_optimizer

        tx = build_optimizer(cfg.train, cfg.profile, state.params)
        # Any gradient values do: the update's cost does not depend on them.
        parts["optimiser update"] = timed(jax.jit(lambda p, o: optax.apply_updates(p, tx.update(p, o, p)[0])),
                                          state.params, state.opt_state)
        targets = jnp.asarray(rng.integers(0, V, n))
        parts["log-sum-exp"] = timed(jax.jit(jax.grad(lambda z: jnp.sum(
            jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0]))), g)
    return {"jax_step_floor_s": round(sum(parts.values()), 3),
            "jax_floor_parts": "; ".join(f"{k} {v:.3g} s" for k, v in parts.items()),
            "jax_head_gemm_gflops": "/".join(f"{r / 1e9:.1f}" for r in rates)}


def _policy(cfg) -> str:
    m = cfg.memory
    if cfg.model.variant not in ("pcaf", "pcaf_no_gate"):
        return "no cache"
    if m.route == "context":
        return f"context/{m.candidate_policy}"
    return f"{m.route}/{m.semantic_index}"


PARITY_TARGET = 1.5
"""JAX within 1.5x of torch either way (the backend issue's target)."""


JUDGED_KINDS = ("parity", "bf16", "bf16 demo")
"""Case kinds judged against the target (the 41M case has no torch side)."""

def bf16_demo_note(rows: list[dict]) -> str:
    """What the ``bf16 demo`` pair (one case in fp32 and in bf16 on a CPU without a bf16 matrix unit) measured,
    from the rows themselves: each backend's bf16 step against its fp32 step. Empty without the pair."""
    demo = {r["precision"]: r for r in rows if r["kind"] == "bf16 demo"}
    if set(demo) != {"fp32", "bf16"}:
        return ""
    fp, bf = demo["fp32"], demo["bf16"]
    speed = {n: float(fp[f"{n}_step_ms"]) / float(bf[f"{n}_step_ms"]) for n in BACKENDS}
    return (f"bf16 on a CPU without a bf16 matrix unit (the `bf16 demo` rows, T={fp['T']}, batch {fp['batch']}): "
            f"torch's bf16 step took {bf['torch_step_ms']} ms against {fp['torch_step_ms']} ms in fp32 "
            f"({speed['torch']:.2f}x the fp32 speed), JAX's {bf['jax_step_ms']} against {fp['jax_step_ms']} ms "
            f"({speed['jax']:.2f}x). Torch runs oneDNN's bf16 GEMM with the bf16 instructions the CPU has "
            "(`make bench` times it beside fp32 in `bench_gemm.csv`: 1.6-2.0x fp32 on a 2-core AMD EPYC with "
            "AVX-512 BF16, 0.5-0.7x on a Xeon with AVX-512 BF16 alone, a 2 GFLOP/s scalar fallback on a Zen 3 "
            "EPYC). "
            "`train.precision=auto` picks fp32 on any CPU without AMX; `train.precision=bf16` asks for bf16.")


def parity_verdict(jax_over_torch: float) -> str:
    """``met`` when JAX is within :data:`PARITY_TARGET` of torch either way, else by how much it missed."""
    slower = max(jax_over_torch, 1 / jax_over_torch)
    return "met" if slower <= PARITY_TARGET else f"missed by {slower / PARITY_TARGET:.2f}x"


def parity_table(rows: list[dict]) -> list[str]:
    """Markdown table of the measured cases: every label, both step times, the ratio and, for the parity
    cases, the target's verdict."""
    lines = ["| model | kind | mode | T | batch | d / blocks / V | policy | precision | profile | dropout "
             "| torch compile | torch ms | JAX ms | torch tokens/s | JAX tokens/s | JAX / torch | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.get("jax_over_torch_time")
        ratio = float(ratio) if ratio not in (None, "") else None
        verdict = parity_verdict(ratio) if ratio is not None and r["kind"] in JUDGED_KINDS else "-"
        lines.append(f"| {r['model']} | {r['kind']} | {r['mode']} | {r['T']} | {r['batch']} | "
                     f"{r['d']} / {r['layers']} / {r['V']} | {r['policy']} | {r['precision']} | {r['profile']} | "
                     f"{r['dropout']} | {r['torch_compile'] or '-'} | {r['torch_step_ms'] or '-'} | "
                     f"{r['jax_step_ms'] or '-'} | {r['torch_tokens_per_s'] or '-'} | {r['jax_tokens_per_s'] or '-'} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {verdict} |")
    return lines


def _steps_label(rows: list[dict]) -> str:
    """Steps and rounds per group of cases, and whether the parity cases' warm-up outlasts JAX's slow start."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for r in rows:
        groups.setdefault((r["warmup_steps"], r["steps_per_sample"], r["rounds"]), []).append(
            f"{r['model']} {r['precision']}" if r["kind"] != "parity" else "parity")
    parts = [f"{w} warm-up + {n} timed, {k} round{'s' * (k > 1)}"
             + ("" if "parity" in names else f" ({', '.join(dict.fromkeys(names))})")
             for (w, n, k), names in sorted(groups.items(), reverse=True)]
    parity_warmup = min((r["warmup_steps"] for r in rows if r["kind"] == "parity"), default=0)
    note = ("warm-up covers compilation and JAX's slower first ~8 steps" if parity_warmup >= 8 else
            "a short warm-up: JAX's slower first ~8 steps fall into the median, so this is a smoke check")
    return "; ".join(parts) + f" ({note})"


def write_results(rows: list[dict], results_dir: Path, labels: dict, command: str) -> Path:
    """``bench_backends_cpu.csv`` and ``bench_backends_cpu.md`` (labels, table, target per row)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "bench_backends_cpu.csv", rows)
    lines = ["# One training step, torch beside JAX", "", f"- {labels_line(labels)}",
             f"- command: `{command}`",
             "- each round: one fresh process per backend measures every case in turn, the backends' order "
             "alternating between rounds; median of the timed steps per case, median over rounds; the step is the "
             "`Backend.train_step` a run of the suite times",
             f"- steps per case: {_steps_label(rows)}",
             f"- target: JAX within {PARITY_TARGET}x of torch either way (parity and bf16 cases)", "",
             *parity_table(rows)]
    if note := bf16_demo_note(rows):
        lines += ["", note]
    md = results_dir / "bench_backends_cpu.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _case_line(c: BackendCase) -> str:
    return f"{c.model:24} {c.kind:9} {c.precision} {c.table}"


def _samples(backend_name: str, cases: list[int], warmup: int, steps: int, heading: str) -> dict[int, dict]:
    """One fresh worker process measuring ``cases`` in turn on ``backend_name``; prints each case as it
    finishes and returns case -> sample. A failing case stops the process: the error names it."""
    cmd = [sys.executable, "-m", "benchmarks.bench_backends", "--worker", backend_name,
           "--case", ",".join(map(str, cases)), "--warmup", str(warmup), "--steps", str(steps)]
    out: dict[int, dict] = {}
    # stderr to a file, not a pipe: a worker's warnings could fill a pipe nobody reads while stdout is read.
    with tempfile.TemporaryFile(mode="w+") as errors:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True) as proc:
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue
                s = json.loads(line)
                out[s["case"]] = s
                print(f"{heading} {_case_line(CASES[s['case']])} {s['mode']} {backend_name:5} "
                      f"{s['step_s'] * 1e3:8.1f} ms", flush=True)
        errors.seek(0)
        err = errors.read()
    if proc.returncode != 0:
        i = next((c for c in cases if c not in out), cases[-1])
        what = (f"{CASES[i].model} ({CASES[i].table}/{CASES[i].row} {' '.join(CASES[i].overrides)})"
                if 0 <= i < len(CASES) else f"#{i} (there are {len(CASES)} cases)")
        raise RuntimeError(f"{backend_name} worker failed on case {what}:\n{err[-3000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/backends.csv")
    parser.add_argument("--rounds", type=int, default=3)
    # JAX's first ~8 steps after compilation run 2-4x slower than its steady state on this CPU (XLA's
    # allocator and thread pool warming up); a 3-step warm-up put that phase into the median.
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cases", default="", help="comma-separated indices into CASES (default: all)")
    parser.add_argument("--quick", action="store_true", help="the two PCAF-context cases, 1 round, 1+2 steps")
    parser.add_argument("--results-dir", default="", help="also write bench_backends_cpu.{csv,md} here")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        for case in map(int, args.case.split(",")):
            print(json.dumps({"case": case, **worker(args.worker, case, args.warmup, args.steps)}), flush=True)
        return 0
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 1, 2
    cases = ([int(c) for c in args.cases.split(",")] if args.cases else
             list(QUICK_CASES) if args.quick else list(range(len(CASES))))
    start = time.perf_counter()
    samples: dict[tuple[int, str], list[dict]] = {}
    for r in range(args.rounds):
        for name in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
            mine = [c for c in cases if name in CASES[c].backends and r < (CASES[c].max_rounds or args.rounds)]
            if not mine:
                continue
            for case, s in _samples(name, mine, args.warmup, args.steps, f"round {r + 1}/{args.rounds}").items():
                samples.setdefault((case, name), []).append(s)
    labels = environment_labels(quick=args.quick)
    rows = []
    for case in cases:
        c = CASES[case]
        med = {n: statistics.median(s["step_s"] for s in samples[(case, n)]) for n in c.backends}
        first = samples[(case, c.backends[0])][0]
        row = {"model": c.model, "kind": c.kind, "table": c.table, "row": c.row, "scale": c.scale,
               "overrides": " ".join(c.overrides), "mode": first["mode"], "T": first["T"], "batch": first["batch"],
               "d": first["d"], "layers": first["layers"], "V": first["V"], "policy": first["policy"],
               "precision": c.precision, "matmul_precision": first["matmul_precision"], "profile": first["profile"],
               "dropout": first["dropout"],
               "torch_compile": samples[(case, "torch")][0]["compile"] if "torch" in med else "",
               "model_mflops_per_token": first["model_mflops_per_token"],
               **{k: first.get(k, "") for k in ("jax_step_floor_s", "jax_floor_parts", "jax_head_gemm_gflops")}}
        for n in BACKENDS:
            row[f"{n}_step_ms"] = round(med[n] * 1e3, 1) if n in med else ""
            row[f"{n}_tokens_per_s"] = round(first["tokens"] / med[n], 1) if n in med else ""
        row["jax_over_torch_time"] = round(med["jax"] / med["torch"], 3) if len(med) == 2 else ""
        warmup, steps = c.steps_override or (args.warmup, args.steps)
        rounds = len(samples[(case, c.backends[0])])
        rows.append({**row, "rounds": rounds, "warmup_steps": warmup, "steps_per_sample": steps, **labels})
    wall = round(time.perf_counter() - start, 1)
    for r in rows:
        r["section_wall_s"] = wall
    write_csv(args.out, rows)
    if args.results_dir:
        command = "python -m benchmarks.bench_backends " + " ".join(argv if argv is not None else sys.argv[1:])
        print(write_results(rows, Path(args.results_dir), labels, command.strip()))
    print(labels_line(labels))
    print("\n".join(parity_table(rows)))
    print(f"{args.out} ({wall} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
