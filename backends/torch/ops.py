"""Memory-bounded gather primitives shared by routing and scoring.

Scoring C candidate slots per query needs ``x_q · y_{idx[q, c]}``. Gathering ``y`` to
``[B, Q, C, d]`` and letting autograd keep it costs ``B·Q·C·d`` floats for the backward pass (gigabytes
for full-AR training at paper scale), so :func:`gather_dot` keeps only the inputs and the integer index.

On the CPU in float32/float64 the three products are sparse: with ``G`` the ``[B·Q, B·T]`` CSR matrix that
holds one entry per slot (row ``b·Q + q``, column ``b·T + idx``), the forward is a sampled dense-dense
product (``x @ yᵀ`` at G's entries), and the backward is ``gx = G·y`` and ``gy = Gᵀ·x`` (Gᵀ built by a
sort) with the incoming gradient as the values. These run as MKL/ATen sparse kernels without any
``[*, C, d]`` temporary, about 4-6x faster than gathering rows here (benchmarks/bench_routing.py).
Elsewhere (CUDA, bf16 under autocast, inside ``torch.compile``) the rows are gathered chunk by chunk in
both directions instead; on CUDA the key-side gradient is one deterministic segmented sum
(``backends.torch.kernels.gather_grad``) rather than chunked ``index_add_`` calls.

Where the slots are each query's sorted predecessors in a bucket layout (the ``recent`` slots of full-AR
queries, and the ``topk_score`` route's window), :func:`banded_dot` computes the same products with blocked
GEMMs and no row gathers at all (mirrors :func:`backends.jax.ops.banded_dot`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from backends.torch.kernels.gather_grad import gather_dot_grad_y
from backends.torch.records import step_constant

CHUNK_ELEMENTS = 1 << 22  # elements per temporary chunk on a CPU (16 MiB in float32)
CHUNK_ELEMENTS_CUDA = 1 << 26
"""... and on a CUDA device (256 MiB in float32): each chunk costs a handful of kernel launches a direction, and
the full-AR step on an H100 waits on launches (docs/results/bench_cuda.md); at the paper shape (T = 1,024,
batch 8, K = 16, d = 256: 33.5M gathered elements) this is one chunk instead of eight."""


def chunk_elements_for(t: torch.Tensor, chunk_elements: int | None) -> int:
    """``chunk_elements``, or the default for ``t``'s device when None (:data:`CHUNK_ELEMENTS`,
    :data:`CHUNK_ELEMENTS_CUDA`)."""
    if chunk_elements is not None:
        return chunk_elements
    return CHUNK_ELEMENTS_CUDA if t.is_cuda else CHUNK_ELEMENTS


def row_offsets(B: int, T: int, device: torch.device) -> torch.Tensor:
    """``[B]`` int64 ``b·T``: where batch row b starts in a flattened ``[B·T, ...]`` tensor (one kernel, not an
    arange and a multiply; made once per shape for eager steps, :func:`backends.torch.records.step_constant`)."""
    if T <= 0:
        return torch.zeros(B, dtype=torch.int64, device=device)
    return step_constant(("row_offsets", B, T, torch.device(device)),
                         lambda: torch.arange(0, B * T, T, device=device))


def batch_gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[b, index[b, ...]]``: values ``[B, T, *F]``, index ``[B, *I]`` (in range) -> ``[B, *I, *F]``."""
    B, T = values.shape[:2]
    # index_select over the flattened [B*T, *F] rows: a contiguous row copy, well ahead of the advanced
    # indexing values[b, index] on the CPU (the routes' key and record gathers are memory-bound).
    rows = (index.reshape(B, -1) + row_offsets(B, T, index.device)[:, None]).reshape(-1)
    out = values.reshape(B * T, *values.shape[2:]).index_select(0, rows)
    return out.reshape(*index.shape, *values.shape[2:])


class _PermuteRows(torch.autograd.Function):
    """``values[b, perm[b, t]]`` for a permutation ``perm`` with inverse ``inverse``: the backward is the inverse
    gather, not the zero-fill and scatter-add that autograd would run for a general index."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return batch_gather(values, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return batch_gather(grad, inverse), None, None


def permute_rows(values: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``values [B, T, *F]`` with its rows permuted by ``perm [B, T]`` (``inverse``: its inverse permutation)."""
    return _PermuteRows.apply(values, perm, inverse)


