"""Autocast's weight casts as one multi-tensor copy a pass, for eager steps.

Under ``torch.autocast`` each matrix product casts its float32 weight and bias to the autocast dtype (autocast
caches the cast for the rest of the forward), and the backward pass casts each of their bf16 gradients back to
float32: two kernels a parameter a step, each launched from the host while an eager step's GPU waits. An eager
bf16 full-AR PCAF-context step at the WikiText-2 paper shape makes 44 of them: 22 parameters, once each way
(``python -m benchmarks.op_census`` counts the step's ops).

:func:`autocast` is ``torch.autocast`` that also makes the copies of the given parameters with one
``_foreach_copy_`` (one multi-tensor kernel on CUDA) and, in the backward pass, their float32 gradients with
another. The layers that multiply by a weight (``nn.Linear`` and the conv of :class:`backends.torch.layers.
ConvBlock`, the head's output product) read the copy through :func:`weight`. The values are autocast's own: the
same round-to-nearest-even cast each way, and a weight read by several products has one copy whose gradient
autograd sums in the autocast dtype before the cast back, as it sums the gradient of autocast's cached cast. So
a step is bitwise the step autocast makes alone (tests/test_torch_weight_casts.py).

Eager steps only: a compiled step fuses the casts into its kernels anyway, and under DDP all the gradients of
the copied parameters would reach the all-reduce at once, at the end of the backward pass, instead of bucket by
bucket while it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch
from torch import nn

_copies: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar("weight_copies",
                                                                                         default=None)


class _CastAll(torch.autograd.Function):
    """``params`` cast to ``dtype`` with one ``_foreach_copy_``; the backward casts the gradients that arrive
    (None for a copy no product read) back to each parameter's dtype with another."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unread copy's gradient stays None, as an unread parameter's does
        ctx.dtypes = [p.dtype for p in params]
        copies = [torch.empty_like(p, dtype=dtype) for p in params]
        torch._foreach_copy_(copies, list(params))
        return tuple(copies)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        present = [i for i, g in enumerate(grads) if g is not None]
        out: list[torch.Tensor | None] = [None] * len(grads)
        if present:
            src = [grads[i] for i in present]
            dst = [torch.empty_like(g, dtype=ctx.dtypes[i]) for i, g in zip(present, src)]
            torch._foreach_copy_(dst, src)
            for i, d in zip(present, dst):
                out[i] = d
        return (None, *out)


def castable(module: nn.Module) -> tuple[nn.Parameter, ...]:
    """The trainable weights and biases of ``module``'s ``nn.Linear`` and ``nn.Conv1d`` layers, each once: the
    parameters whose products autocast runs in its dtype."""
    seen: dict[int, nn.Parameter] = {}
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d)):
            for p in (m.weight, m.bias):
                if p is not None and p.requires_grad:
                    seen.setdefault(id(p), p)
    return tuple(seen.values())


@contextlib.contextmanager
def autocast(device_type: str, dtype: torch.dtype, params: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)``, with ``params`` cast once on entry (:class:`_CastAll`) for
    :func:`weight` to hand out; without ``params`` just ``torch.autocast``."""
    with torch.autocast(device_type=device_type, dtype=dtype):
        if not params:
            yield
            return
        copies = _CastAll.apply(dtype, *params)
        token = _copies.set({id(p): c for p, c in zip(params, copies)})
        try:
            yield
        finally:
            _copies.reset(token)


def weight(p: torch.Tensor | None) -> torch.Tensor | None:
    """``p``'s copy in the autocast dtype inside :func:`autocast` where autocast is on, else ``p`` itself
    (None stays None). Regions that turn autocast off (the routing's selection) get the float32 parameter.
    A compiled step gets ``p``: it makes no copies, and Dynamo cannot trace ``ContextVar.get`` (a graph break,
    which would split a CUDA-graphed step)."""
    if torch.compiler.is_compiling():
        return p
    copies = _copies.get()
    if copies is None or p is None or not torch.is_autocast_enabled(p.device.type):
        return p
    return copies.get(id(p), p)
