"""JAX windowed attention as a blocked band (``model.attention_impl=banded``, the default;
:mod:`backends.jax.window_attention`) against the spec and the masked path: values and gradients, at T below,
above and not a multiple of the block, w = 1 to w > T, g = 0 to more than a block; no ``[T, T]`` array in the
model's program; dropout acting on the weights. Dense causal attention in query blocks against the masked path
and, in the model, the spec."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import build_model, layers, to_variables
from backends.jax.layers import attention, attention_mask
from backends.jax.window_attention import band_block, banded_attention, causal_attention_in_blocks
from pcaf_core import reference
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile
from tests.spec_helpers import spec_params

VARIANTS = ("transformer_local", "transformer_global_local")
# (T, w, g, block): one block; several blocks with a partial last one; w > T; w = 1; g beyond a block and
# beyond w; blocks smaller than w (c = 2 and 3 key blocks back).
SHAPES = [(50, 7, 3, None), (130, 20, 0, None), (40, 64, 5, None), (9, 1, 2, None), (33, 8, 20, 5),
          (70, 16, 4, 6)]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _spec_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, variant: str, w: int, g: int) -> np.ndarray:
    """The spec's softmax attention (``pcaf_core.reference.attention`` after its projections), ``[B, T, H, hd]``."""
    T, hd = q.shape[1], q.shape[-1]
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
    weights = reference.softmax(np.where(reference.attention_mask(T, variant, w, g), logits, -np.inf))
    return np.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,w,g,block", [SHAPES[0], *(pytest.param(*s, marks=pytest.mark.slow) for s in SHAPES[1:])])
def test_band_matches_spec_and_masked_path(variant, T, w, g, block, x64) -> None:
    rng = np.random.default_rng(T + w)
    q, k, v, cot = (rng.standard_normal((2, T, 2, 4)) for _ in range(4))

    def band(q, k, v):
        return banded_attention(q, k, v, variant, w, g, block=block)

    def masked(q, k, v):
        return attention(q, k, v, attention_mask(T, variant, w, g))

    @jax.jit
    def out_and_grads(q, k, v):
        out, vjp = jax.vjp(band, q, k, v)
        return out, vjp(cot), jax.vjp(masked, q, k, v)[1](cot)

    out, got, want = out_and_grads(q, k, v)
    np.testing.assert_allclose(np.asarray(out), _spec_attention(q, k, v, variant, w, g), rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-11, atol=1e-12)


# (T, w, g, rows): a next-token layer's runs: the global rows and a suffix not starting on a block boundary (the
# suffix shorter and longer than w), a suffix alone (local: no global rows), the top layer's one row, and both
# runs overlapping every key block.
ROW_CASES = [(50, 7, 3, (3, 13)), (50, 7, 3, (3, 5)), (40, 16, 0, (0, 23)), (37, 9, 4, (4, 1)), (30, 40, 5, (5, 25))]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,w,g,rows", ROW_CASES)
def test_band_of_some_rows_equals_those_rows_of_the_whole_band(variant, T, w, g, rows, x64) -> None:
    """``rows`` computes the band of those query rows only: the same values and gradients as those rows of the
    whole band (:func:`pcaf_core.reference.layer_rows`), each run blocked from its own first position."""
    rng = np.random.default_rng(T + w + rows[1])
    q, k, v = (rng.standard_normal((2, T, 2, 4)) for _ in range(3))
    kept = reference.layer_rows(T, rows)
    cot = rng.standard_normal((2, len(kept), 2, 4))

    @jax.jit
    def out_and_grads(q, k, v):
        some, vjp_some = jax.vjp(lambda *a: banded_attention(*a, variant, w, g, rows=rows), q, k, v)
        every, vjp_every = jax.vjp(lambda *a: banded_attention(*a, variant, w, g)[:, kept], q, k, v)
        return some, every, vjp_some(cot), vjp_every(cot)

    some, every, got, want = out_and_grads(q, k, v)
    assert some.shape == (2, len(kept), 2, 4)
    np.testing.assert_allclose(np.asarray(some), np.asarray(every), rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-11, atol=1e-12)


