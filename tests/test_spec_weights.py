"""Canonical safetensors I/O shared by every backend (pcaf_core.weights): tag, checks, atomicity."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy

from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.params import init_params, param_shapes
from pcaf_core.profiles import get_profile
from pcaf_core.weights import FORMAT_TAG, WeightsError, load_canonical, read_metadata, save_canonical

MODEL = ModelConfig(variant="pcaf", vocab_size=20, d_model=8, d_hidden=8, n_layers=1, max_seq_len=16)
MEMORY = MemoryConfig(route="hybrid")
PROFILE = get_profile("reference_jax")


@pytest.fixture()
def params() -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in init_params(MODEL, MEMORY, PROFILE, seed=1).items()}


def test_round_trip_is_bit_exact_and_tagged(tmp_path, params) -> None:
    path = save_canonical(tmp_path / "sub" / "w.safetensors", params, {"step": 7})
    assert read_metadata(path) == {**FORMAT_TAG, "step": "7"}
    back = load_canonical(path, param_shapes(MODEL, MEMORY, PROFILE))
    assert list(back) == list(param_shapes(MODEL, MEMORY, PROFILE))  # canonical order
    for k, v in params.items():
        assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes()
    assert [p.name for p in path.parent.iterdir()] == ["w.safetensors"]  # no temporary file left behind


def test_metadata_cannot_override_the_format_tag(tmp_path, params) -> None:
    path = save_canonical(tmp_path / "w.safetensors", params, {"format": "something-else"})
    assert read_metadata(path)["format"] == FORMAT_TAG["format"]


def test_foreign_damaged_and_missing_files_are_refused_with_one_line(tmp_path, params) -> None:
    foreign = tmp_path / "foreign.safetensors"
    safetensors.numpy.save_file(params, str(foreign))
    cases = [
        (foreign, "format tag None, not 'pcaf-canonical'.*convert it"),
        (tmp_path / "absent.safetensors", "no such weights file"),
    ]
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    cases.append((damaged, "not a readable safetensors file"))
    for path, pattern in cases:
        with pytest.raises(WeightsError, match=pattern) as err:
            load_canonical(path)
        assert "\n" not in str(err.value)


def test_non_float_and_non_finite_values_are_refused(tmp_path, params) -> None:
    ints = dict(params, **{"rho": np.array(3, np.int32)})
    save_canonical(tmp_path / "ints.safetensors", ints)
    with pytest.raises(WeightsError, match=r"non-float parameters \(rho: int32\)"):
        load_canonical(tmp_path / "ints.safetensors")
    nan = dict(params, **{"head.out.bias": np.full_like(params["head.out.bias"], np.nan)})
    save_canonical(tmp_path / "nan.safetensors", nan)
    with pytest.raises(WeightsError, match=r"NaN or infinite values in \['head.out.bias'\].*earlier checkpoint"):
        load_canonical(tmp_path / "nan.safetensors")


def test_expected_shapes_name_missing_extra_and_misshaped_keys(tmp_path, params) -> None:
    expected = param_shapes(MODEL, MEMORY, PROFILE)
    name = next(iter(expected))
    bad = {k: v for k, v in params.items() if k != name}
    save_canonical(tmp_path / "w.safetensors", bad)
    with pytest.raises(WeightsError, match=rf"missing: \['{name}'\]"):
        load_canonical(tmp_path / "w.safetensors", expected)
    save_canonical(tmp_path / "x.safetensors", {**params, "extra.weight": np.zeros(2, np.float32)})
    with pytest.raises(WeightsError, match=r"unexpected: \['extra.weight'\]"):
        load_canonical(tmp_path / "x.safetensors", expected)
