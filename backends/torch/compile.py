"""When and how the torch backend compiles its training step (``torch.compile`` with inductor).

Compiling fuses what an eager step spends most of its non-matmul time on: LayerNorm, GELU, dropout's
masks and multiplies, the depthwise conv (as shifted multiply-adds, :func:`backends.torch.layers.
causal_depthwise_conv`) and their backward passes. It costs a one-off compile of about a minute on a
2-core CPU, so ``train.compile=auto`` compiles only runs long enough to repay it; ``on`` / ``off`` force
the choice. Evaluation stays eager (it is a small share of a run and would compile a second graph).

Dropout under compile draws its masks with ATen's generator (``fallback_random``): inductor's in-kernel
random numbers are slower than ATen's vectorised Bernoulli on CPU, and the ATen path draws the same masks
as an eager step, so compiled and eager training agree to float rounding with dropout on.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.torch.layers import ConvBlock
from pcaf_core.config import RunConfig

COMPILE_MIN_STEPS = 1000
"""``train.compile=auto`` compiles runs of at least this many steps (the one-off compile then costs a few
percent of the run at most)."""


def use_compile(cfg: RunConfig) -> bool:
    """Whether the training step of ``cfg`` is compiled: ``train.compile`` on/off, or for ``auto`` runs of
    at least :data:`COMPILE_MIN_STEPS` steps."""
    mode = cfg.train.compile
    if mode == "auto":
        return cfg.train.steps >= COMPILE_MIN_STEPS
    return mode == "on"


def prepare_for_compile(module: nn.Module) -> None:
    """Switch ``module``'s layers to the forms that fuse under inductor (same numbers up to rounding)."""
    for m in module.modules():
        if isinstance(m, ConvBlock):
            m.conv_form = "shifted"


def compile_training(module: nn.Module, wrapped: nn.Module, *, backend: str = "inductor") -> nn.Module:
    """``wrapped`` (the training-loss module, DDP-wrapped or not) compiled with ``backend`` (inductor; tests
    also use ``aot_eager``, the same graph capture without code generation), ``module``'s layers switched
    to their fusable forms first."""
    import torch._inductor.config as inductor_config

    prepare_for_compile(module)
    inductor_config.fallback_random = True
    return torch.compile(wrapped, dynamic=False, backend=backend)


COMPILED_LABEL = "training step compiled (torch.compile, inductor)"
