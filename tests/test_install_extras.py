"""The accelerator extras of pyproject.toml (``gpu``, ``tpu``) install JAX's plugin at exactly the JAX release the
core dependencies pin: a plugin of another release would replace the pinned jaxlib, or fail to load beside it. Their
resolution against PyPI was checked by hand with ``pip install --dry-run``; it downloads the CUDA libraries' metadata,
so it is not a test. The README names each extra."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
JAX_PIN = re.compile(r"jax\[(?P<extra>[\w-]+)\]==(?P<version>[\w.]+)")


def _jax_pins(requirements: list[str]) -> dict[str, str]:
    return {m["extra"]: m["version"] for r in requirements if (m := JAX_PIN.fullmatch(r.replace(" ", "")))}


def test_the_accelerator_extras_pin_the_core_jax_release():
    (core,) = _jax_pins(PROJECT["dependencies"]).values()
    extras = PROJECT["optional-dependencies"]
    assert _jax_pins(extras["gpu"]) == {"cuda13": core}
    assert _jax_pins(extras["tpu"]) == {"tpu": core}


def test_the_readme_says_how_to_install_each_accelerator_extra():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    core = next(iter(_jax_pins(PROJECT["dependencies"]).values()))
    for extra, jax_extra in (("gpu", "cuda13"), ("tpu", "tpu")):
        assert f"EXTRAS={extra}" in readme and f"jax[{jax_extra}]=={core}" in readme, extra
