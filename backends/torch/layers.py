"""Building blocks of every model (mirrors the building blocks of :mod:`pcaf_core.reference`).

Submodule and parameter names are the canonical names of :func:`pcaf_core.params.param_shapes`
(``blocks.0.mlp_in.weight`` …), so :mod:`backends.torch.weights` maps a module to the canonical dict by
name, transposing ``nn.Linear`` weights (torch stores ``[out, in]``) and reversing ``nn.Conv1d`` taps
(torch correlates the left-padded input, the spec indexes by lag).

Dropout sits where :mod:`pcaf_core.reference` places it, in training mode only. Outside the attention weights
it is :class:`backends.torch.dropout.Dropout` (:mod:`pcaf_core.dropout`'s rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from backends.torch import cpu_gemm, mixture, weight_casts
from backends.torch.dropout import Dropout
from backends.torch.head_loss import chunked_target_log_softmax, target_log_softmax, widen
from backends.torch.kernels import gate as gate_kernels
from backends.torch.kernels import l2_normalize as l2_kernels
from backends.torch.kernels import triton_enabled
from backends.torch.window_attention import FLEX_BLOCK, blocked_window_attention, flex_window_attention
from pcaf_core.config import WINDOWED_VARIANTS
from pcaf_core.params import sinusoidal_table
from pcaf_core.reference import LN_EPS, attention_allowed

LINEAR_ATTENTION_DEN_FLOOR = 1e-6


def gelu(x: torch.Tensor, form: str) -> torch.Tensor:
    """See :func:`pcaf_core.reference.gelu`."""
    return F.gelu(x, approximate=gelu_approximate(form))


def gelu_approximate(form: str) -> str:
    """``F.gelu``'s ``approximate`` for a profile's GELU ``form``."""
    return "tanh" if form == "tanh" else "none"


def l2_normalize(x: torch.Tensor, form: str) -> torch.Tensor:
    """See :func:`pcaf_core.reference.l2_normalize`. ``[..., d] -> [..., d]``, with :class:`_L2Normalize`'s
    one-expression gradient."""
    return _L2Normalize.apply(x, form)


def l2_kernels_by_default(x: torch.Tensor) -> bool:
    """Whether :func:`l2_normalize` runs as ``pcaf::l2_normalize``'s kernel, one each way: on CUDA tensors."""
    return x.is_cuda and triton_enabled(x)


