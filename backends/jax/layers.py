"""Building blocks of every model in flax.linen (mirrors the building blocks of :mod:`pcaf_core.reference`).

Parameter names are the canonical ones of :func:`pcaf_core.params.param_shapes`: every module here
stores ``weight``/``bias`` (``table`` for positions) in the canonical layout, Linear ``[in, out]``
(``y = x @ W + b``) and the causal depthwise conv ``[k, d]`` indexed by lag, so
:mod:`backends.jax.weights` only has to nest and flatten names (``blocks.0`` <-> ``blocks_0``).

Precision: ``dtype`` is the compute dtype of matmuls and convolutions (float32, or bfloat16 for the
bf16 option); parameters keep their own dtype and are cast at use. LayerNorm statistics, softmax
normalisers and the residual stream run in ``wide(dtype)`` (at least float32), as torch autocast does.

Dropout sits where :mod:`pcaf_core.reference` places it; it is active only with ``deterministic=False`` and
then draws from the ``"dropout"`` RNG stream (:class:`backends.jax.dropout.Dropout`, :mod:`pcaf_core.dropout`'s
rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from backends.jax.dropout import Dropout
from backends.jax.head_loss import chunked_target_log_softmax
from backends.jax.window_attention import (
    CAUSAL_BLOCK,
    attention,
    attention_mask,
    banded_attention,
    causal_attention_in_blocks,
)
from pcaf_core.config import WINDOWED_VARIANTS
from pcaf_core.params import sinusoidal_table
from pcaf_core.reference import LN_EPS

L2_RSQRT_EPS = 1e-6  # rsqrt_eps form: x / sqrt(Σx² + 1e-6)
L2_MAX_EPS = 1e-12  # max_eps form: x / max(‖x‖, 1e-12)
LINEAR_ATTENTION_DEN_FLOOR = 1e-6
EMBED_STD = 0.02  # canonical (jax_normal) embedding init

Dtype = Any
Initializer = Callable[..., jax.Array]


def wide(dtype: Dtype) -> jnp.dtype:
    """The dtype of normalisers and of the residual stream: ``dtype`` promoted to at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def gelu(x: jax.Array, form: str) -> jax.Array:
    """See :func:`pcaf_core.reference.gelu`."""
    return jax.nn.gelu(x, approximate=form == "tanh")


def l2_normalize(x: jax.Array, form: str) -> jax.Array:
    """See :func:`pcaf_core.reference.l2_normalize`."""
    sq = jnp.sum(x * x, axis=-1, keepdims=True)
    if form == "rsqrt_eps":
        return x / jnp.sqrt(sq + L2_RSQRT_EPS)
    return x / jnp.maximum(jnp.sqrt(sq), L2_MAX_EPS)


# --------------------------------------------------------------------------- initialisers (module.init)
# The canonical initialisation is backends.jax.params.init_params; these make ``module.init`` produce
# the same distributions (jax_normal) so that a bare init is usable too.


