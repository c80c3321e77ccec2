"""The head's log-probability of the target, without the ``[N, V]`` log-softmax graph.

A training step needs ``log p(y)`` of the parametric head at each query, never the whole distribution.
Computing it as ``log_softmax(z @ W^T + b).gather(y)`` makes autograd keep both the logits and the
float32 ``[N, V]`` log-probs, and in the backward pass fill an ``[N, V]`` zero tensor, scatter into it and
run the log-softmax backward. :func:`target_log_softmax` keeps the logits (in the matmul dtype) and the
``[N]`` log-normaliser only (in float32/float64: the softmax numerators and their row sums instead, so
that the backward pass multiplies once), and forms the logits' gradient ``g·(onehot(y) − softmax)`` from
them: the saved activations of a full-AR head shrink from 6 to 2 bytes per logit under bf16 autocast. On this
project's 2-core CPU the step time is unchanged (the three output matmuls dominate it;
``make bench-train-step``).

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
        if wide is logits:
            # float32/float64 logits: keep exp(logits - max) and its row sum instead of the logits, so the
            # backward pass is one multiply over [N, V] rather than copy, subtract, exp and multiply (the same
            # bytes saved; about 2% of a full-AR step at V = 20,000 on a CPU).
            top = wide.amax(dim=-1, keepdim=True)
            top = top.masked_fill(~torch.isfinite(top), 0.0)  # as torch.logsumexp does for infinite rows
            unnormalised = torch.sub(wide, top).exp_()  # [N, V]
            total = unnormalised.sum(dim=-1)  # [N]
            lse = top[:, 0] + total.log()
            ctx.save_for_backward(z, weight, y, unnormalised, total)
        else:
            # 16-bit logits: keeping them (2 bytes a logit) is cheaper in memory than a float32 softmax.
            lse = torch.logsumexp(wide, dim=-1)  # [N]
            ctx.save_for_backward(z, weight, y, logits, lse)
        ctx.saved_softmax = wide is logits
        return target_logit - lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        z, weight, y, saved, norm = ctx.saved_tensors
        g = grad.to(norm.dtype)
        # d/dlogits of g·(logit_y − lse) = g·onehot(y) − g·softmax.
        if ctx.saved_softmax:
            dlogits = torch.mul(saved, (-g / norm)[:, None])  # saved = exp(logits - max), norm = its row sum
        else:
            # float32 from the 16-bit logits in one pass (type promotion), then in place.
            dlogits = torch.sub(saved, norm[:, None]).exp_().mul_(-g[:, None])
        dlogits.scatter_add_(1, y[:, None], g[:, None])
        dbias = dlogits.sum(0)
        dl = dlogits.to(z.dtype)
        dz = dl @ weight if ctx.needs_input_grad[0] else None
        dweight = dl.t() @ z if ctx.needs_input_grad[1] else None
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