class _L2Normalize(torch.autograd.Function):
    """``y = x / n`` over the last axis, ``n = sqrt(Σx² + eps)`` (``rsqrt_eps``) or ``max(‖x‖, eps)``
    (``max_eps``), with the gradient in one expression: ``dx = (g − y·Σ(g·y)) / n``, the projection term left
    out where ``max_eps``'s floor holds (there ``n`` does not depend on ``x``; at ``‖x‖ = eps`` the term stays,
    as clamp's gradient passes at its bound). Autograd's chain through the division, the clamp and the norm
    dispatches 14 ops for the ``max_eps`` backward (11 for ``rsqrt_eps``), this one 7 (5): each a kernel launch
    an eager GPU step waits on. The same value; gradients equal to float rounding (tests/test_torch_models.py).
    An eager step on CUDA runs each pass as one kernel that keeps only x
    (:mod:`backends.torch.kernels.l2_normalize`; equal to bfloat16 or float32 rounding).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, form: str) -> torch.Tensor:
        floored = ctx.floored = form != "rsqrt_eps"
        ctx.kernels = (x.dtype in l2_kernels.KERNEL_DTYPES and not torch.compiler.is_compiling()
                       and l2_kernels_by_default(x))
        if ctx.kernels:
            x = x.contiguous()
            ctx.save_for_backward(x)
            return l2_kernels.l2_normalize(x.view(-1, x.shape[-1]), floored).view(x.shape)
        y, n, norm = l2_kernels.l2_normalize_torch(x, floored)
        ctx.save_for_backward(y, n, norm)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.kernels:
            (x,) = ctx.saved_tensors
            d = x.shape[-1]
            grad = l2_kernels.l2_normalize_grad(x.view(-1, d), g.to(x.dtype).contiguous().view(-1, d), ctx.floored)
            return grad.view(x.shape), None
        y, n, norm = ctx.saved_tensors
        return l2_kernels.l2_normalize_grad_torch(g, y, n, norm, ctx.floored), None


def layer_norm(d: int) -> nn.LayerNorm:
    return nn.LayerNorm(d, eps=LN_EPS)


def causal_depthwise_conv(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """See :func:`pcaf_core.reference.causal_depthwise_conv`. Here weight is ``nn.Conv1d``'s ``[d, 1, k]``, tap j
    multiplying lag ``k-1-j`` (the canonical ``[k, d]`` reversed), and the sum runs as k shifted multiply-adds
    in the ``[B, T, d]`` layout.

    The same sum as :meth:`ConvBlock.forward`'s ``nn.Conv1d``, in another summation order. Under
    ``torch.compile`` it fuses into one elementwise kernel with its neighbours, forward and backward:
    4x faster than the compiled convolution at d=256, T=1024, k=5 (which inductor hands to oneDNN's
    depthwise kernel, whose backward is slow on CPU). Eager on a CPU, forward + backward (ms, 2-core AMD
    EPYC, ``[B, T, d]``): 8.7 against 22.2 at ``[544, 9, 128]`` and 4.2 against 11.0 at ``[136, 9, 256]``
    (next-token receptive-field windows), 15.4 against 27.4 at ``[8, 1024, 256]``, 9.2 against 13.5 at
    ``[1, 4096, 256]``; 1.0 against 0.7 at ``[2, 256, 128]``. The forward alone is about 2x slower than the
    convolution's (1.3 against 0.6 ms at ``[544, 9, 128]``).
    """
    k, T = weight.shape[-1], y.shape[1]
    w = weight[:, 0]  # [d, k]; tap j multiplies lag k-1-j
    padded = F.pad(y, (0, 0, k - 1, 0))
    out = bias + padded[:, k - 1:] * w[:, k - 1]
    for j in range(k - 1):
        out = out + padded[:, j:j + T] * w[:, j]
    return out


class ConvBlock(nn.Module):
    """One block of :func:`pcaf_core.reference.conv_stack`, with dropout (:mod:`pcaf_core.reference`).

    ``conv`` is an ``nn.Conv1d`` (groups = d) applied to the input left-padded with k-1 zeros, so its
    tap j multiplies lag ``k-1-j``: the canonical ``[k, d]`` weight is the taps reversed.
    ``conv_form``: ``conv1d``, ``shifted`` (:func:`causal_depthwise_conv`, what a compiled model uses) or
    ``auto`` (the default): ``shifted`` where a backward pass follows on a CPU (grad enabled), whose oneDNN
    depthwise backward is 1.5-2.6x slower than the shifted form's at the training shapes, ``conv1d``
    elsewhere (its forward is faster, and on a GPU it is one kernel launch where the shifted form makes
    about ten).
    The forms compute the same sum in different orders (float rounding). Training-step timings:
    docs/results/design_measurements.md, "The causal depthwise conv as shifted multiply-adds".
    """

    def __init__(self, d: int, d_hidden: int, kernel_size: int, gelu_form: str, dropout: float) -> None:
        super().__init__()
        self.norm = layer_norm(d)
        self.conv = nn.Conv1d(d, d, kernel_size, groups=d)
        self.mlp_in = cpu_gemm.Linear(d, d_hidden)
        self.mlp_out = cpu_gemm.Linear(d_hidden, d)
        self.drop = Dropout(dropout)
        self.gelu_form = gelu_form
        self.conv_form = "auto"

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None,
                rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[B, T, d] -> [B, T, d]``. ``valid`` ``[B, T]`` bool: False before the window's start (receptive-field
        sub-windows, :meth:`backends.torch.models.PCAFModel.states_at`), where the conv input is zero. ``rows``:
        only those M rows go on after the conv (:func:`pcaf_core.reference.nt_conv_rows`), ``-> [B, M, d]``."""
        y = self.norm(x)
        if valid is not None:
            y = y * valid[..., None].to(y.dtype)
        if self.conv_form == "shifted" or (self.conv_form == "auto" and y.device.type == "cpu"
                                           and torch.is_grad_enabled()):
            y = causal_depthwise_conv(y, self.conv.weight, self.conv.bias)
        else:
            y = y.transpose(1, 2)  # [B, d, T]
            conv = self.conv  # its weight copies under an eager autocast step (backends.torch.weight_casts)
            y = F.conv1d(F.pad(y, (conv.kernel_size[0] - 1, 0)), weight_casts.weight(conv.weight),
                         weight_casts.weight(conv.bias), groups=conv.groups).transpose(1, 2)
        y = self.mlp_out(self.drop.after_gelu(self.mlp_in(layer_rows(y, rows)), gelu_approximate(self.gelu_form)))
        return self.drop.residual(layer_rows(x, rows), y)


