"""The head's log-probability of the target, without the ``[N, V]`` log-softmax graph.

A training step needs ``log p(y)`` of the parametric head at each query, never the whole distribution.
Computing it as ``log_softmax(z @ W^T + b).gather(y)`` makes autograd keep both the logits and the
float32 ``[N, V]`` log-probs, and in the backward pass fill an ``[N, V]`` zero tensor, scatter into it and
run the log-softmax backward. :func:`target_log_softmax` keeps one ``[N, V]`` tensor and the ``[N]``
normaliser:

- float32/float64 logits: the softmax numerators ``U = exp(logits − max)`` (made in place in the logits'
  buffer) and their row sums ``S``. The logits' gradient ``g·onehot(y) − (g/S)·U`` is never formed: the
  backward products run on ``U`` and the ``g/S`` row factor is applied to their ``[N, H]`` side, so the
  backward pass reads ``U`` three times (two products and one matrix-vector product for the bias) and writes
  nothing of size ``[N, V]`` (the ``onehot`` terms are ``[N, H]`` row gathers and adds);
- 16-bit logits (autocast): the logits themselves (2 bytes each) and the log-normaliser; the backward pass
  forms the float32 gradient from them. On CUDA both passes over the logits are one Triton kernel each
  (:mod:`backends.torch.kernels.head_softmax`), which reads the 16-bit logits once and writes no float32
  ``[N, V]`` temporary.

On this project's 2-core CPU the three output products are about 80% of a full-AR step; of the rest, the
backward pass's ``[N, V]`` traffic drops from five passes (a multiply that reads and writes, the bias sum, the
two products) to three, and the ``[N, V]`` gradient buffer is gone (docs/TRAINING.md, "Step cost on a CPU"; the
step and memory figures are in docs/results/design_measurements.md, "The head read at the targets only").

The arithmetic is :meth:`backends.torch.layers.Head.forward`'s: logits in the matmul dtype (bf16 under
autocast), normaliser and target logit in float32 (float64 stays float64), so both paths agree to float
rounding (tests/test_torch_head_loss.py).

:func:`chunked_target_log_softmax` computes the same without any ``[N, V]`` tensor, in logit tiles recomputed
by the backward pass (``train.head_loss``; docs/KERNELS.md, "Chunked head loss").
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from backends.torch import cpu_gemm, weight_casts
from backends.torch.kernels import head_softmax


def widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is a 16-bit float (a new tensor), else ``x`` itself."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


class _TargetLogSoftmax(torch.autograd.Function):
    """``log_softmax(z @ weight^T + bias)[n, y_n]``: z ``[N, H]``, weight ``[V, H]``, bias ``[V]``,
    y ``[N]`` int64 -> ``[N]`` float32."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, y: torch.Tensor,
                kernels: bool) -> torch.Tensor:
        logits = cpu_gemm.linear(z, weight, bias)  # [N, V], the matmul dtype
        ctx.saved_numerators = logits.dtype not in (torch.float16, torch.bfloat16)
        if not ctx.saved_numerators:
            # 16-bit logits: keeping them (2 bytes a logit) is cheaper in memory than a float32 softmax. Their
            # passes: one kernel each way (kernels), or ATen's float32 ones (backends.torch.kernels.head_softmax).
            ctx.kernels = kernels
            y = y.contiguous()
            normaliser = head_softmax.log_normaliser if kernels else head_softmax.log_normaliser_torch
            lse, target_logit = normaliser(logits, y)
            ctx.save_for_backward(z, weight, y, logits, lse)
            return target_logit - lse
        target_logit = logits.gather(1, y[:, None])[:, 0]
        top = logits.amax(dim=-1, keepdim=True)
        top = top.masked_fill(~torch.isfinite(top), 0.0)  # as torch.logsumexp does for infinite rows
        numerators = logits.sub_(top).exp_()  # [N, V] in the logits' buffer: the logits are not needed again
        total = numerators.sum(dim=-1)  # [N]
        ctx.save_for_backward(z, weight, y, numerators, total)
        return target_logit - (top[:, 0] + total.log())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        z, weight, y, saved, norm = ctx.saved_tensors
        g = grad.to(norm.dtype)
        need_z, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # d/dlogits of g·(logit_y − lse) = g·onehot(y) − g·softmax.
        if ctx.saved_numerators:
            # softmax = saved / norm row-wise: the row factor moves to the products' [N, H] side.
            row = -g / norm  # [N]
            dz = dweight = None
            if need_z:  # saved @ weight
                dz = cpu_gemm.linear(saved, weight.t()).mul_(row[:, None]).add_(weight[y] * g[:, None])
            if need_weight:  # savedᵀ @ (z·row)
                dweight = cpu_gemm.weight_grad(saved, z * row[:, None], weight).index_add_(0, y, z * g[:, None])
            dbias = torch.mv(saved.t(), row).index_add_(0, y, g)
            return dz, dweight, dbias, None, None
        logit_grad = head_softmax.logit_grad if ctx.kernels else head_softmax.logit_grad_torch
        dl, dbias = logit_grad(saved, norm, g.contiguous(), y)  # dl in the logits' (= z's) 16-bit dtype
        dz = dl @ weight if need_z else None
        dweight = dl.t() @ z if need_weight else None
        return dz, dweight, dbias.to(weight.dtype), None, None


