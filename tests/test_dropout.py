"""Training-mode dropout (:mod:`pcaf_core.dropout`) on both backends.

* The rule: the threshold and scale of a rate; rates outside [0, 1) are refused.
* Torch's and JAX's layers compute the spec's :func:`~pcaf_core.dropout.dropout` from the levels they drew
  (torch: the signed 16-bit halves of its ``randint`` words; JAX: :func:`backends.jax.dropout.dropout_levels`).
* JAX's levels: two from each 32-bit word, any last axis (odd, one element, a scalar), the rate within 4
  standard errors; a mask split over 4 devices equals one device's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from backends.jax import dropout as jax_dropout
from backends.torch.dropout import Dropout as TorchDropout
from pcaf_core.dropout import DROPOUT_LEVELS, dropout, dropout_scale, dropout_threshold


def test_rule_threshold_scale_and_refusals() -> None:
    assert dropout_threshold(0.1) == 6554 and dropout_threshold(0.0) == 0
    assert dropout_scale(0.1) == DROPOUT_LEVELS / (DROPOUT_LEVELS - 6554)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = dropout(x, np.array([0, 6553, 6554]), 0.1)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [0.0, 0.0, np.float32(3.0 * dropout_scale(0.1))])
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="outside \\[0, 1\\)"):
            dropout_threshold(bad)
    with pytest.raises(ValueError, match="shape"):
        dropout(x, np.zeros(4, np.int64), 0.1)


def test_torch_layer_is_the_rule_on_its_draws() -> None:
    drop = TorchDropout(0.1).train()
    x = torch.randn(3, 7, dtype=torch.float64)  # 21 elements: half of the last word is unused
    torch.manual_seed(11)
    words = torch.randint(-(2**31), 2**31, (11,), dtype=torch.int32)
    levels = words.view(torch.int16)[:21].to(torch.int64).view(3, 7) + DROPOUT_LEVELS // 2
    torch.manual_seed(11)
    out = drop(x)
    np.testing.assert_array_equal(out.numpy(), dropout(x.numpy(), levels.numpy(), 0.1))


_original_levels = jax_dropout.dropout_levels


def test_jax_layer_is_the_rule_on_its_levels(monkeypatch) -> None:
    drawn = []

    def recording(key, shape):
        levels = _original_levels(key, shape)
        drawn.append(np.asarray(levels))
        return levels

    monkeypatch.setattr(jax_dropout, "dropout_levels", recording)
    layer = jax_dropout.Dropout(0.25)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 9))
    out = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})
    assert len(drawn) == 1 and drawn[0].dtype == np.uint16 and drawn[0].shape == (4, 9)
    np.testing.assert_array_equal(np.asarray(out), dropout(np.asarray(x), drawn[0], 0.25))
    assert layer.apply({}, x, deterministic=True) is x
    assert jax_dropout.Dropout(0.0).apply({}, x, deterministic=False) is x
    with pytest.raises(ValueError, match="outside \\[0, 1\\)"):
        jax_dropout.Dropout(1.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})


def test_jax_calls_draw_fresh_masks() -> None:
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            drop = jax_dropout.Dropout(0.5)
            return drop(x, deterministic=False), drop(x, deterministic=False)

    a, b = Twice().apply({}, jnp.ones((64,)), rngs={"dropout": jax.random.PRNGKey(1)})
    assert not np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape", [(3, 5), (2, 1), (4, 8), (7,), (), (0, 5), (3, 0)])
def test_jax_levels_take_two_from_each_word(shape) -> None:
    key = jax.random.PRNGKey(5)
    levels = np.asarray(jax_dropout.dropout_levels(key, shape))
    assert levels.dtype == np.uint16 and levels.shape == shape
    if not shape:
        return
    *lead, last = shape
    words = np.asarray(jax.random.bits(key, (*lead, (last + 1) // 2), jnp.uint32))
    # Each word's low half is the first of its two levels (the little-endian bitcast).
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(*lead, 2 * words.shape[-1])[..., :last]
    np.testing.assert_array_equal(levels, halves)


def test_jax_rate_within_four_standard_errors() -> None:
    n = 1_000_001
    kept = np.asarray(jax_dropout.dropout_levels(jax.random.PRNGKey(2), (n,))) >= dropout_threshold(0.1)
    rate = 1 - kept.mean()
    assert abs(rate - 6554 / DROPOUT_LEVELS) < 4 * (0.1 * 0.9 / n) ** 0.5


_SHARDED = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from backends.jax.dropout import dropout_levels
    assert jax.device_count() == 4
    key = jax.random.PRNGKey(7)
    one = np.asarray(jax.jit(lambda k: dropout_levels(k, (8, 5, 6)))(key))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    split = jax.jit(lambda k: dropout_levels(k, (8, 5, 6)), out_shardings=NamedSharding(mesh, P("data")))(key)
    assert len(split.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(split), one)
    print("ok")
""")


@pytest.mark.slow
def test_jax_mask_split_over_devices_is_one_devices_mask() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
