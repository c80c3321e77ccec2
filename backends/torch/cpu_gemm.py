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

Both are float32 products (largest relative error against float64 at ``[512, 1000] @ [1000, 3000]``: 8.9e-7
oneDNN, 3.6e-7 oneMKL, at every ``torch.set_float32_matmul_precision``); they sum in different orders, so results
differ by float32 rounding. Used where measured faster: float32 tensors on the CPU of an AMD machine, outside
``torch.compile`` (inside it, inductor chooses its own products). Intel CPUs keep oneMKL, which is tuned for them
and was not measured here against oneDNN.
"""

from __future__ import annotations

import functools

import torch

from pcaf_core.sysinfo import cpu_vendor

ONEDNN_VENDORS = ("AuthenticAMD",)
"""CPU vendors whose float32 products :func:`linear` sends to oneDNN."""


@functools.cache
def onednn_on_this_cpu() -> bool:
    """Whether this machine's CPU float32 products go to oneDNN (:data:`ONEDNN_VENDORS`, oneDNN built in)."""
    return torch.backends.mkldnn.is_available() and cpu_vendor() in ONEDNN_VENDORS


def uses_onednn(*tensors: torch.Tensor) -> bool:
    """Whether :func:`linear` of ``tensors`` runs on oneDNN: all float32 on the CPU, not inside ``torch.compile``."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not torch.compiler.is_compiling() and onednn_on_this_cpu())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)``: x ``[M, K]``, weight ``[N, K]`` (transposed views included), bias ``[N]`` ->
    ``[M, N]``, on oneDNN where :func:`uses_onednn`, else ``torch.addmm`` / ``torch.mm``."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if bias is None:
        return torch.mm(x, weight.t())
    return torch.addmm(bias, x, weight.t())
