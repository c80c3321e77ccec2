"""Small shared builders for spec tests, and the cases every backend is checked against the spec on.

The backend-vs-spec tests (``tests/test_torch_vs_spec.py``, ``tests/test_jax_vs_spec.py``) and the torch<->JAX
agreement tests run the same cases: :data:`CACHE_CASES` and :data:`PLAIN_CASES` under :data:`PROFILES` and
:data:`MODES`, at :data:`SMALL` widths (:func:`configs`), on :func:`window`'s tokens with :func:`spec_params`.
"""

from __future__ import annotations

import numpy as np

from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile

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


PROFILES = ("reference_jax", "reference_torch", "corrected")
MODES = ("nt", "ar")
# linear_chunk 6 with T = 20: three full chunks and a padded partial one in every linear-attention case.
SMALL = dict(vocab_size=40, d_model=12, d_hidden=24, n_layers=2, kernel_size=3, n_heads=3, window=5, n_global=2,
             linear_chunk=6, max_seq_len=32)
# ρ per profile: large (the sparse topk proof holds), negative (the dense fallback), moderate (both): every sign
# reaches the topk_score route's ranking.
RHO = {"reference_jax": 25.0, "reference_torch": -0.4, "corrected": 0.7}

CACHE_CASES = [  # (variant, route, semantic_index, candidate_policy)
    ("pcaf", "context", "dense", "topk_score"),
    ("pcaf", "context", "dense", "recent"),
    ("pcaf", "context", "dense", "first"),
    ("pcaf", "semantic", "dense", "topk_score"),
    ("pcaf", "semantic", "bucketed", "topk_score"),
    ("pcaf", "hybrid", "dense", "topk_score"),
    ("pcaf", "hybrid", "bucketed", "recent"),
    ("pcaf", "hybrid", "dense", "first"),
    ("pcaf_no_gate", "context", "dense", "topk_score"),
    ("pcaf_no_gate", "semantic", "dense", "topk_score"),
    ("pcaf_no_gate", "hybrid", "bucketed", "first"),
]
PLAIN_CASES = [(v, "semantic", "dense", "topk_score") for v in
               ("pcaf_no_cache", "local_conv", "transformer_dense", "transformer_local", "transformer_global_local",
                "linear_attention")]
ALL_CASES = CACHE_CASES + PLAIN_CASES


def configs(variant: str, route: str = "context", index: str = "dense", policy: str = "topk_score",
            profile: str = "corrected", **memory_overrides) -> tuple[ModelConfig, MemoryConfig, object]:
    model = ModelConfig(variant=variant, **SMALL)
    memory = MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=7, top_k=3,
                          semantic_buckets=7, semantic_temperature=0.2, semantic_score_scale=0.5, fixed_gate=0.3,
                          **memory_overrides)
    return model, memory, get_profile(profile)



def window(T: int, mode: str, *, B: int = 2, seed: int = 0, distinct: int = 10, vocab: int = 40):
    """Tokens drawn from few distinct ids (long buckets) and matching targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, distinct, (B, T))
    shape = (B,) if mode == "nt" else (B, T)
    # Half the targets come from the window's ids, so the cache holds some of them.
    targets = np.where(rng.random(shape) < 0.5, rng.integers(0, distinct, shape), rng.integers(0, vocab, shape))
    return tokens, targets
