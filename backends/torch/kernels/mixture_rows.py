"""The memory read's per-query passes on CUDA, one kernel each way: the gate's mask and clip, and the mixture's
target log-probability.

A training step's loss mixes, for each query (``[B, Q]``), the head's log-probability of the target with ``p_cache``
at the target (:mod:`backends.torch.kernels.cache_rows`) through the masked gate. In ATen the gate's mask and clip
are about nine kernels forward and backward, the floored mixture seven forward and eight backward, and an eager
step on a GPU waits on the host to launch each. Here each pass is one kernel over the ``[R]`` rows, in float32
(:mod:`backends.torch.mixture` makes the choice).

Ops (namespace ``pcaf``), each the Triton kernel where :func:`backends.torch.kernels.triton_enabled` holds and the
ATen form elsewhere (the ``*_torch`` functions: the reference the kernels are tested against,
``tests/test_torch_mixture_rows.py``). Rows are contiguous float32 ``[R]`` (``R = B·Q``) unless stated:

- ``pcaf::mixture_target(Tensor lp, Tensor p_cache, Tensor gate, int rule) -> Tensor`` and
  ``pcaf::mixture_target_grad(Tensor g, Tensor lp, Tensor p_cache, Tensor gate, int rule) -> (Tensor, Tensor,
  Tensor)``: the target's log-probability under :data:`FLOORED` (the reference profiles' full-AR
  ``log max((1 − λ)·e^lp + λ·p_cache, 1e-8)``) or :data:`LOG` (``logaddexp(log(1 − λ) + lp, log λ + log p_cache)``),
  and its gradients in lp, p_cache and λ;
- ``pcaf::mask_gate(Tensor raw, Tensor any_valid, bool clip_when_empty, bool per_term) -> Tensor`` and
  ``pcaf::mask_gate_grad(Tensor g, Tensor raw, Tensor any_valid, bool per_term) -> Tensor``: raw λ, any_valid bool
  -> the masked gate of :func:`pcaf_core.mixture.mask_gate` (``raw·any_valid``, clipped to
  ``[GATE_CLIP, 1 − GATE_CLIP]`` unless ``per_term``, 0 for an empty query unless ``clip_when_empty``) and its
  gradient ``g·any_valid`` where the clip passes (bounds included, as ``torch.clamp``'s gradient).

``exp`` and ``log`` may differ from ATen's in the last float32 bit: the mixture's kernels agree with the ATen forms
to float32 rounding (``log1p`` is :func:`backends.torch.kernels.triton_math.log1p`); the gate's are bit for bit.
"""

from __future__ import annotations

import torch

from backends.torch.kernels._common import check_rows
from backends.torch.kernels.ops import triton_enabled
from pcaf_core.mixture import AR_PROB_FLOOR, GATE_CLIP

try:
    import triton
    import triton.language as tl

    from backends.torch.kernels.triton_math import log1p
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

FLOORED, LOG = 0, 1
"""``rule`` of the mixture ops: the reference profiles' floored full-AR target, or the log-space mixture."""
ROW_BLOCK = 1024
"""Rows a program."""

