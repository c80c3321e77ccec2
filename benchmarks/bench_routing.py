"""Full-AR routing cost against window length: the dense reference-style route beside the sparse routes.

One window (batch 1) of WikiText-2 train text (random ids where the corpus is missing; the CSV says which),
d = 224, K = 32, B = 32,768 buckets, n = 1, T = 1K..16K. Each route is timed forward + backward: select
the candidates, score them (``q·k/√d + ρ·r``), softmax over the K, and a loss whose backward reaches the
queries, keys, ρ (and the router for the semantic route):

- ``dense``: the paper's full-AR code as it routes (docs/REFERENCE_CODE.md §2.3, §2.5): a ``[T, T]`` score
  ``q·k/√d + ρ·r``, the bucket-equality and causal masks (masked scores -1e9), top-K per row, softmax over the
  K kept scores; the backward runs through the ``[T, T]`` score matrix. Written here because no backend
  function trains this way (the backends' dense ``topk_score`` fallback selects without gradients);
- ``recent``, ``topk_score``: the backends' ``route_context`` (sparse layout; ``topk_score`` with its
  proof and chunked fallback), then ``candidate_scores`` / ``cache_weights`` as the models use them;
- ``semantic_bucketed``: ``route_semantic_bucketed`` on the argmax buckets of a router distribution
  (S = 256, τ = 0.2) and the route term ``λ·log m`` (λ = 1) in the scores.

Each (backend, T) runs in a fresh process (so no case is timed in a heap a larger one grew), the sparse
routes first, timed in interleaved rounds (one run of each per round), and the dense route last; each time is
the median of ``--repeats`` runs after its warm-up runs (:func:`schedule`; JAX: ``jax.jit`` of the
value-and-gradient, compiled before them). Memory is the
peak of intermediate buffers, inputs excluded: torch, the live bytes of every op output
(``benchmarks/torch_memory.py``: forward and backward, freed buffers subtracted); JAX, XLA's buffer
assignment for the compiled step (``memory_analysis().temp_size_in_bytes``). A route that
runs out of memory is recorded as such and its larger T skipped.

    python -m benchmarks.bench_routing [--quick] [--out bench/routing.csv] [--backends torch,jax]

``--quick``: T = 256, 512, 1024, one repeat (checks that it runs; the ratios there mean little).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import environment_labels, loglog_slope, text_tokens, write_csv
from pcaf_core.hashing import addresses as spec_addresses
from pcaf_core.mixture import MASKED_SCORE

SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (256, 512, 1024)
ROUTES = ("dense", "recent", "topk_score", "semantic_bucketed")
MEASURE_ORDER = ("recent", "topk_score", "semantic_bucketed", "dense")
"""Within a T the dense route runs last, so the sparse routes are not timed in a heap its ``[T, T]`` buffers grew."""
BACKENDS = ("torch", "jax")
D, K, S, NUM_BUCKETS, TAU, LAMBDA = 224, 32, 256, 32768, 0.2, 1.0


REPEATS = 15
"""Timed runs of a route (the dense route at T >= 8,192: 2): a sparse step takes 2-180 ms, so 15 interleaved
rounds cost seconds, and a median of 5 runs taken back to back once read 94 ms for a step that reads 53 ms
(torch ``topk_score``, T = 8,192) when the machine slowed for under a second."""

SPARSE_WARMUP = 8
"""Untimed runs before a sparse route is timed: a jitted JAX step runs 1.5-2x slower for its first few calls
(fresh buffers), and at T = 16,384 a sparse step takes 0.1-0.4 s, so 8 cost little."""


def schedule(route: str, T: int, repeats: int) -> tuple[int, int]:
    """(warm-up runs, timed runs) of ``route`` at ``T``: the dense route, seconds a step at T >= 8,192, two
    warm-ups and at most 2 timed there; sparse routes :data:`SPARSE_WARMUP` and ``repeats``; one each in
    ``--quick`` (``repeats`` = 1)."""
    if repeats == 1:
        return 1, 1
    if route == "dense":
        return 2, min(repeats, 2) if T >= 8192 else repeats
    return SPARSE_WARMUP, repeats


def inputs(T: int) -> dict[str, np.ndarray | str]:
    """The same window for both backends: tokens, addresses (n = 1, B = 32,768), unit queries and keys,
    router logits, recency ``s/(T-1)`` and the loss's fixed per-slot coefficients."""
    tokens, source = text_tokens(T, 1)
    rng = np.random.default_rng(T)
    q = rng.normal(size=(1, T, D)).astype(np.float32)
    k = rng.normal(size=(1, T, D)).astype(np.float32)
    return {
        "source": source,
        "addr": spec_addresses(tokens, 1, NUM_BUCKETS).astype(np.int64),
        "q": q / np.linalg.norm(q, axis=-1, keepdims=True),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "z": rng.normal(size=(1, T, S)).astype(np.float32),
        "rec": (np.arange(T) / max(T - 1, 1)).astype(np.float32),
        "coeff": rng.normal(size=(1, T, K)).astype(np.float32),
    }


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "memory" in text or "resource_exhausted" in text


