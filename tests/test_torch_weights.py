"""Canonical weights: torch layouts <-> canonical dict, safetensors round trips, and loud failures."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
import torch
from safetensors import safe_open

from backends.torch import build_model, load_canonical, load_safetensors, save_safetensors, to_canonical
from backends.torch.weights import canonical_shapes
from pcaf_core.config import MODEL_VARIANTS, MemoryConfig, ModelConfig
from pcaf_core.params import init_params, param_shapes
from pcaf_core.profiles import get_profile
from pcaf_core.weights import FORMAT_TAG

SMALL = dict(vocab_size=20, d_model=8, d_hidden=12, n_layers=2, kernel_size=3, n_heads=2, max_seq_len=16)


def _setup(variant: str = "pcaf", profile: str = "reference_jax"):
    model = ModelConfig(variant=variant, **SMALL)
    memory = MemoryConfig(route="hybrid", semantic_buckets=5)
    return model, memory, get_profile(profile)


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
@pytest.mark.parametrize("profile", ["reference_jax", "reference_torch"])
def test_load_then_export_is_the_identity(variant: str, profile: str) -> None:
    model, memory, prof = _setup(variant, profile)
    params = init_params(model, memory, prof, seed=5)
    rng = np.random.default_rng(0)
    params = {k: v + 0.1 * rng.normal(size=v.shape) for k, v in params.items()}
    net = load_canonical(build_model(model, memory, prof, dtype=torch.float64), params)
    out = to_canonical(net)
    assert list(out) == list(param_shapes(model, memory, prof))
    for name, value in params.items():
        np.testing.assert_array_equal(out[name], value, err_msg=name)
        assert out[name].flags.c_contiguous


def test_torch_layouts_are_the_documented_transforms() -> None:
    model, memory, prof = _setup("pcaf")
    params = init_params(model, memory, prof, seed=1)
    net = load_canonical(build_model(model, memory, prof, dtype=torch.float64), params)
    torch.testing.assert_close(net.blocks[0].mlp_in.weight, torch.tensor(params["blocks.0.mlp_in.weight"]).T)
    conv = params["blocks.0.conv.weight"]  # [k, d] by lag; torch taps run oldest first
    torch.testing.assert_close(net.blocks[0].conv.weight[:, 0, :], torch.tensor(conv[::-1].T.copy()))
    assert net.memory.recency_scale.shape == ()


def test_safetensors_round_trip(tmp_path) -> None:
    model, memory, prof = _setup("pcaf")
    src = build_model(model, memory, prof, seed=1)
    path = save_safetensors(tmp_path / "sub" / "w.safetensors", src, metadata={"step": 7})
    dst = load_safetensors(path, build_model(model, memory, prof, seed=2))
    a, b = to_canonical(src), to_canonical(dst)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    raw = safetensors.numpy.load_file(str(path))
    assert set(raw) == set(param_shapes(model, memory, prof))
    assert raw["memory.recency_scale"].shape == ()
    assert raw["blocks.0.conv.weight"].shape == (3, 8)  # canonical, not torch, layout
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pcaf-canonical", "step": "7"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["w.safetensors"]  # no temporary left


def test_safetensors_overwrite_is_atomic(tmp_path, monkeypatch) -> None:
    model, memory, prof = _setup("local_conv", "corrected")
    path = tmp_path / "w.safetensors"
    first = build_model(model, memory, prof, seed=1)
    save_safetensors(path, first)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(path, build_model(model, memory, prof, seed=2))
    assert path.read_bytes() == before  # the old file survives a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_cross_dtype_and_bf16_export(tmp_path) -> None:
    model, memory, prof = _setup("transformer_dense", "corrected")
    src = build_model(model, memory, prof, dtype=torch.bfloat16)
    canon = to_canonical(src)
    assert canon["embed.weight"].dtype == np.float32  # NumPy has no bfloat16
    dst = load_canonical(build_model(model, memory, prof, dtype=torch.float64), canon)
    assert dst.embed.weight.dtype == torch.float64
    torch.testing.assert_close(dst.embed.weight, src.embed.weight.double())


def test_missing_extra_and_misshaped_keys_fail_loudly(tmp_path) -> None:
    model, memory, prof = _setup("pcaf")
    net = build_model(model, memory, prof, seed=3)
    good = to_canonical(net)
    before = {k: v.copy() for k, v in good.items()}

    missing = {k: v for k, v in good.items() if k != "gate.out.bias"}
    with pytest.raises(ValueError, match=r"missing: \['gate.out.bias'\]"):
        load_canonical(net, missing)
    with pytest.raises(ValueError, match=r"unexpected: \['extra.weight'\]"):
        load_canonical(net, {**good, "extra.weight": np.zeros(3)})
    wrong = {**{k: v + 1 for k, v in good.items()}, "head.out.weight": np.zeros((20, 12))}
    with pytest.raises(ValueError, match=r"head.out.weight: got \(20, 12\), expected \(12, 20\)"):
        load_canonical(net, wrong)
    # nothing was copied by the failed loads
    assert all(np.array_equal(to_canonical(net)[k], before[k]) for k in before)

    path = tmp_path / "partial.safetensors"
    safetensors.numpy.save_file(missing, str(path), metadata=FORMAT_TAG)
    with pytest.raises(ValueError, match="gate.out.bias"):
        load_safetensors(path, net)
    # a file written for another configuration (no router under reference_torch's context model)
    other_model, other_memory, other_prof = model, MemoryConfig(route="context"), get_profile("reference_torch")
    other = build_model(other_model, other_memory, other_prof)
    save_safetensors(tmp_path / "other.safetensors", other)
    with pytest.raises(ValueError, match="missing: .*memory.router"):
        load_safetensors(tmp_path / "other.safetensors", net)


def test_generic_module_round_trip() -> None:
    # Modules without a configuration derive their canonical shapes from their parameters.
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Conv1d(4, 4, 2, groups=4))
    assert canonical_shapes(module) == {"0.weight": (3, 4), "0.bias": (4,), "1.weight": (2, 4), "1.bias": (4,)}
    canon = to_canonical(module)
    clone = load_canonical(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Conv1d(4, 4, 2, groups=4)), canon)
    for p, q in zip(module.parameters(), clone.parameters()):
        torch.testing.assert_close(p, q)
