"""The gate's last layer, sigmoid and mask on CUDA, one kernel each way: ``pcaf::masked_gate``.

The learned gate (:class:`backends.torch.layers.Gate`) ends in a ``d/2 → 1`` linear layer on the GELU of its hidden
layer, a sigmoid, and :func:`pcaf_core.mixture.mask_gate`'s mask and clip. In ATen that is the GELU, a one-column
matrix product, a cast, the sigmoid and the mask forward, and backward the mask's and the sigmoid's gradients, the
cast, the column's scatter, two products, the bias sum and GELU's gradient: thirteen kernels an eager step on a GPU
waits on the host to launch. Here:

- ``pcaf::masked_gate(Tensor pre, Tensor w, Tensor b, Tensor any_valid, bool tanh, bool clip_when_empty,
  bool per_term) -> Tensor``: pre ``[R, D]`` (the hidden layer's output before GELU), w ``[D]`` and b ``[1]`` in
  pre's dtype (float32 or 16-bit), any_valid ``[R]`` bool -> the masked gate λ ``[R]`` float32;
- ``pcaf::masked_gate_grad(Tensor g, Tensor pre, Tensor w, Tensor b, Tensor any_valid, bool tanh, bool per_term)
  -> (Tensor, Tensor)``: the gradient in pre ``[R, D]`` (pre's dtype) and per-program partial sums ``[P, D + 1]``
  float32 of the gradients in w and b (their sum over programs, in a fixed order: :func:`masked_gate_grad`).

Every intermediate is rounded to the dtype ATen's chain holds it in: GELU's output and the layer's output in pre's
dtype, the sigmoid and the mask in float32, the layer output's gradient cast back to pre's dtype before the
products. The products themselves sum in another order than cuBLAS's, and GELU's ``erf`` and ``exp`` may differ
in the last float32 bit: the kernels agree with ATen's chain (:func:`masked_gate_torch`) to float32 rounding in
float32 and to one unit of the 16-bit dtype (``tests/test_torch_gate.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch.kernels.ops import triton_enabled
from pcaf_core.mixture import GATE_CLIP

try:
    import triton
    import triton.language as tl

    from backends.torch.kernels.triton_math import as_stored, gelu, gelu_slope
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

ROW_ELEMENTS = 2048
"""``[rows, D]`` elements a program (D padded to a power of two): 16 a thread at 4 warps."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _gate_rows(pre_ptr, w_ptr, b_ptr, any_ptr, R, D, TANH: tl.constexpr, BF16: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's rows: ``(rows, offs, inside, pre, a, w, σ, valid)`` with ``a`` GELU's output and ``σ``
        the sigmoid of the layer's output, each as ATen's chain holds it."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        inside = (rows < R)[:, None] & (cols < D)[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        pre = tl.load(pre_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        a = tl.where(inside, as_stored(gelu(pre, TANH), pre_ptr, BF16), 0.0)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        b = tl.load(b_ptr).to(tl.float32)
        logit = as_stored(tl.sum(a * w[None, :], axis=1) + b, pre_ptr, BF16)
        sigma = 1.0 / (1.0 + tl.exp(-logit))
        valid = tl.load(any_ptr + rows, mask=rows < R, other=0) != 0
        return rows, offs, inside, pre, a, w, sigma, valid

    @triton.jit
    def _masked_gate_kernel(pre_ptr, w_ptr, b_ptr, any_ptr, out_ptr, R, D, CLIP: tl.constexpr,
                            TANH: tl.constexpr, CLIP_WHEN_EMPTY: tl.constexpr, PER_TERM: tl.constexpr,
                            BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``."""
        rows, _, _, _, _, _, sigma, valid = _gate_rows(pre_ptr, w_ptr, b_ptr, any_ptr, R, D, TANH, BF16, BLOCK_R,
                                                       BLOCK_D)
        lam = sigma * tl.where(valid, 1.0, 0.0)
        if not PER_TERM:
            lam = tl.minimum(tl.maximum(lam, CLIP), 1.0 - CLIP)
            if not CLIP_WHEN_EMPTY:
                lam = tl.where(valid, lam, 0.0)
        tl.store(out_ptr + rows, lam, mask=rows < R)

    @triton.jit
    def _masked_gate_grad_kernel(g_ptr, pre_ptr, w_ptr, b_ptr, any_ptr, d_pre_ptr, partial_ptr, R, D,
                                 CLIP: tl.constexpr, TANH: tl.constexpr, PER_TERM: tl.constexpr, BF16: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid ``(cdiv(R, BLOCK_R),)``; ``partial`` row p holds program p's sums of the gradients in w (D) and b."""
        rows, offs, inside, pre, a, w, sigma, valid = _gate_rows(pre_ptr, w_ptr, b_ptr, any_ptr, R, D, TANH, BF16,
                                                                 BLOCK_R, BLOCK_D)
        on = tl.where(valid, 1.0, 0.0)
        d_raw = tl.load(g_ptr + rows, mask=rows < R, other=0.0) * on
        if not PER_TERM:
            lam = sigma * on
            d_raw = tl.where((lam >= CLIP) & (lam <= 1.0 - CLIP), d_raw, 0.0)
        d_logit = as_stored(d_raw * (1.0 - sigma) * sigma, pre_ptr, BF16)  # cast to the layer's dtype
        d_a = as_stored(d_logit[:, None] * w[None, :], pre_ptr, BF16)
        d_pre = as_stored(d_a * gelu_slope(pre, TANH), pre_ptr, BF16)
        tl.store(d_pre_ptr + offs, d_pre.to(d_pre_ptr.dtype.element_ty), mask=inside)
        cols = tl.arange(0, BLOCK_D)
        base = partial_ptr + tl.program_id(0).to(tl.int64) * (D + 1)
        tl.store(base + cols, tl.sum(d_logit[:, None] * a, axis=0), mask=cols < D)
        tl.store(base + D, tl.sum(d_logit, axis=0))


def _grid(R: int, D: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(max(D, 1))
    block_r = max(1, ROW_ELEMENTS // block_d)
    return triton.cdiv(R, block_r), block_r, block_d


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and triton_enabled(x)


# ------------------------------------------------------------------ ATen's chain (the kernels' reference)


def masked_gate_torch(pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor, tanh: bool,
                      clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    """:class:`backends.torch.layers.Gate`'s last layer and sigmoid, then :func:`pcaf_core.mixture.mask_gate`."""
    from backends.torch.kernels.mixture_rows import mask_gate_torch

    a = F.gelu(pre, approximate="tanh" if tanh else "none")
    raw = torch.sigmoid(F.linear(a, w[None], b)[..., 0].float())
    return mask_gate_torch(raw, any_valid, clip_when_empty, per_term)


def masked_gate_grad_torch(g: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                           any_valid: torch.Tensor, tanh: bool, per_term: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d pre, [1, D + 1] partial)``: the chain rule through :func:`masked_gate_torch`, term by term as autograd
    runs it (each gradient in the dtype autograd holds it in; tests/test_torch_gate.py checks the two agree). It is
    written out rather than left to ``torch.autograd.grad`` because it is also the op's form off Triton, and an
    op's body runs below autograd."""
    from backends.torch.kernels.mixture_rows import mask_gate_grad_torch

    approximate = "tanh" if tanh else "none"
    a = F.gelu(pre, approximate=approximate)
    raw = torch.sigmoid(F.linear(a, w[None], b)[..., 0].float())
    d_raw = mask_gate_grad_torch(g, raw, any_valid, per_term)
    d_z = (d_raw * (1.0 - raw) * raw).to(pre.dtype)  # the sigmoid's gradient, cast back as the `.float()`'s is
    d_w = (d_z[None] @ a)[0]  # [D]: the one-column product's weight gradient
    d_b = d_z.sum(0, keepdim=True)
    d_pre = torch.ops.aten.gelu_backward(d_z[:, None] * w[None], pre, approximate=approximate)
    return d_pre, torch.cat([d_w.float(), d_b.float()])[None]


# ------------------------------------------------------------------ the ops


@torch.library.custom_op("pcaf::masked_gate", mutates_args=())
def _masked_gate(pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor, tanh: bool,
                 clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    if not _use_triton(pre):
        return masked_gate_torch(pre, w, b, any_valid, tanh, clip_when_empty, per_term)
    R, D = pre.shape
    out = torch.empty(R, dtype=torch.float32, device=pre.device)
    if R:
        grid, block_r, block_d = _grid(R, D)
        _masked_gate_kernel[(grid,)](pre, w, b, any_valid.view(torch.uint8), out, R, D, CLIP=GATE_CLIP, TANH=tanh,
                                     CLIP_WHEN_EMPTY=clip_when_empty, PER_TERM=per_term,
                                     BF16=pre.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_D=block_d)
    return out


@_masked_gate.register_fake
def _(pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor, tanh: bool,
      clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    return pre.new_empty((pre.shape[0],), dtype=torch.float32)


@torch.library.custom_op("pcaf::masked_gate_grad", mutates_args=())
def _masked_gate_grad(g: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor,
                      tanh: bool, per_term: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(pre):
        return masked_gate_grad_torch(g, pre, w, b, any_valid, tanh, per_term)
    R, D = pre.shape
    grid, block_r, block_d = _grid(R, D)
    d_pre = torch.empty_like(pre)
    partial = torch.zeros(max(grid, 1), D + 1, dtype=torch.float32, device=pre.device)
    if R:
        _masked_gate_grad_kernel[(grid,)](g, pre, w, b, any_valid.view(torch.uint8), d_pre, partial, R, D,
                                          CLIP=GATE_CLIP, TANH=tanh, PER_TERM=per_term,
                                          BF16=pre.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_D=block_d)
    return d_pre, partial


@_masked_gate_grad.register_fake
def _(g: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor, tanh: bool,
      per_term: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _grid(*pre.shape)[0] if triton is not None else 1
    return torch.empty_like(pre), pre.new_empty((max(rows, 1), pre.shape[1] + 1), dtype=torch.float32)


# ------------------------------------------------------------------ checked entry points


def _check(pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor) -> None:
    if pre.ndim != 2 or pre.dtype not in KERNEL_DTYPES or not pre.is_contiguous():
        raise ValueError(f"masked_gate takes contiguous [R, D] float32/bfloat16/float16 rows, got {pre.dtype} of "
                         f"shape {tuple(pre.shape)} and strides {pre.stride()}")
    if w.shape != pre.shape[1:] or b.shape != (1,) or w.dtype != pre.dtype or b.dtype != pre.dtype \
            or not w.is_contiguous():
        raise ValueError(f"masked_gate takes w [{pre.shape[1]}] and b [1] in the rows' dtype {pre.dtype}, got "
                         f"{w.dtype} {tuple(w.shape)} and {b.dtype} {tuple(b.shape)}")
    if any_valid.shape != pre.shape[:1] or any_valid.dtype != torch.bool or not any_valid.is_contiguous():
        raise ValueError(f"masked_gate takes a contiguous [{pre.shape[0]}] bool any_valid, got {any_valid.dtype} of "
                         f"shape {tuple(any_valid.shape)}")


def masked_gate(pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor, *, tanh: bool,
                clip_when_empty: bool, per_term: bool) -> torch.Tensor:
    """The masked gate λ ``[R]`` float32 (see the module docstring)."""
    _check(pre, w, b, any_valid)
    return torch.ops.pcaf.masked_gate(pre, w, b, any_valid, tanh, clip_when_empty, per_term)


def masked_gate_grad(g: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor,
                     *, tanh: bool, per_term: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d pre [R, D], d w [D], d b [1])`` in pre's dtype: :func:`masked_gate`'s gradients times ``g`` ``[R]``
    float32 (w's and b's summed over the kernel's programs in float32, then rounded once)."""
    _check(pre, w, b, any_valid)
    if g.shape != pre.shape[:1] or g.dtype != torch.float32 or not g.is_contiguous():
        raise ValueError(f"masked_gate_grad takes a contiguous [{pre.shape[0]}] float32 gradient, got {g.dtype} of "
                         f"shape {tuple(g.shape)}")
    d_pre, partial = torch.ops.pcaf.masked_gate_grad(g, pre, w, b, any_valid, tanh, per_term)
    totals = partial.sum(0).to(pre.dtype)
    return d_pre, totals[:-1], totals[-1:]
