"""Training-mode dropout: :mod:`pcaf_core.dropout`'s rule on the ``"dropout"`` RNG stream."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from pcaf_core.dropout import dropout_scale, dropout_threshold


def dropout_levels(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform 16-bit levels ``shape`` uint16 (:mod:`pcaf_core.dropout`), two from each 32-bit word that
    ``jax.random.bits`` draws from ``key``: half the threefry blocks of one word an element, which is what
    ``flax.linen.Dropout``'s Bernoulli draw costs.

    The words are drawn in ``shape`` with its last axis halved (rounded up), and each word's two halves are the
    neighbouring levels of that axis: every leading axis stays as it is, so a mask of a batch split over
    devices is the one a single device draws (JAX's partitionable threefry), split the same way."""
    if not shape:
        return jax.random.bits(key, (), jnp.uint16)
    last = shape[-1]
    pairs = (last + 1) // 2
    words = jax.random.bits(key, (*shape[:-1], pairs), jnp.uint32)
    levels = jax.lax.bitcast_convert_type(words, jnp.uint16)  # [..., pairs, 2]
    return levels.reshape(*shape[:-1], 2 * pairs)[..., :last]


class Dropout(nn.Module):
    """The dropout of :mod:`pcaf_core.dropout` at ``rate``, active only with ``deterministic=False``; each call
    draws a fresh key from the module's ``"dropout"`` RNG stream."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        threshold = dropout_threshold(self.rate)  # refuses a rate outside [0, 1)
        if deterministic or threshold == 0:
            return x
        keep = dropout_levels(self.make_rng("dropout"), x.shape) >= threshold
        return jnp.where(keep, x * jnp.asarray(dropout_scale(self.rate), x.dtype), jnp.zeros((), x.dtype))
