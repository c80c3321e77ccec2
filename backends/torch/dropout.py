"""Training-mode dropout: :mod:`pcaf_core.dropout`'s rule on torch's global generator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from backends.torch.kernels import dropout_fused, triton_enabled
from backends.torch.kernels.dropout_mask import KERNEL_DTYPES, dropout_mask
from pcaf_core.dropout import DROPOUT_LEVELS, dropout_scale, dropout_threshold


class Dropout(nn.Module):
    """The dropout of :mod:`pcaf_core.dropout`: one 32-bit random integer (``randint`` on the global
    generator, so seeding and checkpointed RNG states work as before) gives two 16-bit levels, and a
    comparison makes the mask; on a 2-core CPU the mask costs 11-20 ms against 27-41 ms for ``nn.Dropout``'s
    ``bernoulli_`` over 4.2M elements (the NT training step's activations at the cpu scale). Compiled steps
    draw the same masks (:mod:`backends.torch.compile` keeps ATen's random ops), so compiled and eager
    training still agree. An eager step on CUDA applies the mask with one kernel each way
    (:mod:`backends.torch.kernels.dropout_mask`) where ATen takes four forward and one backward, with the same
    values bit for bit.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        dropout_threshold(p)  # refuses a rate outside [0, 1)
        self.p = p

    @property
    def threshold(self) -> int:
        """Levels below it (of :data:`~pcaf_core.dropout.DROPOUT_LEVELS`) drop their element."""
        return dropout_threshold(self.p)

    @property
    def scale(self) -> float:
        return dropout_scale(self.p)

    def extra_repr(self) -> str:
        return f"p={self.p} (drops {self.threshold}/{DROPOUT_LEVELS})"

    @property
    def drops(self) -> bool:
        """Whether a call drops anything (training mode and a rate above 0)."""
        return self.training and self.threshold > 0

    def _levels(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The int16 levels of x's mask, drawn from the global generator, and their cutoff."""
        n = x.numel()
        # randint, not empty().random_(): the same draws from the same generator, and torch.compile traces it
        # (an in-place random_ breaks the compiled graph at every dropout).
        bits = torch.randint(-(2**31), 2**31, ((n + 1) // 2,), dtype=torch.int32, device=x.device)
        # The signed 16-bit view holds level - 2^15, so level >= threshold reads as below.
        return bits.view(torch.int16)[:n], self.threshold - DROPOUT_LEVELS // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.drops:
            return x
        levels, cutoff = self._levels(x)
        if _kernels(x):
            # One kernel each way on CUDA (pcaf::dropout_mask); a compiled step fuses the ATen form below itself.
            return _LevelMask.apply(x, levels, cutoff, self.scale)
        return _ScaledMask.apply(x, levels.view(x.shape) >= cutoff, self.scale)

    def after_gelu(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        """``self(F.gelu(x, approximate=approximate))``; on an eager CUDA step one kernel each way
        (``pcaf::gelu_dropout``), the same masks drawn in the same order."""
        if self.drops and _kernels(x):
            levels, cutoff = self._levels(x)
            return _GeluDropout.apply(x, levels, cutoff, self.scale, approximate == "tanh")
        return self(F.gelu(x, approximate=approximate))

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x + self(y)``, the residual stream x holding y's dtype; on an eager CUDA step one kernel each way
        (``pcaf::add_dropout``), the same mask drawn in the same order."""
        if self.drops and _kernels(y) and _kernels(x) and x.shape == y.shape \
                and torch.result_type(x, y) == x.dtype:
            levels, cutoff = self._levels(y)
            return _AddDropout.apply(x, y, levels, cutoff, self.scale)
        return x + self(y)


def kernels_by_default(x: torch.Tensor) -> bool:
    """Whether :class:`Dropout` masks ``x`` with ``pcaf::dropout_mask``'s kernel (and its neighbours with the fused
    ones): on CUDA tensors."""
    return x.is_cuda and triton_enabled(x)


def _kernels(x: torch.Tensor) -> bool:
    return (not torch.compiler.is_compiling() and kernels_by_default(x) and x.dtype in KERNEL_DTYPES
            and x.is_contiguous())


class _ScaledMask(torch.autograd.Function):
    """``x · keep · scale`` with the float mask ``keep · scale`` made once and kept for the backward: a bool
    mask would be converted to x's dtype in both passes (forward + backward 24-31 ms against 19-20 ms over 4.2M
    elements on the CPU, for 3 more bytes an element of saved activation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        mask = keep.to(x.dtype).mul_(scale)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None


class _LevelMask(torch.autograd.Function):
    """``x · keep · scale`` by :func:`backends.torch.kernels.dropout_mask.dropout_mask`, one kernel each way, with
    the int16 levels kept for the backward: the same values as :class:`_ScaledMask`, bit for bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float) -> torch.Tensor:
        ctx.save_for_backward(levels)
        ctx.cutoff, ctx.scale = cutoff, scale
        return dropout_mask(x, levels, cutoff, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (levels,) = ctx.saved_tensors
        return dropout_mask(grad.contiguous(), levels, ctx.cutoff, ctx.scale), None, None, None


class _GeluDropout(torch.autograd.Function):
    """``drop(GELU(x))`` by :func:`backends.torch.kernels.dropout_fused.gelu_dropout`, one kernel each way, keeping
    x and the int16 levels for the backward (ATen's form keeps GELU's input and output's float mask)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float, tanh: bool) -> torch.Tensor:
        ctx.save_for_backward(x, levels)
        ctx.cutoff, ctx.scale, ctx.tanh = cutoff, scale, tanh
        return dropout_fused.gelu_dropout(x, levels, cutoff, scale, tanh)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, levels = ctx.saved_tensors
        dx = dropout_fused.gelu_dropout_grad(grad.to(x.dtype).contiguous(), x, levels, ctx.cutoff, ctx.scale,
                                             ctx.tanh)
        return dx, None, None, None, None


class _AddDropout(torch.autograd.Function):
    """``x + drop(y)`` by :func:`backends.torch.kernels.dropout_fused.add_dropout`, one kernel each way (the
    gradient in x is the incoming one; in y it is cast to y's dtype and dropped in the same kernel)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, levels: torch.Tensor, cutoff: int, scale: float
                ) -> torch.Tensor:
        ctx.save_for_backward(levels)
        ctx.cutoff, ctx.scale, ctx.y_dtype = cutoff, scale, y.dtype
        return dropout_fused.add_dropout(x, y, levels, cutoff, scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (levels,) = ctx.saved_tensors
        grad = grad.contiguous()
        dy = dropout_fused.add_dropout_grad(grad, levels, ctx.cutoff, ctx.scale, ctx.y_dtype)
        return grad, dy, None, None, None
