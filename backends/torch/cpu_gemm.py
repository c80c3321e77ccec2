"""Float32 products on AMD CPUs through oneDNN rather than oneMKL.

PyTorch's CPU wheels multiply float32 matrices (``mm``, ``addmm``, ``nn.Linear``) with oneMKL's ``sgemm``, which
takes no AVX-512 code path on AMD CPUs under any ``MKL_CBWR`` mode (:mod:`backends.torch.runtime`). oneDNN, which
the same wheels ship and reach through ``torch.ops.mkldnn._linear_pointwise`` (``x @ weight^T + bias``, the op
inductor's CPU fusions call), does take it. Measured on a 2-core AMD EPYC with AVX-512 (torch 2.13.0, 2 threads,
best of 3, fp32) at the head of a full-AR step, N = 2,048 positions, H = 1,000, V = 20,000:

| product | oneMKL | oneDNN |
|---|---|---|
| logits ``z @ W^T`` | 192 GFLOP/s | 365 |
| ``dz = dlogits @ W`` | 222 | 432 |
| ``dW = dlogitsᵀ @ z`` | 216 | 301 |

With the glibc tunables on (``experiments/allocator.py``) and N = 4,096: 473 / 421 / 395 GFLOP/s on oneDNN, 483
for ``dW`` formed as ``(zᵀ @ dlogits)ᵀ`` (:func:`weight_grad`), 222-224 on oneMKL. The block MLPs' products
(``[4096, 256] @ [256, 1000]`` and back) run at 208-220 GFLOP/s on oneMKL and 406-487 on oneDNN in their faster
orientation, so :class:`Linear` sends every ``nn.Linear`` of the models there too, forward and backward.

Both are float32 products (largest relative error against float64 at ``[512, 1000] @ [1000, 3000]``: 8.9e-7
oneDNN, 3.6e-7 oneMKL, at every ``torch.set_float32_matmul_precision``); they sum in different orders, so results
differ by float32 rounding. Used where measured faster: float32 tensors on the CPU of an AMD machine. Intel CPUs
keep oneMKL, which is tuned for them and was not measured here against oneDNN.

The product is the custom op ``pcaf::onednn_linear`` (:func:`onednn_linear`), so ``torch.compile`` keeps it as
one opaque call in its graph rather than lowering the product to oneMKL's ``mm`` (inductor cannot lower oneDNN's
op itself), and its gradient (:func:`weight_grad` and the input's product) is on oneDNN in a compiled backward
pass too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch import weight_casts
from pcaf_core.sysinfo import cpu_vendor

ONEDNN_VENDORS = ("AuthenticAMD",)
"""CPU vendors whose float32 products :func:`linear` sends to oneDNN."""


@functools.cache
def _onednn_vendor() -> bool:
    return torch.backends.mkldnn.is_available() and cpu_vendor() in ONEDNN_VENDORS


@torch.compiler.assume_constant_result  # a fact of the machine: traced as a constant, not a graph break
def onednn_on_this_cpu() -> bool:
    """Whether this machine's CPU float32 products go to oneDNN (:data:`ONEDNN_VENDORS`, oneDNN built in)."""
    return _onednn_vendor()


def uses_onednn(*tensors: torch.Tensor) -> bool:
    """Whether :func:`linear` of ``tensors`` runs on oneDNN: all float32 on the CPU of such a machine."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and onednn_on_this_cpu()


# The schema is given, not inferred from the (postponed, string) annotations: the same on every torch release.
@torch.library.custom_op("pcaf::onednn_linear", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's ``x @ weight^T (+ bias)``: x ``[M, K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[M, N]``
    row-major, float32 CPU tensors.

    oneDNN copies a strided ``x`` to row-major first and reads a row- or column-major ``weight`` in place, so a
    caller with a choice passes the smaller operand as ``x``. A ``weight`` strided both ways (a transposed column
    slice) is copied here first: oneDNN multiplied one such ``[1000, 136] @ [136, 256]`` in 357 ms against 0.4 ms
    row-major."""
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        weight = weight.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _linear_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, dy: torch.Tensor):
    x, weight = ctx.saved_tensors
    dy = dy.contiguous()
    need_x, need_weight, need_bias = ctx.needs_input_grad
    dx = onednn_linear(dy, weight.t(), None) if need_x else None
    dweight = weight_grad(dy, x, weight) if need_weight else None
    dbias = dy.sum(0) if ctx.has_bias and need_bias else None
    return dx, dweight, dbias


