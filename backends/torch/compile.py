"""When and how the torch backend compiles its training step (``torch.compile`` with inductor).

Compiling fuses what an eager step spends most of its non-matmul time on: LayerNorm, GELU, dropout's
masks and multiplies, the depthwise conv (as shifted multiply-adds, :func:`backends.torch.layers.
causal_depthwise_conv`) and their backward passes. It costs a one-off compile of 20-70 s on a 2-core
CPU, so ``train.compile=auto`` compiles only runs long enough to repay it
(:data:`COMPILE_MIN_STEPS`), and only where it measured faster (:func:`compile_pays_off`); ``on`` / ``off``
force the choice. Evaluation stays eager (a small share of a run, which would compile a second graph).

``cudagraphs`` compiles the same way and replays the compiled forward and backward graphs as CUDA graphs
(inductor's ``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets: PyTorch's CUDA graph trees): one launch
per graph instead of one per kernel. It is for steps that wait on the host rather than on the GPU: on an H100
the eager bf16 full-AR step was busy 9.2 of 20.4 ms, and replayed as graphs it takes 6.7 ms, 3.85x fp32
(docs/results/bench_cuda.md); ``auto`` replays what it compiles this way on one CUDA device
(:func:`use_cuda_graphs`). The conv-backbone steps qualify:
they read nothing back from the device before the loss and compile to one graph that inductor can capture
(tests/test_torch_cuda_graphs.py checks that on the CUDA code paths), and so do the windowed Transformers' steps with
FlexAttention, which ``cudagraphs`` also takes. :func:`check_compile_device` refuses what does not (a CPU device,
DDP, the other Transformers, the routes that rank with ρ read back), and a graph inductor
still cannot capture stops the run (``triton.cudagraph_or_error``, :func:`cuda_graph_errors`) rather than
running uncaptured under a CUDA-graph label.

Dropout under compile draws its masks with ATen's generator (``fallback_random``): inductor's in-kernel
random numbers are slower than ATen's vectorised generator on CPU, and the ATen path draws the same masks
as an eager step, so compiled and eager training agree to float rounding with dropout on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from backends.torch import cpu_gemm
from backends.torch.layers import ConvBlock
from pcaf_core.config import PCAF_VARIANTS, WINDOWED_VARIANTS, RunConfig

COMPILE_MIN_STEPS = 5000
"""``train.compile=auto`` compiles runs of at least this many steps, either mode. Compiling gains a next-token
step 10-15% and costs 28-30 s the first time (5-7 s with inductor's on-disk cache warm). Measured on a 2-core AMD
EPYC, next-token PCAF-context, fp32, dropout 0.1, glibc tunables on: cpu scale (d=128, batch 32) 39.3 ms eager
against 33.3 ms compiled, so about 5,000 steps repay a cold compile; paper scale (d=256, batch 64) 181 against
163 ms."""


def compile_pays_off(cfg: RunConfig, device: torch.device | None = None) -> bool:
    """Where compiling measured faster than eager (2-core CPU, steps interleaved in one process; ``device``: where
    the step runs, None for a CPU):

    - next-token steps of the conv-backbone models (PCAF family, local conv): compiled/eager 1.10 at the
      WikiText-2 paper shape (batch 64, dropout 0.1; 90% interval 1.08-1.13 over 15 paired rounds) and 1.15 at
      the cpu scale (d=128, batch 32, V=8,000; 30 rounds), products on oneDNN both ways
      (:mod:`backends.torch.cpu_gemm`);
    - full-AR steps of the same models on CUDA and on CPUs without oneDNN's products: compiled/eager 1.07 for
      PCAF-context ``recent`` at the cpu scale (T=256, batch 2, V=8,000; 40 rounds, oneMKL products);
    - not the Transformers (the dense one 0.86x at V=8,000; measured on a CPU, where the windowed ones run masked
      SDPA: on CUDA their FlexAttention traces into the compiled step's one graph under ``on``, and whether
      compiling pays there is not measured);
    - not routes that rank with ρ as a host number (``topk_score``, the dense semantic route): Dynamo
      specialises on the value, which every optimiser step changes, and recompiles each step (5.5 s a step
      against 0.35 s eager);
    - not full-AR steps on a CPU whose products run on oneDNN (:func:`backends.torch.cpu_gemm.onednn_on_this_cpu`):
      compiled/eager 0.99 at the paper shape (T=1,024, batch 4, dropout 0.1; 5 paired rounds, 1,332 against
      1,323 ms), a tie: the products, the same oneDNN call either way, are 86% of the eager step (its profile in
      ``make bench``).
    """
    if cfg.train.mode == "ar" and (device is None or device.type == "cpu") and cpu_gemm.onednn_on_this_cpu():
        return False
    return conv_backbone(cfg) and not ranks_with_host_rho(cfg)


def conv_backbone(cfg: RunConfig) -> bool:
    """Whether ``cfg`` trains a conv-backbone model: a PCAF variant or local conv (not a Transformer)."""
    return cfg.model.variant in (*PCAF_VARIANTS, "local_conv")


def ranks_with_host_rho(cfg: RunConfig) -> bool:
    """Whether the step of ``cfg`` reads ρ back from the device to rank candidates (``topk_score`` and the
    dense semantic route of the PCAF variants that select; local conv and no cache select nothing)."""
    mem = cfg.memory
    host_rho = (mem.route in ("context", "hybrid") and mem.candidate_policy == "topk_score") or (
        mem.route in ("semantic", "hybrid") and mem.semantic_index == "dense")
    return cfg.model.variant in ("pcaf", "pcaf_no_gate") and host_rho


def use_compile(cfg: RunConfig, device: torch.device | None = None) -> bool:
    """Whether the training step of ``cfg`` on ``device`` (None: a CPU) is compiled: ``train.compile`` on/off;
    ``auto`` for runs of at least :data:`COMPILE_MIN_STEPS` steps where :func:`compile_pays_off`."""
    mode = cfg.train.compile
    if mode == "auto":
        return cfg.train.steps >= COMPILE_MIN_STEPS and compile_pays_off(cfg, device)
    return mode in ("on", "cudagraphs")


def use_cuda_graphs(cfg: RunConfig, device: torch.device | None = None, world_size: int = 1) -> bool:
    """Whether the compiled step of ``cfg`` on ``device`` is replayed as CUDA graphs: ``train.compile=
    cudagraphs``; ``auto`` wherever it compiles (:func:`use_compile`) on one CUDA device in one process.

    ``auto`` picks the graphs there because they were faster than inductor alone in every case measured and took
    no longer to compile (first step 10-20 s against 14-22 s; ``make bench-cuda`` on an H100, WikiText-2 paper
    shape, steps interleaved):
    full-AR PCAF-context fp32 25.8 against 26.9 ms (eager 30.2), bf16 6.7 against 14.3 ms (eager 20.4);
    next-token fp32 5.2 against 10.7 ms (eager 18.0). The steps it compiles qualify by construction
    (:func:`compile_pays_off`: conv-backbone models, no ρ read back), which :func:`check_compile_device` also
    asks of ``cudagraphs``."""
    if cfg.train.compile == "cudagraphs":
        return True
    return (cfg.train.compile == "auto" and use_compile(cfg, device) and device is not None and device.type == "cuda"
            and world_size == 1)


def flex_windowed(cfg: RunConfig) -> bool:
    """Whether ``cfg`` trains a windowed Transformer whose attention is FlexAttention on a GPU
    (``model.attention_impl`` ``banded``, or ``auto``, which is banded on CUDA)."""
    return cfg.model.variant in WINDOWED_VARIANTS and cfg.model.attention_impl in ("banded", "auto")


def check_compile_device(cfg: RunConfig, device: torch.device, world_size: int) -> None:
    """Raise a one-line error when ``train.compile=cudagraphs`` cannot run here: it covers the conv-backbone models
    (:func:`conv_backbone`) and the windowed Transformers with FlexAttention (:func:`flex_windowed`), what the
    tests check for device reads, graph breaks and nodes a CUDA graph cannot hold; it needs a CUDA device, one
    process (each DDP rank would capture graphs around collectives that are not part of them), and a step that
    reads nothing back from the device (:func:`ranks_with_host_rho`: ρ changes every step, so each step would
    compile and capture anew). ``auto`` replays only conv-backbone steps (:func:`use_cuda_graphs`)."""
    if cfg.train.compile != "cudagraphs":
        return
    if not (conv_backbone(cfg) or flex_windowed(cfg)):
        impl = (f" with model.attention_impl={cfg.model.attention_impl}" if cfg.model.variant in WINDOWED_VARIANTS
                else "")
        raise ValueError(f"train.compile=cudagraphs covers the PCAF variants, local conv and the windowed "
                         f"Transformers with FlexAttention (model.attention_impl=banded or auto), not "
                         f"{cfg.model.variant!r}{impl}: use train.compile=on or off")
    if ranks_with_host_rho(cfg):
        raise ValueError(f"train.compile=cudagraphs cannot replay route {cfg.memory.route!r} with policy "
                         f"{cfg.memory.candidate_policy!r} and semantic index {cfg.memory.semantic_index!r}: it "
                         "ranks with rho read back from the device every step; use train.compile=off")
    if device.type != "cuda":
        raise ValueError(f"train.compile=cudagraphs needs a CUDA device, and this run trains on {device.type}: "
                         "use train.compile=on (inductor without CUDA graphs) or auto")
    if world_size > 1:
        raise ValueError(f"train.compile=cudagraphs runs in one process, and this run has {world_size}: use "
                         "train.compile=on with torchrun")


def prepare_for_compile(module: nn.Module) -> None:
    """Switch ``module``'s layers to the forms that fuse under inductor (same numbers up to rounding)."""
    for m in module.modules():
        if isinstance(m, ConvBlock):
            m.conv_form = "shifted"


def compile_training(module: nn.Module, wrapped: nn.Module, *, backend: str = "inductor",
                     cuda_graphs: bool = False) -> nn.Module:
    """``wrapped`` (the training-loss module, DDP-wrapped or not) compiled with ``backend`` (inductor; tests
    also use ``aot_eager``, the same graph capture without code generation), ``module``'s layers switched
    to their fusable forms first. ``cuda_graphs``: inductor with its CUDA graph trees (``triton.cudagraphs``)
    and an error where a graph cannot be captured (``triton.cudagraph_or_error``; a graph on CPU tensors runs
    uncaptured, which is no error)."""
    import torch._inductor.config as inductor_config

    prepare_for_compile(module)
    inductor_config.fallback_random = True
    if cuda_graphs:
        if backend != "inductor":
            raise ValueError(f"CUDA graphs are an inductor option: compile with backend='inductor', not {backend!r}")
        # mode="reduce-overhead" is triton.cudagraphs alone, which falls back to uncaptured code (logging a
        # warning) when a graph cannot be captured; a run that asked for CUDA graphs raises instead
        # (cuda_graph_errors turns that into a one-line message).
        return torch.compile(wrapped, dynamic=False, backend="inductor",
                             options={"triton.cudagraphs": True, "triton.cudagraph_or_error": True})
    return torch.compile(wrapped, dynamic=False, backend=backend)


SKIPPED_CUDA_GRAPHS = "skipping cudagraphs due to"
"""How inductor's error starts when it cannot capture a graph (``triton.cudagraph_or_error``)."""


@contextlib.contextmanager
def cuda_graph_errors(cfg: RunConfig, cuda_graphs: bool) -> Iterator[None]:
    """Inside a step replayed as CUDA graphs (``cuda_graphs``: :func:`use_cuda_graphs`), inductor's refusal to
    capture a graph becomes a one-line error that names the reason and the alternative; other errors pass
    unchanged."""
    try:
        yield
    except RuntimeError as err:
        # Raised while Dynamo compiles the forward, it arrives wrapped ("backend='inductor' raised:\n
        # RuntimeError: skipping cudagraphs due to ..."); raised while the backward compiles, as it is.
        line = next((ln for ln in str(err).splitlines() if SKIPPED_CUDA_GRAPHS in ln), None)
        if not cuda_graphs or line is None:
            raise
        reason = line.split(SKIPPED_CUDA_GRAPHS, 1)[1].strip()
        why = "" if cfg.train.compile == "cudagraphs" else " (auto replays compiled steps as CUDA graphs on a GPU)"
        raise RuntimeError(f"train.compile={cfg.train.compile}{why} could not capture this step as a CUDA graph "
                           f"({reason}): use train.compile=on") from err


COMPILED_LABEL = "training step compiled (torch.compile, inductor)"
CUDA_GRAPHS_LABEL = f"{COMPILED_LABEL} and replayed as CUDA graphs"


def compiled_label(cuda_graphs: bool) -> str:
    """What the record's ``device`` field says about a compiled step (``cuda_graphs``: :func:`use_cuda_graphs`)."""
    return CUDA_GRAPHS_LABEL if cuda_graphs else COMPILED_LABEL
