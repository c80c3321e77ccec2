"""A JAX model's inputs and outputs (mirrors :mod:`backends.torch.model_io`): the checks of ``tokens`` and
``targets`` that need no device values, and the output pytrees :class:`JaxForwardOutput` and
:class:`JaxMemoryTrace` whose fields mirror :class:`pcaf_core.reference.ForwardOutput`."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from backends.jax import records
from backends.jax.routing import Candidates
from pcaf_core.config import ModelConfig, ProfileConfig
from pcaf_core.params import has_positional_table


@flax.struct.dataclass
class JaxMemoryTrace:
    """The fields of :class:`backends.torch.model_io.TorchMemoryTrace` as a pytree (``addresses`` int32)."""

    addresses: jax.Array
    cand: Candidates
    scores: jax.Array
    cache_weights: jax.Array
    gate: jax.Array
    p_cache: jax.Array | None
    router_probs: jax.Array | None
    topk_dense: jax.Array | None = None


@flax.struct.dataclass
class JaxForwardOutput:
    """The fields of :class:`backends.torch.model_io.TorchForwardOutput` as a pytree (``loss`` a 0-d array), plus
    ``prediction_mixture``: ``[B, Q]`` int32 argmax of the predictive distribution (the mixture for cache models,
    the head otherwise) and ``prediction_param``: ``[B, Q]`` int32 argmax of the parametric head; the three
    predictions are None when not requested."""

    hidden: jax.Array
    param_log_probs: jax.Array | None
    log_probs: jax.Array | None
    target_log_prob: jax.Array | None
    prediction: jax.Array | None
    prediction_mixture: jax.Array | None
    prediction_param: jax.Array | None
    memory: JaxMemoryTrace | None
    loss: jax.Array | None


def check_inputs(model: ModelConfig, profile: ProfileConfig, tokens: Any, targets: Any, mode: str
                 ) -> tuple[jax.Array, jax.Array | None]:
    """Check the static properties of ``tokens [B, T]`` and ``targets`` (NT ``[B]`` or ``[B, 1]``, AR
    ``[B, T]``): dtype, shape, mode, T within the positional table; return them as arrays with targets
    reshaped to ``[B, Q]``. Raises ValueError naming the bad value and its limit.

    Token-id ranges are not checked (they would need the values: no device sync, no check under jit);
    the training loop validates each batch once on the host (:func:`pcaf_core.batches.check_batch`).
    """
    records.check_mode(mode)
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, T], got dtype {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [B, T] with B >= 1 and T >= 1, got shape {tuple(tokens.shape)}")
    B, T = tokens.shape
    if has_positional_table(model, profile) and T > model.max_seq_len:
        raise ValueError(f"sequence length T={T} exceeds model.max_seq_len={model.max_seq_len} "
                         "(the trainable positional table's rows)")
    if targets is None:
        return tokens, None
    targets = jnp.asarray(targets)
    Q = 1 if mode == "nt" else T
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be an integer array, got dtype {targets.dtype}")
    if targets.size != B * Q:
        want = "[B] or [B, 1]" if mode == "nt" else "[B, T]"
        raise ValueError(f"{mode} targets must be {want} = {B * Q} ids, got shape {tuple(targets.shape)}")
    return tokens, targets.reshape(B, Q)
