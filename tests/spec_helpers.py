"""Small shared builders for spec tests."""

from __future__ import annotations

import numpy as np

from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.params import init_params

ALL_VARIANT_ROUTES = [
    ("pcaf", "context"),
    ("pcaf", "semantic"),
    ("pcaf", "hybrid"),
    ("pcaf_no_gate", "context"),
    ("pcaf_no_cache", "context"),
    ("local_conv", "context"),
    ("transformer_dense", "context"),
    ("transformer_local", "context"),
    ("transformer_global_local", "context"),
    ("linear_attention", "context"),
]


def tiny_model(variant: str, vocab: int = 40, **kw) -> ModelConfig:
    base = dict(variant=variant, vocab_size=vocab, d_model=12, d_hidden=16, n_layers=2, n_heads=2,
                window=4, n_global=2, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


def tiny_memory(route: str = "context", **kw) -> MemoryConfig:
    base = dict(route=route, num_buckets=16, top_k=4, semantic_buckets=6, semantic_temperature=0.5)
    base.update(kw)
    return MemoryConfig(**base)


def spec_params(model, memory, profile, *, seed: int = 0, rho: float = 0.7) -> dict[str, np.ndarray]:
    """The spec's init, perturbed so that every parameter matters: random biases and LayerNorm
    parameters, a unit-variance embedding, a jittered positional table and the given recency scale ρ
    (with a peaky router from a small temperature, the routes pick non-trivial sets)."""
    params = init_params(model, memory, profile, seed=seed)
    rng = np.random.default_rng(seed + 1000)
    for name, value in params.items():
        if name == "memory.recency_scale":
            params[name] = np.array(rho)
        elif name == "embed.weight":
            params[name] = rng.normal(size=value.shape)
        elif name == "pos.table":
            params[name] = value + 0.1 * rng.normal(size=value.shape)
        elif value.ndim == 1:
            params[name] = value + 0.2 * rng.normal(size=value.shape)
    return params