if triton is not None:

    @triton.jit
    def _log_mixture_terms(lp, pc, gate):
        """``(a, b, out)``: ``a = log(1 − λ) + lp``, ``b = log λ + log p_cache`` and ``logaddexp(a, b)`` (torch's
        rule: two equal infinities give themselves)."""
        a = log1p(-gate) + lp
        b = tl.log(gate) + tl.log(pc)
        top = tl.maximum(a, b)
        same_inf = (a == b) & ((a == float("inf")) | (a == float("-inf")))
        d = tl.where(same_inf, 0.0, a - b)
        d = tl.where(d < 0, -d, d)
        return a, b, tl.where(same_inf, a, top + log1p(tl.exp(-d)))

    @triton.jit
    def _mixture_target_kernel(lp_ptr, pc_ptr, gate_ptr, out_ptr, R, RULE: tl.constexpr, FLOOR: tl.constexpr,
                               BLOCK: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK),)``."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < R
        lp = tl.load(lp_ptr + rows, mask=inside, other=0.0)
        pc = tl.load(pc_ptr + rows, mask=inside, other=0.0)
        gate = tl.load(gate_ptr + rows, mask=inside, other=0.5)
        if RULE == 0:  # FLOORED
            mix = (1.0 - gate) * tl.exp(lp) + gate * pc
            out = tl.log(tl.maximum(mix, FLOOR))
        else:
            _, _, out = _log_mixture_terms(lp, pc, gate)
        tl.store(out_ptr + rows, out, mask=inside)

    @triton.jit
    def _mixture_target_grad_kernel(g_ptr, lp_ptr, pc_ptr, gate_ptr, d_lp_ptr, d_pc_ptr, d_gate_ptr, R,
                                    RULE: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK),)``."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < R
        g = tl.load(g_ptr + rows, mask=inside, other=0.0)
        lp = tl.load(lp_ptr + rows, mask=inside, other=0.0)
        pc = tl.load(pc_ptr + rows, mask=inside, other=0.0)
        gate = tl.load(gate_ptr + rows, mask=inside, other=0.5)
        if RULE == 0:  # FLOORED
            p = tl.exp(lp)
            kept = (1.0 - gate) * p
            mix = kept + gate * pc
            d = tl.where(mix >= FLOOR, g / tl.where(mix >= FLOOR, mix, 1.0), 0.0)
            d_lp = d * kept
            d_pc = d * gate
            d_gate = d * (pc - p)
        else:
            a, b, out = _log_mixture_terms(lp, pc, gate)
            d_lp = g * tl.exp(a - out)
            g_cache = g * tl.exp(b - out)
            d_pc = tl.where(pc > 0, g_cache / tl.where(pc > 0, pc, 1.0), 0.0)
            d_gate = tl.where(gate > 0, g_cache / tl.where(gate > 0, gate, 1.0), 0.0) - d_lp / (1.0 - gate)
        tl.store(d_lp_ptr + rows, d_lp, mask=inside)
        tl.store(d_pc_ptr + rows, d_pc, mask=inside)
        tl.store(d_gate_ptr + rows, d_gate, mask=inside)

    @triton.jit
    def _mask_gate_kernel(raw_ptr, any_ptr, out_ptr, R, CLIP: tl.constexpr, CLIP_WHEN_EMPTY: tl.constexpr,
                          PER_TERM: tl.constexpr, BLOCK: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK),)``."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < R
        raw = tl.load(raw_ptr + rows, mask=inside, other=0.0)
        valid = tl.load(any_ptr + rows, mask=inside, other=0) != 0
        lam = raw * tl.where(valid, 1.0, 0.0)
        if not PER_TERM:
            lam = tl.minimum(tl.maximum(lam, CLIP), 1.0 - CLIP)
            if not CLIP_WHEN_EMPTY:
                lam = tl.where(valid, lam, 0.0)
        tl.store(out_ptr + rows, lam, mask=inside)

    @triton.jit
    def _mask_gate_grad_kernel(g_ptr, raw_ptr, any_ptr, out_ptr, R, CLIP: tl.constexpr, PER_TERM: tl.constexpr,
                               BLOCK: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK),)``."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < R
        g = tl.load(g_ptr + rows, mask=inside, other=0.0)
        raw = tl.load(raw_ptr + rows, mask=inside, other=0.0)
        valid = tl.load(any_ptr + rows, mask=inside, other=0) != 0
        on = tl.where(valid, 1.0, 0.0)
        d = g * on
        if not PER_TERM:
            lam = raw * on
            d = tl.where((lam >= CLIP) & (lam <= 1.0 - CLIP), d, 0.0)
        tl.store(out_ptr + rows, d, mask=inside)


# ------------------------------------------------------------------ the ATen forms (the kernels' reference)


def mixture_target_terms_torch(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int
                               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(out, terms)``: the target's log-probability and the intermediates its gradient reads (``FLOORED``:
    ``(exp(lp), (1 − λ)·exp(lp), the mixture)``; ``LOG``: ``(a, b, out)``)."""
    if rule == FLOORED:
        p = torch.exp(lp)
        kept = (1.0 - gate) * p  # d mix / d lp
        mix = kept + gate * pc
        return torch.log(torch.clamp(mix, min=AR_PROB_FLOOR)), (p, kept, mix)
    a = torch.log1p(-gate) + lp
    b = torch.log(gate) + torch.log(pc)  # log 0 = -inf: safe_log's value without its guard
    out = torch.logaddexp(a, b)
    return out, (a, b, out)


def mixture_target_torch(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int) -> torch.Tensor:
    return mixture_target_terms_torch(lp, pc, gate, rule)[0]


def mixture_target_grad_torch(g: torch.Tensor, lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int,
                              terms: tuple[torch.Tensor, ...] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients from :func:`mixture_target_terms_torch`'s ``terms`` (recomputed when None)."""
    if terms is None:
        terms = mixture_target_terms_torch(lp, pc, gate, rule)[1]
    if rule == FLOORED:
        p, kept, mix = terms
        d = torch.where(mix >= AR_PROB_FLOOR, g / mix, 0.0)
        return d * kept, d * gate, d * (pc - p)
    a, b, out = terms
    d_lp = g * torch.exp(a - out)
    g_cache = g * torch.exp(b - out)
    d_pc = torch.where(pc > 0, g_cache / pc, 0.0)
    d_gate = torch.where(gate > 0, g_cache / gate, 0.0) - d_lp / (1.0 - gate)
    return d_lp, d_pc, d_gate


def mask_gate_torch(raw: torch.Tensor, any_valid: torch.Tensor, clip_when_empty: bool, per_term: bool
                    ) -> torch.Tensor:
    lam = raw * any_valid.to(raw.dtype)
    if per_term:
        return lam
    clipped = torch.clamp(lam, GATE_CLIP, 1.0 - GATE_CLIP)
    return clipped if clip_when_empty else torch.where(any_valid, clipped, torch.zeros_like(clipped))


