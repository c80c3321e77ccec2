"""Scores → cache weights → p_cache; gate masking; the mixture and its accuracy in torch, equal to
:mod:`pcaf_core.mixture` (which also states the backends' target-entry loss path and :func:`safe_log`).

The training loss's per-query passes (the cache weights, ``p_cache`` at the target, the target's mixture) have
hand-written gradients; on CUDA an eager step runs each pass as one kernel
(:mod:`backends.torch.kernels.cache_rows` and :mod:`~backends.torch.kernels.mixture_rows`,
:func:`kernels_by_default`), elsewhere and under ``torch.compile`` as those modules' ATen forms.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from backends.torch.kernels import cache_rows, mixture_rows, triton_enabled
from backends.torch.ops import banded_dot, batch_gather, gather_dot
from backends.torch.routing import Candidates
from pcaf_core.mixture import GATE_CLIP, NT_CACHE_FLOOR, SEMANTIC_OVERLAP_FLOOR
from pcaf_core.routing import ScoreBand


def safe_log(x: torch.Tensor) -> torch.Tensor:
    """``log x`` with ``log 0 = -inf`` and a zero (not NaN) gradient there."""
    pos = x > 0
    return torch.where(pos, torch.log(torch.where(pos, x, torch.ones_like(x))), -math.inf)


def selection_score(query: torch.Tensor, keys: torch.Tensor, recency: torch.Tensor, rho: float | torch.Tensor
                    ) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.selection_score`."""
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
    """See :func:`pcaf_core.mixture.candidate_scores` (the backends' form, with ``router_probs`` and ``band``).

    A band with a ``width`` (the ``topk_score`` window) is refused: torch scores those picks by gathering.
    """
    if band is not None and band.width is not None:
        # The topk_score window (JAX reads its picks off the route's band, computed once inside a jitted
        # step). Measured here, reusing the route's products for the forward and running the band's blocked
        # backward (M = 4K columns of GEMM a row against K gathered rows) scored the picks no faster than
        # the sparse products: 20-23 against 21-23 ms at T = 8,192, 48-52 against 47-54 at 16,384.
        raise ValueError("torch scores topk_score candidates by gathering: pass no band (band.width is set)")
    sqrt_d = math.sqrt(query.shape[-1])
    # On an eager CUDA step the scale and the recency term are one kernel each way (cache_rows.candidate_scores),
    # which reads the empty slots' -1 as position 0 itself.
    fused = (router_probs is None and isinstance(rho, torch.Tensor) and _score_kernels(query, keys, recency, rho))
    idx = None if fused and band is not None else cand.index.clamp(min=0)

    def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if band is None:
            return gather_dot(x, y, idx)
        return banded_dot(band.layout.order, band.layout.rank, x, y, cand.index.shape[-1])

    if fused:
        return _CandidateScores.apply(dot(query, keys), cand.index, recency, rho, sqrt_d)
    rec = recency[idx] if recency.dim() == 1 else batch_gather(recency, idx)
    s = dot(query, keys) / sqrt_d + rho * rec
    if router_probs is not None:
        if query_router_probs is None:
            raise ValueError("the semantic route term needs query_router_probs [B, Q, S] with router_probs")
        m = dot(query_router_probs, router_probs)
        s = s + semantic_score_scale * torch.log(torch.clamp(m, min=SEMANTIC_OVERLAP_FLOOR))
    return s


def kernels_by_default(x: torch.Tensor) -> bool:
    """Whether the memory read's row passes run as ``pcaf::`` kernels, one each way: on CUDA tensors."""
    return x.is_cuda and triton_enabled(x)


def _row_kernels(*xs: torch.Tensor) -> bool:
    """The kernels for float32 rows of an eager step (a compiled one fuses the ATen forms itself)."""
    return (all(x.dtype == torch.float32 for x in xs) and not torch.compiler.is_compiling()
            and kernels_by_default(xs[0]))


def _rows(x: torch.Tensor, K: int | None = None) -> torch.Tensor:
    """``x`` as contiguous ``[R, K]`` rows (``[R]`` when K is None)."""
    return x.contiguous().view(-1) if K is None else x.contiguous().view(-1, K)


def _score_kernels(query: torch.Tensor, keys: torch.Tensor, recency: torch.Tensor, rho: torch.Tensor) -> bool:
    """The scores' kernel for float32 or 16-bit products, a ``[T]`` float32 recency and a float32 ρ, in an eager
    step."""
    return (query.dtype in cache_rows.SCORE_DTYPES and keys.dtype == query.dtype and recency.dim() == 1
            and recency.dtype == torch.float32 and rho.dtype == torch.float32 and rho.numel() == 1
            and not torch.compiler.is_compiling() and kernels_by_default(query))