def banded_dot(order: torch.Tensor, rank: torch.Tensor, x: torch.Tensor, y: torch.Tensor, width: int) -> torch.Tensor:
    """``out[b, t, j] = x[b, t] · y[b, order[b, rank[b, t] - 1 - j]]`` for j < ``width``: every position's
    products with its ``width`` predecessors in a sorted layout.

    Args:
        order: ``[B, T]`` int64 position stored at each sorted slot; rank: ``[B, T]`` its inverse.
        x: ``[B, T, d]`` one row per position (full-AR queries); y: ``[B, T, d]`` per-position rows.
        width: W, the predecessors per position.
    Returns:
        ``[B, T, W]``, differentiable in ``x`` and ``y``. Entries whose slot ``rank - 1 - j`` is negative are
        junk for the caller to mask (as are slots outside a query's bucket segment).

    In sorted order the products form a band of ``x_sorted · y_sortedᵀ``: each block of W sorted rows of x
    is multiplied by the W sorted rows of y before it and by its own W (two batched GEMMs of ``T·W·d``
    multiply-adds each, on non-overlapping views, so neither direction copies y's rows into blocks), and the
    band is read off the ``[W, 2W]`` products by a skewing reshape. The backward pass is the same GEMMs and
    the reshape's transpose; no ``[T, W, d]`` tensor exists in either.
    """
    B, T, d = x.shape
    W = width
    nb = -(-T // W)
    pad = nb * W - T
    xs = F.pad(permute_rows(x, order, rank), (0, 0, 0, pad)).view(B, nb, W, d)
    ys = F.pad(permute_rows(y, order, rank), (0, 0, W, pad)).view(B, nb + 1, W, d)  # W zero rows first
    prod = torch.cat([xs @ ys[:, :nb].transpose(-1, -2), xs @ ys[:, 1:].transpose(-1, -2)], dim=-1)  # [B, nb, W, 2W]
    # Row r of a block is column W + r of its y rows; its j-th predecessor is column W + r - 1 - j, i.e.
    # columns r .. r + W - 1 reversed. Row r is shifted left by r by re-reading the flat [W, 2W] block with
    # rows of 2W + 1 (a view, so its backward is a view too, not a scatter).
    flat = F.pad(prod.reshape(B, nb, W * 2 * W), (0, W))
    shifted = flat.view(B, nb, W, 2 * W + 1)[..., :W]  # [r, c] = prod[r, r + c]
    by_slot = shifted.flip(-1).reshape(B, nb * W, W)[:, :T]
    return permute_rows(by_slot, rank, order)


def _query_chunk(n_queries: int, per_query: int, chunk_elements: int) -> int:
    return max(1, min(n_queries, chunk_elements // max(per_query, 1)))


def _gather_dot_forward(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, chunk_elements: int) -> torch.Tensor:
    B, Q, C = index.shape
    out = x.new_empty(B, Q, C)
    qc = _query_chunk(Q, B * C * x.shape[-1], chunk_elements)
    for q0 in range(0, Q, qc):
        yg = batch_gather(y, index[:, q0 : q0 + qc])  # [B, qc, C, d]
        out[:, q0 : q0 + qc] = (yg @ x[:, q0 : q0 + qc, :, None])[..., 0]
    return out


def _sparse_path(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether :func:`gather_dot` takes the CSR products: CPU float32/float64 outside ``torch.compile``, and
    at most as many slots as the dense ``[B·Q, B·T]`` matrix has entries (C <= B·T; ATen's sampled product
    cannot hold more entries than that, which only windows shorter than C reach)."""
    B, _, C = index.shape
    return (index.numel() > 0 and C <= B * y.shape[1] and x.device.type == "cpu" and y.device.type == "cpu"
            and x.dtype == y.dtype and x.dtype in (torch.float32, torch.float64)
            and not torch.compiler.is_compiling())


def _slot_matrix(index: torch.Tensor, values: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``[B·Q, B·n_cols]`` CSR matrix with one entry per slot: row ``b·Q + q``, column ``b·n_cols +
    index[b, q, c]``, value ``values[b, q, c]`` (C entries a row, in slot order; repeated columns add up)."""
    B, Q, C = index.shape
    # The sparse kernels do not bound-check (an index out of range would corrupt memory, not raise), so
    # check here: two reductions over B·Q·C integers.
    if int(index.min()) < 0 or int(index.max()) >= n_cols:
        raise IndexError(f"gather_dot: index out of range [0, {n_cols}) (clip empty slots before calling)")
    cols = (index + row_offsets(B, n_cols, index.device)[:, None, None]).reshape(-1)
    crow = torch.arange(0, B * Q * C + 1, C, device=index.device)
    with warnings.catch_warnings():
        # ATen warns once that sparse CSR support is in beta (the products used here are tested).
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
        return torch.sparse_csr_tensor(crow, cols, values.reshape(-1), size=(B * Q, B * n_cols),
                                       check_invariants=False)


def _sparse_forward(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    B, Q, C = index.shape
    T, d = y.shape[1], y.shape[2]
    pattern = _slot_matrix(index, x.new_zeros(B * Q * C), T)
    out = torch.sparse.sampled_addmm(pattern, x.reshape(B * Q, d), y.reshape(B * T, d).T, beta=0.0)
    return out.values().view(B, Q, C)


def _sparse_backward(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, grad: torch.Tensor,
                     need_x: bool, need_y: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    B, Q, C = index.shape
    T, d = y.shape[1], y.shape[2]
    grad = grad.contiguous()
    gx = (_slot_matrix(index, grad, T) @ y.reshape(B * T, d)).view(B, Q, d) if need_x else None
    gy = (_transposed_slot_matrix(index, grad, T) @ x.reshape(B * Q, d)).view(B, T, d) if need_y else None
    return gx, gy


def _transposed_slot_matrix(index: torch.Tensor, values: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Gᵀ of :func:`_slot_matrix` as a ``[B·n_cols, B·Q]`` CSR matrix, built by one stable sort of the slots'
    columns: about 1.5-2x faster here than ``G.t() @ x`` (which converts the CSC transpose back to CSR)."""
    B, Q, C = index.shape
    cols = (index + row_offsets(B, n_cols, index.device)[:, None, None]).reshape(-1)
    sorted_cols, perm = torch.sort(cols, stable=True)
    crow = torch.zeros(B * n_cols + 1, dtype=torch.int64, device=index.device)
    crow[1:] = torch.bincount(sorted_cols, minlength=B * n_cols).cumsum(0)
    rows = torch.div(perm, C, rounding_mode="floor")  # slot b·Q·C + q·C + c belongs to G's row b·Q + q
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
        return torch.sparse_csr_tensor(crow, rows, values.reshape(-1)[perm], size=(B * n_cols, B * Q),
                                       check_invariants=False)


def _segment_kernel_for(grad: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the gathered backward sums the key-side gradient with the deterministic segmented-sum kernel
    (``backends.torch.kernels.gather_grad``) instead of ``index_add_``: on CUDA, where deterministic mode makes
    ``index_add_`` a sort-based scatter that dominated the full-AR step's GPU time, for keys of at most 32 bits
    (the kernel sums in float32)."""
    return grad.is_cuda and y.dtype in (torch.float32, torch.bfloat16, torch.float16)


class _GatherDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, chunk_elements: int) -> torch.Tensor:
        ctx.save_for_backward(x, y, index)
        ctx.chunk_elements = chunk_elements
        if _sparse_path(x, y, index):
            return _sparse_forward(x, y, index)
        return _gather_dot_forward(x, y, index, chunk_elements)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, y, index = ctx.saved_tensors
        if _sparse_path(x, y, index):
            gx, gy = _sparse_backward(x, y, index, grad, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
            return gx, gy, None, None
        B, Q, C = index.shape
        T, d = y.shape[1], y.shape[2]
        kernel_gy = ctx.needs_input_grad[1] and _segment_kernel_for(grad, y)
        gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        gy = (torch.zeros(B * T, d, dtype=y.dtype, device=y.device) if ctx.needs_input_grad[1] and not kernel_gy
              else None)
        qc = _query_chunk(Q, B * C * d, ctx.chunk_elements)
        offset = row_offsets(B, T, index.device)[:, None, None]
        for q0 in range(0, Q, qc):
            g = grad[:, q0 : q0 + qc]  # [B, qc, C]
            if gx is not None:
                yg = batch_gather(y, index[:, q0 : q0 + qc])
                gx[:, q0 : q0 + qc] = (g[..., None, :] @ yg)[..., 0, :]
            if gy is not None:
                contrib = g[..., None] * x[:, q0 : q0 + qc, None, :]  # [B, qc, C, d]
                rows = (index[:, q0 : q0 + qc] + offset).reshape(-1)
                gy.index_add_(0, rows, contrib.reshape(-1, d))
        if kernel_gy:
            return gx, gather_dot_grad_y(x, grad, index, T).to(y.dtype), None, None
        return gx, (None if gy is None else gy.view(B, T, d)), None, None


def gather_dot(
    x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, *, chunk_elements: int | None = None
) -> torch.Tensor:
    """``out[b, q, c] = x[b, q] · y[b, index[b, q, c]]``.

    Args:
        x: ``[B, Q, d]`` (queries, or router distributions of the queries).
        y: ``[B, T, d]`` per-position rows (keys, or router distributions).
        index: ``[B, Q, C]`` int64 positions in ``[0, T)`` (clip empty slots before calling).
    Returns:
        ``[B, Q, C]``, differentiable in ``x`` and ``y``; no ``[B, Q, C, d]`` tensor is kept for backward.
        Off the sparse path the rows are gathered in chunks of at most ``chunk_elements`` (default: per device,
        :func:`chunk_elements_for`).
    """
    chunk_elements = chunk_elements_for(x, chunk_elements)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        # One tensor as both (full AR's router distributions score themselves): Dynamo cannot trace an
        # autograd.Function given the same tensor twice and breaks the compiled graph there; a view it can.
        return _GatherDot.apply(x, y.view_as(y) if y is x else y, index, chunk_elements)
    if _sparse_path(x, y, index):
        return _sparse_forward(x, y, index)
    return _gather_dot_forward(x, y, index, chunk_elements)
