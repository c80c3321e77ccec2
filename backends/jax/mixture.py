"""Scores → cache weights → p_cache; gate masking; the mixture and its accuracy (mirrors
:mod:`pcaf_core.mixture` and :mod:`backends.torch.mixture`).

Shapes: B sequences, Q queries per sequence (1 in NT mode, T in AR mode), C candidate slots, V vocab.
The loss needs only the target entries, so :func:`target_cache_prob` and :func:`target_log_prob` work
on ``[B, Q]`` values and the ``[B, Q, V]`` arrays (:func:`cache_distribution`,
:func:`mixture_log_probs`) are built only when a caller asks for full distributions.

Logs of quantities that can be exactly 0 (an empty query's gate, a target the cache never saw) go
through :func:`safe_log`, so their -inf never turns into a NaN gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from backends.jax.ops import band_gather_dot, banded_dot, batch_gather, gather_dot
from backends.jax.routing import Candidates
from pcaf_core.mixture import AR_PROB_FLOOR, GATE_CLIP, MASKED_SCORE, NT_CACHE_FLOOR, SEMANTIC_OVERLAP_FLOOR
from pcaf_core.routing import ScoreBand


def safe_log(x: jax.Array) -> jax.Array:
    """``log x`` with ``log 0 = -inf`` and a zero (not NaN) gradient there."""
    pos = x > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, x, jnp.ones_like(x))), -jnp.inf)


def selection_score(query: jax.Array, keys: jax.Array, recency: jax.Array, rho: float | jax.Array) -> jax.Array:
    """Dense ranking score ``q_t·k_s/√d + ρ·r_s``, ``[B, Q, T]`` (the routes avoid it; kept for tests)."""
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
    """Score of each slot: ``q·k_s/√d + ρ·r_s [+ λ_sem·log(max(m_s, 1e-6))]``, ``[B, Q, C]``.

    query ``[B, Q, d]``, keys ``[B, T, d]``, recency ``[T]`` (or ``[B, T]`` when the records of each sequence
    sit at their own positions, as in a receptive-field sub-sequence). The route term (semantic and hybrid
    routes) needs ``router_probs`` ``[B, T, S]`` and the queries' ``query_router_probs`` ``[B, Q, S]``; the
    overlap ``m_s = r̃_q·r̃_s`` is computed for the selected slots only. Empty slots hold junk; mask them.

    ``band``: for full-AR queries, the :class:`ScoreBand` of the layout ``cand`` was read from; the products
    are then blocked GEMMs (:func:`backends.jax.ops.banded_dot`, :func:`backends.jax.ops.band_gather_dot`)
    instead of row gathers. Same values on the valid slots.
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
    """α = softmax over the valid slots; all zeros where no slot is valid. ``[B, Q, C]``."""
    top = jax.lax.stop_gradient(jnp.max(jnp.where(valid, scores, MASKED_SCORE), axis=-1, keepdims=True))
    # exp(-inf) = 0 with a zero gradient: junk scores of empty slots never reach the softmax.
    e = jnp.exp(jnp.where(valid, scores - top, -jnp.inf))
    z = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.maximum(z, jnp.finfo(scores.dtype).tiny)


def cache_distribution(weights: jax.Array, cand_values: jax.Array, valid: jax.Array, vocab_size: int) -> jax.Array:
    """``p_cache(y) = Σ_i α_i·1[v_i = y]``: ``[B, Q, V]`` from weights and slot values ``[B, Q, C]``."""
    B, Q, _ = weights.shape
    b = jnp.arange(B)[:, None, None]
    q = jnp.arange(Q)[None, :, None]
    p = jnp.zeros((B, Q, vocab_size), dtype=weights.dtype)
    return p.at[b, q, jnp.maximum(cand_values, 0)].add(jnp.where(valid, weights, 0.0))


def target_cache_prob(weights: jax.Array, cand_values: jax.Array, valid: jax.Array, targets: jax.Array) -> jax.Array:
    """``p_cache(y)`` at the targets only: ``[B, Q]``, without a ``[B, Q, V]`` array."""
    hit = valid & (cand_values == targets[..., None])
    return jnp.sum(jnp.where(hit, weights, 0.0), axis=-1)


