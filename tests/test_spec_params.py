"""Parameter counts from the canonical shapes equal the paper's (docs/REFERENCE_CODE.md §1.4)."""

from __future__ import annotations

import pytest

from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.params import count_params, init_params, param_shapes
from pcaf_core.profiles import get_profile

PCAF_RTX = dict(vocab_size=20000, d_model=256, d_hidden=1000, n_layers=2)
ATTN_RTX = dict(vocab_size=20000, d_model=192, d_hidden=1024, n_layers=4, n_heads=4)
PCAF_41M = dict(vocab_size=32000, d_model=256, d_hidden=1000, n_layers=2)
ATTN_41M = dict(vocab_size=32000, d_model=192, d_hidden=1024, n_layers=4, n_heads=4)
SEM_41M = dict(vocab_size=32000, d_model=224, d_hidden=896, n_layers=14)
PCAF_303M = dict(vocab_size=32000, d_model=896, d_hidden=3584, n_layers=24)
ATTN_303M = dict(vocab_size=32000, d_model=896, d_hidden=3584, n_layers=16, n_heads=14)

# (label, variant, route, shape, profile, seq_len for the positional table, S, paper count)
PAPER_COUNTS = [
    ("26.59M PCAF-context (RTX)", "pcaf", "context", PCAF_RTX, "reference_torch", 1024, 256, 26_592_730),
    ("26.59M PCAF no-gate (RTX)", "pcaf_no_gate", "context", PCAF_RTX, "reference_torch", 1024, 256, 26_592_730),
    ("26.59M PCAF no-cache (RTX)", "pcaf_no_cache", "context", PCAF_RTX, "reference_torch", 1024, 256, 26_592_730),
    ("26.43M local conv (RTX)", "local_conv", "context", PCAF_RTX, "reference_torch", 1024, 256, 26_428_120),
    ("26.71M dense (RTX)", "transformer_dense", "context", ATTN_RTX, "reference_torch", 1024, 256, 26_711_712),
    ("26.71M local (RTX)", "transformer_local", "context", ATTN_RTX, "reference_torch", 2048, 256, 26_711_712),
    ("26.71M global-local (RTX)", "transformer_global_local", "context", ATTN_RTX, "reference_torch", 2048, 256,
     26_711_712),
    ("41.74M PCAF-context (NT)", "pcaf", "context", PCAF_41M, "reference_jax", 1024, 256, 41_742_522),
    ("41.74M PCAF-semantic (NT)", "pcaf", "semantic", PCAF_41M, "reference_jax", 1024, 256, 41_742_522),
    ("41.74M PCAF-hybrid (NT)", "pcaf", "hybrid", PCAF_41M, "reference_jax", 1024, 256, 41_742_522),
    ("41.74M PCAF no-gate (NT)", "pcaf_no_gate", "context", PCAF_41M, "reference_jax", 1024, 256, 41_742_522),
    ("41.74M local conv (NT)", "local_conv", "context", PCAF_41M, "reference_jax", 2048, 256, 41_742_522),
    ("41.51M dense T=1024", "transformer_dense", "context", ATTN_41M, "reference_jax", 1024, 256, 41_512_320),
    ("41.51M local T=1024", "transformer_local", "context", ATTN_41M, "reference_jax", 1024, 256, 41_512_320),
    ("41.51M linear attention T=1024", "linear_attention", "context", ATTN_41M, "reference_jax", 1024, 256,
     41_512_320),
    ("41.71M dense T=2048", "transformer_dense", "context", ATTN_41M, "reference_jax", 2048, 256, 41_708_928),
    ("41.71M global-local T=2048", "transformer_global_local", "context", ATTN_41M, "reference_jax", 2048, 256,
     41_708_928),
    ("41.89M PCAF-semantic AR S=128", "pcaf", "semantic", SEM_41M, "reference_jax", 1024, 128, 41_889_442),
    ("41.92M PCAF-semantic AR S=256", "pcaf", "semantic", SEM_41M, "reference_jax", 1024, 256, 41_918_242),
    ("41.98M PCAF-semantic AR S=512", "pcaf", "semantic", SEM_41M, "reference_jax", 1024, 512, 41_975_842),
    ("42.09M PCAF-semantic AR S=1024", "pcaf", "semantic", SEM_41M, "reference_jax", 1024, 1024, 42_091_042),
    ("303.27M PCAF-context", "pcaf", "context", PCAF_303M, "reference_jax", 1024, 256, 303_268_226),
    ("303.27M PCAF-semantic", "pcaf", "semantic", PCAF_303M, "reference_jax", 2048, 256, 303_268_226),
    ("303.27M local conv", "local_conv", "context", PCAF_303M, "reference_jax", 1024, 256, 303_268_226),
    ("301.85M dense T=1024", "transformer_dense", "context", ATTN_303M, "reference_jax", 1024, 256, 301_853_184),
    ("301.85M local T=1024", "transformer_local", "context", ATTN_303M, "reference_jax", 1024, 256, 301_853_184),
    ("302.77M dense T=2048", "transformer_dense", "context", ATTN_303M, "reference_jax", 2048, 256, 302_770_688),
    ("302.77M local T=2048", "transformer_local", "context", ATTN_303M, "reference_jax", 2048, 256, 302_770_688),
]


@pytest.mark.parametrize(
    "label,variant,route,shape,profile,seq_len,S,expected", PAPER_COUNTS, ids=[c[0] for c in PAPER_COUNTS]
)
def test_parameter_count_equals_paper(label, variant, route, shape, profile, seq_len, S, expected):
    model = ModelConfig(variant=variant, max_seq_len=seq_len, **shape)
    memory = MemoryConfig(route=route, semantic_buckets=S)
    assert count_params(model, memory, get_profile(profile)) == expected, label


def test_rtx_router_accounts_for_the_difference_to_current_torch_code():
    """With router parameters (LN + Linear(256, 256)) the RTX shape has the 26,658,778 of the current
    reference PyTorch code: 66,048 more than the table."""
    model = ModelConfig(variant="pcaf", **PCAF_RTX)
    prof = get_profile("reference_torch", router_in_context_models=True)
    assert count_params(model, MemoryConfig(), prof) == 26_658_778


def test_corrected_profile_counts_only_used_parameters():
    model = ModelConfig(variant="local_conv", **PCAF_41M)
    corrected = count_params(model, MemoryConfig(), get_profile("corrected"))
    reference = count_params(model, MemoryConfig(), get_profile("reference_jax"))
    assert corrected < reference
    assert corrected == 8_192_000 + 1_030_608 + 32_289_512  # embedding + blocks + head


def test_init_params_follow_the_canonical_shapes():
    model = ModelConfig(variant="pcaf", vocab_size=30, d_model=8, d_hidden=12)
    memory = MemoryConfig(route="hybrid", semantic_buckets=5)
    prof = get_profile("reference_torch")
    params = init_params(model, memory, prof, seed=1)
    shapes = param_shapes(model, memory, prof)
    assert list(params) == list(shapes)
    assert all(params[k].shape == shapes[k] for k in shapes)
    assert "memory.router_norm.weight" in params and "memory.router.bias" not in params
    assert float(params["memory.recency_scale"]) == 1.0
