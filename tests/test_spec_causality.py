"""Every model's AR forward is causal: changing token j changes no output at positions < j."""

from __future__ import annotations

import numpy as np
import pytest

from pcaf_core import reference
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile
from tests.spec_helpers import ALL_VARIANT_ROUTES, tiny_memory, tiny_model

T = 20
CASES = [(v, r, si, pol) for v, r in ALL_VARIANT_ROUTES for si, pol in [("dense", "topk_score")]]
CASES += [("pcaf", "semantic", "bucketed", "recent"), ("pcaf", "hybrid", "bucketed", "first"),
          ("pcaf", "context", "dense", "recent"), ("pcaf", "context", "dense", "first")]


def _outputs(out: reference.ForwardOutput) -> list[np.ndarray]:
    res = [out.hidden, out.param_log_probs, out.log_probs, out.target_log_prob]
    if out.memory is not None:
        res += [out.memory.gate, out.memory.cache_weights, out.memory.p_cache]
    return res


def _run(variant, route, sem_index, policy, profile, tokens, targets):
    model = tiny_model(variant, max_seq_len=T)
    memory = tiny_memory(route, semantic_index=sem_index, candidate_policy=policy, num_buckets=8, top_k=5)
    prof = get_profile(profile)
    params = init_params(model, memory, prof, seed=2)
    params["memory.recency_scale"] = np.array(0.6) if "memory.recency_scale" in params else None
    params = {k: v for k, v in params.items() if v is not None}
    return reference.forward(params, tokens, model, memory, prof, "ar", targets)


@pytest.mark.parametrize("profile", ["corrected", "reference_torch"])
@pytest.mark.parametrize("variant,route,sem_index,policy", CASES, ids=["-".join(c) for c in CASES])
def test_changing_token_j_leaves_earlier_outputs_unchanged(variant, route, sem_index, policy, profile):
    if profile != "corrected" and route in ("semantic", "hybrid") and sem_index == "dense":
        # The reference leak reads the future by design; see test_reference_leak_breaks_causality.
        profile = "corrected"
    rng = np.random.default_rng(7)
    tokens = rng.integers(3, 9, (2, T))
    targets = rng.integers(3, 9, (2, T))
    base = _outputs(_run(variant, route, sem_index, policy, profile, tokens, targets))
    for j in (0, 1, 6, 13, T - 1):
        changed = tokens.copy()
        changed[:, j] = 3 + (changed[:, j] - 3 + 1) % 6
        new = _outputs(_run(variant, route, sem_index, policy, profile, changed, targets))
        for a, b in zip(base, new):
            np.testing.assert_array_equal(a[:, :j], b[:, :j])
        assert not np.array_equal(base[2][:, j:], new[2][:, j:])  # the change is visible from j on


@pytest.mark.parametrize("route", ["semantic", "hybrid"])
def test_reference_leak_reads_the_target_for_early_queries_and_changes_nothing_else(route):
    """Under the leak a query t < K reads records s >= t (s = t holds its own target); queries t >= K
    are identical with the switch on or off."""
    K = 5
    rng = np.random.default_rng(11)
    tokens = rng.integers(3, 9, (1, T))
    targets = rng.integers(3, 9, (1, T))
    model = tiny_model("pcaf", max_seq_len=T)
    memory = tiny_memory(route, num_buckets=8, top_k=K)
    leak_on = get_profile("reference_jax")
    leak_off = get_profile("reference_jax", semantic_ar_target_leak=False)
    params = init_params(model, memory, leak_on, seed=2)
    on = reference.forward(params, tokens, model, memory, leak_on, "ar", targets)
    off = reference.forward(params, tokens, model, memory, leak_off, "ar", targets)
    for t in range(K):
        assert t in on.memory.cand.index[0, t][on.memory.cand.valid[0, t]]
        assert t not in off.memory.cand.index[0, t][off.memory.cand.valid[0, t]]
    np.testing.assert_array_equal(on.memory.cand.index[:, K:], off.memory.cand.index[:, K:])
    np.testing.assert_array_equal(on.target_log_prob[:, K:], off.target_log_prob[:, K:])
    assert not np.allclose(on.target_log_prob[:, :K], off.target_log_prob[:, :K])
    # A token after position 1 changes query 1's output: the route is no longer causal.
    changed = tokens.copy()
    changed[0, 2] = 3 + (changed[0, 2] - 3 + 1) % 6
    new = reference.forward(params, changed, model, memory, leak_on, "ar", targets)
    assert not np.allclose(on.target_log_prob[0, 1], new.target_log_prob[0, 1])