def fan_in_normal(key: jax.Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> jax.Array:
    """N(0, 1/fan_in) with fan_in = ``shape[0]`` (Linear ``[in, out]`` and conv ``[k, d]`` alike)."""
    return jax.random.normal(key, shape, dtype) / math.sqrt(shape[0])


def embed_normal(key: jax.Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> jax.Array:
    return jax.random.normal(key, shape, dtype) * EMBED_STD


# --------------------------------------------------------------------------- basic modules


def expand_param(p: jax.Array, x: jax.Array) -> jax.Array:
    """A per-feature parameter ``p`` ``[d]`` broadcast to ``x``'s shape ``[..., d]`` in one step.

    Same values as NumPy-style broadcasting (``p * x``), which reshapes ``p`` to ``[1, 1, d]`` first: the
    gradient of that form is a sum over the time axis alone that keeps a unit batch axis, and XLA:CPU's YNN
    reduction runs it 10x slower at batch 1 (15.1 against 1.2 ms for the conv's forward and backward at
    ``[1, 2048, 224]``; docs/results/design_measurements.md, "JAX training step on a CPU"). A direct
    ``broadcast_in_dim`` transposes to one sum over every leading axis.
    """
    return jnp.broadcast_to(p, x.shape)


@jax.custom_vjp
def affine(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """``x @ w + b`` accumulated in ``b.dtype``: x ``[..., in]`` and w ``[in, out]`` in the compute dtype,
    b ``[out]`` in ``wide(compute dtype)`` -> ``[..., out]`` in ``b.dtype``.

    A custom VJP because XLA:CPU's own backward for the bias, a column sum of the ``[N, out]`` cotangent,
    is slow for a large head: at the 41M shape (N=2,048, out=32,000) the head's gradient took 3.5 s with it
    and 2.2 s without. There ``∂b`` is one more row of the ``∂w`` product, ``[x, 1]ᵀ @ g``
    (:func:`bias_row_in_weight_product`); elsewhere it is the column sum.
    """
    return jnp.matmul(x, w, preferred_element_type=b.dtype) + b


def bias_row_in_weight_product() -> bool:
    """Whether :func:`affine`'s backward gets ``∂b`` as a row of the ``∂w`` product: on XLA:CPU, whose column
    sum is the slow part. A GPU or TPU sums the columns at memory speed, fused with the cotangent's producer,
    where the row would cost an ``[N, in + 1]`` copy of x per layer and an odd product width (``in + 1``)."""
    return jax.default_backend() == "cpu"


def _affine_fwd(x: jax.Array, w: jax.Array, b: jax.Array) -> tuple[jax.Array, tuple]:
    return affine(x, w, b), (x, w, b)


def _affine_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, w, b = res
    g = g.astype(x.dtype)  # the products run in the compute dtype, as the forward's do
    dx = jnp.matmul(g, w.T, preferred_element_type=b.dtype).astype(x.dtype)
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if not bias_row_in_weight_product():
        dw = jnp.matmul(x2.T, g2, preferred_element_type=b.dtype)
        return dx, dw.astype(w.dtype), jnp.sum(g2, axis=0, dtype=b.dtype)
    x1 = jnp.concatenate([x2, jnp.ones((x2.shape[0], 1), x.dtype)], axis=1)
    dwb = jnp.matmul(x1.T, g2, preferred_element_type=b.dtype)
    return dx, dwb[:-1].astype(w.dtype), dwb[-1].astype(b.dtype)


affine.defvjp(_affine_fwd, _affine_bwd)


class Dense(nn.Module):
    """``y = x @ weight + bias`` with ``weight [in, out]``; operands in ``dtype``, returns ``dtype``.

    Products accumulate in ``wide(dtype)`` and the bias is added before the one rounding to ``dtype``,
    as a bf16 GEMM with a bias epilogue does under torch autocast. On XLA:CPU this is also the fast
    form: a bf16 dot with a bf16 result runs about 1.8x slower than with float32 accumulation
    (512x128 @ 128x20000: 30 against 17 ms on the 2-core machine).
    """

    features: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", fan_in_normal, (x.shape[-1], self.features), self.param_dtype)
        acc = wide(self.dtype)
        x, w = x.astype(self.dtype), w.astype(self.dtype)
        if not self.use_bias:
            return jnp.matmul(x, w, preferred_element_type=acc).astype(self.dtype)
        b = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        return affine(x, w, b.astype(acc)).astype(self.dtype)


class LayerNorm(nn.Module):
    """Module form of :func:`pcaf_core.reference.layer_norm`, computed in ``wide(dtype)``; returns ``dtype``.
    Parameters ``weight`` (initialised to 1) and ``bias`` (0)."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        w = self.param("weight", nn.initializers.ones, (d,), self.param_dtype)
        b = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
        work = wide(self.dtype)
        x = x.astype(work)
        mu = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
        y = (x - mu) / jnp.sqrt(var + LN_EPS) * expand_param(w.astype(work), x) + expand_param(b.astype(work), x)
        return y.astype(self.dtype)


class Embed(nn.Module):
    """Token embedding ``weight [V, d]``: ``[B, T]`` int -> ``[B, T, d]`` in ``out_dtype``."""

    num_embeddings: int
    features: int
    out_dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        w = self.param("weight", embed_normal, (self.num_embeddings, self.features), self.param_dtype)
        return jnp.take(w, tokens, axis=0).astype(self.out_dtype)


class CausalConv(nn.Module):
    """Module form of :func:`pcaf_core.reference.causal_depthwise_conv` in ``dtype``; ``weight`` and ``bias``
    in the canonical layout (no tap reversal)."""

    kernel_size: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, T = x.shape[-1], x.shape[1]
        w = self.param("weight", fan_in_normal, (self.kernel_size, d), self.param_dtype).astype(self.dtype)
        b = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype).astype(self.dtype)
        x = x.astype(self.dtype)
        out = jnp.broadcast_to(b, x.shape)
        # k shifted multiply-adds: k is small (5), and each tap stays an elementwise op XLA fuses.
        for lag in range(min(self.kernel_size, T)):
            shifted = x if lag == 0 else jnp.pad(x, ((0, 0), (lag, 0), (0, 0)))[:, :T]
            out = out + expand_param(w[lag], shifted) * shifted
        return out


def layer_rows(x: jax.Array, rows: tuple[int, int] | None, axis: int = 1) -> jax.Array:
    """The rows of :func:`pcaf_core.reference.layer_rows` of ``x`` along ``axis`` (None: ``x``); static slices."""
    if rows is None:
        return x
    first, last = rows
    n = x.shape[axis]
    tail = jax.lax.slice_in_dim(x, n - last, n, axis=axis)
    return tail if first == 0 else jnp.concatenate([jax.lax.slice_in_dim(x, 0, first, axis=axis), tail], axis=axis)


class ConvBlock(nn.Module):
    """One block of :func:`pcaf_core.reference.conv_stack`, with dropout (:mod:`pcaf_core.reference`).

    The residual stream keeps its dtype (``wide(dtype)`` in the models); the branch runs in ``dtype``.
    """

    d_model: int
    d_hidden: int
    kernel_size: int
    gelu_form: str
    dropout: float = 0.0
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        self.norm = LayerNorm(dtype=self.dtype)
        self.conv = CausalConv(self.kernel_size, dtype=self.dtype)
        self.mlp_in = Dense(self.d_hidden, dtype=self.dtype)
        self.mlp_out = Dense(self.d_model, dtype=self.dtype)
        self.drop = Dropout(self.dropout)

    def __call__(self, x: jax.Array, deterministic: bool = True, valid: jax.Array | None = None,
                 rows: tuple[int, int] | None = None) -> jax.Array:
        """``[B, T, d] -> [B, T, d]``. ``valid`` ``[B, T]`` bool: False before the window's start (receptive-field
        sub-windows, :meth:`backends.jax.models.PCAFModel.states_at`), where the conv input is zero. ``rows``
        (static): only those M rows go on after the conv (:func:`pcaf_core.reference.nt_conv_rows`),
        ``-> [B, M, d]``."""
        y = self.norm(x)
        if valid is not None:
            y = y * valid[..., None].astype(y.dtype)
        y = layer_rows(self.conv(y), rows)
        y = self.mlp_out(self.drop(gelu(self.mlp_in(y), self.gelu_form), deterministic=deterministic))
        return layer_rows(x, rows) + self.drop(y, deterministic=deterministic).astype(x.dtype)


class OutputLayer(nn.Module):
    """The head's output layer: :class:`Dense` with ``in_features`` known up front, so its ``weight
    [in, V]`` and ``bias [V]`` can also be read without applying the layer (the chunked head loss)."""

    in_features: int
    features: int
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        self.weight = self.param("weight", fan_in_normal, (self.in_features, self.features), jnp.float32)
        self.bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)

    def operands(self) -> tuple[jax.Array, jax.Array]:
        """``(weight, bias)`` as :class:`Dense` uses them: the weight in ``dtype``, the bias in ``wide(dtype)``."""
        return self.weight.astype(self.dtype), self.bias.astype(wide(self.dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w, b = self.operands()
        return affine(x.astype(self.dtype), w, b).astype(self.dtype)


class Head(nn.Module):
    """Module form of :func:`pcaf_core.reference.head_log_probs`, with dropout (:mod:`pcaf_core.reference`), in
    ``wide(dtype)``.

    ``chunks``: ``(position chunk, vocabulary chunk)`` of the training loss's logit tiles
    (:func:`backends.jax.head_loss.chunked_target_log_softmax`), or None for the one-tile form.
    """

    d_hidden: int
    vocab_size: int
    gelu_form: str
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    chunks: tuple[int, int] | None = None

    def setup(self) -> None:
        self.norm = LayerNorm(dtype=self.dtype)
        self.hidden = Dense(self.d_hidden, dtype=self.dtype)
        self.out = OutputLayer(self.d_hidden, self.vocab_size, dtype=self.dtype)
        self.drop = Dropout(self.dropout)

    def features(self, h: jax.Array, deterministic: bool = True) -> jax.Array:
        """``[..., d] -> [..., d_hidden]``: the output layer's input ``drop(GELU(W_h·LN h))`` in ``dtype``."""
        return self.drop(gelu(self.hidden(self.norm(h)), self.gelu_form), deterministic=deterministic)

    def logits(self, h: jax.Array, deterministic: bool = True) -> jax.Array:
        """``[..., d] -> [..., V]`` logits, widened to at least float32 for the normaliser."""
        return self.out(self.features(h, deterministic)).astype(wide(self.dtype))

    def __call__(self, h: jax.Array, deterministic: bool = True) -> jax.Array:
        return jax.nn.log_softmax(self.logits(h, deterministic), axis=-1)

    def target_log_prob(self, h: jax.Array, targets: jax.Array, deterministic: bool = True) -> jax.Array:
        """``__call__(h)`` at ``targets`` only: h ``[..., d]``, targets ``[...]`` int -> ``[...]``.

        One tile: ``logit_y - logsumexp(logits)``, no ``[..., V]`` log-probability array is returned and XLA
        fuses the normaliser into the logits' consumer. With ``chunks``: no ``[..., V]`` array at all.
        """
        if self.chunks is None:
            z = self.logits(h, deterministic)
            return jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(z, axis=-1)
        z = self.features(h, deterministic).astype(self.dtype)
        w, b = self.out.operands()
        out = chunked_target_log_softmax(z.reshape(-1, z.shape[-1]), w, b, targets.reshape(-1), *self.chunks)
        return out.reshape(targets.shape)


class Gate(nn.Module):
    """The learned gate of :func:`pcaf_core.reference.memory_read`: raw λ, before masking, in ``wide(dtype)``."""

    d_model: int
    gelu_form: str
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        self.norm = LayerNorm(dtype=self.dtype)
        self.hidden = Dense(self.d_model // 2, dtype=self.dtype)
        self.out = Dense(1, dtype=self.dtype)

    def __call__(self, h: jax.Array) -> jax.Array:
        g = self.out(gelu(self.hidden(self.norm(h)), self.gelu_form))[..., 0]
        return jax.nn.sigmoid(g.astype(wide(self.dtype)))


class PositionalTable(nn.Module):
    """The trainable positional table of :func:`pcaf_core.reference.hidden_states` (parameter ``table``,
    initialised at ``scale``·sinusoids). Call with T to get rows ``[:T]``."""

    max_seq_len: int
    d_model: int
    scale: float = 1.0
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, seq_len: int) -> jax.Array:
        def init(key: jax.Array, shape: tuple[int, int], dtype: Dtype) -> jax.Array:
            return jnp.asarray(sinusoidal_table(shape[0], shape[1], "trainable_jax") * self.scale, dtype)

        table = self.param("table", init, (self.max_seq_len, self.d_model), self.param_dtype)
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length T={seq_len} exceeds the positional table's {self.max_seq_len} rows "
                             f"(model.max_seq_len={self.max_seq_len})")
        return table[:seq_len]


def fixed_positions(seq_len: int, d: int, form: str, scale: float, dtype: Dtype) -> jax.Array:
    """The fixed sinusoids ``[T, d]`` of :func:`pcaf_core.reference.hidden_states`, in ``dtype``."""
    return jnp.asarray(sinusoidal_table(seq_len, d, form) * scale, dtype=dtype)


# --------------------------------------------------------------------------- attention


def elu_plus_one(x: jax.Array) -> jax.Array:
    """See :func:`pcaf_core.reference.elu_plus_one`."""
    return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


def causal_linear_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
    """The linear attention of :func:`pcaf_core.reference.attention`, chunked as stated there, on split heads."""
    B, H, T, hd = q.shape
    fq, fk = elu_plus_one(q), elu_plus_one(k)
    c = max(1, min(chunk, T))
    n = -(-T // c)
    pad = n * c - T
    if pad:
        # Features are padded after φ, so padded keys contribute zero; padded queries are dropped.
        widths = ((0, 0), (0, 0), (0, pad), (0, 0))
        fq, fk, v = (jnp.pad(x, widths) for x in (fq, fk, v))
    fq, fk, vv = (x.reshape(B, H, n, c, hd) for x in (fq, fk, v))
    tri = jnp.tril(jnp.ones((c, c), dtype=fq.dtype))
    a = jnp.einsum("bhncd,bhnsd->bhncs", fq, fk) * tri  # [B, H, n, c, c]
    num = jnp.einsum("bhncs,bhnsd->bhncd", a, vv)
    den = a.sum(-1)
    kv = jnp.einsum("bhnsd,bhnse->bhnde", fk, vv)  # [B, H, n, hd, hd]
    ks = fk.sum(-2)  # [B, H, n, hd]

    def exclusive_cumsum(x: jax.Array) -> jax.Array:
        total = jnp.cumsum(x, axis=2)
        return jnp.concatenate([jnp.zeros_like(total[:, :, :1]), total[:, :, :-1]], axis=2)

    num = num + jnp.einsum("bhncd,bhnde->bhnce", fq, exclusive_cumsum(kv))
    den = den + jnp.einsum("bhncd,bhnd->bhnc", fq, exclusive_cumsum(ks))
    out = num / jnp.maximum(den, LINEAR_ATTENTION_DEN_FLOOR)[..., None]
    return out.reshape(B, H, n * c, hd)[:, :, :T]


def attention_kernel(impl: str) -> str:
    """What computes windowed attention under ``model.attention_impl=impl`` (:class:`Attention`; the same on every
    device), for the run record."""
    return "masked softmax" if impl == "masked" else "banded GEMMs"


class Attention(nn.Module):
    """Module form of :func:`pcaf_core.reference.attention`, with dropout (:mod:`pcaf_core.reference`). Linear
    attention runs in ``wide(dtype)``: its running sums would lose too much in bfloat16.

    Windowed variants (local, global-local) follow ``attention_impl`` (``model.attention_impl``): ``banded``
    (and ``auto``) is the blocked band of :func:`backends.jax.window_attention.banded_attention`, ``masked``
    every ``[T, T]`` score under the mask (:func:`attention`). Dense attention over all rows runs in causal query
    blocks (:func:`backends.jax.window_attention.causal_attention_in_blocks`); over some rows (a next-token
    step's top layer) it is :func:`attention` of those rows.
    """

    d_model: int
    n_heads: int
    variant: str
    window: int
    n_global: int
    linear_chunk: int
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    attention_impl: str = "auto"

    def setup(self) -> None:
        self.qkv = Dense(3 * self.d_model, dtype=self.dtype)
        self.out = Dense(self.d_model, dtype=self.dtype)
        self.drop = Dropout(self.dropout)

    def __call__(self, x: jax.Array, deterministic: bool = True, rows: tuple[int, int] | None = None) -> jax.Array:
        """``[B, T, d] -> [B, T, d]``; with ``rows`` (softmax variants, static) the outputs of those M rows of x
        only (:func:`pcaf_core.reference.layer_rows`), ``-> [B, M, d]``: both paths take those rows as queries."""
        B, T, d = x.shape
        H = self.n_heads
        if rows is not None and self.variant == "linear_attention":
            raise ValueError("query rows apply to softmax attention, not 'linear_attention'")
        qkv = self.qkv(x)
        q, k, v = (qkv[..., i * d : (i + 1) * d].reshape(B, T, H, d // H) for i in range(3))
        if self.variant == "linear_attention":
            # No attention matrix exists to drop out; the reference linear attention (JAX) has no dropout.
            work = wide(self.dtype)
            q, k, v = (y.astype(work).transpose(0, 2, 1, 3) for y in (q, k, v))
            o = causal_linear_attention(q, k, v, self.linear_chunk).transpose(0, 2, 1, 3)
        elif self.variant in WINDOWED_VARIANTS and self.attention_impl != "masked":
            o = banded_attention(q, k, v, self.variant, self.window, self.n_global,
                                 lambda p: self.drop(p, deterministic=deterministic), rows=rows)
        elif self.variant == "transformer_dense" and rows is None:
            o = causal_attention_in_blocks(q, k, v, lambda p: self.drop(p, deterministic=deterministic),
                                           block=CAUSAL_BLOCK)
        else:
            mask = layer_rows(attention_mask(T, self.variant, self.window, self.n_global), rows, axis=0)
            o = attention(layer_rows(q, rows), k, v, mask, lambda p: self.drop(p, deterministic=deterministic))
        return self.out(o.reshape(B, o.shape[1], d))


class TransformerBlock(nn.Module):
    """One block of :func:`pcaf_core.reference.transformer_stack`, with dropout (:mod:`pcaf_core.reference`)."""

    d_model: int
    d_hidden: int
    n_heads: int
    variant: str
    window: int
    n_global: int
    linear_chunk: int
    gelu_form: str
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    attention_impl: str = "auto"

    def setup(self) -> None:
        self.attn_norm = LayerNorm(dtype=self.dtype)
        self.attn = Attention(self.d_model, self.n_heads, self.variant, self.window, self.n_global,
                              self.linear_chunk, self.dropout, dtype=self.dtype, attention_impl=self.attention_impl)
        self.mlp_norm = LayerNorm(dtype=self.dtype)
        self.mlp_in = Dense(self.d_hidden, dtype=self.dtype)
        self.mlp_out = Dense(self.d_model, dtype=self.dtype)
        self.drop = Dropout(self.dropout)

    def __call__(self, x: jax.Array, deterministic: bool = True, rows: tuple[int, int] | None = None) -> jax.Array:
        """``[B, T, d] -> [B, T, d]``; with ``rows`` (static) only those M rows of x go on (softmax attention's
        next-token layers, :func:`pcaf_core.reference.nt_attention_rows`), ``-> [B, M, d]``."""
        a = self.attn(self.attn_norm(x), deterministic, rows)
        x = layer_rows(x, rows) + self.drop(a, deterministic=deterministic).astype(x.dtype)
        y = self.mlp_out(self.drop(gelu(self.mlp_in(self.mlp_norm(x)), self.gelu_form), deterministic=deterministic))
        return x + self.drop(y, deterministic=deterministic).astype(x.dtype)
