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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (-0.0 and 0.0 told apart)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; on a CPU the Triton interpreter runs the kernel")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_mask_kernel_is_the_aten_mask_bit_for_bit(monkeypatch, dtype, device) -> None:
    """``pcaf::dropout_mask`` (the CUDA path; on a CPU run by the Triton interpreter) against the ATen mask: the
    same outputs and input gradients, bit for bit (NaN where ATen's are NaN), over more than one program's block
    with a partial last one, and with negative zeros, NaN and infinities among the inputs."""
    from backends.torch import dropout as torch_dropout
    from backends.torch.kernels import dropout_mask as kernel

    assert kernel.triton is not None and torch_dropout.triton_enabled(torch.zeros(1, device=device))
    x = torch.randn(3, 7, 101).to(dtype)  # 2,121 elements: two programs of 2,048, the second partial
    x.view(-1)[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")]).to(dtype)
    x, g = x.to(device), torch.randn(3, 7, 101).to(dtype).to(device)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(torch_dropout, "kernels_by_default", lambda t, fused=fused: fused)
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(3)
        out = TorchDropout(0.3).train()(leaf)
        out.backward(g)
        results[fused] = (out.detach(), leaf.grad)
        assert (out.grad_fn.name() == "_LevelMaskBackward") == fused
    for a, b in zip(results[True], results[False]):
        nan = torch.isnan(b)
        assert a.dtype == dtype and torch.equal(torch.isnan(a), nan)
        assert torch.equal(_bits(a[~nan]), _bits(b[~nan]))
    assert torch.isnan(results[False][0]).sum() == 1  # x's NaN, kept or dropped (x · 0)
    dropped = results[False][0] == 0
    assert 0.2 < dropped.float().mean() < 0.4


def test_torch_mask_kernel_inputs_it_refuses_and_the_layers_fallback(monkeypatch) -> None:
    from backends.torch import dropout as torch_dropout
    from backends.torch.kernels.dropout_mask import dropout_mask

    levels = torch.zeros(6, dtype=torch.int16)
    with pytest.raises(ValueError, match="contiguous float32/bfloat16/float16"):
        dropout_mask(torch.zeros(6, dtype=torch.float64), levels, 0, 1.0)
    with pytest.raises(ValueError, match="contiguous float32/bfloat16/float16"):
        dropout_mask(torch.zeros(3, 2).t(), levels, 0, 1.0)
    with pytest.raises(ValueError, match="6 contiguous int16 levels"):
        dropout_mask(torch.zeros(6), levels[:5], 0, 1.0)
    # The layer keeps the ATen mask for what the kernel does not take: float64, non-contiguous inputs.
    monkeypatch.setattr(torch_dropout, "kernels_by_default", lambda t: True)
    for x in (torch.ones(4, 3, dtype=torch.float64, requires_grad=True), torch.ones(3, 4).t().requires_grad_(True)):
        assert TorchDropout(0.5).train()(x).grad_fn.name() == "_ScaledMaskBackward"