onednn_linear.register_autograd(_linear_backward, setup_context=_linear_context)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)``: x ``[M, K]``, weight ``[N, K]`` (transposed views included), bias ``[N]`` ->
    ``[M, N]``, on oneDNN where :func:`uses_onednn`, else ``torch.addmm`` / ``torch.mm``."""
    if uses_onednn(x, weight):
        return onednn_linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t())
    return torch.addmm(bias, x, weight.t())


def column_major(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``[N, K]`` is stored column-major (its transpose row-major), as
    :func:`lay_out_for_onednn` stores the weights of the widening linears."""
    return not weight.is_contiguous() and weight.t().is_contiguous()


def weight_grad(dy: torch.Tensor, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``dyᵀ @ x``, the gradient of a linear's weight: dy ``[M, N]``, x ``[M, K]`` -> ``[N, K]`` in the layout of
    ``like`` (that weight), so that autograd stores it without a copy: on oneDNN a transposed view of
    ``xᵀ @ dy`` for a :func:`column_major` weight (``index_add_`` and autograd take either layout).

    oneDNN copies its first operand row-major (:func:`onednn_linear`), so ``(xᵀ @ dy)ᵀ`` copies the narrower
    ``x`` where ``dyᵀ @ x`` copies ``dy``; :func:`lay_out_for_onednn` makes the weights with K < N column-major
    for that reason. Median of 7, fp32, 2-core AMD EPYC, glibc tunables on (``experiments/allocator.py``):

    | N, K | M | ``dyᵀ @ x`` | ``(xᵀ @ dy)ᵀ`` |
    |---|---|---|---|
    | 20,000, 1,000 (head) | 8 / 128 / 680 / 4,096 | 2.4 / 12.8 / 65.3 / 413 ms | 2.4 / 10.5 / 55.9 / 339 |
    | 1,000, 256 (block MLP in) | 128 / 680 / 4,096 | 0.20 / 0.92 / 7.72 ms | 0.16 / 0.77 / 5.13 |

    A row-major result for a column-major weight (or the reverse) would cost a copy of the ``[N, K]`` gradient:
    14 ms at the head.
    """
    if uses_onednn(dy, x):
        if column_major(like):
            return onednn_linear(x.t(), dy.t(), None).t()
        return onednn_linear(dy.t(), x.t(), None)
    return torch.mm(dy.t(), x)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, initialisation and state dict) whose float32 CPU products run on oneDNN
    where :func:`uses_onednn`, forward and backward (:func:`onednn_linear`); anywhere else (autocast, CUDA,
    another CPU) it is ``nn.Linear``, under autocast with the weight copies of :mod:`backends.torch.weight_casts`
    where a step made them. Results differ from oneMKL's by float32 rounding only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # The weight copies of an eager autocast step where it made them (backends.torch.weight_casts).
            return F.linear(x, weight_casts.weight(self.weight), weight_casts.weight(self.bias))
        if x.numel() == 0 or not uses_onednn(x, self.weight):
            return super().forward(x)
        out = onednn_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


COLUMN_MAJOR_FROM_ROWS = 2048
"""Rows a step (M, the head's positions) from which :func:`lay_out_for_onednn` stores weights column-major."""


def lay_out_for_onednn(module: nn.Module, rows: int) -> None:
    """Store the weight of every :class:`Linear` in ``module`` that widens (in < out features) column-major, where
    its products run on oneDNN (:func:`uses_onednn`) and a step multiplies at least :data:`COLUMN_MAJOR_FROM_ROWS`
    ``rows`` through the head; the values, shapes and state dict are unchanged.

    With the weight column-major, its gradient is formed with the narrower operand copied (:func:`weight_grad`),
    and the input gradient reads ``weightᵀ`` row-major, but fused AdamW copies a non-contiguous parameter each
    step (14 ms for the head's ``[20000, 1000]``). Head products a step, forward + input gradient + weight
    gradient (+ that copy), median of 7, fp32, 2-core AMD EPYC, glibc tunables on:

    | rows | row-major | column-major |
    |---|---|---|
    | 128 | 12.5 + 12.6 + 12.8 = 38 ms | 11.2 + 12.3 + 10.5 + 14 = 48 ms |
    | 680 | 60 + 67 + 65 = 193 ms | 57 + 65 + 56 + 14 = 192 ms |
    | 4,096 (a full-AR step at T=1,024, batch 4) | 347 + 395 + 413 = 1,155 ms | 341 + 364 + 339 + 14 = 1,058 ms |

    Call it before an optimiser holds the parameters: each changed weight becomes a new ``nn.Parameter``.
    """
    if rows < COLUMN_MAJOR_FROM_ROWS:
        return
    for m in module.modules():
        if isinstance(m, Linear) and m.in_features < m.out_features and uses_onednn(m.weight):
            m.weight = nn.Parameter(m.weight.detach().t().contiguous().t(), requires_grad=m.weight.requires_grad)
