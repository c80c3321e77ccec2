"""Scores → cache weights → p_cache; gate masking; the mixture and its accuracy (mirrors
:mod:`pcaf_core.mixture`).

Shapes: B sequences, Q queries per sequence (1 in NT mode, T in AR mode), C candidate slots, V vocab.
The loss needs only the target entries, so :func:`target_cache_prob` and :func:`target_log_prob` work
on ``[B, Q]`` values and the ``[B, Q, V]`` tensors (:func:`cache_distribution`,
:func:`mixture_log_probs`) are built only when a caller asks for full distributions.

Logs of quantities that can be exactly 0 (an empty query's gate, a target the cache never saw) go
through :func:`safe_log`, so their -inf never turns into a NaN gradient.
"""

from __future__ import annotations

import math

import torch

from backends.torch.ops import banded_dot, batch_gather, gather_dot
from backends.torch.routing import Candidates
from pcaf_core.mixture import AR_PROB_FLOOR, GATE_CLIP, MASKED_SCORE, NT_CACHE_FLOOR, SEMANTIC_OVERLAP_FLOOR
from pcaf_core.routing import ScoreBand


def safe_log(x: torch.Tensor) -> torch.Tensor:
    """``log x`` with ``log 0 = -inf`` and a zero (not NaN) gradient there."""
    pos = x > 0
    return torch.where(pos, torch.log(torch.where(pos, x, torch.ones_like(x))), -math.inf)


def selection_score(query: torch.Tensor, keys: torch.Tensor, recency: torch.Tensor, rho: float | torch.Tensor
                    ) -> torch.Tensor:
    """Dense ranking score ``q_t·k_s/√d + ρ·r_s``, ``[B, Q, T]`` (the routes avoid it; kept for tests)."""
    return query @ keys.transpose(1, 2) / math.sqrt(query.shape[-1]) + rho * recency


def candidate_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    recency: torch.Tensor,
    rho: torch.Tensor | float,
    cand: Candidates,
    router_probs: torch.Tensor | None = None,
    query_router_probs: torch.Tensor | None = None,
    semantic_score_scale: float = 0.0,
    *,
    band: ScoreBand | None = None,
) -> torch.Tensor:
    """Score of each slot: ``q·k_s/√d + ρ·r_s [+ λ_sem·log(max(m_s, 1e-6))]``, ``[B, Q, C]``.

    query ``[B, Q, d]``, keys ``[B, T, d]``, recency ``[T]`` (or ``[B, T]`` when the records of each sequence
    sit at their own positions, as in a receptive-field sub-sequence). The route term (semantic and hybrid
    routes) needs ``router_probs`` ``[B, T, S]`` and the queries' ``query_router_probs`` ``[B, Q, S]``; the
    overlap ``m_s = r̃_q·r̃_s`` is computed for the selected slots only. Empty slots hold junk; mask them.

    ``band``: for full-AR queries whose slot c is each query's (c+1)-th sorted predecessor in the layout
    ``cand`` was read from (the ``recent`` context and bucketed semantic routes: ``ScoreBand(layout)``), the
    products are blocked GEMMs (:func:`backends.torch.ops.banded_dot`) instead of row gathers. Same values
    on the valid slots. A band with a ``width`` (the ``topk_score`` window) is refused.
    """
    idx = cand.index.clamp(min=0)
    rec = recency[idx] if recency.dim() == 1 else batch_gather(recency, idx)
    if band is not None and band.width is not None:
        # The topk_score window (JAX reads its picks off the route's band, computed once inside a jitted
        # step). Measured here, reusing the route's products for the forward and running the band's blocked
        # backward (M = 4K columns of GEMM a row against K gathered rows) scored the picks no faster than
        # the sparse products: 20-23 against 21-23 ms at T = 8,192, 48-52 against 47-54 at 16,384.
        raise ValueError("torch scores topk_score candidates by gathering: pass no band (band.width is set)")

    def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if band is None:
            return gather_dot(x, y, idx)
        return banded_dot(band.layout.order, band.layout.rank, x, y, idx.shape[-1])

    s = dot(query, keys) / math.sqrt(query.shape[-1]) + rho * rec
    if router_probs is not None:
        if query_router_probs is None:
            raise ValueError("the semantic route term needs query_router_probs [B, Q, S] with router_probs")
        m = dot(query_router_probs, router_probs)
        s = s + semantic_score_scale * torch.log(torch.clamp(m, min=SEMANTIC_OVERLAP_FLOOR))
    return s


