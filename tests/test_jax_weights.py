"""Canonical parameter dict <-> linen variables <-> safetensors files (backends.jax.weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from backends.jax import build_model, load_safetensors, save_safetensors, to_canonical, to_variables
from pcaf_core import reference
from pcaf_core.config import MODEL_VARIANTS
from pcaf_core.params import init_params, param_shapes
from pcaf_core.weights import load_canonical, read_metadata
from tests.spec_helpers import configs, spec_params, window


@pytest.mark.parametrize("profile_name", ["reference_jax", "reference_torch", "corrected"])
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_canonical_round_trip(variant: str, profile_name: str) -> None:
    model, memory, profile = configs(variant, "hybrid", profile=profile_name)
    expected = param_shapes(model, memory, profile)
    params = init_params(model, memory, profile, seed=1, dtype=np.float32)
    variables = to_variables(params)
    assert set(variables) == {"params"}
    back = to_canonical(variables, expected)
    assert list(back) == list(expected)  # canonical order
    for name in expected:
        assert back[name].dtype == np.float32 and back[name].shape == expected[name], name
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)
    # the bare tree converts too; without expected every leaf is still named canonically
    assert set(to_canonical(variables["params"])) == set(expected)


def test_tree_layout_names() -> None:
    model, memory, profile = configs("transformer_dense", profile="corrected")
    tree = to_variables(init_params(model, memory, profile))["params"]
    assert tree["blocks_1"]["attn"]["qkv"]["weight"].shape == (12, 36)  # [in, out]
    assert tree["pos"]["table"].shape == (32, 12)
    model, memory, profile = configs("pcaf", "semantic", profile="reference_torch")
    tree = to_variables(init_params(model, memory, profile))["params"]
    assert tree["blocks_0"]["conv"]["weight"].shape == (3, 12)  # [k, d] by lag
    assert tree["memory"]["recency_scale"].shape == ()
    assert set(tree["memory"]) == {"query", "key", "router", "router_norm", "recency_scale"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["pcaf", "transformer_global_local"])
def test_safetensors_round_trip_and_forward(tmp_path, variant: str) -> None:
    model, memory, profile = configs(variant, "hybrid", profile="reference_jax")
    params = spec_params(model, memory, profile)
    expected = param_shapes(model, memory, profile)
    variables = to_variables(params, jnp.float32)
    path = save_safetensors(tmp_path / "w.safetensors", variables["params"], metadata={"step": "7"},
                            expected=expected)
    assert read_metadata(path) == {"format": "pcaf-canonical", "step": "7"}
    tree = load_safetensors(path, expected)
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                                jax.tree_util.tree_flatten_with_path(variables["params"])[0], strict=True):
        assert pa == pb and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The file is the canonical dict: the NumPy spec reads it and computes what the JAX model computes.
    spec = load_canonical(path, expected)
    tokens, targets = window(12, "ar")
    ref = reference.forward(spec, tokens, model, memory, profile, "ar", targets)
    with jax.default_matmul_precision("highest"):
        out = jax.jit(lambda p: build_model(model, memory, profile).apply(
            {"params": p}, jnp.asarray(tokens), jnp.asarray(targets), "ar"))(tree)
    np.testing.assert_allclose(np.asarray(out.log_probs), ref.log_probs, rtol=1e-4, atol=1e-5)


def test_bfloat16_leaves_are_saved_as_float32(tmp_path) -> None:
    model, memory, profile = configs("local_conv", profile="corrected")
    expected = param_shapes(model, memory, profile)
    tree = to_variables(init_params(model, memory, profile, seed=2), jnp.bfloat16)["params"]
    path = save_safetensors(tmp_path / "bf16.safetensors", tree)
    raw = safetensors.numpy.load_file(str(path))
    assert all(v.dtype == np.float32 for v in raw.values())
    back = load_safetensors(path, expected)
    np.testing.assert_array_equal(np.asarray(back["head"]["out"]["weight"]),
                                  np.asarray(tree["head"]["out"]["weight"], dtype=np.float32))


def test_load_errors_name_missing_extra_and_misshaped_keys(tmp_path) -> None:
    model, memory, profile = configs("pcaf", "semantic", profile="reference_jax")
    params = init_params(model, memory, profile, dtype=np.float32)
    expected = param_shapes(model, memory, profile)
    broken = dict(params)
    del broken["gate.out.bias"]
    broken["extra.weight"] = np.zeros(3, np.float32)
    broken["head.out.weight"] = np.zeros((24, 41), np.float32)
    path = save_safetensors(tmp_path / "broken.safetensors", to_variables(broken)["params"])
    with pytest.raises(ValueError) as err:
        load_safetensors(path, expected)
    msg = str(err.value)
    assert "gate.out.bias" in msg and "extra.weight" in msg and "head.out.weight" in msg
    assert "(24, 41)" in msg and "(24, 40)" in msg
    with pytest.raises(ValueError, match="gate.out.bias"):
        to_canonical(to_variables(broken), expected)
    # a file written for another configuration (router parameters present) is refused by name
    _, _, corrected = configs("pcaf", "context", profile="corrected")
    with pytest.raises(ValueError, match="memory.router.weight"):
        load_safetensors(save_safetensors(tmp_path / "ok.safetensors", to_variables(params)["params"]),
                         param_shapes(model, configs("pcaf", "context")[1], corrected))


def test_foreign_file_is_refused(tmp_path) -> None:
    model, memory, profile = configs("local_conv", profile="corrected")
    path = tmp_path / "foreign.safetensors"
    safetensors.numpy.save_file({k: np.asarray(v, np.float32) for k, v in init_params(model, memory, profile).items()},
                                str(path))
    with pytest.raises(ValueError, match="format tag"):
        load_safetensors(path, param_shapes(model, memory, profile))
