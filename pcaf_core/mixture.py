"""Scores → cache weights → p_cache; gate masking; the mixture and its accuracy (docs/REFERENCE_CODE.md §4).

Shapes: B sequences, Q queries per sequence (1 in NT mode, T in AR mode), C candidate slots, V vocab.

Backends. The loss needs only the target entries, so the backends' ``target_cache_prob`` (``p_cache(y)`` at the
targets) and ``target_log_prob`` work on ``[B, Q]`` values, and the ``[B, Q, V]`` arrays
(:func:`cache_distribution`, :func:`mixture_log_probs`) are built only when a caller asks for full
distributions. Logs of quantities that can be exactly 0 (an empty query's gate, a target the cache never saw)
go through each backend's ``safe_log`` (``log 0 = -inf`` with a zero gradient), so their -inf never turns into
a NaN gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pcaf_core.config import ProfileConfig
from pcaf_core.routing import Candidates

SEMANTIC_OVERLAP_FLOOR = 1e-6  # log(max(m, 1e-6)) in the route term
NT_CACHE_FLOOR = 1e-6  # reference NT: log(max(p_cache, 1e-6)) for every vocabulary entry
AR_PROB_FLOOR = 1e-8  # reference AR: log(max(p, 1e-8))
GATE_CLIP = 1e-5  # lambda is clipped to [1e-5, 1 - 1e-5]
MASKED_SCORE = -1e9


class MixtureRule(NamedTuple):
    """Which profile switches act in one mode: the spec and both backends read this, never the switches.

    nt_floor: ``p_cache`` floored at 1e-6 on every entry (NT). ar_floor: the probability-space AR target
    log-prob floored at 1e-8. gate_per_term: each gate term clamped on its own side (NT). renormalise:
    the NT loss re-normalises the log-mixture over the vocabulary. parametric_accuracy: accuracy is the
    argmax of the parametric head (AR).
    """

    nt_floor: bool
    ar_floor: bool
    gate_per_term: bool
    renormalise: bool
    parametric_accuracy: bool


def mixture_rule(profile: ProfileConfig, mode: str) -> MixtureRule:
    """The :class:`MixtureRule` of ``profile`` in ``mode`` (``nt`` or ``ar``)."""
    nt = mode == "nt"
    return MixtureRule(
        nt_floor=profile.nt_mixture_floor and nt,
        ar_floor=profile.ar_mixture_floor and not nt,
        gate_per_term=profile.nt_gate_per_term_clamp and nt,
        renormalise=profile.nt_loss_renormalise and nt,
        parametric_accuracy=profile.ar_accuracy_parametric_only and not nt,
    )


def selection_score(query: np.ndarray, keys: np.ndarray, recency: np.ndarray, rho: float) -> np.ndarray:
    """Ranking score of every record for every query: ``q_t·k_s/√d + ρ·r_s``.

    query: ``[B, Q, d]``; keys: ``[B, T, d]``; recency: ``[T]``. Returns ``[B, Q, T]``. √d uses d_model.
    The backends' routes never build this array; their ``selection_score`` is kept for tests.
    """
    d = query.shape[-1]
    return np.einsum("bqd,btd->bqt", query, keys) / np.sqrt(d) + rho * recency[None, None, :]


def candidate_scores(
    query: np.ndarray,
    keys: np.ndarray,
    recency: np.ndarray,
    rho: float,
    cand: Candidates,
    overlap: np.ndarray | None = None,
    semantic_score_scale: float = 0.0,
) -> np.ndarray:
    """Score of each candidate slot: ``q·k_s/√d + ρ·r_s [+ λ_sem·log(max(m_s, 1e-6))]``.

    The route term is added for semantic and hybrid routes (``overlap`` ``[B, Q, T]`` given), to every
    slot including the hybrid's context slots. Returns ``[B, Q, C]`` (empty slots hold junk; mask them).

    The backends take ``router_probs`` ``[B, T, S]`` and the queries' ``query_router_probs`` ``[B, Q, S]`` in
    place of ``overlap`` and compute ``m_s = r̃_q·r̃_s`` for the selected slots only. Their recency may also be
    ``[B, T]``, when the records of each sequence sit at their own positions (a receptive-field sub-sequence).
    Their ``band``, a :class:`~pcaf_core.routing.ScoreBand` of the layout ``cand`` was read from (full-AR
    queries), computes the products as blocked GEMMs instead of row gathers: the same values on the valid slots.
    """
    B, Q, d = query.shape
    idx = np.clip(cand.index, 0, None)
    b = np.arange(B)[:, None, None]
    k = keys[b, idx]  # [B, Q, C, d]
    s = np.einsum("bqd,bqcd->bqc", query, k) / np.sqrt(d) + rho * recency[idx]
    if overlap is not None:
        qi = np.arange(Q)[None, :, None]
        m = overlap[b, qi, idx]
        s = s + semantic_score_scale * np.log(np.maximum(m, SEMANTIC_OVERLAP_FLOOR))
    return s


def cache_weights(scores: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """α = softmax over the valid slots; all zeros where no slot is valid. ``[B, Q, C]``."""
    masked = np.where(valid, scores, -np.inf)
    top = np.max(np.where(valid, scores, MASKED_SCORE), axis=-1, keepdims=True)
    e = np.where(valid, np.exp(masked - top), 0.0)
    z = e.sum(-1, keepdims=True)
    return e / np.maximum(z, 1e-300)


def cache_distribution(weights: np.ndarray, cand_values: np.ndarray, valid: np.ndarray, vocab_size: int) -> np.ndarray:
    """``p_cache(y) = Σ_i α_i·1[v_i = y]``: ``[B, Q, V]`` from weights and slot values ``[B, Q, C]``."""
    B, Q, C = weights.shape
    p = np.zeros((B, Q, vocab_size), dtype=weights.dtype)
    bi, qi, ci = np.nonzero(valid)
    np.add.at(p, (bi, qi, cand_values[bi, qi, ci]), weights[bi, qi, ci])
    return p


def mask_gate(raw_gate: np.ndarray, any_valid: np.ndarray, *, clip_when_empty: bool, per_term: bool = False
              ) -> np.ndarray:
    """Gate λ masked by "any valid candidate" and clipped to [1e-5, 1 - 1e-5].

    The reference clips after masking, so an empty query keeps λ = 1e-5 (``clip_when_empty``);
    the normative gate of an empty query is exactly 0. With ``per_term`` the masked gate is returned
    unclipped: :func:`gate_log_weights` clamps each mixture term on its own side. ``[B, Q]``.
    """
    lam = raw_gate * any_valid
    if per_term:
        return lam
    clipped = np.clip(lam, GATE_CLIP, 1.0 - GATE_CLIP)
    return clipped if clip_when_empty else np.where(any_valid, clipped, 0.0)


def _log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(x)


def gate_log_weights(gate: np.ndarray, *, per_term: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(log w_param, log w_cache)`` of the mixture, each shaped like ``gate``.

    Normally ``(log(1-λ), log λ)`` of the already clipped gate. With ``per_term`` (the reference
    PyTorch NT path) ``(log1p(-min(λ, 1-1e-5)), log(max(λ, 1e-5)))``: a query with λ = 0 keeps weight
    exactly 1 on the parametric term while the cache term gets 1e-5, so the weights need not sum to 1.
    """
    if per_term:
        return np.log1p(-np.minimum(gate, 1.0 - GATE_CLIP)), np.log(np.maximum(gate, GATE_CLIP))
    return np.log1p(-gate), _log(gate)