def cache_weights(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """α = softmax over the valid slots; all zeros where no slot is valid. ``[B, Q, C]``."""
    top = torch.where(valid, scores, torch.full_like(scores, MASKED_SCORE)).amax(-1, keepdim=True).detach()
    # exp(-inf) = 0 with a zero gradient: junk scores of empty slots never reach the softmax.
    e = torch.exp(torch.where(valid, scores - top, torch.full_like(scores, -math.inf)))
    z = e.sum(-1, keepdim=True)
    return e / torch.clamp(z, min=torch.finfo(scores.dtype).tiny)


def cache_distribution(weights: torch.Tensor, cand_values: torch.Tensor, valid: torch.Tensor, vocab_size: int
                       ) -> torch.Tensor:
    """``p_cache(y) = Σ_i α_i·1[v_i = y]``: ``[B, Q, V]`` from weights and slot values ``[B, Q, C]``."""
    B, Q, _ = weights.shape
    p = weights.new_zeros(B, Q, vocab_size)
    return p.scatter_add(-1, cand_values.clamp(min=0), torch.where(valid, weights, torch.zeros_like(weights)))


def target_cache_prob(weights: torch.Tensor, cand_values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                      ) -> torch.Tensor:
    """``p_cache(y)`` at the targets only: ``[B, Q]``, without a ``[B, Q, V]`` tensor."""
    hit = valid & (cand_values == targets[..., None])
    return torch.where(hit, weights, torch.zeros_like(weights)).sum(-1)


def mask_gate(raw_gate: torch.Tensor, any_valid: torch.Tensor, *, clip_when_empty: bool, per_term: bool = False
              ) -> torch.Tensor:
    """Gate λ masked by "any valid candidate" and clipped to [1e-5, 1 - 1e-5]; ``[B, Q]``.

    ``clip_when_empty`` (reference) clips after masking, so an empty query keeps λ = 1e-5; otherwise the
    gate of an empty query is exactly 0. ``per_term``: returned unclipped (:func:`gate_log_weights`).
    """
    lam = raw_gate * any_valid.to(raw_gate.dtype)
    if per_term:
        return lam
    clipped = torch.clamp(lam, GATE_CLIP, 1.0 - GATE_CLIP)
    return clipped if clip_when_empty else torch.where(any_valid, clipped, torch.zeros_like(clipped))


def gate_log_weights(gate: torch.Tensor, *, per_term: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log w_param, log w_cache)``: ``(log(1-λ), log λ)``, or with ``per_term`` (reference PyTorch NT)
    ``(log1p(-min(λ, 1-1e-5)), log(max(λ, 1e-5)))``, each shaped like ``gate``."""
    if per_term:
        return torch.log1p(-torch.clamp(gate, max=1.0 - GATE_CLIP)), torch.log(torch.clamp(gate, min=GATE_CLIP))
    return torch.log1p(-gate), safe_log(gate)


def mixture_log_probs(param_log_probs: torch.Tensor, p_cache: torch.Tensor, gate: torch.Tensor, *, nt_floor: bool,
                      gate_per_term: bool = False) -> torch.Tensor:
    """``log[(1-λ)·p_param + λ·p_cache]`` over the vocabulary, ``[B, Q, V]``.

    With ``nt_floor`` (reference NT) p_cache is floored at 1e-6 on every entry (unnormalised result).
    """
    log_keep, log_gate = gate_log_weights(gate[..., None], per_term=gate_per_term)
    cache = torch.clamp(p_cache, min=NT_CACHE_FLOOR) if nt_floor else p_cache
    return torch.logaddexp(log_keep + param_log_probs, log_gate + safe_log(cache))


def renormalised_target_log_prob(mixture_lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(mixture_lp)[target]``, ``[B, Q]``: the reference PyTorch NT loss (a cross-entropy
    over the unnormalised log-mixture ``[B, Q, V]``)."""
    return mixture_lp.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(mixture_lp, dim=-1)


def target_log_prob(
    param_log_prob: torch.Tensor,
    p_cache: torch.Tensor,
    gate: torch.Tensor,
    *,
    nt_floor: bool,
    ar_floor: bool,
    mode: str,
    gate_per_term: bool = False,
) -> torch.Tensor:
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
        p_cache = torch.clamp(p_cache, min=NT_CACHE_FLOOR)
    if mode == "ar" and ar_floor:
        return torch.log(torch.clamp((1.0 - gate) * torch.exp(param_log_prob) + gate * p_cache, min=AR_PROB_FLOOR))
    log_keep, log_gate = gate_log_weights(gate, per_term=gate_per_term and mode == "nt")
    return torch.logaddexp(log_keep + param_log_prob, log_gate + safe_log(p_cache))


def predictions(mixture_lp: torch.Tensor | None, param_log_probs: torch.Tensor, *, parametric_only: bool
                ) -> torch.Tensor:
    """Predicted token per query, ``[B, Q]`` int64: argmax (first maximum) of the mixture, or of the
    parametric head only (the reference's full-AR accuracy)."""
    src = param_log_probs if parametric_only else mixture_lp
    if src is None:
        raise ValueError("mixture predictions need the mixture log-probs")
    return torch.argmax(src, dim=-1)
