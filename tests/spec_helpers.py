"""Small shared builders for spec tests."""

from __future__ import annotations

from pcaf_core.config import MemoryConfig, ModelConfig

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