def _apply_flat(fn, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor, *args):
    """``fn(z [N, H], weight, bias, targets [N], *args)`` on ``z`` flattened to rows, in the autocast dtype when
    autocast is on (the casts outside the autograd function, so their gradients reach the float32 parameters
    through autograd's own cast backward); the result in ``targets``' shape."""
    lead = targets.shape
    zf = z.reshape(-1, z.shape[-1])
    if torch.is_autocast_enabled(zf.device.type):
        dtype = torch.get_autocast_dtype(zf.device.type)
        # The step's weight copies where it made them (backends.torch.weight_casts); .to is then a no-op.
        weight, bias = weight_casts.weight(weight), weight_casts.weight(bias)
        zf, weight, bias = zf.to(dtype), weight.to(dtype), bias.to(dtype)
    with torch.autocast(zf.device.type, enabled=False):
        out = fn(zf, weight, bias, targets.reshape(-1), *args)
    return out.reshape(lead)


def kernels_by_default(z: torch.Tensor) -> bool:
    """Whether :func:`target_log_softmax` passes over 16-bit logits with the Triton kernels when its caller does
    not say: on CUDA tensors."""
    return z.is_cuda


def target_log_softmax(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor,
                       *, kernels: bool | None = None) -> torch.Tensor:
    """Head log-probability of ``targets``: z ``[..., H]``, targets ``[...]`` (ids in ``[0, V)``) ->
    ``[...]`` float32 (float64 when z is float64).

    Under autocast the output matmul runs in the autocast dtype, as ``nn.Linear`` would; the casts of
    ``weight`` and ``bias`` sit outside the autograd function, so their gradients reach the float32
    parameters through autograd's own cast backward. ``kernels``: 16-bit logits pass through
    :mod:`backends.torch.kernels.head_softmax` (one kernel each way) instead of ATen's float32 passes; None:
    :func:`kernels_by_default`. The two agree to float rounding (tests/test_torch_head_softmax.py).
    """
    use = kernels_by_default(z) if kernels is None else kernels
    return _apply_flat(_TargetLogSoftmax.apply, z, weight, bias, targets, use)


# --------------------------------------------------------------------------- chunked (never [N, V])


