"""The cache's per-slot passes on CUDA, one kernel each way: the candidates' scores from their products, the cache
weights and ``p_cache`` at the target.

Once the query–key products of the candidates exist, a training step's memory read works on the K slots of each
query (``[B, Q, K]``). In ATen the scores' scale and recency term are five kernels forward and four backward, the
masked softmax ten forward and four backward and the hit sum five, and an eager step on a GPU waits on the host to
launch each. Here each pass is one kernel that reads its rows once, in float32
(:mod:`backends.torch.mixture` makes the choice; :mod:`backends.torch.kernels.mixture_rows` holds the per-query
passes that follow).

Ops (namespace ``pcaf``), each the Triton kernel where :func:`backends.torch.kernels.triton_enabled` holds and the
ATen form elsewhere (the ``*_torch`` functions: the reference the kernels are tested against,
``tests/test_torch_mixture_rows.py``). Rows are contiguous, ``[R, K]`` is ``[B·Q, K]``:

- ``pcaf::candidate_scores(Tensor dots, Tensor index, Tensor recency, Tensor rho, float sqrt_d) -> Tensor``: dots
  ``[R, K]`` (the products ``q·k``, float32 or 16-bit), index ``[R, K]`` int64 (-1 = empty, read as position 0),
  recency ``[T]`` float32, rho a float32 scalar tensor -> the scores ``dots/√d + ρ·r[index]`` ``[R, K]`` float32,
  ``dots/√d`` rounded to the products' dtype first, as ATen's chain holds it;
- ``pcaf::candidate_scores_grad(Tensor g, Tensor index, Tensor recency, float sqrt_d, ScalarType dtype) -> (Tensor,
  Tensor)``: the gradient in the products (g cast to their ``dtype``, divided by √d, in that dtype) and the
  per-program partial sums of ``g·r[index]`` whose sum is ρ's gradient (summed in a fixed order, no atomics);
- ``pcaf::cache_weights(Tensor scores, Tensor valid) -> Tensor``: scores ``[R, K]`` float32, valid ``[R, K]`` bool
  -> the masked softmax ``w [R, K]``: ``exp(s − max)`` over the valid slots, divided by their sum floored at
  float32's ``tiny`` (an empty row is all 0);
- ``pcaf::cache_weights_grad(Tensor w, Tensor g) -> Tensor``: ``w·(g − Σ_k g·w)``, ``[R, K]``;
- ``pcaf::target_cache_prob(Tensor w, Tensor values, Tensor valid, Tensor targets) -> Tensor``: values ``[R, K]``
  int64, targets ``[R]`` int64 -> ``p_cache(y) = Σ_k w·[valid ∧ value = y]``, ``[R]``;
- ``pcaf::target_cache_prob_grad(Tensor g, Tensor values, Tensor valid, Tensor targets) -> Tensor``: ``g`` ``[R]`` ->
  ``g·[valid ∧ value = y]``, ``[R, K]``.

``exp`` may differ from ATen's in the last float32 bit, and sums run in another order: the kernels agree with the
ATen forms to float32 rounding, not bit for bit (the scores' division is the correctly rounded one, ATen's on CUDA
a product with the reciprocal).
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

    from backends.torch.kernels.triton_math import as_stored
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
    def _candidate_scores_kernel(dots_ptr, index_ptr, rec_ptr, rho_ptr, out_ptr, R, K, sqrt_d,
                                 DOTS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``."""
        _, offs, inside = _row_block(R, K, BLOCK_R, BLOCK_K)
        dots = tl.load(dots_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        index = tl.maximum(tl.load(index_ptr + offs, mask=inside, other=0), 0)
        rec = tl.load(rec_ptr + index, mask=inside, other=0.0)
        rho = tl.load(rho_ptr)
        scaled = as_stored(tl.div_rn(dots, sqrt_d), dots_ptr, DOTS_BF16)
        tl.store(out_ptr + offs, scaled + rho * rec, mask=inside)

    @triton.jit
    def _candidate_scores_grad_kernel(g_ptr, index_ptr, rec_ptr, d_dots_ptr, partial_ptr, R, K, sqrt_d,
                                      DOTS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``; ``partial`` holds one float32 a program."""
        _, offs, inside = _row_block(R, K, BLOCK_R, BLOCK_K)
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        index = tl.maximum(tl.load(index_ptr + offs, mask=inside, other=0), 0)
        rec = tl.load(rec_ptr + index, mask=inside, other=0.0)
        cast = as_stored(g, d_dots_ptr, DOTS_BF16)  # autograd casts the gradient to the products' dtype
        d_dots = as_stored(tl.div_rn(cast, sqrt_d), d_dots_ptr, DOTS_BF16)
        tl.store(d_dots_ptr + offs, d_dots.to(d_dots_ptr.dtype.element_ty), mask=inside)
        tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.sum(g * rec, axis=1), axis=0))

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


def candidate_scores_torch(dots: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, rho: torch.Tensor,
                           sqrt_d: float) -> torch.Tensor:
    return dots / sqrt_d + rho * recency[index.clamp(min=0)]


def candidate_scores_grad_torch(g: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, sqrt_d: float,
                                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d dots, [d ρ])``: one partial sum, the whole of ρ's gradient."""
    return g.to(dtype) / sqrt_d, (g * recency[index.clamp(min=0)]).sum().reshape(1)


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


@torch.library.custom_op("pcaf::candidate_scores", mutates_args=())
def _candidate_scores(dots: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, rho: torch.Tensor,
                      sqrt_d: float) -> torch.Tensor:
    if not _use_triton(dots):
        return candidate_scores_torch(dots, index, recency, rho, sqrt_d)
    R, K = dots.shape
    out = torch.empty(R, K, dtype=torch.float32, device=dots.device)
    if R:
        grid, block_r, block_k = _row_grid(R, K)
        _candidate_scores_kernel[(grid,)](dots, index, recency, rho, out, R, K, sqrt_d,
                                          DOTS_BF16=dots.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_K=block_k)
    return out


@_candidate_scores.register_fake
def _(dots: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, rho: torch.Tensor, sqrt_d: float
      ) -> torch.Tensor:
    return dots.new_empty(dots.shape, dtype=torch.float32)


@torch.library.custom_op("pcaf::candidate_scores_grad", mutates_args=())
def _candidate_scores_grad(g: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, sqrt_d: float,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(g):
        return candidate_scores_grad_torch(g, index, recency, sqrt_d, dtype)
    R, K = g.shape
    grid, block_r, block_k = _row_grid(R, K)
    d_dots = torch.empty(R, K, dtype=dtype, device=g.device)
    partial = torch.zeros(max(grid, 1), dtype=torch.float32, device=g.device)
    if R:
        _candidate_scores_grad_kernel[(grid,)](g, index, recency, d_dots, partial, R, K, sqrt_d,
                                               DOTS_BF16=dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_K=block_k)
    return d_dots, partial


@_candidate_scores_grad.register_fake
def _(g: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, sqrt_d: float, dtype: torch.dtype
      ) -> tuple[torch.Tensor, torch.Tensor]:
    grid = _row_grid(g.shape[0], g.shape[1])[0] if triton is not None else 1
    return g.new_empty(g.shape, dtype=dtype), g.new_empty((max(grid, 1),), dtype=torch.float32)


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


SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_scores(name: str, rows: torch.Tensor, index: torch.Tensor, recency: torch.Tensor) -> None:
    if rows.ndim != 2 or rows.dtype not in SCORE_DTYPES or not rows.is_contiguous():
        raise ValueError(f"{name} takes contiguous [R, K] float32/bfloat16/float16 rows, got {rows.dtype} of shape "
                         f"{tuple(rows.shape)} and strides {rows.stride()}")
    if index.shape != rows.shape or index.dtype != torch.int64 or not index.is_contiguous():
        raise ValueError(f"{name} takes a contiguous int64 index of shape {tuple(rows.shape)}, got {index.dtype} of "
                         f"shape {tuple(index.shape)}")
    if recency.ndim != 1 or recency.dtype != torch.float32 or not recency.is_contiguous():
        raise ValueError(f"{name} takes a contiguous [T] float32 recency, got {recency.dtype} of shape "
                         f"{tuple(recency.shape)}")


def candidate_scores(dots: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, rho: torch.Tensor,
                     sqrt_d: float) -> torch.Tensor:
    """The scores ``dots/√d + ρ·recency[index]`` ``[R, K]`` float32 (see the module docstring)."""
    _check_scores("candidate_scores", dots, index, recency)
    if rho.numel() != 1 or rho.dtype != torch.float32:
        raise ValueError(f"candidate_scores takes ρ as one float32, got {rho.dtype} of shape {tuple(rho.shape)}")
    return torch.ops.pcaf.candidate_scores(dots, index, recency, rho.reshape(()), sqrt_d)


def candidate_scores_grad(g: torch.Tensor, index: torch.Tensor, recency: torch.Tensor, sqrt_d: float,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d dots [R, K] in dtype, d ρ)`` of :func:`candidate_scores` times ``g`` ``[R, K]`` float32; d ρ is a 0-d
    float32 tensor."""
    _check_scores("candidate_scores_grad", g, index, recency)
    if g.dtype != torch.float32 or dtype not in SCORE_DTYPES:
        raise ValueError(f"candidate_scores_grad takes a float32 gradient into float32/bfloat16/float16 products, "
                         f"got {g.dtype} into {dtype}")
    d_dots, partial = torch.ops.pcaf.candidate_scores_grad(g, index, recency, sqrt_d, dtype)
    return d_dots, partial.sum()


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
