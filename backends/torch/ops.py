"""Memory-bounded gather primitives shared by routing and scoring.

Scoring C candidate slots per query needs ``x_q · y_{idx[q, c]}``. Gathering ``y`` to
``[B, Q, C, d]`` and letting autograd keep it costs ``B·Q·C·d`` floats for the backward pass (gigabytes
for full-AR training at paper scale), so :func:`gather_dot` recomputes the gather chunk by chunk in
both directions and keeps only the inputs and the integer index.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

CHUNK_ELEMENTS = 1 << 22  # elements per temporary chunk (16 MiB in float32)


def batch_gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[b, index[b, ...]]``: values ``[B, T, *F]``, index ``[B, *I]`` (in range) -> ``[B, *I, *F]``."""
    B, T = values.shape[:2]
    # index_select over the flattened [B*T, *F] rows: a contiguous row copy, well ahead of the advanced
    # indexing values[b, index] on the CPU (the routes' key and record gathers are memory-bound).
    rows = (index.reshape(B, -1) + (torch.arange(B, device=index.device) * T)[:, None]).reshape(-1)
    out = values.reshape(B * T, *values.shape[2:]).index_select(0, rows)
    return out.reshape(*index.shape, *values.shape[2:])


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


class _GatherDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, chunk_elements: int) -> torch.Tensor:
        ctx.save_for_backward(x, y, index)
        ctx.chunk_elements = chunk_elements
        return _gather_dot_forward(x, y, index, chunk_elements)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, y, index = ctx.saved_tensors
        B, Q, C = index.shape
        T, d = y.shape[1], y.shape[2]
        gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        gy = torch.zeros(B * T, d, dtype=y.dtype, device=y.device) if ctx.needs_input_grad[1] else None
        qc = _query_chunk(Q, B * C * d, ctx.chunk_elements)
        offset = (torch.arange(B, device=index.device) * T)[:, None, None]
        for q0 in range(0, Q, qc):
            g = grad[:, q0 : q0 + qc]  # [B, qc, C]
            if gx is not None:
                yg = batch_gather(y, index[:, q0 : q0 + qc])
                gx[:, q0 : q0 + qc] = (g[..., None, :] @ yg)[..., 0, :]
            if gy is not None:
                contrib = g[..., None] * x[:, q0 : q0 + qc, None, :]  # [B, qc, C, d]
                rows = (index[:, q0 : q0 + qc] + offset).reshape(-1)
                gy.index_add_(0, rows, contrib.reshape(-1, d))
        return gx, (None if gy is None else gy.view(B, T, d)), None, None


def gather_dot(
    x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, *, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """``out[b, q, c] = x[b, q] · y[b, index[b, q, c]]``.

    Args:
        x: ``[B, Q, d]`` (queries, or router distributions of the queries).
        y: ``[B, T, d]`` per-position rows (keys, or router distributions).
        index: ``[B, Q, C]`` int64 positions in ``[0, T)`` (clip empty slots before calling).
    Returns:
        ``[B, Q, C]``, differentiable in ``x`` and ``y``; no ``[B, Q, C, d]`` tensor is kept for backward.
    """
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        return _GatherDot.apply(x, y, index, chunk_elements)
    return _gather_dot_forward(x, y, index, chunk_elements)