def _tile_logits(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``z @ weight^T + bias`` of one tile, widened to at least float32: the same ops as the full path, so a
    tile's logits are bit for bit the full path's (and the backward recomputes exactly the forward's)."""
    return widen(cpu_gemm.linear(z, weight, bias))


def _target_in_tile(y: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(column [n, 1], inside [n])``: the target's column in the tile ``[v0, v0 + width)`` (clamped into it
    where the target lies outside) and whether it lies inside."""
    local = y - v0
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1)[:, None], inside


class _ChunkedTargetLogSoftmax(torch.autograd.Function):
    """:class:`_TargetLogSoftmax` tile by tile: ``[P, C]`` logit tiles (P positions, C vocabulary entries), an
    online log-sum-exp over each row's tiles, and only ``[N]`` normalisers kept for the backward pass."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, y: torch.Tensor,
                position_chunk: int, vocab_chunk: int) -> torch.Tensor:
        N, V = z.shape[0], weight.shape[0]
        acc = widen(z.new_empty(())).dtype  # float32 (float64 stays float64)
        out = torch.empty(N, dtype=acc, device=z.device)
        lse = torch.empty(N, dtype=acc, device=z.device)
        for p0 in range(0, N, position_chunk):
            p1 = min(p0 + position_chunk, N)
            zp, yp = z[p0:p1], y[p0:p1]
            top = torch.full((p1 - p0,), float("-inf"), dtype=acc, device=z.device)
            total = torch.zeros(p1 - p0, dtype=acc, device=z.device)
            target = torch.zeros(p1 - p0, dtype=acc, device=z.device)
            for v0 in range(0, V, vocab_chunk):
                v1 = min(v0 + vocab_chunk, V)
                tile = _tile_logits(zp, weight[v0:v1], bias[v0:v1])  # [P, C]
                col, inside = _target_in_tile(yp, v0, v1 - v0)
                target = torch.where(inside, tile.gather(1, col)[:, 0], target)
                new_top = torch.maximum(top, tile.amax(dim=1))
                # As torch.logsumexp: a row whose maximum is infinite shifts by 0, not by the infinity.
                shift = new_top.masked_fill(~torch.isfinite(new_top), 0.0)
                total = total * torch.exp(top - shift) + tile.sub_(shift[:, None]).exp_().sum(dim=1)
                top = new_top
            norm = top.masked_fill(~torch.isfinite(top), 0.0) + total.log()
            lse[p0:p1] = norm
            out[p0:p1] = target - norm
        ctx.chunks = (position_chunk, vocab_chunk)
        ctx.save_for_backward(z, weight, bias, y, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        z, weight, bias, y, lse = ctx.saved_tensors
        position_chunk, vocab_chunk = ctx.chunks
        need_z, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, V = z.shape[0], weight.shape[0]
        g = grad.to(lse.dtype)
        # Accumulators in the wide dtype: a 16-bit dz or dweight summed over tiles would round at every tile.
        dz = torch.zeros(z.shape, dtype=lse.dtype, device=z.device) if need_z else None
        # In the weight's layout (column-major where cpu_gemm.lay_out_for_onednn put it), so autograd copies nothing.
        dweight = torch.zeros_like(weight, dtype=lse.dtype) if need_weight else None
        dbias = torch.zeros(V, dtype=lse.dtype, device=z.device)
        same = z.dtype == lse.dtype  # no 16-bit operands: the products accumulate in place
        for p0 in range(0, N, position_chunk):
            p1 = min(p0 + position_chunk, N)
            zp, yp, gp = z[p0:p1], y[p0:p1], g[p0:p1]
            for v0 in range(0, V, vocab_chunk):
                v1 = min(v0 + vocab_chunk, V)
                # d/dlogits of g·(logit_y − lse) = g·onehot(y) − g·softmax, formed in the tile's buffer.
                tile = _tile_logits(zp, weight[v0:v1], bias[v0:v1])
                dlogits = tile.sub_(lse[p0:p1, None]).exp_().mul_(-gp[:, None])
                col, inside = _target_in_tile(yp, v0, v1 - v0)
                dlogits.scatter_add_(1, col, torch.where(inside, gp, 0.0)[:, None])
                dbias[v0:v1] += dlogits.sum(dim=0)
                dl = dlogits if same else dlogits.to(z.dtype)
                # Float32 on oneDNN (cpu_gemm): its products do not accumulate, so each tile's is added after.
                onednn = same and cpu_gemm.uses_onednn(dl, weight)
                if need_z:
                    if onednn:
                        dz[p0:p1] += cpu_gemm.linear(dl, weight[v0:v1].t())
                    elif same:
                        dz[p0:p1].addmm_(dl, weight[v0:v1])
                    else:
                        dz[p0:p1] += dl @ weight[v0:v1]
                if need_weight:
                    if onednn:
                        dweight[v0:v1] += cpu_gemm.weight_grad(dl, zp, dweight)
                    elif same:
                        dweight[v0:v1].addmm_(dl.t(), zp)
                    else:
                        dweight[v0:v1] += dl.t() @ zp
        return (None if dz is None else dz.to(z.dtype), None if dweight is None else dweight.to(weight.dtype),
                dbias.to(bias.dtype), None, None, None)


def chunked_target_log_softmax(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor,
                               *, position_chunk: int, vocab_chunk: int) -> torch.Tensor:
    """:func:`target_log_softmax` without ever holding ``[N, V]``: the same inputs, output and autocast
    behaviour; the logits live one ``[position_chunk, vocab_chunk]`` tile at a time.

    Forward: per tile ``z_p @ W_c^T + b_c``, an online log-sum-exp per row (running maximum and rescaled sum)
    and the target's logit read from the tile that holds it; only the ``[N]`` normalisers are saved. Backward:
    each tile's logits are recomputed, turned into ``g·onehot(y) − g·softmax`` in place, and the three
    gradients are accumulated into ``[N, H]``, ``[V, H]`` and ``[V]`` buffers (products in the matmul dtype,
    sums in float32). So the head costs four ``N·H·V`` products instead of three and at most one tile of
    logits at a time; the chunks need not divide N or V.
    """
    if position_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"position_chunk={position_chunk} and vocab_chunk={vocab_chunk} must both be >= 1")
    return _apply_flat(_ChunkedTargetLogSoftmax.apply, z, weight, bias, targets, position_chunk, vocab_chunk)
