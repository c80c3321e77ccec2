"""Process-wide oneMKL settings of the torch backend (backends/torch/runtime.py): importing ``backends.torch``
sets ``MKL_CBWR=AUTO`` on AMD CPUs before oneMKL's first call, keeps a value the environment sets, and leaves
other vendors on oneMKL's default. Checked on oneMKL's own report of each call (``MKL_VERBOSE=1``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backends.torch import runtime
from backends.torch.runtime import MKL_CBWR_BY_VENDOR, MKL_CBWR_ENV, configure_mkl
from pcaf_core.sysinfo import cpu_vendor

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import torch
import backends.torch
a = torch.randn(64, 64)
a @ a  # a float32 GEMM: oneMKL's sgemm in PyTorch's CPU wheels
"""


def _mkl_modes(env_value: str | None) -> list[str]:
    """The ``CNR:`` mode oneMKL reports for each call of the probe process."""
    env = {k: v for k, v in os.environ.items() if k != MKL_CBWR_ENV}
    env.update(MKL_VERBOSE="1", PYTHONPATH=str(ROOT))
    if env_value is not None:
        env[MKL_CBWR_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    modes = re.findall(r"^MKL_VERBOSE SGEMM\(.*\bCNR:(\S+)", out.stdout, flags=re.M)
    assert modes, f"oneMKL reported no SGEMM call:\n{out.stdout[-2000:]}"
    return modes


@pytest.mark.slow
def test_import_sets_the_vendors_mode_before_onemkls_first_call() -> None:
    expected = MKL_CBWR_BY_VENDOR.get(cpu_vendor() or "", "OFF")  # oneMKL reports its default as OFF
    assert set(_mkl_modes(None)) == {expected}


@pytest.mark.slow
def test_a_mode_in_the_environment_is_kept() -> None:
    assert set(_mkl_modes("COMPATIBLE")) == {"COMPATIBLE"}


@pytest.mark.parametrize(("vendor", "expected"), [("AuthenticAMD", "AUTO"), ("GenuineIntel", "unset"),
                                                  (None, "unset")])
def test_configure_mkl_by_vendor(monkeypatch, vendor: str | None, expected: str) -> None:
    monkeypatch.delenv(MKL_CBWR_ENV, raising=False)
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: vendor)
    assert configure_mkl() == expected
    assert os.environ.get(MKL_CBWR_ENV, "unset") == expected
    monkeypatch.setenv(MKL_CBWR_ENV, "AVX2")  # the user's choice wins on any vendor
    assert configure_mkl() == "AVX2"


def test_the_cpu_device_label_names_the_mode() -> None:
    """Run records carry the mode in their ``device`` text, after the part figure legends show."""
    from backends.torch.backend import TorchBackend

    device = TorchBackend("cpu").device
    assert f"; oneMKL MKL_CBWR={os.environ.get(MKL_CBWR_ENV, 'unset')}; " in device
    assert "MKL" not in device.split(";")[0]