# ----------------------------------------------------------------------------------------------- torch


def torch_route_step(route: str, x: dict):
    """A ``() -> None`` that runs one forward + backward of ``route`` on the torch tensors ``x`` (on any one
    device). ``recent_kernel``: the ``recent`` route without the bucket layout, i.e. the candidate kernels
    (Triton on CUDA) and gathered scores, the path a route given no layout takes (``benchmarks.bench_cuda``
    times it beside the banded one)."""
    import torch

    from backends.torch.mixture import cache_weights, candidate_scores
    from backends.torch.routing import bucket_layout, route_context, route_semantic_bucketed, semantic_buckets
    from pcaf_core.routing import ScoreBand, SelectionInputs

    T = x["addr"].shape[1]
    qpos = torch.arange(T, device=x["addr"].device)
    col = qpos

    def step() -> None:
        q, k, z, rho = (x[n].detach().requires_grad_(True) for n in ("q", "k", "z", "rho"))
        if route == "dense":
            score = q[0] @ k[0].T / math.sqrt(D) + rho * x["rec"]  # [T, T]
            allowed = (x["addr"][0][None, :] == x["addr"][0][:, None]) & (col[None, :] < col[:, None])
            vals, _ = torch.topk(torch.where(allowed, score, MASKED_SCORE), K, dim=-1)
            w = cache_weights(vals[None], vals[None] > MASKED_SCORE / 10)
        else:
            # As the models do: full-AR recent / semantic candidates are scored from the bucket layout their
            # route read (the band); topk_score's picks are gathered (backends.torch.mixture says why).
            probs = band = None
            if route == "recent":
                band = ScoreBand(bucket_layout(x["addr"]))
                cand = route_context(x["addr"], qpos, K, "recent", query_layout="ar", layout=band.layout)
            elif route == "recent_kernel":
                cand = route_context(x["addr"], qpos, K, "recent", query_layout="ar")
            elif route == "topk_score":
                select = SelectionInputs(q.detach(), k.detach(), x["rec"], float(rho.detach()))
                cand = route_context(x["addr"], qpos, K, "topk_score", select, query_layout="ar")
            else:
                probs = torch.softmax(z / TAU, dim=-1)
                sem = semantic_buckets(probs.detach())
                band = ScoreBand(bucket_layout(sem))
                cand = route_semantic_bucketed(sem, qpos, K, query_layout="ar", layout=band.layout)
            s = candidate_scores(q, k, x["rec"], rho, cand, router_probs=probs, query_router_probs=probs,
                                 semantic_score_scale=LAMBDA if probs is not None else 0.0, band=band)
            w = cache_weights(s, cand.valid)
        (w * x["coeff"]).sum().backward()

    return step


