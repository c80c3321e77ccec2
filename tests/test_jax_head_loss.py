"""The chunked JAX head loss (``backends.jax.head_loss``) against the one-tile form of
``layers.Head.target_log_prob``: values and gradients (features, weight, bias) within 1e-5 in float32 and to
bf16 rounding under bf16 compute, tiles that do not divide N or V, jit, no ``[N, V]`` array in the
jaxpr of the forward and backward passes, and the models' chunked head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import build_model, to_variables
from backends.jax.head_loss import chunked_target_log_softmax
from backends.jax.layers import affine
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile
from tests.test_jax_memory import _measure

# (position chunk, vocabulary chunk) against N = 14 positions and V = 11: ragged last tiles on both axes,
# one-element tiles, one tile wider than the vocabulary, one tile holding everything.
CHUNKS = [(3, 4), (1, 1), (5, 11), (14, 20), (100, 100)]


def _one_tile(z, w, b, y):
    """``Head.target_log_prob``'s form: Dense's logits rounded to the compute dtype, widened, log-softmax."""
    logits = affine(z, w, b).astype(z.dtype).astype(b.dtype)
    return jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)


def _inputs(N=14, H=5, V=11, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    z = jax.random.normal(k[0], (N, H))
    w = jax.random.normal(k[1], (H, V))
    b = jax.random.normal(k[2], (V,))
    y = jax.random.randint(k[3], (N,), 0, V).at[0].set(3).at[1].set(3)  # a repeated target
    return z, w, b, y, jax.random.normal(k[4], (N,))


def _value_and_grads(fn, z, w, b, y, upstream, dtype):
    def loss(z, w, b):
        out = fn(z.astype(dtype), w.astype(dtype), b, y)
        return jnp.sum(out * upstream), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(z, w, b)
    return out, grads


@pytest.mark.parametrize("chunks", [CHUNKS[0], *(pytest.param(c, marks=pytest.mark.slow) for c in CHUNKS[1:])],
                         ids=str)
def test_chunked_equals_the_one_tile_form_in_float32(chunks):
    z, w, b, y, upstream = _inputs()
    with jax.default_matmul_precision("highest"):
        got, g_got = _value_and_grads(lambda *a: chunked_target_log_softmax(*a, *chunks), z, w, b, y, upstream,
                                      jnp.float32)
        want, g_want = _value_and_grads(_one_tile, z, w, b, y, upstream, jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == y.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for name, a, r in zip("zwb", g_got, g_want):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_chunked_matches_the_one_tile_form_in_bf16():
    """bf16 compute (products in bf16, logits rounded to bf16, normaliser in float32): the values agree to
    float32 rounding, the float32 parameters' gradients to bf16 rounding of their scale."""
    z, w, b, y, upstream = _inputs(N=64, H=32, V=300, seed=1)
    got, g_got = _value_and_grads(lambda *a: chunked_target_log_softmax(*a, 48, 128), z, w, b, y, upstream,
                                  jnp.bfloat16)
    want, g_want = _value_and_grads(_one_tile, z, w, b, y, upstream, jnp.bfloat16)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for name, a, r in zip("zwb", g_got, g_want):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, r, rtol=2e-2, atol=2**-8 * float(jnp.abs(r).max()), err_msg=name)


@pytest.mark.slow
def test_chunked_jits_and_holds_no_logits_sized_array():
    """Under ``jit`` the one-tile value; the jaxpr of value and gradient holds nothing larger than a tile or a
    gradient (``[H, V]``), where the one-tile form holds the ``[N, V]`` logits."""
    N, H, V, P, C = 96, 4, 500, 32, 100
    z, w, b, y, upstream = _inputs(N, H, V, seed=2)

    def grad_of(fn):
        return jax.value_and_grad(lambda z, w, b: jnp.sum(fn(z, w, b, y) * upstream), argnums=(0, 1, 2))

    chunked = grad_of(lambda *a: chunked_target_log_softmax(*a, P, C))
    np.testing.assert_allclose(jax.jit(chunked)(z, w, b)[0], jax.jit(grad_of(_one_tile))(z, w, b)[0], rtol=1e-5)
    assert _measure(grad_of(_one_tile), z, w, b)[0] >= N * V
    assert _measure(chunked, z, w, b)[0] <= max(P * C, H * V)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["local_conv", "transformer_dense"])
def test_models_chunked_head_trains_like_the_one_tile_head(variant):
    """``build_model(..., head_chunks=...)``: the training loss and every parameter's gradient equal the
    one-tile model's, and evaluation still builds the whole distribution."""
    model = ModelConfig(variant=variant, vocab_size=23, d_model=8, d_hidden=12, n_layers=1, kernel_size=3,
                        n_heads=2, max_seq_len=10)
    memory = MemoryConfig(num_buckets=5, top_k=3)
    profile = get_profile("corrected")
    variables = to_variables(init_params(model, memory, profile, seed=3))
    rng = np.random.default_rng(5)
    tokens, targets = jnp.asarray(rng.integers(0, 23, (2, 10))), jnp.asarray(rng.integers(0, 23, (2, 10)))
    results = []
    for chunks in (None, (4, 5)):
        net = build_model(model, memory, profile, head_chunks=chunks)

        def loss(params, net=net):
            return net.apply({"params": params}, tokens, targets, "ar", need_log_probs=False,
                             need_predictions=False).loss

        with jax.default_matmul_precision("highest"):
            results.append(jax.jit(jax.value_and_grad(loss))(variables["params"]))
    (l0, g0), (l1, g1) = results
    np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-6)
    for path, a, r in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g1),
                          jax.tree_util.tree_leaves(g0)):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path[0]))
    chunked = build_model(model, memory, profile, head_chunks=(4, 5))
    out = jax.jit(lambda v: chunked.apply(v, tokens, targets, "ar"))(variables)
    assert out.param_log_probs.shape == (2, 10, 23)