class Head(nn.Module):
    """Module form of :func:`pcaf_core.reference.head_log_probs`, with dropout (:mod:`pcaf_core.reference`)."""

    def __init__(self, d: int, d_hidden: int, vocab_size: int, gelu_form: str, dropout: float) -> None:
        super().__init__()
        self.norm = layer_norm(d)
        self.hidden = cpu_gemm.Linear(d, d_hidden)
        self.out = cpu_gemm.Linear(d_hidden, vocab_size)
        self.drop = Dropout(dropout)
        self.gelu_form = gelu_form
        # (position chunk, vocabulary chunk) of the training loss's logit tiles, or None for the one-tile
        # form (backends.torch.head_loss); the backend sets it from train.head_loss.
        self.chunks: tuple[int, int] | None = None
        # Whether the one-tile form passes over 16-bit logits with the Triton kernels (None: on CUDA;
        # backends.torch.head_loss.target_log_softmax).
        self.kernels: bool | None = None

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., d] -> [..., d_hidden]``: the output layer's input ``drop(GELU(W_h·LN h))``."""
        return self.drop.after_gelu(self.hidden(self.norm(h)), gelu_approximate(self.gelu_form))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # The normaliser in float32 under bf16 autocast: CUDA autocast upcasts log_softmax by itself, CPU
        # autocast would keep bf16 and round every log-probability to 8 significant bits.
        return torch.log_softmax(widen(self.out(self.features(h))), dim=-1)

    def target_log_prob(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``forward(h)`` at ``targets`` only: h ``[..., d]``, targets ``[...]`` -> ``[...]``, without the
        ``[..., V]`` log-softmax graph (``backends.torch.head_loss``); with :attr:`chunks` without any
        ``[N, V]`` tensor at all."""
        if self.chunks is not None:
            return chunked_target_log_softmax(self.features(h), self.out.weight, self.out.bias, targets,
                                              position_chunk=self.chunks[0], vocab_chunk=self.chunks[1])
        return target_log_softmax(self.features(h), self.out.weight, self.out.bias, targets, kernels=self.kernels)


class Gate(nn.Module):
    """The learned gate of :func:`pcaf_core.reference.memory_read`: raw λ, before masking, in float32 at least.

    The sigmoid runs on the widened logit, as JAX's ``Gate`` does: under bf16 autocast a bf16 sigmoid rounds
    every λ above 0.998 to exactly 1, where the mask's clip to 1 − 1e-5 (itself 1 in bf16) no longer keeps
    log(1 − λ) finite."""

    def __init__(self, d: int, gelu_form: str) -> None:
        super().__init__()
        self.norm = layer_norm(d)
        self.hidden = cpu_gemm.Linear(d, d // 2)
        self.out = cpu_gemm.Linear(d // 2, 1)
        self.gelu_form = gelu_form

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._raw(self.hidden(self.norm(h)))

    def _raw(self, pre: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(widen(self.out(gelu(pre, self.gelu_form))[..., 0]))

    def masked(self, h: torch.Tensor, any_valid: torch.Tensor, *, clip_when_empty: bool, per_term: bool
               ) -> torch.Tensor:
        """:func:`backends.torch.mixture.mask_gate` of ``self(h)``: the masked gate ``[B, Q]`` float32 of h
        ``[B, Q, d]``, any_valid ``[B, Q]`` bool. On an eager CUDA step the last layer, sigmoid and mask run as one
        kernel each way (:mod:`backends.torch.kernels.gate`; :func:`gate_kernels_by_default`)."""
        pre = self.hidden(self.norm(h))
        if pre.dtype in gate_kernels.KERNEL_DTYPES and not torch.compiler.is_compiling() \
                and gate_kernels_by_default(pre):
            w = weight_casts.weight(self.out.weight).to(pre.dtype)[0]
            b = weight_casts.weight(self.out.bias).to(pre.dtype)
            return _MaskedGate.apply(pre, w, b, any_valid, self.gelu_form == "tanh", clip_when_empty, per_term)
        return mixture.mask_gate(self._raw(pre), any_valid, clip_when_empty=clip_when_empty, per_term=per_term)


def gate_kernels_by_default(x: torch.Tensor) -> bool:
    """Whether :meth:`Gate.masked` runs as ``pcaf::masked_gate``'s kernel, one each way: on CUDA tensors."""
    return x.is_cuda and triton_enabled(x)


class _MaskedGate(torch.autograd.Function):
    """The gate's last layer, sigmoid and mask by :func:`backends.torch.kernels.gate.masked_gate`, one kernel each
    way (the layer's weight and bias gradients summed from per-program partial sums)."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, w: torch.Tensor, b: torch.Tensor, any_valid: torch.Tensor, tanh: bool,
                clip_when_empty: bool, per_term: bool) -> torch.Tensor:
        rows, valid = pre.contiguous().view(-1, pre.shape[-1]), any_valid.contiguous().view(-1)
        ctx.save_for_backward(rows, w, b, valid)
        ctx.tanh, ctx.per_term, ctx.shape = tanh, per_term, pre.shape
        return gate_kernels.masked_gate(rows, w, b, valid, tanh=tanh, clip_when_empty=clip_when_empty,
                                        per_term=per_term).view(any_valid.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        rows, w, b, valid = ctx.saved_tensors
        d_pre, d_w, d_b = gate_kernels.masked_gate_grad(g.float().contiguous().view(-1), rows, w, b, valid,
                                                         tanh=ctx.tanh, per_term=ctx.per_term)
        return d_pre.view(ctx.shape), d_w, d_b, None, None, None, None


class PositionalTable(nn.Module):
    """The trainable positional table ``pos.table`` of :func:`pcaf_core.reference.hidden_states`."""

    def __init__(self, max_seq_len: int, d: int, scale: float = 1.0) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.as_tensor(sinusoidal_table(max_seq_len, d, "trainable_jax") * scale,
                                                  dtype=torch.get_default_dtype()))

    def forward(self, seq_len: int) -> torch.Tensor:
        n = self.table.shape[0]
        if seq_len > n:
            raise ValueError(f"sequence length T={seq_len} exceeds the positional table's {n} rows "
                             f"(model.max_seq_len={n})")
        return self.table[:seq_len]


class FixedPositions(nn.Module):
    """The fixed sinusoids of :func:`pcaf_core.reference.hidden_states`.

    One table per (dtype, device) is kept, the longest requested so far: rows depend on the position
    only, so shorter windows read a prefix of it.
    """

    def __init__(self, d: int, form: str, scale: float = 1.0) -> None:
        super().__init__()
        self.d, self.form, self.scale = d, form, scale
        self._cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def forward(self, seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        table = self._cache.get(key)
        if table is None or table.shape[0] < seq_len:
            values = torch.as_tensor(sinusoidal_table(seq_len, self.d, self.form) * self.scale, dtype=torch.float64)
            table = self._cache[key] = values.to(device=device, dtype=dtype)
        return table[:seq_len]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """See :func:`pcaf_core.reference.elu_plus_one`."""
    return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))


def attention_mask(seq_len: int, variant: str, window: int, n_global: int, device: torch.device) -> torch.Tensor:
    """See :func:`pcaf_core.reference.attention_mask`; built on ``device``."""
    pos = torch.arange(seq_len, device=device)
    return attention_allowed(pos[:, None], pos[None, :], variant, window, n_global)


def layer_rows(x: torch.Tensor, rows: tuple[int, int] | None, dim: int = 1) -> torch.Tensor:
    """The rows of :func:`pcaf_core.reference.layer_rows` of ``x`` along ``dim`` (None: ``x``), from two slices."""
    if rows is None:
        return x
    first, last = rows
    n = x.shape[dim]
    tail = x.narrow(dim, n - last, last)
    return tail if first == 0 else torch.cat([x.narrow(dim, 0, first), tail], dim=dim)


def causal_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """The linear attention of :func:`pcaf_core.reference.attention`, chunked as stated there, on split heads."""
    B, H, T, hd = q.shape
    fq, fk = elu_plus_one(q), elu_plus_one(k)
    c = max(1, min(chunk, T))
    n = -(-T // c)
    pad = n * c - T
    if pad:
        # Features are padded after φ, so padded keys contribute zero; padded queries are dropped.
        fq, fk, v = (F.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v))
    fq, fk, vv = (x.reshape(B, H, n, c, hd) for x in (fq, fk, v))
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    a = (fq @ fk.transpose(-1, -2)) * tri.to(fq.dtype)  # [B, H, n, c, c]
    num = a @ vv
    den = a.sum(-1)
    kv = fk.transpose(-1, -2) @ vv  # [B, H, n, hd, hd]
    kv_prev = torch.cumsum(kv, dim=2) - kv
    ks = fk.sum(-2)  # [B, H, n, hd]
    ks_prev = torch.cumsum(ks, dim=2) - ks
    num = num + fq @ kv_prev
    den = den + (fq * ks_prev[..., None, :]).sum(-1)
    out = num / torch.clamp(den, min=LINEAR_ATTENTION_DEN_FLOOR)[..., None]
    return out.reshape(B, H, n * c, hd)[:, :, :T]


CAUSAL_BLOCK = 128
"""Query rows per SDPA call of :func:`causal_attention_in_blocks` (fastest of 64, 128 and 256 on the 2-core CPU
at T = 1,024, batch 8, 4 heads of 32)."""


def causal_attention_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                               block: int = CAUSAL_BLOCK) -> torch.Tensor:
    """Causal softmax attention with dropout, ``[B, H, T, hd] x 3 -> [B, H, T, hd]``, as SDPA over query blocks of
    ``block`` rows, each against the keys up to its last row under its rows of the causal mask: ``(T + block) /
    2T`` of the ``[T, T]`` scores, dropout draws and their backward. On a CPU, SDPA's only form with dropout is its
    math path over the whole ``[T, T]`` array, the masked half included; CUDA's fused kernels skip that half
    themselves. Each block draws its own dropout mask over its entries, which leaves every weight's distribution
    as it was."""
    T = q.shape[2]
    if T <= block:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    parts = []
    for start in range(0, T, block):
        end = min(T, start + block)
        parts.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                    attn_mask=causal[start:end, :end], dropout_p=dropout_p))
    return torch.cat(parts, dim=2)


def uses_flex_attention(impl: str, device: torch.device) -> bool:
    """Whether windowed attention under ``model.attention_impl=impl`` runs FlexAttention on ``device`` (``banded``,
    and ``auto`` on CUDA: FlexAttention has no backward pass on a CPU, so ``auto`` trains masked there)."""
    return impl == "banded" or (impl == "auto" and torch.device(device).type == "cuda")


def attention_kernel(impl: str, device: torch.device, next_token: bool) -> str:
    """What computes windowed attention under ``impl`` on ``device`` (:class:`Attention`), for the run record;
    ``next_token``: a next-token run, whose layers above the first read fewer query rows
    (:meth:`Attention.banded`)."""
    if impl == "blocked":
        return "blocked SDPA"
    if uses_flex_attention(impl, device):
        return "FlexAttention" + (f" (masked SDPA in layers of under {FLEX_BLOCK} query rows)" if next_token else "")
    return "masked SDPA"


class Attention(nn.Module):
    """Module form of :func:`pcaf_core.reference.attention`, with dropout (:mod:`pcaf_core.reference`).

    Windowed variants (local, global-local) follow ``impl`` (``model.attention_impl``): ``banded`` is
    FlexAttention over the window's block mask (:mod:`backends.torch.window_attention`), ``blocked`` SDPA over
    query blocks and their windows' keys (``blocked_window_attention``), ``masked`` SDPA under the ``[T, T]``
    mask, ``auto`` banded on CUDA and masked elsewhere (FlexAttention has no backward pass on a CPU, so a CPU
    trains masked). Dense attention is causal SDPA; with dropout on a CPU, SDPA over query blocks
    (:func:`causal_attention_in_blocks`).
    """

    def __init__(self, d: int, n_heads: int, variant: str, window: int, n_global: int, linear_chunk: int,
                 dropout: float, impl: str = "auto") -> None:
        super().__init__()
        self.qkv = cpu_gemm.Linear(d, 3 * d)
        self.out = cpu_gemm.Linear(d, d)
        self.n_heads, self.variant = n_heads, variant
        self.window, self.n_global, self.linear_chunk = window, n_global, linear_chunk
        self.dropout = dropout
        self.impl = impl

    def banded(self, device: torch.device, query_rows: int | None = None) -> bool:
        """Whether windowed attention on ``device`` runs FlexAttention (``impl``; ``auto``: on CUDA). A next-token
        layer whose query rows are fewer than one FlexAttention block (the top layer's one row) runs masked SDPA
        over its rows of the mask either way: a block-sparse kernel has nothing to skip there, and FlexAttention
        would switch to its decoding kernels. ``query_rows``: that layer's query rows (None: a whole window)."""
        if self.variant not in WINDOWED_VARIANTS or not uses_flex_attention(self.impl, device):
            return False
        return query_rows is None or query_rows >= FLEX_BLOCK

    def forward(self, x: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[B, T, d] -> [B, T, d]``; with ``rows`` (softmax variants) the queries are those M rows of x
        (:func:`pcaf_core.reference.layer_rows`), ``-> [B, M, d]``."""
        B, T, d = x.shape
        if rows is not None and self.variant == "linear_attention":
            raise ValueError("query rows apply to softmax attention, not 'linear_attention'")
        q, k, v = (y.reshape(B, T, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for y in self.qkv(x).split(d, dim=-1))
        q = layer_rows(q, rows, dim=2)
        if self.variant == "linear_attention":
            # No attention matrix exists to drop out; the reference linear attention (JAX) has no dropout.
            o = causal_linear_attention(q, k, v, self.linear_chunk)
        else:
            p = self.dropout if self.training else 0.0
            if self.variant == "transformer_dense" and rows is None and p > 0 and x.device.type == "cpu":
                o = causal_attention_in_blocks(q, k, v, p)
            elif self.variant == "transformer_dense" and rows is None:
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            elif self.variant == "transformer_dense" and rows == (0, 1):
                # The next-token top layer's last row reads every key: no mask, and SDPA's fused kernels.
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
            elif self.variant in WINDOWED_VARIANTS and self.impl == "blocked":
                o = blocked_window_attention(q, k, v, self.variant, self.window, self.n_global, p, rows=rows)
            elif self.banded(x.device, None if rows is None else q.shape[2]):
                o = flex_window_attention(q, k, v, self.variant, self.window, self.n_global, p, rows=rows)
            else:
                mask = layer_rows(attention_mask(T, self.variant, self.window, self.n_global, x.device), rows, 0)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.out(o.transpose(1, 2).reshape(B, o.shape[2], d))


class TransformerBlock(nn.Module):
    """One block of :func:`pcaf_core.reference.transformer_stack`, with dropout (:mod:`pcaf_core.reference`)."""

    def __init__(self, d: int, d_hidden: int, n_heads: int, variant: str, window: int, n_global: int,
                 linear_chunk: int, gelu_form: str, dropout: float, attention_impl: str = "auto") -> None:
        super().__init__()
        self.attn_norm = layer_norm(d)
        self.attn = Attention(d, n_heads, variant, window, n_global, linear_chunk, dropout, attention_impl)
        self.mlp_norm = layer_norm(d)
        self.mlp_in = cpu_gemm.Linear(d, d_hidden)
        self.mlp_out = cpu_gemm.Linear(d_hidden, d)
        self.drop = Dropout(dropout)
        self.gelu_form = gelu_form

    def forward(self, x: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[B, T, d] -> [B, T, d]``; with ``rows`` only those M rows of x go on (softmax attention's
        next-token layers, :func:`pcaf_core.reference.nt_attention_rows`), ``-> [B, M, d]``."""
        x = self.drop.residual(layer_rows(x, rows), self.attn(self.attn_norm(x), rows))
        y = self.mlp_out(self.drop.after_gelu(self.mlp_in(self.mlp_norm(x)), gelu_approximate(self.gelu_form)))
        return self.drop.residual(x, y)