def mask_gate_grad_torch(g: torch.Tensor, raw: torch.Tensor, any_valid: torch.Tensor, per_term: bool
                         ) -> torch.Tensor:
    on = any_valid.to(raw.dtype)
    if per_term:
        return g * on
    lam = raw * on
    return torch.where((lam >= GATE_CLIP) & (lam <= 1.0 - GATE_CLIP), g * on, 0.0)


# ------------------------------------------------------------------ the ops


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and triton_enabled(x)


@torch.library.custom_op("pcaf::mixture_target", mutates_args=())
def _mixture_target(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int) -> torch.Tensor:
    if not _use_triton(lp):
        return mixture_target_torch(lp, pc, gate, rule)
    out = torch.empty_like(lp)
    R = lp.numel()
    if R:
        _mixture_target_kernel[(triton.cdiv(R, ROW_BLOCK),)](lp, pc, gate, out, R, RULE=rule, FLOOR=AR_PROB_FLOOR,
                                                             BLOCK=ROW_BLOCK)
    return out


@_mixture_target.register_fake
def _(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int) -> torch.Tensor:
    return torch.empty_like(lp)


@torch.library.custom_op("pcaf::mixture_target_grad", mutates_args=())
def _mixture_target_grad(g: torch.Tensor, lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _use_triton(lp):
        return mixture_target_grad_torch(g, lp, pc, gate, rule)
    d_lp, d_pc, d_gate = torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)
    R = lp.numel()
    if R:
        _mixture_target_grad_kernel[(triton.cdiv(R, ROW_BLOCK),)](g, lp, pc, gate, d_lp, d_pc, d_gate, R, RULE=rule,
                                                                  FLOOR=AR_PROB_FLOOR, BLOCK=ROW_BLOCK)
    return d_lp, d_pc, d_gate


@_mixture_target_grad.register_fake
def _(g: torch.Tensor, lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)


@torch.library.custom_op("pcaf::mask_gate", mutates_args=())
def _mask_gate(raw: torch.Tensor, any_valid: torch.Tensor, clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    if not _use_triton(raw):
        return mask_gate_torch(raw, any_valid, clip_when_empty, per_term)
    out = torch.empty_like(raw)
    R = raw.numel()
    if R:
        _mask_gate_kernel[(triton.cdiv(R, ROW_BLOCK),)](raw, any_valid.view(torch.uint8), out, R, CLIP=GATE_CLIP,
                                                        CLIP_WHEN_EMPTY=clip_when_empty, PER_TERM=per_term,
                                                        BLOCK=ROW_BLOCK)
    return out


@_mask_gate.register_fake
def _(raw: torch.Tensor, any_valid: torch.Tensor, clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    return torch.empty_like(raw)


@torch.library.custom_op("pcaf::mask_gate_grad", mutates_args=())
def _mask_gate_grad(g: torch.Tensor, raw: torch.Tensor, any_valid: torch.Tensor, per_term: bool) -> torch.Tensor:
    if not _use_triton(raw):
        return mask_gate_grad_torch(g, raw, any_valid, per_term)
    out = torch.empty_like(raw)
    R = raw.numel()
    if R:
        _mask_gate_grad_kernel[(triton.cdiv(R, ROW_BLOCK),)](g, raw, any_valid.view(torch.uint8), out, R,
                                                             CLIP=GATE_CLIP, PER_TERM=per_term, BLOCK=ROW_BLOCK)
    return out


@_mask_gate_grad.register_fake
def _(g: torch.Tensor, raw: torch.Tensor, any_valid: torch.Tensor, per_term: bool) -> torch.Tensor:
    return torch.empty_like(raw)


# ------------------------------------------------------------------ checked entry points


def mixture_target(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int) -> torch.Tensor:
    """The target's log-probability ``[R]`` under ``rule`` (:data:`FLOORED` or :data:`LOG`) from the head's ``lp``,
    ``p_cache`` at the target and the masked gate λ, ``[R]`` float32 each."""
    check_rows("mixture_target", (lp, pc, gate), lp)
    return torch.ops.pcaf.mixture_target(lp, pc, gate, rule)


def mixture_target_grad(g: torch.Tensor, lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d lp, d p_cache, d λ)`` ``[R]`` of :func:`mixture_target` times ``g``."""
    check_rows("mixture_target_grad", (g, lp, pc, gate), lp)
    return torch.ops.pcaf.mixture_target_grad(g, lp, pc, gate, rule)


def mask_gate(raw: torch.Tensor, any_valid: torch.Tensor, clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    """The masked gate ``[R]`` of raw λ ``[R]`` float32 and ``any_valid`` ``[R]`` bool."""
    check_rows("mask_gate", (raw,), raw, any_valid)
    return torch.ops.pcaf.mask_gate(raw, any_valid, clip_when_empty, per_term)


def mask_gate_grad(g: torch.Tensor, raw: torch.Tensor, any_valid: torch.Tensor, per_term: bool) -> torch.Tensor:
    """The gradient ``[R]`` in raw λ of :func:`mask_gate` times ``g`` ``[R]``."""
    check_rows("mask_gate_grad", (g, raw), raw, any_valid)
    return torch.ops.pcaf.mask_gate_grad(g, raw, any_valid, per_term)
