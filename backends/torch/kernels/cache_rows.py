"""The cache's per-slot passes on CUDA, one kernel each way: the cache weights and ``p_cache`` at the target.

After the candidates are scored, a training step's memory read works on the K slots of each query (``[B, Q, K]``).
In ATen the masked softmax is ten kernels forward and four backward and the hit sum five, and an eager step on a
GPU waits on the host to launch each. Here each pass is one kernel that reads its rows once, in float32
(:mod:`backends.torch.mixture` makes the choice; :mod:`backends.torch.kernels.mixture_rows` holds the per-query
passes that follow).

Ops (namespace ``pcaf``), each the Triton kernel where :func:`backends.torch.kernels.triton_enabled` holds and the
ATen form elsewhere (the ``*_torch`` functions: the reference the kernels are tested against,
``tests/test_torch_mixture_rows.py``). Rows are contiguous, ``[R, K]`` is ``[B·Q, K]``:

- ``pcaf::cache_weights(Tensor scores, Tensor valid) -> Tensor``: scores ``[R, K]`` float32, valid ``[R, K]`` bool
  -> the masked softmax ``w [R, K]``: ``exp(s − max)`` over the valid slots, divided by their sum floored at
  float32's ``tiny`` (an empty row is all 0);
- ``pcaf::cache_weights_grad(Tensor w, Tensor g) -> Tensor``: ``w·(g − Σ_k g·w)``, ``[R, K]``;
- ``pcaf::target_cache_prob(Tensor w, Tensor values, Tensor valid, Tensor targets) -> Tensor``: values ``[R, K]``
  int64, targets ``[R]`` int64 -> ``p_cache(y) = Σ_k w·[valid ∧ value = y]``, ``[R]``;
- ``pcaf::target_cache_prob_grad(Tensor g, Tensor values, Tensor valid, Tensor targets) -> Tensor``: ``g`` ``[R]`` ->
  ``g·[valid ∧ value = y]``, ``[R, K]``.

``exp`` may differ from ATen's in the last float32 bit, and a row's sums run in another order: the kernels agree
with the ATen forms to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import math

import torch

from backends.torch.kernels._common import check_rows
from backends.torch.kernels.ops import triton_enabled
from pcaf_core.mixture import MASKED_SCORE

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

ROW_ELEMENTS = 2048
"""``[rows, K]`` elements a program (``K`` padded to a power of two): 16 a thread at 4 warps."""
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


# ------------------------------------------------------------------ checked entry points


def cache_weights(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The masked softmax ``[R, K]`` of ``scores [R, K]`` float32 over ``valid [R, K]`` bool."""
    check_rows("cache_weights", (scores,), scores, valid)
    return torch.ops.pcaf.cache_weights(scores, valid)


def cache_weights_grad(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``w·(g − Σ_k g·w)`` ``[R, K]``: the masked softmax's gradient from its weights ``w`` and theirs ``g``."""
    check_rows("cache_weights_grad", (w, g), w)
    return torch.ops.pcaf.cache_weights_grad(w, g)


def target_cache_prob(w: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                      ) -> torch.Tensor:
    """``[R]``: each row's weight on the slots that hold its target. w ``[R, K]`` float32, values ``[R, K]`` and
    targets ``[R]`` int64, valid ``[R, K]`` bool."""
    check_rows("target_cache_prob", (w,), w, values, valid, targets)
    return torch.ops.pcaf.target_cache_prob(w, values, valid, targets)


def target_cache_prob_grad(g: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
                           ) -> torch.Tensor:
    """``[R, K]``: ``g [R]`` on the slots that hold each row's target, 0 elsewhere."""
    check_rows("target_cache_prob_grad", (g,), targets, values, valid, targets)
    return torch.ops.pcaf.target_cache_prob_grad(g, values, valid, targets)
