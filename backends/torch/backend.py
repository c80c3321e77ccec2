"""The torch implementation of :class:`pcaf_core.backend.Backend`.

``TorchBackend`` owns the numerics of one process: model, AdamW, clipping, dropout, precision, seeding
and the torch state files. The loop (``pcaf_core.loop``) owns the cadence, validation, evaluation
reduction, bookkeeping and checkpoint layout; ``backends.torch.train`` and ``backends.torch.ddp``
build this backend and hand it to the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from backends.torch import checkpoint as ckpt
from backends.torch import cpu_gemm, weight_casts
from backends.torch.compile import (
    check_compile_device,
    compile_training,
    compiled_label,
    cuda_graph_errors,
    use_compile,
    use_cuda_graphs,
)
from backends.torch.layers import attention_kernel
from backends.torch.optim import build_optimizer, fill_missing_grads
from backends.torch.precision import set_matmul_precision
from backends.torch.runtime import configure_mkl
from pcaf_core.backend import EvalOutputs
from pcaf_core.config import WINDOWED_VARIANTS, RunConfig, attention_label, head_loss_chunks, head_loss_label
from pcaf_core.profiles import matmul_precision
from pcaf_core.sysinfo import cpu_has_bf16_matmul, peak_rss_mb


def auto_precision(device: str | torch.device | None = None) -> tuple[str, str]:
    """What ``train.precision=auto`` trains in on ``device`` (None: CUDA when present): ``(precision, why)``.

    bf16 autocast where the hardware multiplies bf16 matrices faster than float32 (a CUDA device with bf16
    support; a CPU with AMX), float32 elsewhere: without AMX a CPU's bf16 products are slower than its
    float32 ones (:data:`pcaf_core.sysinfo.BF16_MATMUL_FLAGS` has the measurements)."""
    dev = torch.device(device if device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{torch.cuda.get_device_name(dev)} multiplies bf16 in hardware"
        return "fp32", f"{torch.cuda.get_device_name(dev)} has no bf16 support"
    if cpu_has_bf16_matmul():
        return "bf16", "this CPU has a bf16 matrix unit (AMX)"
    return "fp32", "this CPU has no bf16 matrix unit (AMX), so its bf16 products are slower than float32"


class TrainingLoss(nn.Module):
    """``module``'s training loss as the forward's only output.

    Training needs the target entries only (no ``[B, Q, V]`` mixture, no argmax). Returning a bare
    tensor also matters under DDP: it finds the tensors of a forward's output to hook its gradient
    all-reduce (with ``static_graph`` the first step's reduction runs from such a hook), and it does
    not look inside a dataclass such as the models' output.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, mode: str) -> torch.Tensor:
        return self.module(tokens, targets, mode, need_log_probs=False, need_predictions=False).loss


def _checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this process can train on (``cpu``, or ``cuda``/``cuda:N`` with that CUDA
    device present); otherwise a one-line ``ValueError`` saying what to use instead."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"backend.device={device}: the torch backend trains on cpu or cuda (cuda:N for one of "
                         "several GPUs)")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
            raise ValueError(f"backend.device={device}: torch {torch.__version__} ({built}) sees no CUDA device on "
                             "this machine: use backend.device=cpu, or run where a GPU and a CUDA build of torch are")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"backend.device={device}: this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}")
    return dev


@dataclass
class TorchState:
    """Model (``module``), the training-loss callable (``wrapped``: :class:`TrainingLoss`, inside
    ``DistributedDataParallel`` when data-parallel) and the optimiser."""

    module: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.AdamW
    cfg: RunConfig
    cuda_graphs: bool = False
    """Whether ``wrapped`` is compiled and replayed as CUDA graphs (``compile.use_cuda_graphs``)."""
    params: tuple[nn.Parameter, ...] = ()
    """``module``'s trainable parameters, listed once: each step gives them zero gradients where they have none
    and clips their norm, and walking the module tree for them every step is host time a GPU waits on."""
    weight_casts: tuple[nn.Parameter, ...] = ()
    """The parameters each step casts to bf16 in one multi-tensor copy (:mod:`backends.torch.weight_casts`):
    those of the eager bf16 step of one process, else none (autocast casts them one by one)."""


