"""How many ops an eager training step dispatches on the CUDA code paths, counted on a CPU.

An eager step on a GPU launches about one kernel per dispatched op, each from the host while the GPU waits
(on an H100 the eager bf16 full-AR PCAF-context step was busy 9.2 of its 20.4 ms). This counts the ops of one
eager training step (forward, backward, optimiser) at the WikiText-2 paper shape with a short T and batch (T=64,
batch 2: T=16, batch 1 counts two ops fewer), with CPU tensors taking the code paths a CUDA tensor takes: the
Triton candidate kernels, gathered scores, the segmented key-gradient op, the head loss's kernels over 16-bit
logits, dropout's mask kernel, the memory read's row and L2 normalisation kernels and the gate's and the addresses'
kernels; the products through ATen rather than the CPU's oneDNN path, and the conv as ``F.conv1d``. Counted are
the ops that launch a kernel on a GPU (not views, aliases or allocations); a custom op such as a Triton kernel's
counts as one. The command line runs each ``pcaf::`` op as the shapes of its outputs
(:func:`custom_ops_as_shapes`: the same count, 5 s instead of 20 s under Triton's interpreter).

    python -m benchmarks.op_census                       # full-AR PCAF-context, bf16 and fp32
    python -m benchmarks.op_census --mode nt --top 30
    python -m benchmarks.op_census --profile corrected     # the benchmark's profile: reference_torch
    python -m benchmarks.op_census --aten-forms            # ATen's forms instead of the fused kernels

It needs no GPU; what the count saves on a GPU is measured by ``make bench-cuda`` (``profile.csv``'s
``kernels_per_step``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def cuda_code_paths() -> Iterator[None]:
    """CPU tensors take the code paths a CUDA tensor takes, until the context ends: the Triton candidate kernels,
    gathered scores instead of the CPU's sparse products, the segmented key-gradient op, the head loss's kernels
    over 16-bit logits, dropout's mask kernel, the memory read's row and L2 normalisation kernels, the gate's and
    the addresses' kernels, and the chunk size of the gathers (tests/conftest.py's ``cuda_code_paths`` fixture)."""
    from unittest import mock

    from backends.torch import dropout, hashing, head_loss, layers, mixture, ops, routing

    with contextlib.ExitStack() as stack:  # the choices of the code paths, each made once in its module
        stack.enter_context(mock.patch.object(routing, "kernels_by_default", lambda addresses: True))
        stack.enter_context(mock.patch.object(hashing, "kernels_by_default", lambda tokens: True))
        stack.enter_context(mock.patch.object(mixture, "kernels_by_default", lambda x: True))
        stack.enter_context(mock.patch.object(layers, "l2_kernels_by_default", lambda x: True))
        stack.enter_context(mock.patch.object(layers, "gate_kernels_by_default", lambda x: True))
        stack.enter_context(mock.patch.object(head_loss, "kernels_by_default", lambda z: True))
        stack.enter_context(mock.patch.object(ops, "_sparse_path", lambda x, y, index: False))
        stack.enter_context(mock.patch.object(ops, "_segment_kernel_for", lambda grad, y: True))
        stack.enter_context(mock.patch.object(dropout, "kernels_by_default", lambda x: True))
        # The gathers' chunks at CUDA's size: at the paper shape one chunk, where a CPU's size makes eight.
        stack.enter_context(mock.patch.object(ops, "CHUNK_ELEMENTS", ops.CHUNK_ELEMENTS_CUDA))
        yield


@contextlib.contextmanager
def custom_ops_as_shapes() -> Iterator[None]:
    """Until the context ends, each ``pcaf::`` op returns zeros of the shapes, dtypes and strides its fake
    implementation gives, without running its kernel; every other op runs as it is.

    What an op is charged or counted depends on the shapes alone, and on the CUDA code paths no op's shape or choice
    depends on a value (they read nothing back: tests/test_torch_cuda_graphs.py), so the step dispatches the same
    ops on the same shapes as with the kernels run: tests/test_step_traffic.py compares the two. On a CPU the
    kernels run under Triton's interpreter, which took 14 minutes for the three steps of :func:`eager_step` at the
    paper shape (T=1024, batch 8). Zeros, not uninitialised memory: an index a kernel returns must stay in range
    for the gathers that read it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    def zeros_like_fake(t):
        if not isinstance(t, FakeTensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_()

    class CustomOpShapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace != "pcaf":
                return func(*args, **kwargs)
            with FakeTensorMode(allow_non_fake_inputs=True):
                out = func(*args, **kwargs)
            return tree_map(zeros_like_fake, out)

    with CustomOpShapes():
        yield


@contextlib.contextmanager
def aten_forms() -> Iterator[None]:
    """Until the context ends, every choice of a fused ``pcaf::`` kernel over its ATen form is made for the ATen form,
    on any device: the head loss's 16-bit passes, dropout alone and fused with its neighbours, the memory read's
    row passes, the L2 normalisation, the gate and the addresses. The eager step as it was before those kernels (the
    candidate kernels and the segmented key gradient stay), for ``benchmarks.bench_cuda`` to time beside the
    kernels' step."""
    from unittest import mock

    from backends.torch import dropout, hashing, head_loss, layers, mixture

    with contextlib.ExitStack() as stack:
        for module, name in ((mixture, "kernels_by_default"), (dropout, "kernels_by_default"),
                             (layers, "l2_kernels_by_default"), (layers, "gate_kernels_by_default"),
                             (head_loss, "kernels_by_default"), (hashing, "kernels_by_default")):
            stack.enter_context(mock.patch.object(module, name, lambda x: False))
        yield


@contextlib.contextmanager
def eager_step(model: str = "PCAF-context", mode: str = "ar", precision: str = "bf16", T: int = 64, batch: int = 2,
               profile: str | None = None, fused: bool = True, device: str = "cpu",
               scale: str = "paper", kernels: bool = True) -> Iterator[Callable[[], None]]:
    """One more eager training step of ``model`` (``bench_cuda``'s case at ``T`` and ``batch``) ready to run: the
    backend built and warmed by two steps (the optimiser's state and the step's cached constants exist by then).
    Yields the function that runs it. On a CPU (``device="cpu"``) the tensors take the code paths a CUDA tensor
    takes (:func:`cuda_code_paths`) and the products go through ATen, as on CUDA, not the CPU's oneDNN path.
    ``profile``: another profile than the benchmark's (``reference_torch``, the paper's PyTorch code).
    ``fused=False``: ATen's forms instead of the fused kernels (:func:`aten_forms`). ``scale``: the widths of
    another scale than the paper's (``bench_cuda``'s smoke runs). ``kernels=False``: the ``pcaf::`` ops give zeros
    of their outputs' shapes instead of running (:func:`custom_ops_as_shapes`), for counts at large shapes on a
    CPU."""
    from unittest import mock

    from backends.torch import cpu_gemm
    from backends.torch.backend import TorchBackend
    from backends.torch.layers import ConvBlock
    from benchmarks.bench_cuda_cases import GpuCase, case_config
    from benchmarks.bench_models import Case, _batch
    from pcaf_core.config import validate
    from pcaf_core.profiles import get_profile

    case = Case(model, mode, T, batch, 0.1, "eager", precision)
    cfg = case_config(GpuCase(model, mode, T, batch, precision, "eager"), case, scale)
    if profile is not None:
        cfg.profile = get_profile(profile)
        cfg = validate(cfg)
    backend = TorchBackend(device)
    on_cpu = device == "cpu"
    with cuda_code_paths() if on_cpu else contextlib.nullcontext(), \
            aten_forms() if not fused else contextlib.nullcontext(), \
            mock.patch.object(cpu_gemm, "onednn_on_this_cpu", lambda: False), \
            custom_ops_as_shapes() if not kernels else contextlib.nullcontext():
        state = backend.init(cfg)
        for m in state.module.modules():  # the conv's form on CUDA (ConvBlock's "auto" shifts on CPUs only)
            if isinstance(m, ConvBlock) and m.conv_form == "auto":
                m.conv_form = "conv1d"
        x, y, _ = _batch(cfg)
        holder = {"state": state}

        def step() -> None:
            holder["state"], _ = backend.train_step(holder["state"], x, y, 1e-4)

        for _ in range(2):
            step()
        yield step


def census(model: str = "PCAF-context", mode: str = "ar", precision: str = "bf16", T: int = 64,
           batch: int = 2, profile: str | None = None, fused: bool = True,
           kernels: bool = True) -> collections.Counter[str]:
    """The ops that launch a kernel on CUDA, by schema name, of one eager training step (:func:`eager_step`, on CPU
    tensors taking the CUDA code paths). Left out: views, aliases, allocations and profiler marks
    (:func:`launches_kernel`). A custom op (``pcaf::``) counts once: its own ops are not seen. ``kernels=False``:
    the ``pcaf::`` ops as shapes (:func:`custom_ops_as_shapes`), the same count without Triton's interpreter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if launches_kernel(func):
                self.count[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    with eager_step(model, mode, precision, T, batch, profile, fused, kernels=kernels) as step, _Count() as counted:
        step()
    return counted.count


def launches_kernel(func) -> bool:
    """Whether the dispatched op ``func`` launches a kernel (or a copy) on a GPU: not a view, an alias, an
    allocation or a profiler mark."""
    import torch

    aten = torch.ops.aten
    no_kernel = (aten.detach.default, aten.lift_fresh.default, aten._unsafe_view.default,  # aliases, as views
                 aten.empty_like.default, aten.new_empty.default, aten.empty.memory_format,  # allocations
                 aten.empty_strided.default)
    return not (func.is_view or func.namespace == "profiler" or func in no_kernel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="PCAF-context")
    parser.add_argument("--mode", choices=("ar", "nt"), default="ar")
    parser.add_argument("--precision", choices=("bf16", "fp32", "both"), default="both")
    parser.add_argument("--profile", default=None, help="a profile other than the benchmark's reference_torch")
    parser.add_argument("--top", type=int, default=15, help="how many of the most frequent ops to list")
    parser.add_argument("--aten-forms", action="store_true",
                        help="ATen's forms instead of the fused kernels (bench_cuda's 'ATen passes' case)")
    args = parser.parse_args(argv)
    for precision in (("bf16", "fp32") if args.precision == "both" else (args.precision,)):
        count = census(args.model, args.mode, precision, profile=args.profile, fused=not args.aten_forms,
                       kernels=False)
        label = f"{args.model} {args.mode} {precision}" + (f" {args.profile}" if args.profile else "") + (
            ", ATen passes" if args.aten_forms else "")
        print(f"{label}, eager, CUDA code paths: {sum(count.values())} ops a step")
        for name, n in count.most_common(args.top):
            print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
