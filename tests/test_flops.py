"""The analytic FLOP counts of the benchmark's fraction of peak, checked against the spec's parameter shapes: a
full-AR forward applies every matrix (and conv) weight once per position, so its matmul FLOPs per position are
twice the applied weights, plus the parameter-free products (attention, candidate scores)."""

from __future__ import annotations

import math

import pytest

from pcaf_core import reference
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.flops import forward_flops, train_step_flops
from pcaf_core.params import param_shapes
from pcaf_core.profiles import get_profile

T, K, S = 64, 8, 16


def _applied(model: ModelConfig, memory: MemoryConfig) -> int:
    """Elements of every weight a position multiplies by (2-d weights and conv taps; not the embedding table)."""
    shapes = param_shapes(model, memory, get_profile("corrected"))
    return sum(math.prod(s) for n, s in shapes.items() if len(s) == 2 and n not in ("embed.weight", "pos.table"))


@pytest.mark.parametrize("route", ["context", "semantic", "hybrid"])
def test_pcaf_full_ar_flops_are_twice_the_applied_weights(route: str) -> None:
    model = ModelConfig(variant="pcaf", vocab_size=500, d_model=32, d_hidden=64, n_layers=3, kernel_size=5)
    memory = MemoryConfig(route=route, semantic_buckets=S, top_k=K)
    C = 2 * K if route == "hybrid" else K
    scores = 2 * C * model.d_model + (2 * C * S if route != "context" else 0)
    assert forward_flops(model, memory, "ar", T) == T * (2 * _applied(model, memory) + scores)
    assert train_step_flops(model, memory, "ar", T, 3) == 3 * 3 * forward_flops(model, memory, "ar", T)


@pytest.mark.parametrize("variant", ["transformer_dense", "transformer_local"])
def test_transformer_full_ar_flops_add_attention_over_the_keys_read(variant: str) -> None:
    model = ModelConfig(variant=variant, vocab_size=500, d_model=32, d_hidden=64, n_layers=2, n_heads=4, window=16)
    memory = MemoryConfig()
    keys = T * (T + 1) / 2 if variant == "transformer_dense" else 16 * 17 / 2 + (T - 16) * 16
    attention = model.n_layers * 4 * model.d_model * keys
    assert forward_flops(model, memory, "ar", T) == T * 2 * _applied(model, memory) + attention
    # the masked dense local attention computes all T keys of every query
    computed = forward_flops(model, memory, "ar", T, attention_keys="computed")
    assert computed == T * 2 * _applied(model, memory) + model.n_layers * 4 * model.d_model * (
        T * T if variant == "transformer_local" else keys)


def test_next_token_receptive_field_counts_only_the_positions_it_reads() -> None:
    model = ModelConfig(variant="pcaf", vocab_size=500, d_model=32, d_hidden=64, n_layers=2, kernel_size=5)
    memory = MemoryConfig(route="context", candidate_policy="recent", top_k=K)
    d, R = model.d_model, 2 * 4 + 1
    conv = model.n_layers * (2 * 5 * d + 4 * d * model.d_hidden)
    head = 2 * d * model.d_hidden + 2 * model.d_hidden * model.vocab_size
    query = 2 * d * d + 2 * K * d + d * d + d  # projection, scores, gate
    full = forward_flops(model, memory, "nt", T)
    assert full == T * conv + head + 2 * d * d * (T - 1) + query
    # One receptive field: block 1's conv over R = 9 rows and its MLP over the 5 block 2 reads; block 2's conv
    # over those 5 and its MLP over the last row.
    field = 2 * 5 * d * R + 4 * d * model.d_hidden * 5 + 2 * 5 * d * 5 + 4 * d * model.d_hidden * 1
    assert field < R * conv / 2
    executed = forward_flops(model, memory, "nt", T, nt_count="receptive_field")
    assert executed == (1 + K) * field + head + 2 * d * d * K + query
    # recent selects from tokens alone: no selection pass; topk_score ranks by states: one forward over T
    assert train_step_flops(model, memory, "nt", T, 1, nt_count="receptive_field") == 3 * executed
    ranked = MemoryConfig(route="context", candidate_policy="topk_score", top_k=K)
    assert (train_step_flops(model, ranked, "nt", T, 1, nt_count="receptive_field")
            == 3 * executed + T * (conv + 4 * d * d))
    local = ModelConfig(variant="local_conv", vocab_size=500, d_model=32, d_hidden=64, n_layers=2, kernel_size=5)
    assert forward_flops(local, memory, "nt", T, nt_count="receptive_field") == field + head


@pytest.mark.parametrize("variant", ["transformer_local", "transformer_global_local", "transformer_dense"])
def test_next_token_receptive_field_of_attention_is_its_sub_window(variant: str) -> None:
    """Windowed attention executes the global prefix and the last L·(w-1)+1 positions as a window of their own;
    dense attention reads every position, and its top layer computes the last row only."""
    model = ModelConfig(variant=variant, vocab_size=500, d_model=32, d_hidden=64, n_layers=2, n_heads=2, window=8,
                        n_global=4)
    memory = MemoryConfig()
    executed = forward_flops(model, memory, "nt", T, nt_count="receptive_field")
    d, h, head = 32, 64, 2 * 32 * 64 + 2 * 64 * 500
    if variant == "transformer_dense":
        # Layer 1 over every row (T(T+1)/2 causal keys), layer 2's qkv over every row, the rest over the last.
        layer1 = (8 * d * d + 4 * d * h) * T + 4 * d * T * (T + 1) // 2
        layer2 = 6 * d * d * T + (2 * d * d + 4 * d * h) * 1 + 4 * d * T
        assert executed == layer1 + layer2 + head
        assert forward_flops(model, memory, "nt", T) - executed == (2 * d * d + 4 * d * h) * (T - 1) + 4 * d * (
            T * (T + 1) // 2 - T)
        return
    g = 4 if variant == "transformer_global_local" else 0
    # Layer 1 reads the sub-window's g + 15 rows and keeps g + 8 (w = 8), layer 2 reads those and keeps the last.
    allowed = reference.attention_mask(g + 15, variant, 8, 4)
    keys1 = int(allowed[reference.layer_rows(g + 15, (g, 8))].sum())
    keys2 = int(allowed[-1].sum())  # the last row sees the same keys in layer 2's row coordinates
    layer1 = 6 * d * d * (g + 15) + (2 * d * d + 4 * d * h) * (g + 8) + 4 * d * keys1
    layer2 = 6 * d * d * (g + 8) + (2 * d * d + 4 * d * h) * 1 + 4 * d * keys2
    assert executed == layer1 + layer2 + head
    assert executed < forward_flops(model, memory, "nt", g + 2 * 7 + 1)  # the sub-window as a window of its own
    assert executed < forward_flops(model, memory, "nt", T) / 2
