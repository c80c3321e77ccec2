"""The key-side gradient of :func:`backends.torch.ops.gather_dot` on CUDA: a deterministic segmented sum.

``out[b, q, c] = x[b, q] · y[b, index[b, q, c]]`` has the gradient ``gy[b, t] = Σ grad[b, q, c] · x[b, q]`` over
the slots with ``index[b, q, c] == t``: a scatter-add with many repeats (every later query of a bucket reads the
same records). ``index_add_`` computes it, but with ``torch.use_deterministic_algorithms`` on (the torch backend
turns it on) CUDA runs ``index_add_`` as a sort-based ``index_put_(accumulate=True)``, which a profile of the
full-AR PCAF-context step on an H100 (T = 1,024, batch 8) put at 39% of the GPU's time, about 6 ms a step.

Here one stable sort of the slots by their target row groups each row's slots in slot order (a CSR layout of
Gᵀ), and :func:`_segment_rows_kernel` gives each row one program that sums its slots' ``grad · x`` rows in that
order, in float32: deterministic by construction (one writer per output element, a fixed summation order), with
no ``[slots, d]`` temporary. Slots whose gradient is exactly zero are left out of the sort's segments: callers
clip empty slots to position 0 and mask their scores, so at T = 8,192 with K = 32 most of the 262,144 slots
would otherwise form one segment on row 0 that a single program sums serially (the gathered routes took 20 ms
instead of 7 on an H100). They add nothing to the sum, except ``0 · inf = NaN``, which this sum does not
reproduce (a non-finite query row makes every other gradient of the step non-finite anyway).

Op ``pcaf::gather_dot_grad_y(Tensor x, Tensor grad, Tensor index, SymInt T) -> Tensor``: the Triton kernel where
:func:`backends.torch.kernels.triton_enabled` holds, :func:`gather_dot_grad_y_torch` (``index_add_``) elsewhere.
"""

from __future__ import annotations

import torch

from backends.torch.kernels.ops import triton_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

BLOCK_SLOTS = 16
"""Slots a program loads per step: 16 independent row loads in flight instead of one dependent chain."""
MAX_BLOCK_D = 256

if triton is not None:

    @triton.jit
    def _segment_rows_kernel(
        perm_ptr,  # [N] int64: slot ids b·Q·C + q·C + c, stably sorted by their target row
        crow_ptr,  # [R + 1] int64: row r's slots are perm[crow[r] : crow[r + 1]]
        grad_ptr,  # [N] float: the incoming gradient of each slot's product
        x_ptr,  # [B·Q, d] float: the query rows
        out_ptr,  # [R, d] float32 out
        d,
        C,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Grid ``(R, cdiv(d, BLOCK_D))``: program (r, j) writes columns ``j·BLOCK_D ..`` of row r."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cmask = cols < d
        start = tl.load(crow_ptr + r)
        end = tl.load(crow_ptr + r + 1)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i0 in range(start, end, BLOCK_S):
            i = i0 + tl.arange(0, BLOCK_S)
            smask = i < end
            slot = tl.load(perm_ptr + i, mask=smask, other=0)
            g = tl.load(grad_ptr + slot, mask=smask, other=0.0).to(tl.float32)
            xrow = slot // C
            xv = tl.load(x_ptr + xrow[:, None] * d + cols[None, :], mask=smask[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(g[:, None] * xv.to(tl.float32), axis=0)
        tl.store(out_ptr + r * d + cols, acc, mask=cmask)


def _rows(index: torch.Tensor, T: int) -> torch.Tensor:
    """``[B·Q·C]`` int64 target rows ``b·T + index[b, q, c]`` of the slots, in slot order."""
    B = index.shape[0]
    return (index + (torch.arange(B, device=index.device) * T)[:, None, None]).reshape(-1)


def gather_dot_grad_y_triton(x: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, T, d]`` float32 ``gy`` (module docstring) by one stable sort and :func:`_segment_rows_kernel`.

    Args:
        x: ``[B, Q, d]`` query rows; grad: ``[B, Q, C]`` gradient of the products; index: ``[B, Q, C]`` int64
            positions in ``[0, T)`` (empty slots clipped by the caller, their ``grad`` zero).
        T: the number of rows of ``y``.
    """
    B, Q, C = index.shape
    d = x.shape[-1]
    out = torch.empty(B * T, d, dtype=torch.float32, device=x.device)
    if B * T == 0 or d == 0:
        return out.view(B, T, d)
    # Zero-gradient slots get the sentinel row B·T, past every segment (module docstring).
    rows = torch.where(grad.reshape(-1) != 0, _rows(index, T), B * T)
    sorted_rows, perm = torch.sort(rows, stable=True)
    crow = torch.searchsorted(sorted_rows, torch.arange(B * T + 1, device=x.device))
    block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    _segment_rows_kernel[(B * T, triton.cdiv(d, block_d))](
        perm, crow, grad.contiguous().reshape(-1), x.contiguous().reshape(B * Q, d), out, d, C,
        BLOCK_S=BLOCK_SLOTS, BLOCK_D=block_d,
    )
    return out.view(B, T, d)


def gather_dot_grad_y_torch(x: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, T: int) -> torch.Tensor:
    """The same ``gy`` by ``index_add_`` of the ``[B·Q·C, d]`` float32 contributions (the reference the kernel is
    tested against; no chunking, so for small inputs only)."""
    B, Q, C = index.shape
    d = x.shape[-1]
    contrib = grad.float()[..., None] * x.float()[:, :, None, :]  # [B, Q, C, d]
    out = torch.zeros(B * T, d, dtype=torch.float32, device=x.device)
    return out.index_add_(0, _rows(index, T), contrib.reshape(-1, d)).view(B, T, d)


@torch.library.custom_op("pcaf::gather_dot_grad_y", mutates_args=())
def _gather_dot_grad_y(x: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, T: int) -> torch.Tensor:
    """``pcaf::gather_dot_grad_y``: see :func:`gather_dot_grad_y`."""
    if triton is not None and triton_enabled(x):
        return gather_dot_grad_y_triton(x, grad, index, T)
    return gather_dot_grad_y_torch(x, grad, index, T)


@_gather_dot_grad_y.register_fake
def _gather_dot_grad_y_fake(x: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, T: int) -> torch.Tensor:
    """Shapes only: ``[B, T, d]`` float32 on the input's device."""
    return x.new_empty((x.shape[0], T, x.shape[-1]), dtype=torch.float32)


def gather_dot_grad_y(x: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, T: int) -> torch.Tensor:
    """``gy[b, t] = Σ_{(q, c): index[b, q, c] = t} grad[b, q, c] · x[b, q]``, ``[B, T, d]`` float32, summed in
    slot order (deterministic); see the module docstring."""
    if index.shape[:2] != x.shape[:2] or grad.shape != index.shape:
        raise ValueError(f"gather_dot_grad_y: x {tuple(x.shape)}, grad {tuple(grad.shape)} and index "
                         f"{tuple(index.shape)} must share [B, Q] (grad and index [B, Q, C])")
    return torch.ops.pcaf.gather_dot_grad_y(x, grad, index, T)