def torch_worker(seq_lens: tuple[int, ...], repeats: int, skip: tuple[str, ...] = ()) -> list[dict]:
    import torch

    from benchmarks.torch_memory import PeakLiveBytes, storage_frees_are_seen

    method = ("torch: peak live bytes of op outputs (TorchDispatchMode), inputs excluded"
              if storage_frees_are_seen() else "torch: largest single op output (frees not observable)")
    rows, dead = [], set(skip)
    for T in seq_lens:
        raw = inputs(T)
        x = {n: torch.from_numpy(v) for n, v in raw.items() if isinstance(v, np.ndarray)}
        x["rho"] = torch.tensor(1.0)

        def prepare(route: str, row: dict, x: dict = x):
            step = torch_route_step(route, x)
            with PeakLiveBytes() as probe:
                step()
            peak = probe.peak_bytes if "peak" in method else probe.largest_bytes
            row.update(peak_mb=round(peak / 2**20, 3), largest_buffer_mb=round(probe.largest_bytes / 2**20, 3))
            return step

        base = {"backend": "torch", "T": T, "batch": 1, "d": D, "K": K, "dtype": "fp32", "compile": "eager",
                "dropout": "none", "tokens": raw["source"], "memory_method": method}
        rows += _measure_T(base, T, repeats, dead, prepare)
    return rows


def _measure_T(base: dict, T: int, repeats: int, dead: set[str], prepare) -> list[dict]:
    """Rows of every live route at ``T``: ``prepare(route, row)`` builds the step (recording its memory in
    ``row``) and returns it; the sparse routes are then timed in interleaved rounds (one run of each per round,
    after their warm-ups), so a slow phase of the machine falls on all of them alike, and the dense route
    last. A route out of memory joins ``dead``."""
    rows, sparse = [], {}
    for route in MEASURE_ORDER:
        if route in dead:
            continue
        if route == "dense" and sparse:  # timed before the dense route's [T, T] buffers grow the heap
            _time_routes(rows, sparse, T, repeats)
            sparse = {}
        row = {**base, "route": route}
        rows.append(row)
        try:
            step = prepare(route, row)
            if route != "dense":
                sparse[route] = step
                continue
            _time_routes(rows, {route: step}, T, repeats)
        except (MemoryError, RuntimeError) as exc:  # XlaRuntimeError is a RuntimeError
            if not _out_of_memory(exc):
                raise
            dead.add(route)
            sparse.pop(route, None)
            row.clear()
            row.update(base, route=route, status=f"out of memory ({exc})"[:80])
            print(_line(row), file=sys.stderr, flush=True)
    if sparse:
        _time_routes(rows, sparse, T, repeats)
    return rows


