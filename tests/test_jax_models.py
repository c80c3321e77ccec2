"""JAX models beyond the forward values: gradients, dropout, bf16 compute, initialisation, parameter counts.

* ``jax.grad`` of the training loss equals central finite differences (float64) along random directions
  in each parameter group: conv, head, memory query/key, gate, router, ρ, attention, positions.
* Dropout acts only with ``deterministic=False`` and follows the ``dropout`` RNG.
* bf16 compute runs with float32 parameters and normalisers and stays close to float32.
* ``module.init`` creates exactly the canonical parameters; ``jax.eval_shape`` of it (no weight
  allocated) gives the paper's 13 parameter counts; ``init_params`` follows both init schemes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import build_model, init_params, to_canonical, to_variables
from pcaf_core import reference
from pcaf_core.config import MODEL_VARIANTS, MemoryConfig, ModelConfig
from pcaf_core.params import param_shapes
from pcaf_core.profiles import get_profile
from tests.spec_helpers import RHO, configs, spec_params, window
from tests.test_jax_vs_spec import assert_matches
from tests.test_spec_params import PAPER_COUNTS


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _loss_fn(net, tokens, targets, mode):
    def loss(params):
        out = net.apply({"params": params}, tokens, targets, mode, deterministic=True, need_log_probs=False,
                        need_predictions=False)
        return out.loss
    return jax.jit(loss)


def _host(tree):
    """``tree`` with NumPy leaves. The tests' own arithmetic on parameter trees (perturbations, dot products,
    finiteness) runs on the host: eagerly in JAX, every operation on every new shape is a compilation."""
    return jax.tree_util.tree_map(np.asarray, tree)


def _variables(params, dtype):
    """``to_variables`` of the canonical ``params`` cast to ``dtype`` on the host (the same rounding as a cast
    on the device, without a compilation per shape)."""
    return to_variables({k: np.asarray(v, dtype) for k, v in params.items()}, dtype)


def _direction(params, names: list[str], seed: int):
    """A random unit-scale direction that is non-zero only on the canonical parameters ``names``."""
    rng = np.random.default_rng(seed)
    flat = {k: np.zeros(np.shape(v)) for k, v in to_canonical(params).items()}
    for n in names:
        flat[n] = rng.normal(size=flat[n].shape)
    return _host(to_variables(flat, jnp.float64)["params"])


def _tree_dot(a, b) -> float:
    return float(sum(np.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                                                     strict=True)))


GRAD_GROUPS = {
    ("pcaf", "hybrid", "dense", "topk_score"): {
        "conv": ["blocks.0.conv.weight", "blocks.1.conv.bias", "blocks.0.norm.weight", "blocks.1.mlp_in.weight"],
        "head": ["head.norm.bias", "head.hidden.weight", "head.out.weight", "head.out.bias"],
        "memory": ["memory.query.weight", "memory.key.weight"],
        "gate": ["gate.norm.weight", "gate.hidden.weight", "gate.out.weight", "gate.out.bias"],
        "router": ["memory.router.weight", "memory.router.bias"],
        "rho": ["memory.recency_scale"],
        "embed": ["embed.weight"],
    },
    ("transformer_global_local", "context", "dense", "topk_score"): {
        "attention": ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.bias", "blocks.0.attn.out.weight",
                      "blocks.1.attn_norm.weight"],
        "positions": ["pos.table"],
    },
}


GRAD_RUNS = [(case, mode) for case in GRAD_GROUPS for mode in (("nt", "ar") if case[0] == "pcaf" else ("ar",))]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "mode"), GRAD_RUNS, ids=[f"{c[0]}-{m}" for c, m in GRAD_RUNS])
def test_grad_matches_finite_differences(x64, case, mode: str) -> None:
    model, memory, profile = configs(*case, profile="corrected")
    params = _host(_variables(spec_params(model, memory, profile, rho=0.7), np.float64)["params"])
    tokens, targets = window(12, mode)
    net = build_model(model, memory, profile, dtype=jnp.float64)
    # One compiled program serves both the gradient and the finite differences' loss values.
    value_and_grad = jax.jit(jax.value_and_grad(_loss_fn(net, jnp.asarray(tokens), jnp.asarray(targets), mode)))
    grad = _host(value_and_grad(params)[1])
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grad))
    eps = 1e-6
    for i, (group, names) in enumerate(GRAD_GROUPS[case].items()):
        v = _direction(params, names, seed=i)
        plus = jax.tree_util.tree_map(lambda p, d: p + eps * d, params, v)  # float64 on the host
        minus = jax.tree_util.tree_map(lambda p, d: p - eps * d, params, v)
        fd = (float(value_and_grad(plus)[0]) - float(value_and_grad(minus)[0])) / (2 * eps)
        analytic = _tree_dot(grad, v)
        assert abs(analytic) > 1e-6, f"{group}: no gradient reaches the group"
        np.testing.assert_allclose(analytic, fd, rtol=1e-5, atol=1e-8, err_msg=group)


@pytest.mark.slow
def test_gradient_is_finite_with_empty_queries_and_zero_gate(x64) -> None:
    """AR queries without records have λ = 0 (corrected) and log 0 terms: the gradient stays finite."""
    model, memory, profile = configs("pcaf", "context", "dense", "recent", "corrected")
    params = _variables(spec_params(model, memory, profile), np.float64)["params"]
    tokens, targets = window(10, "ar", distinct=8)
    net = build_model(model, memory, profile, dtype=jnp.float64)

    def loss(p):
        out = net.apply({"params": p}, jnp.asarray(tokens), jnp.asarray(targets), "ar", need_log_probs=False,
                        need_predictions=False)
        return out.loss, out.memory.gate

    grad, gate = _host(jax.jit(jax.grad(loss, has_aux=True))(params))
    assert (gate == 0).any()
    for leaf in jax.tree_util.tree_leaves(grad):
        assert np.isfinite(leaf).all()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["pcaf", "transformer_dense"])
def test_dropout_only_in_training_mode(variant: str) -> None:
    model, memory, _ = configs(variant, "context")
    profile = get_profile("reference_torch")  # dropout 0.1
    assert profile.dropout > 0
    params = spec_params(model, memory, profile)
    tokens, targets = window(12, "ar")
    net = build_model(model, memory, profile)
    variables = _variables(params, np.float32)
    x, y = jnp.asarray(tokens), jnp.asarray(targets)

    @functools.partial(jax.jit, static_argnums=0)
    def loss(deterministic: bool, key: jax.Array) -> jax.Array:
        return net.apply(variables, x, y, "ar", deterministic=deterministic, need_log_probs=False,
                         need_predictions=False, rngs={"dropout": key}).loss

    def run(deterministic: bool, key: int) -> float:
        return float(loss(deterministic, jax.random.PRNGKey(key)))

    with jax.default_matmul_precision("highest"):
        ref = reference.forward(params, tokens, model, memory, profile, "ar", targets)
        evaluation = [run(True, k) for k in (0, 1)]
        train = [run(False, k) for k in (0, 0, 1)]
    np.testing.assert_allclose(evaluation, [ref.loss, ref.loss], rtol=1e-5)
    assert train[0] == train[1]  # same key, same mask
    assert train[0] != train[2]  # another key, another mask
    assert abs(train[0] - ref.loss) > 1e-4  # dropout changes the loss
    with pytest.raises(Exception, match="dropout"):  # training without a dropout key fails loudly (when traced)
        jax.eval_shape(lambda v: net.apply(v, x, y, "ar", deterministic=False), variables)


@pytest.mark.parametrize("case", [("pcaf", "hybrid", "dense", "topk_score"),
                                  ("linear_attention", "context", "dense", "topk_score")], ids=lambda c: c[0])
@pytest.mark.slow
def test_bf16_compute_is_close_to_fp32(case) -> None:
    """bf16 matmuls, float32 parameters, residual stream and normalisers: close to the float64 spec."""
    model, memory, profile = configs(*case, profile="reference_jax")
    params = spec_params(model, memory, profile, rho=RHO["reference_jax"])
    tokens, targets = window(16, "ar")
    ref = reference.forward(params, tokens, model, memory, profile, "ar", targets)
    variables = _variables(params, np.float32)
    x, y = jnp.asarray(tokens), jnp.asarray(targets)
    net = build_model(model, memory, profile, dtype=jnp.bfloat16)
    out = jax.jit(lambda v: net.apply(v, x, y, "ar"))(variables)
    assert out.log_probs.dtype == jnp.float32 and out.hidden.dtype == jnp.float32
    assert np.isfinite(np.asarray(out.log_probs)).all()
    assert abs(float(out.loss) - ref.loss) < 0.05 * abs(ref.loss)
    np.testing.assert_allclose(np.exp(out.log_probs), np.exp(ref.log_probs), atol=0.05)
    assert not np.allclose(np.asarray(out.log_probs), ref.log_probs, rtol=1e-5, atol=1e-6)  # bf16 did run
    if case[0] != "pcaf":
        return

    def loss(p):
        return net.apply({"params": p}, x, y, "ar", need_log_probs=False, need_predictions=False).loss

    grad = _host(jax.jit(jax.grad(loss))(variables["params"]))
    for leaf in jax.tree_util.tree_leaves(grad):  # parameters (and so their gradients) stay float32
        assert leaf.dtype == np.float32 and np.isfinite(leaf).all()


@pytest.mark.parametrize("bias_row", [True, False], ids=["bias-row", "column-sum"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_affine_vjp_matches_autodiff_of_the_plain_product(dtype, bias_row: bool, monkeypatch) -> None:
    """``layers.affine``'s own backward in both its forms (``∂b`` as one more row of ``[x, 1]ᵀ @ g``, on a CPU;
    the cotangent's column sum, on an accelerator) gives what autodiff of ``x @ w + b`` gives, for a batched
    ``[B, T, in]`` input, in the compute dtype it was given."""
    from backends.jax import layers
    from backends.jax.layers import affine

    monkeypatch.setattr(layers, "bias_row_in_weight_product", lambda: bias_row)

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 5, 7)), dtype)
    w = jnp.asarray(rng.normal(size=(7, 11)), dtype)
    b = jnp.asarray(rng.normal(size=(11,)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(2, 5, 11)), jnp.float32)  # a cotangent with no symmetry

    def plain(x, w, b):
        return jnp.sum(c * (jnp.matmul(x, w, preferred_element_type=jnp.float32) + b))

    got, want = jax.jit(lambda *a: (jax.grad(lambda *a: jnp.sum(c * affine(*a)), argnums=(0, 1, 2))(*a),
                                    jax.grad(plain, argnums=(0, 1, 2))(*a)))(x, w, b)  # one program
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for g, r, like in zip(got, want, (x, w, b)):
        assert g.dtype == like.dtype and g.shape == like.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol)
    # ∂b is the cotangent's column sum
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(c.sum(axis=(0, 1))), rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["conv", "layernorm"])
@pytest.mark.parametrize("batch", [1, 2])
def test_conv_and_layernorm_per_feature_parameters_broadcast_in_one_step(batch, layer) -> None:
    """CausalConv and LayerNorm give the values and gradients of the NumPy-broadcast formulas, and each
    per-feature parameter's gradient is one sum over every leading axis (``expand_param``): the form whose
    backward XLA:CPU runs fast at batch 1 (docs/JAX.md, "Step cost on a CPU")."""
    from backends.jax.layers import CausalConv, LayerNorm, expand_param

    rng = np.random.default_rng(5)
    T, d, k = 9, 6, 3
    x = jnp.asarray(rng.normal(size=(batch, T, d)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(batch, T, d)), jnp.float32)

    def conv_ref(p, x):
        xp = jnp.pad(x, ((0, 0), (k - 1, 0), (0, 0)))
        return p["bias"] + sum(p["weight"][lag] * xp[:, k - 1 - lag:k - 1 - lag + T] for lag in range(k))

    def ln_ref(p, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-5) * p["weight"] + p["bias"]

    module, ref = (CausalConv(k), conv_ref) if layer == "conv" else (LayerNorm(), ln_ref)
    params = _host(jax.jit(module.init)(jax.random.PRNGKey(0), x)["params"])
    params = jax.tree_util.tree_map(lambda a: a + rng.normal(size=a.shape).astype(a.dtype), params)

    @jax.jit  # values and gradients of both forms in one program (eagerly, each operation compiles alone)
    def values_and_grads(params, x):
        got = jax.grad(lambda p, x: jnp.sum(c * module.apply({"params": p}, x)), argnums=(0, 1))(params, x)
        want = jax.grad(lambda p, x: jnp.sum(c * ref(p, x)), argnums=(0, 1))(params, x)
        return module.apply({"params": params}, x), ref(params, x), got, want

    value, ref_value, got, want = values_and_grads(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    # No parameter gradient summed over time alone (the NumPy form's [B, 1, d] -> [B, d] sum).
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(c * module.apply({"params": p}, x))))(params))
    assert "reduce_sum[axes=(1,)" not in jaxpr, jaxpr

    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(c * expand_param(p, x))))(jnp.ones(d)))
    assert "reduce_sum[axes=(0, 1)" in jaxpr, jaxpr


def _tree_shapes(tree) -> dict[str, tuple[int, ...]]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(k.key) for k in path)] = tuple(leaf.shape)
    return out


def _init_shapes(model, memory, profile, T: int = 6) -> dict[str, tuple[int, ...]]:
    net = build_model(model, memory, profile)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    variables = jax.eval_shape(lambda t: net.init(jax.random.PRNGKey(0), t, None, "ar"), tokens)
    assert set(variables) == {"params"}
    return _tree_shapes(variables["params"])


@pytest.mark.parametrize("profile_name", ["reference_jax", "reference_torch", "corrected"])
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_module_init_creates_exactly_the_canonical_parameters(variant: str, profile_name: str) -> None:
    model, memory, profile = configs(variant, "hybrid", profile=profile_name)
    got = _init_shapes(model, memory, profile)
    canonical = param_shapes(model, memory, profile)
    flat = {name: np.zeros(shape, np.float32) for name, shape in canonical.items()}
    want = _tree_shapes(to_variables(flat, np.float32)["params"])
    assert got == want
    assert sorted(to_canonical(to_variables(flat, np.float32))) == sorted(canonical)


_DISTINCT = {}
for _row in PAPER_COUNTS:
    _DISTINCT.setdefault(_row[-1], _row)
assert len(_DISTINCT) == 13


@pytest.mark.slow
@pytest.mark.parametrize("row", list(_DISTINCT.values()), ids=[r[0] for r in _DISTINCT.values()])
def test_eval_shape_of_init_gives_paper_counts(row) -> None:
    label, variant, route, shape, profile_name, seq_len, S, expected = row
    model = ModelConfig(variant=variant, max_seq_len=seq_len, **shape)
    memory = MemoryConfig(route=route, semantic_buckets=S)
    profile = get_profile(profile_name)
    shapes = _init_shapes(model, memory, profile)  # abstract: no weight is allocated
    assert sum(math.prod(s) for s in shapes.values()) == expected, label
    abstract = jax.eval_shape(lambda: init_params(model, memory, profile, seed=0))
    assert {k: v.shape for k, v in abstract.items()} == param_shapes(model, memory, profile)
    assert sum(math.prod(v.shape) for v in abstract.values()) == expected, label


@pytest.mark.slow
def test_init_params_jax_normal_scheme() -> None:
    model, memory, profile = configs("pcaf", "hybrid", profile="corrected")
    model = ModelConfig(**{**model.__dict__, "vocab_size": 400, "d_model": 64, "d_hidden": 96})
    jitted = jax.jit(lambda seed: init_params(model, memory, profile, seed=seed))  # one program, any seed

    def draw(seed: int) -> dict[str, np.ndarray]:  # statistics on the host: no compilation per shape
        return _host(jitted(seed))

    p = draw(3)
    assert {k: v.shape for k, v in p.items()} == param_shapes(model, memory, profile)
    assert all(v.dtype == np.float32 for v in p.values())
    np.testing.assert_allclose(float(np.std(p["embed.weight"])), 0.02, rtol=0.05)
    np.testing.assert_allclose(float(np.std(p["head.out.weight"])), 1 / math.sqrt(96), rtol=0.05)
    np.testing.assert_allclose(float(np.std(p["blocks.0.conv.weight"])), 1 / math.sqrt(3), rtol=0.15)
    assert float(np.abs(p["head.out.bias"]).max()) == 0.0
    assert float(p["memory.recency_scale"]) == 1.0 and p["memory.recency_scale"].shape == ()
    np.testing.assert_array_equal(p["gate.norm.weight"], 1.0)
    again, other = draw(3), draw(4)
    assert all(np.array_equal(p[k], again[k]) for k in p)
    assert not np.array_equal(p["head.out.weight"], other["head.out.weight"])


@pytest.mark.slow
def test_init_params_torch_default_scheme() -> None:
    model, memory, _ = configs("transformer_dense", profile="reference_torch")
    model = ModelConfig(**{**model.__dict__, "vocab_size": 400, "d_model": 48, "d_hidden": 96, "n_heads": 4})
    profile = get_profile("reference_torch")
    # Drawn by one jitted program each; the statistics on the host (no compilation per shape).
    p = _host(jax.jit(lambda: init_params(model, memory, profile, seed=0))())
    d = 48
    np.testing.assert_allclose(float(np.std(p["embed.weight"])), 1.0, rtol=0.05)  # nn.Embedding N(0, 1)
    for name, fan_in in (("blocks.0.mlp_in", d), ("blocks.0.mlp_out", 96), ("head.out", 96), ("blocks.1.attn.out", d)):
        w = p[f"{name}.weight"]
        bound = 1 / math.sqrt(fan_in)
        assert float(np.abs(w).max()) <= bound and float(np.abs(w).max()) > 0.9 * bound, name
        np.testing.assert_allclose(float(np.std(w)), bound / math.sqrt(3), rtol=0.1, err_msg=name)
    assert 0 < float(np.abs(p["head.out.bias"]).max()) <= 1 / math.sqrt(96)
    qkv_bound = math.sqrt(6 / (d + 3 * d))
    assert 0.9 * qkv_bound < float(np.abs(p["blocks.0.attn.qkv.weight"]).max()) <= qkv_bound
    for zero in ("blocks.0.attn.qkv.bias", "blocks.0.attn.out.bias", "head.norm.bias"):
        assert float(np.abs(p[zero]).max()) == 0.0, zero
    conv_model, conv_memory, _ = configs("pcaf", "semantic", profile="reference_torch")
    q = _host(jax.jit(lambda: init_params(conv_model, conv_memory, profile, seed=0))())
    k = conv_model.kernel_size
    assert 0 < float(np.abs(q["blocks.0.conv.weight"]).max()) <= 1 / math.sqrt(k)
    assert 0 < float(np.abs(q["blocks.0.conv.bias"]).max()) <= 1 / math.sqrt(k)
    assert "memory.router.bias" not in q and "memory.router_norm.weight" in q  # layernorm_linear router


JIT_CASES = [(("pcaf", "hybrid", "dense", "topk_score"), "reference_jax", "ar"),
             (("pcaf_no_gate", "semantic", "dense", "recent"), "reference_torch", "nt")]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "profile_name", "mode"), JIT_CASES, ids=[c[0][0] for c in JIT_CASES])
def test_jitted_forward_matches_spec(x64, case, profile_name: str, mode: str) -> None:
    """The path the trainer runs: the whole forward under one ``jax.jit`` with the module static."""
    model, memory, profile = configs(*case, profile=profile_name)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens, targets = window(20, mode)
    ref = reference.forward(params, tokens, model, memory, profile, mode, targets)
    net = build_model(model, memory, profile, dtype=jnp.float64)
    fwd = jax.jit(lambda module, v, x, y: module.apply(v, x, y, mode), static_argnums=0)
    out = fwd(net, _variables(params, np.float64), jnp.asarray(tokens), jnp.asarray(targets))
    assert_matches(out, ref, rtol=1e-5, atol=1e-10)
    # an equal module (equal configuration) is the same static argument: no retrace
    assert hash(build_model(model, memory, profile, dtype=jnp.float64)) == hash(net)


def test_static_input_checks() -> None:
    model, memory, profile = configs("transformer_dense", profile="corrected")  # trainable table, 32 rows
    net = build_model(model, memory, profile)
    variables = _variables(spec_params(model, memory, profile), np.float32)
    ok = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="integer"):
        net.apply(variables, ok.astype(jnp.float32), None, "nt")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        net.apply(variables, jnp.zeros((8,), jnp.int32), None, "nt")
    with pytest.raises(ValueError, match="max_seq_len=32"):
        net.apply(variables, jnp.zeros((1, 33), jnp.int32), None, "ar")
    with pytest.raises(ValueError, match=r"nt targets must be \[B\] or \[B, 1\]"):
        net.apply(variables, ok, jnp.zeros((2, 8), jnp.int32), "nt")
    with pytest.raises(ValueError, match="mode"):
        net.apply(variables, ok, None, "bidirectional")
    # NT targets may be [B, 1]; shapes only (abstract evaluation, nothing compiled)
    out = jax.eval_shape(lambda v: net.apply(v, ok, jnp.zeros((2, 1), jnp.int32), "nt"), variables)
    assert out.target_log_prob.shape == (2, 1) and out.loss.shape == () and out.prediction.dtype == jnp.int32