class _CandidateScores(torch.autograd.Function):
    """``dots/√d + ρ·recency[index]`` by :func:`backends.torch.kernels.cache_rows.candidate_scores`, one kernel
    each way (ρ's gradient summed from per-program partial sums)."""

    @staticmethod
    def forward(ctx, dots: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, rho: torch.Tensor,
                sqrt_d: float) -> torch.Tensor:
        K = dots.shape[-1]
        rows = _rows(index, K)
        ctx.save_for_backward(rows, recency)
        ctx.sqrt_d, ctx.dtype, ctx.shape, ctx.rho_shape = sqrt_d, dots.dtype, dots.shape, rho.shape
        return cache_rows.candidate_scores(_rows(dots, K), rows, recency, rho, sqrt_d).view(dots.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        index, recency = ctx.saved_tensors
        d_dots, d_rho = cache_rows.candidate_scores_grad(_rows(g.float(), index.shape[-1]), index, recency,
                                                         ctx.sqrt_d, ctx.dtype)
        return d_dots.view(ctx.shape), None, None, d_rho.reshape(ctx.rho_shape), None


def cache_weights(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.cache_weights`."""
    return _CacheWeights.apply(scores, valid)


class _CacheWeights(torch.autograd.Function):
    """The masked softmax with its gradient as one expression, ``w·(g − Σ g·w)``: 4 backward ops where autograd's
    chain through the division, clamp, exp and masks took 13 (an eager GPU step launches each; on CUDA each pass
    is one kernel). Junk scores of empty slots never reach the softmax (exp(-inf) = 0), and get a zero gradient
    (their weight is 0); an empty query's weights are all 0, and so is its gradient (its sum is clamped at
    ``tiny``, not divided by 0)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ctx.kernels = _row_kernels(scores)
        if ctx.kernels:
            K = scores.shape[-1]
            w = cache_rows.cache_weights(_rows(scores, K), _rows(valid, K)).view(scores.shape)
        else:
            w = cache_rows.cache_weights_torch(scores, valid)
        ctx.save_for_backward(w)
        return w

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (w,) = ctx.saved_tensors
        if ctx.kernels:
            K = w.shape[-1]
            return cache_rows.cache_weights_grad(_rows(w, K), _rows(g, K)).view(w.shape), None
        return cache_rows.cache_weights_grad_torch(w, g), None


def cache_distribution(weights: torch.Tensor, cand_values: torch.Tensor, valid: torch.Tensor, vocab_size: int
                       ) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.cache_distribution`."""
    B, Q, _ = weights.shape
    p = weights.new_zeros(B, Q, vocab_size)
    return p.scatter_add(-1, cand_values.clamp(min=0), torch.where(valid, weights, torch.zeros_like(weights)))


def target_cache_prob(weights: torch.Tensor, cand_values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                      ) -> torch.Tensor:
    """``p_cache(y)`` at the targets, ``[B, Q]`` (:mod:`pcaf_core.mixture`, "Backends")."""
    if _row_kernels(weights):
        return _TargetCacheProb.apply(weights, cand_values, valid, targets)
    return cache_rows.target_cache_prob_torch(weights, cand_values, valid, targets)


class _TargetCacheProb(torch.autograd.Function):
    """:func:`target_cache_prob` by one kernel each way (:mod:`backends.torch.kernels.cache_rows`)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, cand_values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                ) -> torch.Tensor:
        K = weights.shape[-1]
        ids = (_rows(cand_values, K), _rows(valid, K), _rows(targets))
        ctx.save_for_backward(*ids)
        return cache_rows.target_cache_prob(_rows(weights, K), *ids).view(targets.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        values, valid, targets = ctx.saved_tensors
        shape = (*g.shape, values.shape[-1])
        return cache_rows.target_cache_prob_grad(_rows(g), values, valid, targets).view(shape), None, None, None


def mask_gate(raw_gate: torch.Tensor, any_valid: torch.Tensor, *, clip_when_empty: bool, per_term: bool = False
              ) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.mask_gate`."""
    if _row_kernels(raw_gate):
        return _MaskGate.apply(raw_gate, any_valid, clip_when_empty, per_term)
    return mixture_rows.mask_gate_torch(raw_gate, any_valid, clip_when_empty, per_term)


class _MaskGate(torch.autograd.Function):
    """:func:`mask_gate` by one kernel each way (:mod:`backends.torch.kernels.mixture_rows`), where the plain ops
    and the clamp's gradient are about nine."""

    @staticmethod
    def forward(ctx, raw_gate: torch.Tensor, any_valid: torch.Tensor, clip_when_empty: bool, per_term: bool
                ) -> torch.Tensor:
        raw, valid = _rows(raw_gate), _rows(any_valid)
        ctx.per_term = per_term
        ctx.save_for_backward(raw, valid)
        return mixture_rows.mask_gate(raw, valid, clip_when_empty, per_term).view(raw_gate.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        raw, valid = ctx.saved_tensors
        return mixture_rows.mask_gate_grad(_rows(g), raw, valid, ctx.per_term).view(g.shape), None, None, None


def gate_log_weights(gate: torch.Tensor, *, per_term: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`pcaf_core.mixture.gate_log_weights`."""
    if per_term:
        return torch.log1p(-torch.clamp(gate, max=1.0 - GATE_CLIP)), torch.log(torch.clamp(gate, min=GATE_CLIP))
    return torch.log1p(-gate), safe_log(gate)


def mixture_log_probs(param_log_probs: torch.Tensor, p_cache: torch.Tensor, gate: torch.Tensor, *, nt_floor: bool,
                      gate_per_term: bool = False) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.mixture_log_probs`."""
    log_keep, log_gate = gate_log_weights(gate[..., None], per_term=gate_per_term)
    cache = torch.clamp(p_cache, min=NT_CACHE_FLOOR) if nt_floor else p_cache
    return torch.logaddexp(log_keep + param_log_probs, log_gate + safe_log(cache))


def renormalised_target_log_prob(mixture_lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.renormalised_target_log_prob`."""
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
    """See :func:`pcaf_core.mixture.target_log_prob` (the backends' form, from the target entries)."""
    if mode == "nt" and nt_floor:
        p_cache = torch.clamp(p_cache, min=NT_CACHE_FLOOR)
    if mode == "ar" and ar_floor:
        return _MixtureTarget.apply(param_log_prob, p_cache, gate, mixture_rows.FLOORED)
    if not (gate_per_term and mode == "nt"):
        return _MixtureTarget.apply(param_log_prob, p_cache, gate, mixture_rows.LOG)
    log_keep, log_gate = gate_log_weights(gate, per_term=True)
    return torch.logaddexp(log_keep + param_log_prob, log_gate + safe_log(p_cache))


def predictions(mixture_lp: torch.Tensor | None, param_log_probs: torch.Tensor, *, parametric_only: bool
                ) -> torch.Tensor:
    """See :func:`pcaf_core.mixture.predictions`."""
    src = param_log_probs if parametric_only else mixture_lp
    if src is None:
        raise ValueError("mixture predictions need the mixture log-probs")
    return torch.argmax(src, dim=-1)


class _MixtureTarget(torch.autograd.Function):
    """The target's log-probability from the head's ``lp``, ``p_cache`` at the target and the masked gate λ, with
    its three gradients as one expression each (:mod:`backends.torch.kernels.mixture_rows`, which holds both rules'
    formulas; on CUDA one kernel each way):

    - ``FLOORED``: ``log(max((1 − λ)·exp(lp) + λ·p_cache, AR_PROB_FLOOR))``, the reference profiles' full-AR target;
      below the floor the gradient is 0, as the clamp's is. 8 backward ops where autograd's chain took 11.
    - ``LOG``: ``logaddexp(log(1 − λ) + lp, log λ + log p_cache)``, λ and p_cache in [0, 1]. A zero λ or p_cache
      has log −∞ and a zero gradient, as :func:`safe_log`'s; the forward is the plain ops' own. About 24 ops
      forward and backward where the plain ops and autograd's chain took about 40.

    The kernels' backward recomputes the forward's intermediates from the three inputs (``[B, Q]`` each); the ATen
    form keeps them.
    """

    @staticmethod
    def forward(ctx, lp: torch.Tensor, p_cache: torch.Tensor, gate: torch.Tensor, rule: int) -> torch.Tensor:
        ctx.rule, ctx.kernels = rule, _row_kernels(lp, p_cache, gate)
        if ctx.kernels:
            ctx.save_for_backward(lp, p_cache, gate)
            return mixture_rows.mixture_target(_rows(lp), _rows(p_cache), _rows(gate), rule).view(lp.shape)
        out, terms = mixture_rows.mixture_target_terms_torch(lp, p_cache, gate, rule)
        ctx.save_for_backward(lp, p_cache, gate, *terms)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        lp, p_cache, gate, *terms = ctx.saved_tensors
        if ctx.kernels:
            grads = mixture_rows.mixture_target_grad(_rows(g), _rows(lp), _rows(p_cache), _rows(gate), ctx.rule)
            return (*(d.view(lp.shape) for d in grads), None)
        return (*mixture_rows.mixture_target_grad_torch(g, lp, p_cache, gate, ctx.rule, tuple(terms)), None)
