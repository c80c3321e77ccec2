"""Canonical initialisation with a torch generator (the ``jax_normal`` scheme of
:func:`pcaf_core.params.init_params`: same distributions, torch's own random stream).

Embeddings N(0, 0.02²); Linear weights N(0, 1/fan_in), biases 0; conv N(0, 1/k), bias 0; LayerNorm
gain 1, bias 0; ρ = 1; the trainable positional table starts at the sinusoids.
"""

from __future__ import annotations

import math

import torch

from pcaf_core.config import MemoryConfig, ModelConfig, ProfileConfig
from pcaf_core.params import param_shapes, sinusoidal_table


def init_params(
    model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig, seed: int = 0, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Canonical ``name -> tensor`` (canonical layouts, CPU) drawn from ``torch.Generator().manual_seed(seed)``."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(model, memory, profile).items():
        if name == "embed.weight":
            w = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") * 0.02
        elif name == "pos.table":
            w = torch.as_tensor(sinusoidal_table(shape[0], shape[1], "trainable_jax") * profile.positional_scale)
        elif name == "memory.recency_scale":
            w = torch.tensor(1.0, dtype=torch.float64)
        elif name.endswith("conv.weight") or (name.endswith(".weight") and len(shape) == 2):
            # Both are N(0, 1/fan_in): the conv's fan-in per channel is its k taps (shape[0]).
            w = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") / math.sqrt(shape[0])
        elif name.endswith(".weight"):  # LayerNorm gain
            w = torch.ones(shape, dtype=torch.float64)
        else:
            w = torch.zeros(shape, dtype=torch.float64)
        out[name] = w.to(dtype)
    return out