class TorchBackend:
    """The torch implementation of :class:`pcaf_core.loop.Backend`.

    device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device`` (None: CUDA when available).
    rank / world_size: data-parallel position; with ``world_size > 1`` a ``torch.distributed`` process
    group must already be initialised (``backends.torch.ddp`` does it).
    """

    name = "torch"
    # What a checkpoint of this backend holds beside the shared canonical weights (backends.torch.checkpoint);
    # the loop writes it into every checkpoint, so another backend's resume is refused by name.
    checkpoint_format = "torch-1: model.safetensors, optimizer.pt, rng_rank<r>.pt"

    def __init__(self, device: str | torch.device | None = None, *, rank: int = 0, world_size: int = 1) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.torch_device = _checked_device(device)
        self.rank = rank
        self.world_size = world_size
        if self.torch_device.type == "cuda":
            self.device = f"{torch.cuda.get_device_name(self.torch_device)} (torch {torch.__version__})"
        else:
            self.device = (f"cpu (torch {torch.__version__}, {torch.get_num_threads()} threads; "
                           f"oneMKL MKL_CBWR={configure_mkl()}; peak memory = process max RSS)")

    # ------------------------------------------------------------------ distributed members

    def barrier(self) -> None:
        """``torch.distributed.barrier`` when data-parallel."""
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum ``values`` over ranks in float64."""
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def auto_precision(self) -> tuple[str, str]:
        """``train.precision=auto`` on this backend's device (:func:`auto_precision`)."""
        return auto_precision(self.torch_device)

    def versions(self) -> dict[str, str]:
        """torch and safetensors versions."""
        import safetensors

        return {"torch": torch.__version__, "safetensors": safetensors.__version__}

    # ------------------------------------------------------------------ state

    def _autocast(self, cfg: RunConfig, casts: Sequence[nn.Parameter] = ()) -> AbstractContextManager[Any]:
        """bf16 autocast for a ``bf16`` run, with ``casts`` copied in one pass (:mod:`backends.torch.weight_casts`)."""
        if cfg.train.precision == "bf16":
            return weight_casts.autocast(self.torch_device.type, torch.bfloat16, casts)
        return nullcontext()

    def _label(self, label: str) -> None:
        """Add ``label`` (how the step runs) to the record's device description, once."""
        if label not in self.device.split("; "):
            self.device += f"; {label}"

    def _build(self, cfg: RunConfig) -> TorchState:
        from backends.torch.models import build_model

        check_compile_device(cfg, self.torch_device, self.world_size)
        # warn_only: some CUDA kernels have no deterministic implementation, and a warning is better than
        # refusing to train; CPU runs are deterministic regardless.
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new uninitialised tensor with NaN, a debugging aid that
        # costs a memory pass per allocation (183 against 154 ms a cpu-scale full-AR step); every kernel writes
        # its output before reading it, so results are the same without it.
        torch.utils.deterministic.fill_uninitialized_memory = False
        # What fp32 means on this device: train.matmul_precision (the profile's unless set), for matmuls and
        # cuDNN's convolutions alike (cuDNN's own default is TF32). bf16 runs use autocast.
        set_matmul_precision(matmul_precision(cfg))
        # build_model draws the initial weights from its own generator seeded with train.seed.
        chunks = head_loss_chunks(cfg, self.world_size)
        module = build_model(cfg.model, cfg.memory, cfg.profile, seed=cfg.train.seed, device=self.torch_device,
                             head_chunks=chunks)
        self._label(head_loss_label(chunks))
        if cfg.model.variant in WINDOWED_VARIANTS:
            self._label(attention_label(attention_kernel(cfg.model.attention_impl, self.torch_device,
                                                         cfg.train.mode == "nt")))
        if hasattr(module, "nt_receptive_field"):
            # Next-token runs compute each prediction from the receptive fields it reads (PCAFModel. and
            # TransformerLM.nt_receptive_read): the same loss and gradients at a fraction of the window's work.
            module.nt_receptive_field = cfg.train.mode == "nt"
        # The head's rows a step: the widening linears' weights go column-major where that many rows make their
        # gradients cheaper that way (cpu_gemm.lay_out_for_onednn; off oneDNN, nothing). One process only: DDP's
        # gradient buckets with column-major weights are neither tested nor measured.
        if self.world_size == 1:
            rows = cfg.train.batch_size * (cfg.train.seq_len if cfg.train.mode == "ar" else 1)
            cpu_gemm.lay_out_for_onednn(module, rows)
        # The global generator drives dropout. Each rank gets its own stream, so the ranks' batch slices
        # do not share dropout masks; one process uses train.seed itself.
        torch.manual_seed(cfg.train.seed + self.rank)
        wrapped: nn.Module = TrainingLoss(module)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # static_graph: some profiles carry parameters the forward never touches (docs/REFERENCE_CODE.md
            # §7.16); DDP then learns the used set once instead of erroring on unused parameters.
            wrapped = DistributedDataParallel(
                wrapped,
                device_ids=[self.torch_device.index] if self.torch_device.type == "cuda" else None,
                static_graph=True,
            )
        graphs = use_cuda_graphs(cfg, self.torch_device, self.world_size)
        compiled = use_compile(cfg, self.torch_device)
        if compiled:
            wrapped = compile_training(module, wrapped, cuda_graphs=graphs)
            self._label(compiled_label(graphs))
        optimizer = build_optimizer(module, cfg.train, cfg.profile)
        # An eager bf16 step of one process casts its weights in one pass each way (weight_casts: a compiled
        # step fuses the casts itself; DDP would get every gradient at once, at the end of the backward pass).
        casts = ()
        if cfg.train.precision == "bf16" and not compiled and self.world_size == 1:
            casts = weight_casts.castable(module)
        return TorchState(module=module, wrapped=wrapped, optimizer=optimizer, cfg=cfg, cuda_graphs=graphs,
                          params=tuple(p for p in module.parameters() if p.requires_grad), weight_casts=casts)

    def init(self, cfg: RunConfig) -> TorchState:
        """Build the model (``backends.torch.models.build_model``, seeded by ``train.seed``), AdamW,
        and seed the dropout stream."""
        return self._build(cfg)

    def load(self, path: Path, cfg: RunConfig) -> TorchState:
        """Rebuild the model and optimiser, then load weights, optimiser and generator states."""
        state = self._build(cfg)
        ckpt.load_weights(state.module, Path(path) / ckpt.WEIGHTS_FILE)
        ckpt.load_optimizer_state(path, state.optimizer, self.torch_device)
        # Without a saved state for this rank (the checkpoint was written by fewer processes) its
        # dropout stream restarts from the seed _build set.
        ckpt.load_rng_state(path, self.rank)
        return state

    def save(self, state: TorchState, path: Path) -> None:
        """Weights (safetensors), optimiser and generator states into ``path``."""
        ckpt.save_torch_state(Path(path), state.module, state.optimizer, self.rank)

    def param_count(self, state: TorchState) -> int:
        """Number of trainable parameter elements (buffers such as a fixed sinusoid table excluded)."""
        return sum(p.numel() for p in state.module.parameters() if p.requires_grad)

    def peak_memory_mb(self) -> float | None:
        """CUDA ``max_memory_allocated``, or the process's peak RSS on CPU (MiB)."""
        if self.torch_device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.torch_device) / 2**20
        return peak_rss_mb()

    # ------------------------------------------------------------------ steps

    def _tensors(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self._upload(inputs), self._upload(targets)

    def _upload(self, tokens: np.ndarray) -> torch.Tensor:
        """``tokens`` as int64 on the device. To a GPU through pinned memory without blocking: a copy from
        pageable memory would wait for every kernel already queued (the step in flight). The caching host
        allocator keeps the pinned buffer until the copy has run."""
        t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        if self.torch_device.type != "cuda":
            return t.to(self.torch_device)
        return t.pin_memory().to(self.torch_device, non_blocking=True)

    def train_step(
        self, state: TorchState, inputs: np.ndarray, targets: np.ndarray, lr: float, *, wait: bool = True
    ) -> tuple[TorchState, float | torch.Tensor]:
        """Forward, backward, optional clipping and one AdamW step at ``lr``; returns the loss (``wait=False``:
        as a 0-d fp32 tensor on the device, :meth:`pcaf_core.backend.Backend.train_step`)."""
        cfg = state.cfg
        if state.cuda_graphs:
            # A new step: the graphs' outputs of the last one (its loss, its gradients, already consumed by
            # the optimiser) may be overwritten by this replay.
            torch.compiler.cudagraph_mark_step_begin()
        x, y = self._tensors(inputs, targets)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        if not state.module.training:  # only eval_batch switches it (module.eval()); a tree walk otherwise
            state.wrapped.train()
        state.optimizer.zero_grad(set_to_none=True)
        with cuda_graph_errors(cfg, state.cuda_graphs):
            with self._autocast(cfg, state.weight_casts):
                loss = state.wrapped(x, y, cfg.train.mode)
            loss.backward()
        # The clip's norm runs over the gradients backward produced. The zero ones fill_missing_grads adds (for
        # parameters the forward never read) add nothing to it, but a longer list changes the order of the
        # norm's sums: pcaf_no_cache would then drift from local_conv by float rounding, where without them it
        # trains bitwise as local_conv does.
        produced = [p for p in state.params if p.grad is not None]
        fill_missing_grads(state.params)
        if cfg.profile.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(produced, cfg.profile.grad_clip_norm)
        state.optimizer.step()
        loss = loss.detach().float()
        if not wait:
            # A replayed graph's loss is its static output, which the next step's replay overwrites: a copy, queued
            # after this step, keeps it until it is read.
            return state, loss.clone() if state.cuda_graphs else loss
        # .item() synchronises the device, so the loop's step timer measures the whole step.
        return state, float(loss.item())

    @torch.no_grad()
    def eval_batch(self, state: TorchState, inputs: np.ndarray, targets: np.ndarray, mode: str) -> EvalOutputs:
        """Per-target log-probs and the mixture and parametric argmax of one evaluation batch (the loop
        reduces them: :func:`pcaf_core.evaluation.reduce_outputs`)."""
        x, y = self._tensors(inputs, targets)
        state.module.eval()
        with self._autocast(state.cfg, state.weight_casts):
            out = state.module(x, y, mode)
        log_probs = out.log_probs if out.log_probs is not None else out.param_log_probs
        return EvalOutputs(
            target_log_prob=out.target_log_prob.double().cpu().numpy(),
            prediction=log_probs.argmax(-1).cpu().numpy(),
            prediction_param=out.param_log_probs.argmax(-1).cpu().numpy(),
        )