def _time_routes(rows: list[dict], steps: dict, T: int, repeats: int) -> None:
    """Median seconds of each step in ``steps`` (route -> callable that finishes its work), interleaved: every
    step's warm-ups, then rounds of one timed run each (:func:`schedule`); written into its row of ``rows``."""
    plan = {route: schedule(route, T, repeats) for route in steps}
    for _ in range(max(w for w, _ in plan.values())):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {route: [] for route in steps}
    for i in range(max(r for _, r in plan.values())):
        for route, step in steps.items():
            if i < plan[route][1]:
                t0 = time.perf_counter()
                step()
                times[route].append(time.perf_counter() - t0)
    for row in rows:
        if row["route"] in steps:
            warm, reps = plan[row["route"]]
            row.update(status="ok", fwd_bwd_ms=round(statistics.median(times[row["route"]]) * 1e3, 3), warmup=warm,
                       repeats=reps)
            print(_line(row), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- JAX


def jax_route_loss(route: str):
    """``(q, k, z, rho, addr, rec, coeff) -> loss`` of ``route`` in JAX (the torch step's twin)."""
    import jax
    import jax.numpy as jnp

    from backends.jax.mixture import cache_weights, candidate_scores
    from backends.jax.routing import bucket_layout, route_context, route_semantic_bucketed, semantic_buckets
    from pcaf_core.routing import ScoreBand, SelectionInputs, topk_sparse_window

    def loss(q, k, z, rho, addr, rec, coeff):
        T = addr.shape[1]
        qpos = jnp.arange(T, dtype=jnp.int32)
        if route == "dense":
            score = q[0] @ k[0].T / math.sqrt(D) + rho * rec
            col = jnp.arange(T)
            allowed = (addr[0][None, :] == addr[0][:, None]) & (col[None, :] < col[:, None])
            vals, _ = jax.lax.top_k(jnp.where(allowed, score, MASKED_SCORE), K)
            w = cache_weights(vals[None], vals[None] > MASKED_SCORE / 10)
        else:
            # As the models do: full-AR candidates are scored from the bucket layout their route read (the band).
            probs = None
            if route == "recent":
                band = ScoreBand(bucket_layout(addr))
                cand = route_context(addr, qpos, K, "recent", query_layout="ar", layout=band.layout)
            elif route == "topk_score":
                sg = jax.lax.stop_gradient
                band = ScoreBand(bucket_layout(addr), topk_sparse_window(K))
                cand = route_context(addr, qpos, K, "topk_score", SelectionInputs(sg(q), sg(k), rec, sg(rho)),
                                     query_layout="ar", layout=band.layout)
            else:
                probs = jax.nn.softmax(z / TAU, axis=-1)
                sem = semantic_buckets(jax.lax.stop_gradient(probs))
                band = ScoreBand(bucket_layout(sem))
                cand = route_semantic_bucketed(sem, qpos, K, query_layout="ar", layout=band.layout)
            s = candidate_scores(q, k, rec, rho, cand, router_probs=probs, query_router_probs=probs,
                                 semantic_score_scale=LAMBDA if probs is not None else 0.0, band=band)
            w = cache_weights(s, cand.valid)
        return jnp.sum(w * coeff)

    return loss


def _xla_temp_bytes(compiled) -> int | None:
    """Bytes of the compiled step's temporaries in XLA's buffer assignment (None where the runtime has none)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some runtimes do not implement it; the CSV then says so
        return None
    return getattr(stats, "temp_size_in_bytes", None) if stats is not None else None


def jax_worker(seq_lens: tuple[int, ...], repeats: int, skip: tuple[str, ...] = ()) -> list[dict]:
    import jax
    import jax.numpy as jnp

    method = "jax: XLA buffer assignment of the compiled step (temp_size_in_bytes), inputs excluded"
    rows, dead = [], set(skip)
    for T in seq_lens:
        raw = inputs(T)
        args = (jnp.asarray(raw["q"]), jnp.asarray(raw["k"]), jnp.asarray(raw["z"]), jnp.float32(1.0),
                jnp.asarray(raw["addr"], jnp.int32), jnp.asarray(raw["rec"]), jnp.asarray(raw["coeff"]))

        def prepare(route: str, row: dict, args: tuple = args):
            grad = jax.jit(jax.value_and_grad(jax_route_loss(route), argnums=(0, 1, 2, 3)))
            t0 = time.perf_counter()
            compiled = grad.lower(*args).compile()
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            peak = _xla_temp_bytes(compiled)
            row["peak_mb"] = round(peak / 2**20, 3) if peak is not None else ""
            return lambda c=compiled, a=args: jax.block_until_ready(c(*a))

        base = {"backend": "jax", "T": T, "batch": 1, "d": D, "K": K, "dtype": "fp32", "compile": "jit",
                "dropout": "none", "tokens": raw["source"], "memory_method": method}
        rows += _measure_T(base, T, repeats, dead, prepare)
    return rows


# ----------------------------------------------------------------------------------------------- driver


def _line(row: dict) -> str:
    if row["status"] != "ok":
        return f"[routing {row['backend']} {row['route']} T={row['T']}] {row['status']}"
    return (f"[routing {row['backend']} {row['route']} T={row['T']} d={D} K={K} fp32] {row['fwd_bwd_ms']:.1f} ms "
            f"forward+backward, peak {row['peak_mb']} MB")


def routing_summary(rows: list[dict]) -> list[dict]:
    """Per (backend, sparse route): the log-log exponents of time and memory over the measured T (``Ts``) and the
    dense/sparse time ratio at each T both were measured at (``ratios``). Rows as written or as read back."""
    out = []
    ok = [r for r in rows if r["status"] == "ok"]
    for backend in sorted({r["backend"] for r in ok}):
        dense = {int(r["T"]): float(r["fwd_bwd_ms"]) for r in ok if r["backend"] == backend and r["route"] == "dense"}
        for route in [r for r in ROUTES if r != "dense"] + sorted({r["route"] for r in ok} - set(ROUTES)):
            pts = sorted((int(r["T"]), float(r["fwd_bwd_ms"]), r.get("peak_mb", "")) for r in ok
                         if r["backend"] == backend and r["route"] == route)
            if not pts:
                continue
            mem = [(t, float(m)) for t, _, m in pts if m not in ("", None) and float(m) > 0]
            out.append({
                "backend": backend, "route": route, "Ts": [p[0] for p in pts],
                "time_exponent": loglog_slope([p[0] for p in pts], [p[1] for p in pts]) if len(pts) > 1 else None,
                "memory_exponent": loglog_slope([m[0] for m in mem], [m[1] for m in mem]) if len(mem) > 1 else None,
                "ratios": {t: dense[t] / ms for t, ms, _ in pts if t in dense},
            })
    return out


def _sample(backend: str, T: int, repeats: int, skip: set[str]) -> list[dict]:
    """Every route of ``backend`` at ``T`` in a fresh worker process, except the ``skip`` routes (out of
    memory at a smaller T)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_routing", "--worker", backend, "--seq-lens", str(T),
           "--repeats", str(repeats), "--skip", ",".join(sorted(skip))]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {backend} routing worker at T={T} failed (exit {out.returncode}); its stderr is above")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/routing.csv")
    parser.add_argument("--quick", action="store_true", help="T = 256, 512, 1024, one repeat")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--seq-lens", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seq_lens = tuple(int(t) for t in args.seq_lens.split(",")) if args.seq_lens else (
        QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    repeats = 1 if args.quick else args.repeats
    if args.worker:
        skip = tuple(r for r in args.skip.split(",") if r)
        rows = (torch_worker if args.worker == "torch" else jax_worker)(seq_lens, repeats, skip)
        print(json.dumps(rows))
        return 0
    start = time.perf_counter()
    labels = environment_labels(quick=args.quick)
    rows = []
    for backend in args.backends.split(","):
        dead: set[str] = set()
        for T in seq_lens:
            sample = _sample(backend, T, repeats, dead)
            dead |= {r["route"] for r in sample if r["status"] != "ok"}
            rows += [{**r, **labels} for r in sample]
    wall = round(time.perf_counter() - start, 1)
    for r in rows:
        r["section_wall_s"] = wall
    write_csv(args.out, rows)
    for s in routing_summary(rows):
        ratios = ", ".join(f"{x:.1f}x at {t}" for t, x in sorted(s["ratios"].items()))
        exps = [f"{s[k]:.2f}" if s[k] is not None else "-" for k in ("time_exponent", "memory_exponent")]
        print(f"{s['backend']:5} {s['route']:17} time exponent {exps[0]}, memory exponent {exps[1]} "
              f"(T {min(s['Ts'])}-{max(s['Ts'])}); dense/sparse {ratios}")
    print(f"{args.out} ({wall} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
