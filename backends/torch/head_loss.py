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
  forms the float32 gradient from them.

On this project's 2-core CPU the three output products are about 80% of a full-AR step; of the rest, the
backward pass's ``[N, V]`` traffic drops from five passes (a multiply that reads and writes, the bias sum, the
two products) to three, and the ``[N, V]`` gradient buffer is gone (the step and memory figures are in
docs/BACKENDS.md, "Step cost on a CPU").

The arithmetic is :meth:`backends.torch.layers.Head.forward`'s: logits in the matmul dtype (bf16 under
autocast), normaliser and target logit in float32 (float64 stays float64), so both paths agree to float
rounding (tests/test_torch_head_loss.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is a 16-bit float (a new tensor), else ``x`` itself."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


class _TargetLogSoftmax(torch.autograd.Function):
    """``log_softmax(z @ weight^T + bias)[n, y_n]``: z ``[N, H]``, weight ``[V, H]``, bias ``[V]``,
    y ``[N]`` int64 -> ``[N]`` float32."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = torch.addmm(bias, z, weight.t())  # [N, V], the matmul dtype
        wide = widen(logits)
        target_logit = wide.gather(1, y[:, None])[:, 0]
        ctx.saved_numerators = wide is logits
        if ctx.saved_numerators:
            top = wide.amax(dim=-1, keepdim=True)
            top = top.masked_fill(~torch.isfinite(top), 0.0)  # as torch.logsumexp does for infinite rows
            numerators = wide.sub_(top).exp_()  # [N, V] in the logits' buffer: the logits are not needed again
            total = numerators.sum(dim=-1)  # [N]
            ctx.save_for_backward(z, weight, y, numerators, total)
            return target_logit - (top[:, 0] + total.log())
        # 16-bit logits: keeping them (2 bytes a logit) is cheaper in memory than a float32 softmax.
        lse = torch.logsumexp(wide, dim=-1)  # [N]
        ctx.save_for_backward(z, weight, y, logits, lse)
        return target_logit - lse

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
            if need_z:
                dz = torch.mm(saved, weight).mul_(row[:, None]).add_(weight[y] * g[:, None])
            if need_weight:
                dweight = torch.mm(saved.t(), z * row[:, None]).index_add_(0, y, z * g[:, None])
            dbias = torch.mv(saved.t(), row).index_add_(0, y, g)
            return dz, dweight, dbias, None
        # float32 from the 16-bit logits in one pass (type promotion), then in place.
        dlogits = torch.sub(saved, norm[:, None]).exp_().mul_(-g[:, None])
        dlogits.scatter_add_(1, y[:, None], g[:, None])
        dbias = dlogits.sum(0)
        dl = dlogits.to(z.dtype)
        dz = dl @ weight if need_z else None
        dweight = dl.t() @ z if need_weight else None
        return dz, dweight, dbias.to(weight.dtype), None


def target_log_softmax(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor
                       ) -> torch.Tensor:
    """Head log-probability of ``targets``: z ``[..., H]``, targets ``[...]`` (ids in ``[0, V)``) ->
    ``[...]`` float32 (float64 when z is float64).

    Under autocast the output matmul runs in the autocast dtype, as ``nn.Linear`` would; the casts of
    ``weight`` and ``bias`` sit outside the autograd function, so their gradients reach the float32
    parameters through autograd's own cast backward.
    """
    lead = targets.shape
    zf = z.reshape(-1, z.shape[-1])
    if torch.is_autocast_enabled(zf.device.type):
        dtype = torch.get_autocast_dtype(zf.device.type)
        zf, weight, bias = zf.to(dtype), weight.to(dtype), bias.to(dtype)
    with torch.autocast(zf.device.type, enabled=False):
        out = _TargetLogSoftmax.apply(zf, weight, bias, targets.reshape(-1))
    return out.reshape(lead)