def mixture_log_probs(
    param_log_probs: np.ndarray, p_cache: np.ndarray, gate: np.ndarray, *, nt_floor: bool,
    gate_per_term: bool = False,
) -> np.ndarray:
    """Mixture over the vocabulary in log space: ``log[(1-λ)·p_param + λ·p_cache]``, ``[B, Q, V]``.

    With ``nt_floor`` (reference NT) p_cache is floored at 1e-6 on every entry, so the result's mass is
    ``1 + λ·1e-6·(#vocabulary entries with p_cache = 0)`` rather than 1. ``gate_per_term``: see
    :func:`gate_log_weights`.
    """
    log_keep, log_gate = gate_log_weights(gate[..., None], per_term=gate_per_term)
    cache = np.maximum(p_cache, NT_CACHE_FLOOR) if nt_floor else p_cache
    return np.logaddexp(log_keep + param_log_probs, log_gate + _log(cache))


def renormalised_target_log_prob(mixture_lp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``log_softmax(mixture_lp)[target]``, ``[B, Q]``: the reference PyTorch NT loss, which feeds the
    unnormalised log-mixture ``[B, Q, V]`` to a cross-entropy."""
    top = mixture_lp.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(mixture_lp - top).sum(-1, keepdims=True)))[..., 0]
    return np.take_along_axis(mixture_lp, targets[..., None], -1)[..., 0] - lse


def target_log_prob(
    param_log_probs: np.ndarray,
    p_cache: np.ndarray,
    gate: np.ndarray,
    targets: np.ndarray,
    *,
    nt_floor: bool,
    ar_floor: bool,
    mode: str,
    gate_per_term: bool = False,
    renormalise: bool = False,
) -> np.ndarray:
    """log p(y) of each target, ``[B, Q]``, as the loss uses it.

    NT: the target entry of :func:`mixture_log_probs`, ``logaddexp(log(1-λ) + lp_y, log λ + log pc_y)``
    (pc_y floored at 1e-6 under ``nt_floor``; gate terms per :func:`gate_log_weights`), or with
    ``renormalise`` (reference PyTorch) the target entry of its log-softmax over the vocabulary. AR with
    ``ar_floor`` (reference): computed in probability space, ``log(max((1-λ)·exp(lp_y) + λ·p_cache(y), 1e-8))``;
    otherwise the exact log. ``gate``: ``[B, Q]`` masked λ (:func:`mask_gate`).

    The backends take the target entries only: ``param_log_prob`` ``[B, Q]``, the parametric log-prob of the
    target, and ``p_cache`` ``[B, Q]``, p_cache(target), in place of the ``[B, Q, V]`` arrays and ``targets``.
    They have no ``renormalise``: the re-normalised NT loss needs the whole vocabulary
    (:func:`renormalised_target_log_prob`).
    """
    if mode == "nt" and renormalise:
        mix = mixture_log_probs(param_log_probs, p_cache, gate, nt_floor=nt_floor, gate_per_term=gate_per_term)
        return renormalised_target_log_prob(mix, targets)
    lp_y = np.take_along_axis(param_log_probs, targets[..., None], -1)[..., 0]
    pc_y = np.take_along_axis(p_cache, targets[..., None], -1)[..., 0]
    if mode == "nt":
        pc = np.maximum(pc_y, NT_CACHE_FLOOR) if nt_floor else pc_y
        log_keep, log_gate = gate_log_weights(gate, per_term=gate_per_term)
        return np.logaddexp(log_keep + lp_y, log_gate + _log(pc))
    if ar_floor:
        return np.log(np.maximum((1.0 - gate) * np.exp(lp_y) + gate * pc_y, AR_PROB_FLOOR))
    return np.logaddexp(np.log1p(-gate) + lp_y, _log(gate) + _log(pc_y))


def predictions(mixture_lp: np.ndarray, param_log_probs: np.ndarray, *, parametric_only: bool) -> np.ndarray:
    """Predicted token per query, ``[B, Q]`` int64: argmax (first maximum) of the mixture, or of the parametric
    head only (the reference's full-AR accuracy). The backends take ``mixture_lp=None`` with ``parametric_only``."""
    src = param_log_probs if parametric_only else mixture_lp
    return np.argmax(src, axis=-1).astype(np.int64)
