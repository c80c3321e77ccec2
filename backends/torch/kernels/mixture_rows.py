"""The memory read's per-query passes on CUDA, one kernel each way: cache weights, ``p_cache`` at the target, and the
mixture's target log-probability.

After the candidates are scored, a training step's memory read works on small rows: the K scores of each query
(``[B, Q, K]``) and one number per query (``[B, Q]``). In ATen each formula below is a chain of elementwise kernels
(the masked softmax is ten forward and four backward, the hit sum five, the floored mixture seven forward and eight
backward), and an eager step on a GPU waits on the host to launch each. Here each pass is one kernel that reads its
rows once; the arithmetic is float32, in the order of the ATen form it replaces (:mod:`backends.torch.mixture`,
where the choice is made).

Ops (namespace ``pcaf``), each the Triton kernel where :func:`backends.torch.kernels.triton_enabled` holds and the
ATen form elsewhere (the ``*_torch`` functions: the reference the kernels are tested against,
``tests/test_torch_mixture_rows.py``). Rows are contiguous float32 unless stated; ``[R, K]`` is ``[B·Q, K]``:

- ``pcaf::cache_weights(Tensor scores, Tensor valid) -> Tensor``: scores ``[R, K]``, valid ``[R, K]`` bool -> the
  masked softmax ``w [R, K]``: ``exp(s − max)`` over the valid slots, divided by their sum floored at float32's
  ``tiny`` (an empty row is all 0);
- ``pcaf::cache_weights_grad(Tensor w, Tensor g) -> Tensor``: ``w·(g − Σ_k g·w)``, ``[R, K]``;
- ``pcaf::target_cache_prob(Tensor w, Tensor values, Tensor valid, Tensor targets) -> Tensor``: values ``[R, K]``
  int64, targets ``[R]`` int64 -> ``p_cache(y) = Σ_k w·[valid ∧ value = y]``, ``[R]``;
- ``pcaf::target_cache_prob_grad(Tensor g, Tensor values, Tensor valid, Tensor targets) -> Tensor``: ``g`` ``[R]`` ->
  ``g·[valid ∧ value = y]``, ``[R, K]``;
- ``pcaf::mixture_target(Tensor lp, Tensor p_cache, Tensor gate, int rule) -> Tensor`` and
  ``pcaf::mixture_target_grad(Tensor g, Tensor lp, Tensor p_cache, Tensor gate, int rule) -> (Tensor, Tensor,
  Tensor)``: ``[R]`` each; the target's log-probability under :data:`FLOORED` (the reference profiles' full-AR
  ``log max((1 − λ)·e^lp + λ·p_cache, 1e-8)``) or :data:`LOG` (``logaddexp(log(1 − λ) + lp, log λ + log p_cache)``),
  and its gradients in lp, p_cache and λ;
- ``pcaf::mask_gate(Tensor raw, Tensor any_valid, bool clip_when_empty, bool per_term) -> Tensor`` and
  ``pcaf::mask_gate_grad(Tensor g, Tensor raw, Tensor any_valid, bool per_term) -> Tensor``: raw λ ``[R]``,
  any_valid ``[R]`` bool -> the masked gate of :func:`pcaf_core.mixture.mask_gate` (``raw·any_valid``, clipped to
  ``[GATE_CLIP, 1 − GATE_CLIP]`` unless ``per_term``, 0 for an empty query unless ``clip_when_empty``) and its
  gradient ``g·any_valid`` where the clip passes (bounds included, as ``torch.clamp``'s gradient).

``exp`` and ``log`` may differ from ATen's in the last float32 bit, and a row's sums run in another order: the
kernels agree with the ATen forms to float32 rounding, not bit for bit (``log1p`` is
:func:`backends.torch.kernels.triton_math.log1p`).
"""

from __future__ import annotations

import math

import torch

from backends.torch.kernels.ops import triton_enabled
from pcaf_core.mixture import AR_PROB_FLOOR, GATE_CLIP, MASKED_SCORE

try:
    import triton
    import triton.language as tl

    from backends.torch.kernels.triton_math import log1p
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

FLOORED, LOG = 0, 1
"""``rule`` of the mixture ops: the reference profiles' floored full-AR target, or the log-space mixture."""
ROW_ELEMENTS = 2048
"""``[rows, K]`` elements a program of the ``[R, K]`` kernels (``K`` padded to a power of two): 16 a thread at 4
warps."""
ROW_BLOCK = 1024
"""Rows a program of the ``[R]`` mixture kernels."""
TINY = torch.finfo(torch.float32).tiny