def test_float32_band_matches_float32_masked_path() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 261, 4, 16)), jnp.float32) for _ in range(3))
    got, want = jax.jit(lambda q, k, v: (banded_attention(q, k, v, "transformer_global_local", 128, 16), attention(
        q, k, v, attention_mask(261, "transformer_global_local", 128, 16))))(q, k, v)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_dropout_acts_on_the_band_weights() -> None:
    """``drop`` receives the band's weights ``[B, H, blocks, b, (c+1)·b + g]``; the output is linear in them."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 30, 2, 4)), jnp.float32) for _ in range(3))
    shapes = []

    def double(p):
        shapes.append(p.shape)
        return 2.0 * p

    def both(q, k, v):
        return (banded_attention(q, k, v, "transformer_global_local", 8, 3),
                banded_attention(q, k, v, "transformer_global_local", 8, 3, double))

    plain, doubled = jax.jit(both)(q, k, v)
    np.testing.assert_allclose(np.asarray(doubled), 2.0 * np.asarray(plain), rtol=1e-6)
    assert shapes == [(1, 2, 4, 8, 2 * 8 + 3)] and band_block(8, 30) == 8


def _model(impl: str, T: int = 70) -> tuple[ModelConfig, MemoryConfig, object]:
    # One block: each block's attention is the same band (or mask), so a second one would only double the
    # compiled programs (the band's own shapes and edge cases are test_band_matches_spec_and_masked_path's).
    model = ModelConfig(variant="transformer_global_local", vocab_size=40, d_model=16, d_hidden=24, n_layers=1,
                        n_heads=2, window=9, n_global=3, max_seq_len=T, attention_impl=impl)
    return model, MemoryConfig(), get_profile("reference_torch")  # dropout 0.1 in training


@pytest.mark.slow
def test_model_banded_equals_masked_and_spec(x64) -> None:
    """The default (``auto``, banded) model gives the spec's loss and the ``masked`` model's gradients; with
    dropout on, a training forward is finite and differs from evaluation."""
    rng = np.random.default_rng(2)
    tokens, targets = rng.integers(0, 40, (2, 70)), rng.integers(0, 40, (2, 70))
    model, memory, profile = _model("auto")
    params = spec_params(model, memory, profile, seed=3)
    spec = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    variables = to_variables(params, jnp.float64)
    losses, grads = {}, {}
    for impl in ("auto", "masked"):
        net = build_model(_model(impl)[0], memory, profile, dtype=jnp.float64)

        def loss(p, net=net):
            return net.apply({"params": p}, tokens, targets, "ar", need_log_probs=False, need_predictions=False).loss

        losses[impl], grads[impl] = jax.jit(jax.value_and_grad(loss))(variables["params"])
    np.testing.assert_allclose(float(losses["auto"]), spec.loss, rtol=1e-12)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9,
                                                                   atol=1e-12), grads["auto"], grads["masked"])
    net = build_model(model, memory, profile, dtype=jnp.float64)
    trained = jax.jit(lambda v: net.apply(v, tokens, targets, "ar", deterministic=False, need_log_probs=False,
                                          need_predictions=False, rngs={"dropout": jax.random.key(0)}).loss)(variables)
    assert np.isfinite(float(trained)) and abs(float(trained) - spec.loss) > 1e-6


@pytest.mark.slow
def test_default_model_builds_no_t_by_t_array() -> None:
    """The band is what runs by default: no value in the training step's program has two trailing T axes (the
    ``masked`` model's has them, which shows the check can fail)."""
    T = 256
    tokens = jnp.zeros((1, T), jnp.int32)

    def square_arrays(impl: str) -> int:
        model, memory, profile = _model(impl, T)
        params = spec_params(model, memory, profile, seed=0)
        net = build_model(model, memory, profile)

        def loss(p):
            return net.apply({"params": p}, tokens, tokens, "ar", need_log_probs=False, need_predictions=False).loss

        jaxpr = jax.make_jaxpr(jax.grad(loss))(to_variables(params)["params"])
        found = 0
        for eqn in _equations(jaxpr.jaxpr):
            found += sum(1 for var in eqn.outvars if getattr(var.aval, "shape", ())[-2:] == (T, T))
        return found

    assert square_arrays("auto") == 0
    assert square_arrays("masked") > 0


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the programs nested in its equations (pjit, custom VJPs, loops)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


# (T, block): one block (T <= block); several blocks with a partial last one; blocks of one row.
CAUSAL_SHAPES = [(9, 16), (23, 5), (12, 4), (7, 1)]


@pytest.mark.parametrize("T,block", CAUSAL_SHAPES)
def test_causal_blocks_match_spec_and_masked_path(T, block, x64) -> None:
    """Values equal the spec's, and gradients the masked path's, with ``drop`` an elementwise map of the weights
    (each block's weights are the masked path's rows, so any elementwise ``drop`` gives the same output)."""
    rng = np.random.default_rng(T + block)
    q, k, v, cot = (rng.standard_normal((2, T, 2, 4)) for _ in range(4))

    def square(p):
        return p * p

    def blocked(q, k, v):
        return causal_attention_in_blocks(q, k, v, square, block=block)

    def masked(q, k, v):
        return attention(q, k, v, attention_mask(T, "transformer_dense", 0, 0), square)

    @jax.jit
    def out_and_grads(q, k, v):
        out, vjp = jax.vjp(blocked, q, k, v)
        plain = causal_attention_in_blocks(q, k, v, block=block)
        return out, plain, vjp(cot), jax.vjp(masked, q, k, v)

    out, plain, got, (want_out, want_vjp) = out_and_grads(q, k, v)
    np.testing.assert_allclose(np.asarray(plain), _spec_attention(q, k, v, "transformer_dense", 0, 0),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want_vjp(cot), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-11, atol=1e-12)


def test_dense_model_runs_causal_blocks_and_equals_spec(monkeypatch, x64) -> None:
    """The dense Transformer's attention over every row runs in query blocks (``layers.CAUSAL_BLOCK``, here 8 rows
    so that a short window has several): the spec's loss, no ``[T, T]`` array in its program, and the masked
    path's gradients."""
    monkeypatch.setattr(layers, "CAUSAL_BLOCK", 8)
    rng = np.random.default_rng(5)
    T = 30
    tokens, targets = rng.integers(0, 40, (2, T)), rng.integers(0, 40, (2, T))
    model = ModelConfig(variant="transformer_dense", vocab_size=40, d_model=16, d_hidden=24, n_layers=1, n_heads=2,
                        max_seq_len=T)
    memory, profile = MemoryConfig(), get_profile("reference_torch")
    params = spec_params(model, memory, profile, seed=3)
    spec = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    net = build_model(model, memory, profile, dtype=jnp.float64)

    def loss(p):
        return net.apply({"params": p}, tokens, targets, "ar", need_log_probs=False, need_predictions=False).loss

    variables = to_variables(params, jnp.float64)
    value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"])
    np.testing.assert_allclose(float(value), spec.loss, rtol=1e-12)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"])
    assert not any(getattr(var.aval, "shape", ())[-2:] == (T, T) for eqn in _equations(jaxpr.jaxpr)
                   for var in eqn.outvars)
    monkeypatch.setattr(layers, "CAUSAL_BLOCK", T)  # one block: the masked path itself
    whole = jax.jit(jax.grad(loss))(variables["params"])
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9,
                                                                   atol=1e-12), grads, whole)
