"""What an eager training step's ops must move and compute, and the time that takes at best on a device: the step's
floor.

Each op that launches a kernel on a GPU (:func:`benchmarks.op_census.launches_kernel`) is charged the bytes of its
operands and results and its FLOPs; its floor is the longer of the two at the device's rates, the FLOPs at the
GEMM peak of the products' dtype, the bytes at the measured copy bandwidth. The step's floor is the sum: the time
its op graph takes on that device if every kernel ran at the rate's limit with no gap between kernels. A step
faster than the floor needs another op graph (fewer passes over memory), not faster kernels. The bytes are a lower
bound for each op: a kernel reads each operand and writes each result at least once, except that

- a gather (``embedding``, ``index_select``, ``gather``) is charged the rows it reads, not its whole table;
- a fill or a random draw (``zeros_like``, ``randint``, ``fill_``) reads nothing;
- an in-place op (``mul_``, ``_foreach_mul_``, ``_fused_adamw_``) reads and writes each tensor it updates, except
  that a copy (``copy_``, ``_foreach_copy_``) only writes its destination.

A ``pcaf::`` op is one kernel: charged its operands and results, not the ATen ops of its form off Triton. FLOPs
are ``torch.utils.flop_counter``'s (products, convolutions, attention); every other op counts none, since its
bytes bound it first.

    python -m benchmarks.step_traffic                         # full-AR PCAF-context bf16, the paper shape, on CPU
    python -m benchmarks.step_traffic --precision fp32 --aten-forms --top 20
    python -m benchmarks.step_traffic --bench-dir docs/results/bench_cuda  # floors at that run's rates

On a CPU the step runs on CPU tensors taking the CUDA code paths (as ``benchmarks.op_census`` does), each
``pcaf::`` op giving zeros of its outputs' shapes instead of running its kernel
(:func:`benchmarks.op_census.custom_ops_as_shapes`: the same ops on the same shapes, a few seconds at the paper
shape where Triton's interpreter took 14 minutes); the counts do not depend on the device. ``make bench-cuda``
counts the same on the GPU, kernels run (its ``traffic`` section), and judges the bf16 step against the floor at
the rates measured in the same run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

GATHERS = ("aten::embedding", "aten::index_select", "aten::gather", "aten::take_along_dim", "aten::index.Tensor")
"""Ops charged the rows they read (their result's elements from the source) rather than the source's size."""
NO_READS = ("aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::new_zeros", "aten::new_ones",
            "aten::new_full", "aten::zeros", "aten::ones", "aten::full", "aten::fill_", "aten::zero_",
            "aten::randint", "aten::rand", "aten::randn", "aten::rand_like", "aten::randn_like",
            "aten::randint_like", "aten::random_", "aten::uniform_", "aten::normal_", "aten::bernoulli_")
"""Ops that read no operand's values (only shapes, or none): charged their results only."""
OVERWRITES = ("aten::copy_", "aten::_foreach_copy_")
"""In-place ops that write the tensors they update without reading them."""
READ_ONLY = {"aten::_fused_adamw_": "grads", "aten::_fused_adam_": "grads"}
"""An argument an op's schema marks as updated that the step's call only reads (the fused optimisers scale their
gradients in place only when given a ``grad_scale``, which the step does not pass)."""


@dataclasses.dataclass(frozen=True)
class OpTraffic:
    """One kernel-launching op of a step: ``name`` its schema name, bytes read and written, FLOPs, and ``dtype``,
    the products' dtype (``bf16`` for 16-bit operands, else ``fp32``; empty for an op with no FLOPs)."""

    name: str
    read: int
    written: int
    flops: int
    dtype: str


def _bytes(t) -> int:
    """The bytes a tensor's elements occupy; an expanded view (a zero stride) its storage's."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def charge(func, args: tuple, kwargs: dict, out) -> OpTraffic:
    """The bytes and FLOPs of one dispatched op (see the module docstring)."""
    import torch
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    name = func._schema.name
    tensors = {}
    for i, a in enumerate(func._schema.arguments):  # tensors an in-place op updates: read and written
        if a.alias_info is not None and a.alias_info.is_write and READ_ONLY.get(name) != a.name:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    tensors[id(t)] = t
    written = list(tensors.values())
    seen = set(tensors)
    written += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and id(t) not in seen]
    inputs = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    if name in NO_READS:
        read = 0
    elif name in OVERWRITES:
        read = sum(_bytes(t) for t in inputs.values() if id(t) not in tensors)
    elif name in GATHERS and written:
        source, *rest = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        rows = sum(t.numel() for t in written) * source.element_size()
        read = min(_bytes(source), rows) + sum(_bytes(t) for t in rest)
    else:
        read = sum(_bytes(t) for t in inputs.values())
    flops, dtype = 0, ""
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        flops = int(formula(*args, **kwargs, out_val=out))
        floats = [t for t in inputs.values() if t.is_floating_point()]
        dtype = "bf16" if floats and all(t.element_size() == 2 for t in floats) else "fp32"
    return OpTraffic(name, read, sum(_bytes(t) for t in written), flops, dtype)


def traffic_mode():
    """A ``TorchDispatchMode`` whose ``ops`` list gets an :class:`OpTraffic` for each kernel-launching op run
    under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.op_census import launches_kernel

    class _Traffic(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[OpTraffic] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if launches_kernel(func):
                self.ops.append(charge(func, args, kwargs, out))
            return out

    return _Traffic()


def op_floor_ms(op: OpTraffic, peaks: dict[str, float], bandwidth: float) -> float:
    """``op``'s floor in ms: its FLOPs at ``peaks[op.dtype]`` (GFLOP/s) or its bytes at ``bandwidth`` (GB/s),
    whichever takes longer."""
    compute = op.flops / peaks[op.dtype] / 1e6 if op.flops else 0.0
    return max(compute, (op.read + op.written) / bandwidth / 1e6)


def by_op(ops: list[OpTraffic], peaks: dict[str, float] | None = None,
          bandwidth: float | None = None) -> list[dict]:
    """One row per op name, the longest floor first (the most bytes first without rates): ``op``, ``count``,
    ``read_mb``, ``written_mb``, ``gflop`` and, with rates, ``floor_ms``."""
    groups: dict[str, list[OpTraffic]] = collections.defaultdict(list)
    for op in ops:
        groups[op.name].append(op)
    rows = []
    for name, group in groups.items():
        row = {"op": name, "count": len(group), "read_mb": round(sum(o.read for o in group) / 1e6, 1),
               "written_mb": round(sum(o.written for o in group) / 1e6, 1),
               "gflop": round(sum(o.flops for o in group) / 1e9, 2)}
        if peaks is not None and bandwidth is not None:
            row["floor_ms"] = round(sum(op_floor_ms(o, peaks, bandwidth) for o in group), 3)
        rows.append(row)
    key = "floor_ms" if peaks is not None and bandwidth is not None else "read_mb"
    return sorted(rows, key=lambda r: -(r[key] + (r["written_mb"] if key == "read_mb" else 0)))


def summary(ops: list[OpTraffic], peaks: dict[str, float], bandwidth: float) -> dict:
    """The step's totals: ``ops``, ``read_gb``, ``written_gb``, ``gflop``, ``floor_ms`` (every op at its floor),
    ``gemm_floor_ms`` (the FLOPs alone at their peaks) and ``bytes_floor_ms`` (the bytes of the ops with no
    FLOPs at the bandwidth)."""
    return {"ops": len(ops), "read_gb": round(sum(o.read for o in ops) / 1e9, 3),
            "written_gb": round(sum(o.written for o in ops) / 1e9, 3),
            "gflop": round(sum(o.flops for o in ops) / 1e9, 1),
            "floor_ms": round(sum(op_floor_ms(o, peaks, bandwidth) for o in ops), 3),
            "gemm_floor_ms": round(sum(o.flops / peaks[o.dtype] / 1e6 for o in ops if o.flops), 3),
            "bytes_floor_ms": round(sum((o.read + o.written) / bandwidth / 1e6 for o in ops if not o.flops), 3)}


def count_step(precision: str = "bf16", T: int = 1024, batch: int = 8, fused: bool = True, device: str = "cpu",
               model: str = "PCAF-context", mode: str = "ar", scale: str = "paper",
               kernels: bool = True) -> list[OpTraffic]:
    """The ops of one eager training step of ``bench_cuda``'s case (:func:`benchmarks.op_census.eager_step`; the
    WikiText-2 paper shape, full AR, T=1024, batch 8 by default). ``kernels=False`` (a CPU): the ``pcaf::`` ops give
    zeros of their outputs' shapes instead of running (:func:`benchmarks.op_census.custom_ops_as_shapes`), the same
    ops charged the same bytes in a fraction of the time."""
    from benchmarks.op_census import eager_step

    with eager_step(model, mode, precision, T, batch, fused=fused, device=device, scale=scale,
                    kernels=kernels) as step:
        mode_ = traffic_mode()
        with mode_:
            step()
    return mode_.ops


def rates(bench_dir: Path) -> tuple[dict[str, float], float]:
    """The GEMM peaks (GFLOP/s by dtype: the best of ``gemm.csv``) and the copy bandwidth (GB/s,
    ``bandwidth.csv``) a ``benchmarks.bench_cuda`` run measured."""
    from benchmarks.common import read_csv

    gemm, copy = bench_dir / "gemm.csv", bench_dir / "bandwidth.csv"
    for f in (gemm, copy):
        if not f.exists():
            raise SystemExit(f"{f} is missing: a benchmarks.bench_cuda run's gemm section writes it (make bench-cuda)")
    peaks = {d: max(float(r["gflops"]) for r in read_csv(gemm) if r["dtype"] == d) for d in ("fp32", "bf16")}
    return peaks, max(float(r["gb_per_s"]) for r in read_csv(copy))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--mode", choices=("ar", "nt"), default="ar")
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--aten-forms", action="store_true",
                        help="ATen's forms instead of the fused kernels (bench_cuda's 'ATen passes' case)")
    parser.add_argument("--bench-dir", type=Path, default=None,
                        help="a bench_cuda run's folder: floors at its GEMM peaks and copy bandwidth")
    parser.add_argument("--top", type=int, default=15, help="how many ops to list")
    args = parser.parse_args(argv)
    peaks, bandwidth = rates(args.bench_dir) if args.bench_dir else (None, None)  # before the count: fail first
    ops = count_step(args.precision, args.T, args.batch, fused=not args.aten_forms, mode=args.mode, kernels=False)
    label = (f"PCAF-context {args.mode} {args.precision}, T={args.T}, batch {args.batch}, WikiText-2 paper shape, "
             f"profile reference_torch, dropout 0.1, eager" + (", ATen passes" if args.aten_forms else "")
             + ", CUDA code paths counted on CPU tensors")
    if peaks is not None:
        s = summary(ops, peaks, bandwidth)
        print(f"{label}: {s['ops']} ops, {s['read_gb']} GB read, {s['written_gb']} GB written, {s['gflop']} GFLOP; "
              f"floor {s['floor_ms']} ms at {args.bench_dir}'s rates (bf16 {peaks['bf16']:,.0f} and fp32 "
              f"{peaks['fp32']:,.0f} GFLOP/s, {bandwidth:,.0f} GB/s)")
    else:
        print(f"{label}: {len(ops)} ops, {sum(o.read for o in ops) / 1e9:.3f} GB read, "
              f"{sum(o.written for o in ops) / 1e9:.3f} GB written, {sum(o.flops for o in ops) / 1e9:.1f} GFLOP")
    for r in by_op(ops, peaks, bandwidth)[:args.top]:
        floor = f"{r['floor_ms']:8.3f} ms  " if "floor_ms" in r else ""
        print(f"  {floor}{r['count']:4d}x  {r['read_mb']:9.1f} MB read  {r['written_mb']:9.1f} MB written  "
              f"{r['gflop']:8.2f} GFLOP  {r['op']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