@pytest.mark.parametrize("profile", ["reference_jax", "reference_torch"])  # trainable table / fixed sinusoids
@pytest.mark.parametrize("variant", ["transformer_local", "transformer_global_local"])
def test_next_token_state_of_windowed_attention_is_its_sub_window_s(variant, profile):
    """The last position's final state depends on the global prefix and the last n_layers·(w-1)+1 positions
    only (reference.nt_attention_crop): computed on that sub-window with its own positions, it is the full
    window's; a token just before the sub-window changes nothing, the first one inside it does."""
    model, prof = tiny_model(variant, max_seq_len=T), get_profile(profile)
    params = init_params(model, tiny_memory(), prof, seed=4)
    g, start = reference.nt_attention_crop(model, T)
    assert (g, start) == ((2 if variant == "transformer_global_local" else 0), T - (2 * 3 + 1))
    positions = reference.nt_attention_positions(model, T)
    np.testing.assert_array_equal(positions, np.r_[0:g, start:T])
    tokens = np.random.default_rng(1).integers(0, 40, (3, T))
    full = reference.hidden_states(params, tokens, model, prof)[:, -1]
    sub = reference.hidden_states(params, tokens[:, positions], model, prof, positions=positions)[:, -1]
    np.testing.assert_allclose(sub, full, rtol=1e-12, atol=1e-12)
    # Layer by layer, only the rows the prediction reads (reference.nt_attention_rows): the same state.
    for layers in (2, 3):
        deep = tiny_model(variant, max_seq_len=T, n_layers=layers)
        deep_params = init_params(deep, tiny_memory(), prof, seed=4)
        at = reference.nt_attention_positions(deep, T)
        rows = reference.nt_attention_rows(deep, T)
        assert rows == [(g, 2 * 3 + 1), (g, 3 + 1), (0, 1)][3 - layers:]  # w = 4
        last = reference.hidden_states(deep_params, tokens[:, at], deep, prof, positions=at, rows=rows)
        assert last.shape == (3, 1, model.d_model)
        np.testing.assert_allclose(last[:, 0], reference.hidden_states(deep_params, tokens, deep, prof)[:, -1],
                                   rtol=1e-12, atol=1e-12)
    outside, inside = tokens.copy(), tokens.copy()
    outside[:, start - 1] = (outside[:, start - 1] + 1) % 40
    inside[:, start] = (inside[:, start] + 1) % 40
    assert np.array_equal(reference.hidden_states(params, outside, model, prof)[:, -1], full)
    assert not np.allclose(reference.hidden_states(params, inside, model, prof)[:, -1], full)
    for other in ("transformer_dense", "linear_attention"):
        assert reference.nt_attention_crop(tiny_model(other), T) is None
    assert reference.nt_attention_rows(tiny_model("linear_attention"), T) is None
    np.testing.assert_array_equal(reference.layer_rows(6, (2, 3)), [0, 1, 3, 4, 5])
    np.testing.assert_array_equal(reference.layer_rows(6, None), np.arange(6))
    assert reference.nt_attention_crop(model, g + 2 * 3 + 1) is None  # nothing to cut
    np.testing.assert_array_equal(reference.nt_attention_positions(model, 5), np.arange(5))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_next_token_state_of_dense_attention_from_one_top_row(layers):
    """Dense attention reads every earlier position: no crop, every row of each layer below the top, and the top
    layer's last row alone (reference.nt_attention_rows), whose query reads every key; the full window's state."""
    model, prof = tiny_model("transformer_dense", max_seq_len=T, n_layers=layers), get_profile("reference_torch")
    params = init_params(model, tiny_memory(), prof, seed=5)
    rows = reference.nt_attention_rows(model, T)
    assert rows == [None] * (layers - 1) + [(0, 1)]
    tokens = np.random.default_rng(3).integers(0, 40, (3, T))
    last = reference.hidden_states(params, tokens, model, prof, rows=rows)
    assert last.shape == (3, 1, model.d_model)
    np.testing.assert_allclose(last[:, 0], reference.hidden_states(params, tokens, model, prof)[:, -1],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layers,kernel", [(2, 5), (3, 3)])
def test_conv_stack_on_the_receptive_field_keeps_the_rows_read_above(layers, kernel):
    """The last position's final state of a conv stack from its R-token receptive field, each block's MLP on the
    rows the blocks above read (reference.nt_conv_rows) only: the full window's state."""
    model = tiny_model("local_conv", n_layers=layers, kernel_size=kernel)
    prof = get_profile("corrected")
    params = init_params(model, tiny_memory(), prof, seed=3)
    R = layers * (kernel - 1) + 1
    rows = reference.nt_conv_rows(model)
    assert rows == reference.receptive_rows(layers, kernel - 1)
    assert rows[-1] == (0, 1) and rows[0] == (0, (layers - 1) * (kernel - 1) + 1)
    tokens = np.random.default_rng(2).integers(0, 40, (3, T))
    full = reference.hidden_states(params, tokens, model, prof)[:, -1]
    x = params["embed.weight"][tokens[:, -R:]]
    last = reference.conv_stack(params, x, model, prof.gelu, rows)
    assert last.shape == (3, 1, model.d_model)
    np.testing.assert_allclose(last[:, 0], full, rtol=1e-12, atol=1e-12)
    short = [(0, r[1] - 1) if r[1] > 1 else r for r in rows]  # one row too few below the top
    if short != rows:
        assert not np.allclose(reference.conv_stack(params, x, model, prof.gelu, short)[:, -1], full)
