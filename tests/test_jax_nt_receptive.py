"""JAX next-token forwards from receptive fields only (``nt_receptive_field``) equal the full forward
(mirrors tests/test_torch_nt_receptive.py): outputs, memory traces and ``jax.grad`` in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import build_model, to_variables
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile

CASES = [  # (variant, route, semantic index, policy, profile): each code path of the receptive read once
    ("pcaf", "context", "dense", "first", "reference_torch"),  # selection from tokens alone
    ("pcaf", "hybrid", "dense", "topk_score", "reference_jax"),  # ranks by keys and router: a full pass first
    ("pcaf_no_gate", "semantic", "bucketed", "recent", "corrected"),  # router buckets, fixed gate
    ("local_conv", "context", "dense", "first", "corrected"),  # no cache: the query's state only
]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _setup(case, T: int, dtype=np.float64):
    variant, route, index, policy, profile = case
    model = ModelConfig(variant=variant, vocab_size=40, d_model=12, d_hidden=16, n_layers=2, kernel_size=3)
    memory = MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=5, top_k=3,
                          semantic_buckets=4, semantic_temperature=0.5, semantic_score_scale=0.7)
    prof = get_profile(profile)
    rng = np.random.default_rng(T)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in init_params(model, memory, prof, seed=0).items()}
    tokens = rng.integers(3, 9, (3, T))
    tokens[2] = np.arange(3, 3 + T) % 40
    targets = rng.integers(3, 40, 3)
    # Cast on the host (no compilation per parameter shape; the same rounding as on the device).
    variables = to_variables({k: v.astype(dtype) for k, v in params.items()}, dtype)
    return model, memory, prof, variables, jnp.asarray(tokens), jnp.asarray(targets)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_receptive_field_forward_and_gradient_equal_the_full_window(x64, case) -> None:
    # T < R is covered by tests/test_torch_nt_receptive.py; one jitted program per path keeps this cheap.
    model, memory, prof, variables, tokens, targets = _setup(case, 37)
    full_net = build_model(model, memory, prof, dtype=jnp.float64)
    part_net = build_model(model, memory, prof, dtype=jnp.float64, nt_receptive_field=True)

    def run(net):  # one program: the outputs, and the loss's gradient of the training path
        def loss(v):
            out = net.apply(v, tokens, targets, "nt", need_log_probs=False, need_predictions=False)
            return out.loss, net.apply(v, tokens, targets, "nt")
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(variables)

    (_, full), g_full = run(full_net)
    (_, part), g_part = run(part_net)
    for name in ("param_log_probs", "log_probs", "target_log_prob", "loss"):
        np.testing.assert_allclose(getattr(part, name), getattr(full, name), rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_array_equal(part.prediction, full.prediction)
    np.testing.assert_allclose(part.hidden[:, 0], full.hidden[:, -1], rtol=1e-10, atol=1e-12)
    if full.memory is not None:
        np.testing.assert_array_equal(part.memory.cand.index, full.memory.cand.index)
        for name in ("cache_weights", "gate", "p_cache"):
            np.testing.assert_allclose(getattr(part.memory, name), getattr(full.memory, name), rtol=1e-10,
                                       atol=1e-12, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_full), jax.tree_util.tree_leaves(g_part)):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_receptive_forward_under_jit_with_dropout_draws_finite_losses() -> None:
    model, memory, prof, variables, tokens, targets = _setup(CASES[0], 30, np.float32)
    net = build_model(model, memory, prof, nt_receptive_field=True)

    @jax.jit
    def step(key):
        return net.apply(variables, tokens, targets, "nt", deterministic=False, need_log_probs=False,
                         need_predictions=False, rngs={"dropout": key}).loss

    a, b = step(jax.random.PRNGKey(0)), step(jax.random.PRNGKey(1))
    assert np.isfinite(a) and np.isfinite(b) and a != b


@pytest.mark.parametrize(("variant", "impl"), [
    *((v, i) for v in ("transformer_local", "transformer_global_local") for i in ("banded", "blocked", "masked")),
    ("transformer_dense", "auto"),
])
def test_attention_next_token_forward_from_its_sub_window_equals_the_full_window(x64, variant, impl) -> None:
    """Windowed attention from the global prefix and the last n_layers·(w-1)+1 positions, each layer computing
    the rows the prediction reads (pcaf_core.reference.nt_attention_rows), on every attention path; dense
    attention over the whole window with its top layer's last row only (mirrors
    tests/test_torch_nt_receptive.py, which also covers the profiles and linear attention)."""
    model = ModelConfig(variant=variant, vocab_size=40, d_model=12, d_hidden=16, n_layers=3, n_heads=2, window=4,
                        n_global=2, max_seq_len=40, attention_impl=impl)
    memory, prof = MemoryConfig(), get_profile("reference_jax")  # the trainable positional table
    rng = np.random.default_rng(2)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in init_params(model, memory, prof, seed=0).items()}
    variables = to_variables(params, np.float64)
    tokens, targets = jnp.asarray(rng.integers(0, 40, (3, 37))), jnp.asarray(rng.integers(0, 40, 3))

    def run(net):
        def loss(v):
            out = net.apply(v, tokens, targets, "nt", need_log_probs=False, need_predictions=False)
            return out.loss, net.apply(v, tokens, targets, "nt")
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(variables)

    (_, full), g_full = run(build_model(model, memory, prof, dtype=jnp.float64))
    (_, part), g_part = run(build_model(model, memory, prof, dtype=jnp.float64, nt_receptive_field=True))
    assert part.hidden.shape == (3, 1, 12)
    for name in ("param_log_probs", "log_probs", "target_log_prob", "loss"):
        np.testing.assert_allclose(getattr(part, name), getattr(full, name), rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(part.hidden[:, 0], full.hidden[:, -1], rtol=1e-10, atol=1e-12)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_full), jax.tree_util.tree_leaves(g_part)):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12, err_msg=jax.tree_util.keystr(path))