if triton is not None:

    @triton.jit
    def _row_block(R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """This program's rows ``[BLOCK_R]``, their ``[BLOCK_R, BLOCK_K]`` offsets into an ``[R, K]`` array and
        the mask of the real ones."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        inside = (rows < R)[:, None] & (cols < K)[None, :]
        return rows, rows.to(tl.int64)[:, None] * K + cols[None, :], inside

    @triton.jit
    def _cache_weights_kernel(scores_ptr, valid_ptr, w_ptr, R, K, MASKED: tl.constexpr, FLOOR: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``."""
        _, offs, inside = _row_block(R, K, BLOCK_R, BLOCK_K)
        s = tl.load(scores_ptr + offs, mask=inside, other=0.0)
        v = tl.load(valid_ptr + offs, mask=inside, other=0) != 0
        # An empty slot counts as MASKED in the maximum, as in the ATen form; the padding columns not at all.
        top = tl.max(tl.where(inside, tl.where(v, s, MASKED), float("-inf")), axis=1)
        e = tl.exp(tl.where(v, s - top[:, None], float("-inf")))
        total = tl.maximum(tl.sum(e, axis=1), FLOOR)
        tl.store(w_ptr + offs, e / total[:, None], mask=inside)

    @triton.jit
    def _cache_weights_grad_kernel(w_ptr, g_ptr, out_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``."""
        _, offs, inside = _row_block(R, K, BLOCK_R, BLOCK_K)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0)
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        tl.store(out_ptr + offs, w * (g - tl.sum(g * w, axis=1)[:, None]), mask=inside)

    @triton.jit
    def _hits(values_ptr, valid_ptr, targets_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """``[BLOCK_R, BLOCK_K]`` whether each slot is valid and holds its row's target, with the offsets and mask
        of :func:`_row_block`."""
        rows, offs, inside = _row_block(R, K, BLOCK_R, BLOCK_K)
        values = tl.load(values_ptr + offs, mask=inside, other=-1)
        v = tl.load(valid_ptr + offs, mask=inside, other=0) != 0
        y = tl.load(targets_ptr + rows, mask=rows < R, other=-1)
        return rows, offs, inside, v & (values == y[:, None])

    @triton.jit
    def _target_cache_prob_kernel(w_ptr, values_ptr, valid_ptr, targets_ptr, out_ptr, R, K,
                                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``."""
        rows, offs, inside, hit = _hits(values_ptr, valid_ptr, targets_ptr, R, K, BLOCK_R, BLOCK_K)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0)
        tl.store(out_ptr + rows, tl.sum(tl.where(hit, w, 0.0), axis=1), mask=rows < R)

    @triton.jit
    def _target_cache_prob_grad_kernel(g_ptr, values_ptr, valid_ptr, targets_ptr, out_ptr, R, K,
                                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``."""
        rows, offs, inside, hit = _hits(values_ptr, valid_ptr, targets_ptr, R, K, BLOCK_R, BLOCK_K)
        g = tl.load(g_ptr + rows, mask=rows < R, other=0.0)
        tl.store(out_ptr + offs, tl.where(hit, g[:, None], 0.0), mask=inside)

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


if triton is not None:

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


def _row_grid(R: int, K: int) -> tuple[int, int, int]:
    """``(programs, BLOCK_R, BLOCK_K)`` of an ``[R, K]`` kernel."""
    block_k = triton.next_power_of_2(max(K, 1))
    block_r = max(1, ROW_ELEMENTS // block_k)
    return triton.cdiv(R, block_r), block_r, block_k


# ------------------------------------------------------------------ the ATen forms (the kernels' reference)


def cache_weights_torch(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    top = torch.where(valid, scores, MASKED_SCORE).amax(-1, keepdim=True)
    e = torch.exp(torch.where(valid, scores - top, -math.inf))
    return e / e.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)


def cache_weights_grad_torch(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return w * (g - (g * w).sum(-1, keepdim=True))


def _hit(values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return valid & (values == targets[..., None])


def target_cache_prob_torch(w: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                            ) -> torch.Tensor:
    return torch.where(_hit(values, valid, targets), w, 0.0).sum(-1)


def target_cache_prob_grad_torch(g: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                                 ) -> torch.Tensor:
    return torch.where(_hit(values, valid, targets), g[..., None], 0.0)


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


@torch.library.custom_op("pcaf::cache_weights", mutates_args=())
def _cache_weights(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if not _use_triton(scores):
        return cache_weights_torch(scores, valid)
    R, K = scores.shape
    w = torch.empty_like(scores)
    if R:
        grid, block_r, block_k = _row_grid(R, K)
        _cache_weights_kernel[(grid,)](scores, valid.view(torch.uint8), w, R, K, MASKED=MASKED_SCORE, FLOOR=TINY,
                                       BLOCK_R=block_r, BLOCK_K=block_k)
    return w


@_cache_weights.register_fake
def _(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scores)


@torch.library.custom_op("pcaf::cache_weights_grad", mutates_args=())
def _cache_weights_grad(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if not _use_triton(w):
        return cache_weights_grad_torch(w, g)
    R, K = w.shape
    out = torch.empty_like(w)
    if R:
        grid, block_r, block_k = _row_grid(R, K)
        _cache_weights_grad_kernel[(grid,)](w, g, out, R, K, BLOCK_R=block_r, BLOCK_K=block_k)
    return out


@_cache_weights_grad.register_fake
def _(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(w)


@torch.library.custom_op("pcaf::target_cache_prob", mutates_args=())
def _target_cache_prob(w: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                       ) -> torch.Tensor:
    if not _use_triton(w):
        return target_cache_prob_torch(w, values, valid, targets)
    R, K = w.shape
    out = w.new_empty(R)
    if R:
        grid, block_r, block_k = _row_grid(R, K)
        _target_cache_prob_kernel[(grid,)](w, values, valid.view(torch.uint8), targets, out, R, K,
                                           BLOCK_R=block_r, BLOCK_K=block_k)
    return out


@_target_cache_prob.register_fake
def _(w: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return w.new_empty(w.shape[0])


@torch.library.custom_op("pcaf::target_cache_prob_grad", mutates_args=())
def _target_cache_prob_grad(g: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                            ) -> torch.Tensor:
    if not _use_triton(g):
        return target_cache_prob_grad_torch(g, values, valid, targets)
    R, K = values.shape
    out = g.new_empty(R, K)
    if R:
        grid, block_r, block_k = _row_grid(R, K)
        _target_cache_prob_grad_kernel[(grid,)](g, values, valid.view(torch.uint8), targets, out, R, K,
                                                BLOCK_R=block_r, BLOCK_K=block_k)
    return out


@_target_cache_prob_grad.register_fake
def _(g: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return g.new_empty(values.shape)


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


def _check(name: str, floats: tuple[torch.Tensor, ...], rows: torch.Tensor, *others: torch.Tensor) -> None:
    """Every float input contiguous float32 shaped ``rows``; ``others`` (ids, masks) contiguous of their shape."""
    for t in floats:
        if t.dtype != torch.float32 or t.shape != rows.shape or not t.is_contiguous():
            raise ValueError(f"{name} takes contiguous float32 rows of shape {tuple(rows.shape)}, got {t.dtype} of "
                             f"shape {tuple(t.shape)} and strides {t.stride()}")
    for t in others:
        if not t.is_contiguous():
            raise ValueError(f"{name} takes contiguous ids and masks, got shape {tuple(t.shape)} with strides "
                             f"{t.stride()}")


def cache_weights(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The masked softmax ``[R, K]`` of ``scores [R, K]`` float32 over ``valid [R, K]`` bool."""
    _check("cache_weights", (scores,), scores, valid)
    return torch.ops.pcaf.cache_weights(scores, valid)


def cache_weights_grad(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``w·(g − Σ_k g·w)`` ``[R, K]``: the masked softmax's gradient from its weights ``w`` and theirs ``g``."""
    _check("cache_weights_grad", (w, g), w)
    return torch.ops.pcaf.cache_weights_grad(w, g)


def target_cache_prob(w: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                      ) -> torch.Tensor:
    """``[R]``: each row's weight on the slots that hold its target. w ``[R, K]`` float32, values ``[R, K]`` and
    targets ``[R]`` int64, valid ``[R, K]`` bool."""
    _check("target_cache_prob", (w,), w, values, valid, targets)
    return torch.ops.pcaf.target_cache_prob(w, values, valid, targets)


def target_cache_prob_grad(g: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                           ) -> torch.Tensor:
    """``[R, K]``: ``g [R]`` on the slots that hold each row's target, 0 elsewhere."""
    _check("target_cache_prob_grad", (g,), targets, values, valid, targets)
    return torch.ops.pcaf.target_cache_prob_grad(g, values, valid, targets)


def mixture_target(lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int) -> torch.Tensor:
    """The target's log-probability ``[R]`` under ``rule`` (:data:`FLOORED` or :data:`LOG`) from the head's ``lp``,
    ``p_cache`` at the target and the masked gate λ, ``[R]`` float32 each."""
    _check("mixture_target", (lp, pc, gate), lp)
    return torch.ops.pcaf.mixture_target(lp, pc, gate, rule)


def mixture_target_grad(g: torch.Tensor, lp: torch.Tensor, pc: torch.Tensor, gate: torch.Tensor, rule: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d lp, d p_cache, d λ)`` ``[R]`` of :func:`mixture_target` times ``g``."""
    _check("mixture_target_grad", (g, lp, pc, gate), lp)
    return torch.ops.pcaf.mixture_target_grad(g, lp, pc, gate, rule)


def mask_gate(raw: torch.Tensor, any_valid: torch.Tensor, clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    """The masked gate ``[R]`` of raw λ ``[R]`` float32 and ``any_valid`` ``[R]`` bool."""
    _check("mask_gate", (raw,), raw, any_valid)
    return torch.ops.pcaf.mask_gate(raw, any_valid, clip_when_empty, per_term)


def mask_gate_grad(g: torch.Tensor, raw: torch.Tensor, any_valid: torch.Tensor, per_term: bool) -> torch.Tensor:
    """The gradient ``[R]`` in raw λ of :func:`mask_gate` times ``g`` ``[R]``."""
    _check("mask_gate_grad", (g, raw), raw, any_valid)
    return torch.ops.pcaf.mask_gate_grad(g, raw, any_valid, per_term)