def mask_gate(raw_gate: jax.Array, any_valid: jax.Array, *, clip_when_empty: bool, per_term: bool = False
              ) -> jax.Array:
    """Gate λ masked by "any valid candidate" and clipped to [1e-5, 1 - 1e-5]; ``[B, Q]``.

    ``clip_when_empty`` (reference) clips after masking, so an empty query keeps λ = 1e-5; otherwise the
    gate of an empty query is exactly 0. ``per_term``: returned unclipped (:func:`gate_log_weights`).
    """
    lam = raw_gate * any_valid.astype(raw_gate.dtype)
    if per_term:
        return lam
    clipped = jnp.clip(lam, GATE_CLIP, 1.0 - GATE_CLIP)
    return clipped if clip_when_empty else jnp.where(any_valid, clipped, jnp.zeros_like(clipped))


def gate_log_weights(gate: jax.Array, *, per_term: bool) -> tuple[jax.Array, jax.Array]:
    """``(log w_param, log w_cache)``: ``(log(1-λ), log λ)``, or with ``per_term`` (reference PyTorch NT)
    ``(log1p(-min(λ, 1-1e-5)), log(max(λ, 1e-5)))``, each shaped like ``gate``."""
    if per_term:
        return jnp.log1p(-jnp.minimum(gate, 1.0 - GATE_CLIP)), jnp.log(jnp.maximum(gate, GATE_CLIP))
    return jnp.log1p(-gate), safe_log(gate)


def mixture_log_probs(param_log_probs: jax.Array, p_cache: jax.Array, gate: jax.Array, *, nt_floor: bool,
                      gate_per_term: bool = False) -> jax.Array:
    """``log[(1-λ)·p_param + λ·p_cache]`` over the vocabulary, ``[B, Q, V]``.

    With ``nt_floor`` (reference NT) p_cache is floored at 1e-6 on every entry (unnormalised result).
    """
    log_keep, log_gate = gate_log_weights(gate[..., None], per_term=gate_per_term)
    cache = jnp.maximum(p_cache, NT_CACHE_FLOOR) if nt_floor else p_cache
    return jnp.logaddexp(log_keep + param_log_probs, log_gate + safe_log(cache))


def renormalised_target_log_prob(mixture_lp: jax.Array, targets: jax.Array) -> jax.Array:
    """``log_softmax(mixture_lp)[target]``, ``[B, Q]``: the reference PyTorch NT loss (a cross-entropy
    over the unnormalised log-mixture ``[B, Q, V]``)."""
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
    """log p(y) of each target as the loss uses it, ``[B, Q]``, from the target entries.

    Args:
        param_log_prob: ``[B, Q]`` parametric log-prob of the target; p_cache: ``[B, Q]`` p_cache(target);
        gate: ``[B, Q]`` masked λ.
    NT: ``logaddexp(log(1-λ) + lp_y, log λ + log pc_y)`` (pc_y floored at 1e-6 under ``nt_floor``; gate
    terms per :func:`gate_log_weights`). AR with ``ar_floor`` (reference):
    ``log(max((1-λ)·exp(lp_y) + λ·pc_y, 1e-8))``; otherwise the exact log. (The re-normalised NT loss
    needs the whole vocabulary: :func:`renormalised_target_log_prob`.)
    """
    if mode == "nt" and nt_floor:
        p_cache = jnp.maximum(p_cache, NT_CACHE_FLOOR)
    if mode == "ar" and ar_floor:
        return jnp.log(jnp.maximum((1.0 - gate) * jnp.exp(param_log_prob) + gate * p_cache, AR_PROB_FLOOR))
    log_keep, log_gate = gate_log_weights(gate, per_term=gate_per_term and mode == "nt")
    return jnp.logaddexp(log_keep + param_log_prob, log_gate + safe_log(p_cache))


def predictions(mixture_lp: jax.Array | None, param_log_probs: jax.Array, *, parametric_only: bool) -> jax.Array:
    """Predicted token per query, ``[B, Q]`` int32: argmax (first maximum) of the mixture, or of the
    parametric head only (the reference's full-AR accuracy)."""
    src = param_log_probs if parametric_only else mixture_lp
    if src is None:
        raise ValueError("mixture predictions need the mixture log-probs")
    return jnp.argmax(src, axis=-1).astype(jnp.int32)
