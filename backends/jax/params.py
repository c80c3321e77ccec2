"""Canonical initialisation with ``jax.random`` (mirrors :mod:`backends.torch.params`).

``profile.init`` picks the scheme:

* ``jax_normal``: the canonical scheme of :func:`pcaf_core.params.init_params` (same distributions, JAX's
  own random stream): embeddings N(0, 0.02²); Linear weights N(0, 1/fan_in), biases 0; conv N(0, 1/k),
  bias 0; LayerNorm gain 1, bias 0.
* ``torch_default``: the library defaults of the reference PyTorch modules: ``nn.Linear`` weight and
  bias U(±1/√fan_in); the depthwise ``nn.Conv1d`` likewise with fan_in = k; ``nn.Embedding`` N(0, 1);
  LayerNorm 1/0; the fused attention in-projection ``qkv`` Xavier-uniform over torch's ``[3d, d]`` with
  zero bias, and a zero ``attn.out`` bias (``nn.MultiheadAttention``).

Either way ρ starts at 1 and a trainable positional table at ``positional_scale``·sinusoids. Every
parameter draws from ``fold_in(PRNGKey(seed), i)`` with i its position in the canonical order, so the
values do not depend on which other parameters exist. The result is the FLAT canonical dict; feed it to
:func:`backends.jax.weights.to_variables`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pcaf_core.config import MemoryConfig, ModelConfig, ProfileConfig
from pcaf_core.params import param_shapes, sinusoidal_table

EMBED_STD = 0.02


def _is_matrix_weight(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and name != "embed.weight"


def _jax_normal(name: str, shape: tuple[int, ...], key: jax.Array, dtype: Any) -> jax.Array:
    if name == "embed.weight":
        return jax.random.normal(key, shape, dtype) * EMBED_STD
    if _is_matrix_weight(name, shape):  # Linear [in, out] and conv [k, d]: fan_in = shape[0]
        return jax.random.normal(key, shape, dtype) / math.sqrt(shape[0])
    if name.endswith(".weight"):  # LayerNorm gain
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)


def _uniform(key: jax.Array, shape: tuple[int, ...], bound: float, dtype: Any) -> jax.Array:
    return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)


def _torch_default(name: str, shape: tuple[int, ...], key: jax.Array, dtype: Any,
                   fan_in: dict[str, int]) -> jax.Array:
    if name == "embed.weight":
        return jax.random.normal(key, shape, dtype)
    if name.endswith("attn.qkv.weight"):  # xavier_uniform over torch's [3d, d]: fan_in d, fan_out 3d
        return _uniform(key, shape, math.sqrt(6.0 / (shape[0] + shape[1])), dtype)
    if name.endswith(("attn.qkv.bias", "attn.out.bias")):
        return jnp.zeros(shape, dtype)
    if _is_matrix_weight(name, shape):  # kaiming_uniform(a=√5): bound 1/√fan_in; conv fan_in = k
        return _uniform(key, shape, 1.0 / math.sqrt(shape[0]), dtype)
    if name.endswith(".bias") and name[: -len(".bias")] in fan_in:  # Linear / conv bias
        return _uniform(key, shape, 1.0 / math.sqrt(fan_in[name[: -len(".bias")]]), dtype)
    if name.endswith(".weight"):  # LayerNorm gain
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)  # LayerNorm bias


def init_params(
    model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig, seed: int = 0, dtype: Any = jnp.float32
) -> dict[str, jax.Array]:
    """Canonical ``name -> jax.Array`` (canonical names, layouts and order of
    :func:`pcaf_core.params.param_shapes`) drawn from ``jax.random.PRNGKey(seed)`` under ``profile.init``.

    Traceable: ``jax.eval_shape(lambda: init_params(...))`` gives the shapes without allocating weights.
    """
    shapes = param_shapes(model, memory, profile)
    # Biases of layers with a matrix weight draw from that layer's fan-in under torch_default.
    fan_in = {n[: -len(".weight")]: s[0] for n, s in shapes.items() if _is_matrix_weight(n, s)}
    root = jax.random.PRNGKey(seed)
    out: dict[str, jax.Array] = {}
    for i, (name, shape) in enumerate(shapes.items()):
        key = jax.random.fold_in(root, i)
        if name == "pos.table":
            w = jnp.asarray(sinusoidal_table(shape[0], shape[1], "trainable_jax") * profile.positional_scale, dtype)
        elif name == "memory.recency_scale":
            w = jnp.ones((), dtype)
        elif profile.init == "torch_default":
            w = _torch_default(name, shape, key, dtype, fan_in)
        else:
            w = _jax_normal(name, shape, key, dtype)
        out[name] = w
    return out
