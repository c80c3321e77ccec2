"""Time the candidate-selection kernels side by side: Triton vs the pure-torch path vs the NumPy spec.

Each row runs all three implementations on the same addresses in one process, checks that they agree
exactly, and reports median wall times and the ratios ``torch/triton`` and ``spec/triton``. On a CUDA
machine Triton runs compiled on the GPU and the torch path runs on the same GPU; without CUDA the
kernels run under ``TRITON_INTERPRET=1`` (set here before Triton is imported), which measures the
interpreter, not a GPU, and uses small shapes. The spec always runs on CPU in NumPy.

Usage::

    .venv/bin/python benchmarks/bench_kernels.py [--out bench/kernels.csv] [--repeats 5]

The table is printed and written as CSV (``bench/`` is git-ignored).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton picks compiled vs interpreted when a kernel is defined, so this must precede the import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402

from backends.torch.kernels import torch_impl, triton_impl  # noqa: E402
from backends.torch.kernels.torch_impl import lookup_bucket_table  # noqa: E402
from pcaf_core.hashing import addresses as spec_addresses  # noqa: E402
from pcaf_core.routing import route_context  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration: ``mode`` is ``nt``, ``ar`` or ``table`` (NT via build + lookup)."""

    mode: str
    batch: int
    seq_len: int
    top_k: int
    num_buckets: int
    vocab: int


CPU_SHAPES = [
    Shape("nt", 4, 1024, 16, 32768, 2000),
    Shape("nt", 4, 1024, 16, 64, 2000),
    Shape("table", 4, 1024, 16, 4096, 2000),
    Shape("ar", 2, 256, 16, 32768, 2000),
    Shape("ar", 2, 1024, 16, 32768, 2000),
    Shape("ar", 2, 1024, 32, 64, 2000),
]

GPU_SHAPES = [
    Shape("nt", 32, 1024, 16, 32768, 20000),
    Shape("nt", 32, 4096, 32, 32768, 20000),
    Shape("nt", 32, 4096, 32, 64, 20000),
    Shape("table", 32, 1024, 16, 32768, 20000),
    Shape("ar", 32, 1024, 16, 32768, 20000),
    Shape("ar", 32, 4096, 32, 32768, 20000),
    Shape("ar", 8, 16384, 32, 8192, 20000),
]


def _time(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    """Median wall time in milliseconds over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _implementations(shape: Shape, policy: str, addr: torch.Tensor, addr_np: np.ndarray) -> dict:
    """The three callables for one shape; each returns ``(index, valid)`` as NumPy arrays."""
    T, K, nb = shape.seq_len, shape.top_k, shape.num_buckets

    def as_np(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        return pair[0].cpu().numpy(), pair[1].cpu().numpy()

    if shape.mode == "nt":
        return {
            "triton": lambda: triton_impl.candidates_nt_triton(addr, K, policy),
            "torch": lambda: torch_impl.candidates_nt_torch(addr, K, policy),
            "spec": lambda: route_context(addr_np, np.array([T - 1]), K, policy),
            "as_np": as_np,
        }
    if shape.mode == "ar":
        return {
            "triton": lambda: triton_impl.candidates_ar_triton(addr, K, policy),
            "torch": lambda: torch_impl.candidates_ar_torch(addr, K, policy),
            "spec": lambda: route_context(addr_np, np.arange(T), K, policy),
            "as_np": as_np,
        }
    query = addr[:, -1]
    return {
        "triton": lambda: lookup_bucket_table(triton_impl.bucket_table_triton(addr[:, :-1], nb, K, policy), query),
        "torch": lambda: lookup_bucket_table(torch_impl.bucket_table_torch(addr[:, :-1], nb, K, policy), query),
        "spec": lambda: route_context(addr_np, np.array([T - 1]), K, policy),
        "as_np": as_np,
    }


def run(shapes: list[Shape], repeats: int, device: torch.device) -> list[dict]:
    """Benchmark every shape under both policies; returns one CSV row per (shape, policy)."""
    cuda = device.type == "cuda"
    rng = np.random.default_rng(0)
    rows = []
    for shape in shapes:
        tokens = rng.integers(1, shape.vocab, size=(shape.batch, shape.seq_len))
        addr_np = spec_addresses(tokens, 1, shape.num_buckets)
        addr = torch.from_numpy(addr_np).to(device)
        for policy in ("recent", "first"):
            impl = _implementations(shape, policy, addr, addr_np)
            spec = impl["spec"]()
            for name in ("triton", "torch"):
                index, valid = impl["as_np"](impl[name]())
                if not (np.array_equal(index, spec.index) and np.array_equal(valid, spec.valid)):
                    raise AssertionError(f"{name} disagrees with the spec on {shape} / {policy}")
            ms = {name: _time(impl[name], repeats, cuda and name != "spec") for name in ("triton", "torch")}
            ms["spec"] = _time(impl["spec"], max(1, repeats // 2), False)
            rows.append(
                {
                    "mode": shape.mode,
                    "policy": policy,
                    "batch": shape.batch,
                    "seq_len": shape.seq_len,
                    "top_k": shape.top_k,
                    "num_buckets": shape.num_buckets,
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "triton_mode": "interpreted" if triton_impl.INTERPRETED else "compiled",
                    "torch_threads": torch.get_num_threads(),
                    "triton_ms": round(ms["triton"], 4),
                    "torch_ms": round(ms["torch"], 4),
                    "spec_ms": round(ms["spec"], 4),
                    "torch_over_triton": round(ms["torch"] / ms["triton"], 3),
                    "spec_over_triton": round(ms["spec"] / ms["triton"], 3),
                }
            )
            print(_format_row(rows[-1]), flush=True)
    return rows


_COLUMNS = (
    "mode",
    "policy",
    "batch",
    "seq_len",
    "top_k",
    "num_buckets",
    "triton_mode",
    "triton_ms",
    "torch_ms",
    "spec_ms",
    "torch_over_triton",
    "spec_over_triton",
)


def _format_row(row: dict) -> str:
    return " | ".join(f"{row[c]!s:>{max(len(c), 8)}}" for c in _COLUMNS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "kernels.csv", help="CSV output path")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per implementation (median)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, where the interpreter and NumPy spec are "
        "single-threaded and a shared machine makes multi-threaded timings erratic; torch's default on GPU)",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    print(" | ".join(f"{c:>{max(len(c), 8)}}" for c in _COLUMNS))
    rows = run(shapes, args.repeats, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
