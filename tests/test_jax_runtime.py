"""Process-wide XLA:CPU settings of the JAX backend (backends/jax/runtime.py): importing ``backends.jax``
turns asynchronous CPU dispatch off before JAX creates its CPU client, unless PCAF_JAX_CPU_ASYNC_DISPATCH=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.jax.runtime import ASYNC_DISPATCH_ENV

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import jax
from jax._src import xla_bridge
import backends.jax
assert not xla_bridge.backends_are_initialized(), "importing backends.jax created a JAX client"
jax.devices()  # the client is created now, with the setting in force
print(jax.config.values["jax_cpu_enable_async_dispatch"])
"""


@pytest.mark.slow
@pytest.mark.parametrize(("env_value", "expected"), [(None, "False"), ("1", "True")])
def test_import_sets_cpu_dispatch_before_the_client_exists(env_value: str | None, expected: str) -> None:
    """Off by default and on when asked, in a fresh interpreter: the import sets it before the client exists.
    (How every accepted value reads is test_each_accepted_setting_reads_as_on_or_off's, in this process.)"""
    env = {k: v for k, v in os.environ.items() if k != ASYNC_DISPATCH_ENV}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    if env_value is not None:
        env[ASYNC_DISPATCH_ENV] = env_value  # the user's choice stands
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize(("env_value", "expected"), [("0", False), ("yes", True), (" True ", True), ("no", False),
                                                    ("", False)])
def test_each_accepted_setting_reads_as_on_or_off(monkeypatch, env_value: str, expected: bool) -> None:
    """configure_cpu_dispatch maps the variable to JAX's setting (here, after this process's client exists, the
    setting has no effect on it; it is restored)."""
    import jax

    from backends.jax.runtime import configure_cpu_dispatch

    monkeypatch.setenv(ASYNC_DISPATCH_ENV, env_value)
    before = jax.config.values["jax_cpu_enable_async_dispatch"]
    try:
        assert configure_cpu_dispatch() is expected
        assert jax.config.values["jax_cpu_enable_async_dispatch"] is expected
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", before)


def test_a_bad_setting_is_refused_in_one_line(monkeypatch) -> None:
    from backends.jax.runtime import configure_cpu_dispatch

    monkeypatch.setenv(ASYNC_DISPATCH_ENV, "sometimes")
    with pytest.raises(ValueError, match=rf"^{ASYNC_DISPATCH_ENV}='sometimes': set it to 1 .* or 0 [^\n]*$"):
        configure_cpu_dispatch()
