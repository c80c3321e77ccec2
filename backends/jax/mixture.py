"""Scores → cache weights → p_cache; gate masking; the mixture and its accuracy in jnp, equal to
:mod:`pcaf_core.mixture` (which also states the backends' target-entry loss path and :func:`safe_log`; mirrors
:mod:`backends.torch.mixture`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from backends.jax.ops import argmax_last, band_gather_dot, banded_dot, batch_gather, gather_dot
from backends.jax.routing import Candidates
from pcaf_core.mixture import AR_PROB_FLOOR, GATE_CLIP, MASKED_SCORE, NT_CACHE_FLOOR, SEMANTIC_OVERLAP_FLOOR
from pcaf_core.routing import ScoreBand


def safe_log(x: jax.Array) -> jax.Array:
    """``log x`` with ``log 0 = -inf`` and a zero (not NaN) gradient there."""
    pos = x > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, x, jnp.ones_like(x))), -jnp.inf)


def selection_score(query: jax.Array, keys: jax.Array, recency: jax.Array, rho: float | jax.Array) -> jax.Array:
    """See :func:`pcaf_core.mixture.selection_score`."""
    return jnp.einsum("bqd,btd->bqt", query, keys) / math.sqrt(query.shape[-1]) + rho * recency


def candidate_scores(
    query: jax.Array,
    keys: jax.Array,
    recency: jax.Array,
    rho: jax.Array | float,
    cand: Candidates,
    router_probs: jax.Array | None = None,
    query_router_probs: jax.Array | None = None,
    semantic_score_scale: float = 0.0,
    *,
    band: ScoreBand | None = None,
) -> jax.Array:
    """See :func:`pcaf_core.mixture.candidate_scores` (the backends' form, with ``router_probs`` and ``band``).

    A band with a ``width`` (the ``topk_score`` window) reads the picks off the route's window
    (:func:`backends.jax.ops.band_gather_dot`) at the route's ``HIGHEST`` precision.
    """
    idx = jnp.maximum(cand.index, 0)
    rec = recency[idx] if recency.ndim == 1 else batch_gather(recency, idx)
    C = idx.shape[-1]

    def dot(x: jax.Array, y: jax.Array) -> jax.Array:
        if band is None:
            return gather_dot(x, y, idx)
        order, rank = band.layout.order, band.layout.rank
        if band.width is None:
            return banded_dot(order, rank, x, y, C)
        # The route scored this same window at HIGHEST precision (its proof needs exact float32); the same
        # precision here makes the two forward GEMMs identical, so XLA computes them once inside a jitted step.
        return band_gather_dot(order, rank, x, y, cand.index, band.width, precision=jax.lax.Precision.HIGHEST)

    s = dot(query, keys) / math.sqrt(query.shape[-1]) + rho * rec
    if router_probs is not None:
        if query_router_probs is None:
            raise ValueError("the semantic route term needs query_router_probs [B, Q, S] with router_probs")
        m = dot(query_router_probs, router_probs)
        s = s + semantic_score_scale * jnp.log(jnp.maximum(m, SEMANTIC_OVERLAP_FLOOR))
    return s


def cache_weights(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """See :func:`pcaf_core.mixture.cache_weights`."""
    top = jax.lax.stop_gradient(jnp.max(jnp.where(valid, scores, MASKED_SCORE), axis=-1, keepdims=True))
    # exp(-inf) = 0 with a zero gradient: junk scores of empty slots never reach the softmax.
    e = jnp.exp(jnp.where(valid, scores - top, -jnp.inf))
    z = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.maximum(z, jnp.finfo(scores.dtype).tiny)


def cache_distribution(weights: jax.Array, cand_values: jax.Array, valid: jax.Array, vocab_size: int) -> jax.Array:
    """See :func:`pcaf_core.mixture.cache_distribution`."""
    B, Q, _ = weights.shape
    b = jnp.arange(B)[:, None, None]
    q = jnp.arange(Q)[None, :, None]
    p = jnp.zeros((B, Q, vocab_size), dtype=weights.dtype)
    return p.at[b, q, jnp.maximum(cand_values, 0)].add(jnp.where(valid, weights, 0.0))


def target_cache_prob(weights: jax.Array, cand_values: jax.Array, valid: jax.Array, targets: jax.Array) -> jax.Array:
    """``p_cache(y)`` at the targets, ``[B, Q]`` (:mod:`pcaf_core.mixture`, "Backends")."""
    hit = valid & (cand_values == targets[..., None])
    return jnp.sum(jnp.where(hit, weights, 0.0), axis=-1)


def mask_gate(raw_gate: jax.Array, any_valid: jax.Array, *, clip_when_empty: bool, per_term: bool = False
              ) -> jax.Array:
    """See :func:`pcaf_core.mixture.mask_gate`."""
    lam = raw_gate * any_valid.astype(raw_gate.dtype)
    if per_term:
        return lam
    clipped = jnp.clip(lam, GATE_CLIP, 1.0 - GATE_CLIP)
    return clipped if clip_when_empty else jnp.where(any_valid, clipped, jnp.zeros_like(clipped))


def gate_log_weights(gate: jax.Array, *, per_term: bool) -> tuple[jax.Array, jax.Array]:
    """See :func:`pcaf_core.mixture.gate_log_weights`."""
    if per_term:
        return jnp.log1p(-jnp.minimum(gate, 1.0 - GATE_CLIP)), jnp.log(jnp.maximum(gate, GATE_CLIP))
    return jnp.log1p(-gate), safe_log(gate)


def mixture_log_probs(param_log_probs: jax.Array, p_cache: jax.Array, gate: jax.Array, *, nt_floor: bool,
                      gate_per_term: bool = False) -> jax.Array:
    """See :func:`pcaf_core.mixture.mixture_log_probs`."""
    log_keep, log_gate = gate_log_weights(gate[..., None], per_term=gate_per_term)
    cache = jnp.maximum(p_cache, NT_CACHE_FLOOR) if nt_floor else p_cache
    return jnp.logaddexp(log_keep + param_log_probs, log_gate + safe_log(cache))


def renormalised_target_log_prob(mixture_lp: jax.Array, targets: jax.Array) -> jax.Array:
    """See :func:`pcaf_core.mixture.renormalised_target_log_prob`."""
    picked = jnp.take_along_axis(mixture_lp, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(mixture_lp, axis=-1)


def target_log_prob(
    param_log_prob: jax.Array,
    p_cache: jax.Array,
    gate: jax.Array,
    *,
    nt_floor: bool,
    ar_floor: bool,
    mode: str,
    gate_per_term: bool = False,
) -> jax.Array:
    """See :func:`pcaf_core.mixture.target_log_prob` (the backends' form, from the target entries)."""
    if mode == "nt" and nt_floor:
        p_cache = jnp.maximum(p_cache, NT_CACHE_FLOOR)
    if mode == "ar" and ar_floor:
        return jnp.log(jnp.maximum((1.0 - gate) * jnp.exp(param_log_prob) + gate * p_cache, AR_PROB_FLOOR))
    log_keep, log_gate = gate_log_weights(gate, per_term=gate_per_term and mode == "nt")
    return jnp.logaddexp(log_keep + param_log_prob, log_gate + safe_log(p_cache))


def predictions(mixture_lp: jax.Array | None, param_log_probs: jax.Array, *, parametric_only: bool) -> jax.Array:
    """See :func:`pcaf_core.mixture.predictions`; int32."""
    src = param_log_probs if parametric_only else mixture_lp
    if src is None:
        raise ValueError("mixture predictions need the mixture log-probs")
    return argmax_last(src)
