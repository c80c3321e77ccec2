"""Reference forward of every model from the canonical parameter dict (evaluation mode: dropout off).

``forward(params, tokens, model, memory, profile, mode, targets)`` is the oracle every backend is tested
against. NumPy, float64 unless the parameters are float32.

The models of :data:`pcaf_core.config.MODEL_VARIANTS`:

* conv backbone (:func:`conv_stack`): embedding + causal conv blocks + parametric head, and for ``pcaf`` /
  ``pcaf_no_gate`` the associative memory (context, semantic or hybrid route, :func:`memory_read`) mixed in by
  a gate. ``pcaf_no_cache`` and ``local_conv`` are the same network with the cache path off (their unused
  memory/gate/router parameters exist where the profile says the reference carried them).
* Transformers (:func:`transformer_stack`): dense / local / global-local softmax attention or linear attention.

Training mode (backends only) adds the profile's dropout where the reference PyTorch code has it: after the
GELU of the block MLP and of the head, on each residual branch, and on the softmax attention weights (linear
attention forms no attention matrix and has none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import erf

from pcaf_core import hashing, mixture, records, routing
from pcaf_core.config import TRANSFORMER_VARIANTS, MemoryConfig, ModelConfig, ProfileConfig
from pcaf_core.params import check_params, has_positional_table, param_shapes, sinusoidal_table, uses_cache

LN_EPS = 1e-5


# --------------------------------------------------------------------------- building blocks


def gelu(x: np.ndarray, form: str) -> np.ndarray:
    """GELU: ``tanh`` approximation (jax.nn.gelu default) or exact ``erf`` (torch nn.GELU)."""
    if form == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + 1e-5)·weight + bias``, two-pass (biased) variance."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + LN_EPS) * weight + bias


def l2_normalize(x: np.ndarray, form: str) -> np.ndarray:
    """``rsqrt_eps``: ``x·rsqrt(Σx² + 1e-6)`` (JAX); ``max_eps``: ``x / max(‖x‖, 1e-12)`` (torch ``F.normalize``)."""
    sq = (x * x).sum(-1, keepdims=True)
    if form == "rsqrt_eps":
        return x / np.sqrt(sq + 1e-6)
    return x / np.maximum(np.sqrt(sq), 1e-12)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(x))


def linear(p: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    """``x @ weight + bias`` of the canonical Linear ``name``: weight ``[in, out]``, bias ``[out]`` optional."""
    y = x @ p[f"{name}.weight"]
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def causal_depthwise_conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Causal depthwise conv ``out_t = Σ_lag w[lag]·x_{t-lag} + b`` with zeros left of the window.

    x ``[B, T, d]``; weight ``[k, d]`` indexed by lag (the canonical layout); bias ``[d]``. Returns ``[B, T, d]``.
    """
    out = np.zeros_like(x) + bias
    T = x.shape[1]
    for lag in range(weight.shape[0]):
        if lag < T:
            out[:, lag:] += weight[lag] * x[:, : T - lag]
    return out


def mlp(p: dict[str, np.ndarray], prefix: str, x: np.ndarray, gelu_form: str) -> np.ndarray:
    return linear(p, f"{prefix}.mlp_out", gelu(linear(p, f"{prefix}.mlp_in", x), gelu_form))


def conv_stack(p: dict[str, np.ndarray], x: np.ndarray, model: ModelConfig, gelu_form: str,
               rows: list[tuple[int, int]] | None = None) -> np.ndarray:
    """Pre-LN residual blocks ``x += W2·GELU(W1·conv(LN x))``: ``[B, T, d] -> [B, T, d]``; with ``rows``
    (:func:`nt_conv_rows`, on a window of the last position's R tokens) block i keeps the rows ``rows[i]`` of
    its input after its conv, ``-> [B, 1, d]``.

    The conv is :func:`causal_depthwise_conv`. Receptive field: the final state at position t depends on the
    tokens at ``t-R+1 .. t`` only, ``R = n_layers·(k - 1) + 1``; positions before the window's start feed zeros
    to every conv (the left padding). Backends compute next-token forwards from receptive fields
    (``nt_receptive_field``): a prediction reads the query's final state and the keys of its C candidate slots
    (K, 2K for the hybrid route; none without a cache), so they compute ``B·(1 + C)·R`` positions instead of
    ``B·T``. Routes that select from the tokens alone (``recent`` / ``first`` context routes) select first;
    routes that rank by states select without gradients, then recompute the selected states with gradients:
    the semantic and hybrid routes on a full forward (every position's state sets its semantic bucket), the
    context route's ``topk_score`` on the keys of the query's bucket alone, which the tokens name (torch computes
    them from their receptive fields; JAX, in static shapes, runs the full forward). Inside a receptive field
    each block's MLP runs on the rows the blocks above read only (:func:`nt_conv_rows`): for 2 blocks of k = 5,
    5 and 1 rows instead of 9 and 9. Same outputs as the full forward up to float rounding (dropout draws its
    masks for the computed positions only).
    """
    for i in range(model.n_layers):
        pre = f"blocks.{i}"
        y = layer_norm(x, p[f"{pre}.norm.weight"], p[f"{pre}.norm.bias"])
        y = causal_depthwise_conv(y, p[f"{pre}.conv.weight"], p[f"{pre}.conv.bias"])
        if rows is not None:
            kept = layer_rows(x.shape[1], rows[i])
            x, y = x[:, kept], y[:, kept]
        x = x + mlp(p, pre, y, gelu_form)
    return x


def head_log_probs(p: dict[str, np.ndarray], h: np.ndarray, gelu_form: str) -> np.ndarray:
    """Parametric head ``log_softmax(W_o·GELU(W_h·LN h))``: ``[..., d] -> [..., V]``."""
    y = layer_norm(h, p["head.norm.weight"], p["head.norm.bias"])
    return log_softmax(linear(p, "head.out", gelu(linear(p, "head.hidden", y), gelu_form)))


def attention_allowed(t: Any, s: Any, variant: str, window: int, n_global: int) -> Any:
    """True where query position ``t`` may attend key position ``s`` (causal; local window; global prefix).

    ``t`` and ``s`` are integer arrays of any array library that broadcast against each other (NumPy,
    torch, jax.numpy): every backend builds its mask with this one rule from its own ``arange``.
    """
    causal = s <= t
    if variant in ("transformer_dense", "linear_attention"):
        return causal
    local = causal & (t - s < window)
    if variant == "transformer_local":
        return local
    return local | (causal & (s < n_global))


def nt_attention_crop(model: ModelConfig, seq_len: int) -> tuple[int, int] | None:
    """The sub-window a next-token prediction of windowed attention reads: ``(g, start)``, the positions
    ``[0, g) ∪ [start, T)`` of the g global keys (global-local; g = 0 for local) and the last
    ``R = n_layers·(w - 1) + 1`` positions (``start = T - R``). None when that is the whole window: dense and
    linear attention read every earlier position, and a window with ``g + R >= T`` has nothing to cut.

    The last position's final state depends on nothing else: each layer widens what it reads by w - 1
    positions back, and a global key's state depends on the global prefix alone. On the sub-window, with each
    position's own positional encoding, the mask rule (:func:`attention_allowed`) in sub-window coordinates
    gives the same pairs (the global keys stay the first g, every other pair keeps its distance), so the
    sub-window's last state equals the full window's (:func:`hidden_states` with ``positions``); the positions
    whose windows the cut truncates feed nothing the prediction reads. Next-token training and evaluation
    compute this sub-window only (``nt_receptive_field`` in the backends): the same loss and gradients, at
    ``(g + R) / T`` of the work (up to float rounding; dropout draws its masks for the computed positions only).
    Dense attention has no crop, but its top layer computes one row (:func:`nt_attention_rows`).
    """
    if model.variant not in ("transformer_local", "transformer_global_local"):
        return None
    g = model.n_global if model.variant == "transformer_global_local" else 0
    R = model.n_layers * (model.window - 1) + 1
    if g + R >= seq_len:
        return None
    return g, seq_len - R


def nt_attention_positions(model: ModelConfig, seq_len: int) -> np.ndarray:
    """The window positions of :func:`nt_attention_crop`'s sub-window, ``[g + R]`` int64 ascending (every
    position ``0..T-1`` when there is nothing to cut)."""
    crop = nt_attention_crop(model, seq_len)
    if crop is None:
        return np.arange(seq_len)
    g, start = crop
    return np.concatenate([np.arange(g), np.arange(start, seq_len)])


def nt_attention_rows(model: ModelConfig, seq_len: int) -> list[tuple[int, int] | None] | None:
    """Per layer of a next-token forward on :func:`nt_attention_crop`'s sub-window (dense attention: on the whole
    window), the rows of the layer's input whose outputs the prediction reads: ``(first, last)``, the input's
    first ``first`` rows and its last ``last`` rows (:func:`layer_rows`), or None for every row. The layer's
    output is those rows only, and it is the next layer's input. None when nothing is cut (linear attention, and
    a window with nothing to cut).

    The top layer's output is read at the last position only: ``(0, 1)``. A layer's queries read keys up to
    w - 1 rows back and the g global rows, so below the top, layer i of L keeps the g global rows and the last
    ``(L-1-i)·(w-1) + 1``; the bottom layer's input is the whole sub-window (g + R rows). The sub-window's
    positions stay in the rows' order, so the mask rule (:func:`attention_allowed`) in row coordinates gives
    the same pairs: the global rows are the first g, every other row keeps its distance to the others. Each
    row's state is the one the full window computes at that position, up to float rounding; backends compute a
    next-token Transformer step this way, at ``Σ rows / (L·(g + R))`` of the sub-window's per-position work.

    Dense attention reads every earlier position, so every layer below the top keeps all rows (None) and only
    the top one is cut, to its last row, whose query reads every key (no mask): ``(L-1)/L`` of the window's
    per-position work, and of its attention products. Linear attention's top layer could be cut the same way;
    its chunked form computes every row at once, so it is not.
    """
    if model.variant == "transformer_dense":
        return [None] * (model.n_layers - 1) + [(0, 1)]
    crop = nt_attention_crop(model, seq_len)
    if crop is None:
        return None
    return receptive_rows(model.n_layers, model.window - 1, crop[0])


def nt_conv_rows(model: ModelConfig) -> list[tuple[int, int]]:
    """Per block of a conv stack on one position's R-token receptive field (:func:`conv_stack`), the rows of
    the block's input whose outputs the last position's final state reads: ``(0, (L-1-i)·(k-1) + 1)`` for block
    i of L, the last row alone at the top (:func:`receptive_rows`)."""
    return receptive_rows(model.n_layers, model.kernel_size - 1)


def receptive_rows(n_layers: int, reach: int, n_global: int = 0) -> list[tuple[int, int]]:
    """``(first, last)`` rows per layer (:func:`layer_rows`) of a stack whose layers read ``reach`` rows back
    (w - 1 for windowed attention, k - 1 for a causal conv) plus the first ``n_global`` rows, when only the last
    row's top output is read: below the top, layer i keeps those ``n_global`` rows and its last
    ``(n_layers-1-i)·reach + 1``; the top layer keeps the last row alone."""
    return [(n_global, (n_layers - 1 - i) * reach + 1) for i in range(n_layers - 1)] + [(0, 1)]


def layer_rows(n: int, rows: tuple[int, int] | None) -> np.ndarray:
    """The input rows ``[m]`` int64 ascending that ``rows`` = ``(first, last)`` keeps of a layer input of ``n``
    rows (:func:`nt_attention_rows`; None: all n)."""
    if rows is None:
        return np.arange(n)
    first, last = rows
    return np.concatenate([np.arange(first), np.arange(n - last, n)])


def attention_mask(seq_len: int, variant: str, window: int, n_global: int) -> np.ndarray:
    """``[T, T]`` bool, True where query t may attend key s (:func:`attention_allowed`)."""
    return attention_allowed(np.arange(seq_len)[:, None], np.arange(seq_len)[None, :], variant, window, n_global)


def _split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    B, T, d = x.shape
    return x.reshape(B, T, n_heads, d // n_heads).transpose(0, 2, 1, 3)  # [B, H, T, hd]


def elu_plus_one(x: np.ndarray) -> np.ndarray:
    """``φ(x) = elu(x) + 1``, as ``exp(x)`` for x <= 0: exact for very negative x (no ``expm1 + 1``)."""
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def attention(p: dict[str, np.ndarray], prefix: str, x: np.ndarray, model: ModelConfig,
              rows: tuple[int, int] | None = None) -> np.ndarray:
    """Multi-head attention of one block: ``[B, T, d] -> [B, T, d]``; with ``rows`` (:func:`layer_rows`, softmax
    variants) the queries are those m rows only and the result ``[B, m, d]``, each query masked at its row.

    The fused ``qkv`` projection gives q, k, v (columns ``[q | k | v]``, heads of ``head_dim`` contiguous
    columns), split into ``[B, H, T, hd]``; the heads' outputs are joined and projected by ``out``.

    * Softmax variants: ``softmax(q·kᵀ/√hd)`` with the logits ``-inf`` where :func:`attention_mask` is False.
    * ``linear_attention``: normalised causal linear attention, φ = :func:`elu_plus_one`,
      ``out_t = φ(q_t)·Σ_{s<=t} φ(k_s) v_sᵀ / max(φ(q_t)·Σ_{s<=t} φ(k_s), 1e-6)``, here as a masked ``[T, T]``
      product. Backends compute it chunked (exact; chunk length c = ``model.linear_chunk``, at most T): inside a
      chunk a lower-triangular (diagonal included) ``[c, c]`` product; across chunks exclusive prefix sums of
      ``φ(k)ᵀv`` ``[hd, hd]`` and ``Σφ(k)``. Memory O(T·c + T/c·hd²).
    """
    B, T, d = x.shape
    qkv = linear(p, f"{prefix}.qkv", x)
    q, k, v = (_split_heads(qkv[..., i * d : (i + 1) * d], model.n_heads) for i in range(3))
    if model.variant == "linear_attention":
        fq, fk = elu_plus_one(q), elu_plus_one(k)
        causal = attention_mask(T, model.variant, model.window, model.n_global)
        a = np.einsum("bhtd,bhsd->bhts", fq, fk) * causal
        num = np.einsum("bhts,bhsd->bhtd", a, v)
        den = np.maximum(a.sum(-1, keepdims=True), 1e-6)
        o = num / den
    else:
        mask = attention_mask(T, model.variant, model.window, model.n_global)
        if rows is not None:
            kept = layer_rows(T, rows)
            q, mask = q[:, :, kept], mask[kept]
        logits = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(model.head_dim)
        o = np.einsum("bhts,bhsd->bhtd", softmax(np.where(mask, logits, -np.inf)), v)
    o = o.transpose(0, 2, 1, 3).reshape(B, o.shape[2], d)
    return linear(p, f"{prefix}.out", o)


def transformer_stack(
    p: dict[str, np.ndarray], x: np.ndarray, model: ModelConfig, gelu_form: str,
    rows: list[tuple[int, int] | None] | None = None,
) -> np.ndarray:
    """Pre-LN blocks ``x += Attn(LN x)`` (:func:`attention`); ``x += W2·GELU(W1·LN x)``. ``[B, T, d] -> [B, T, d]``;
    with ``rows`` (:func:`nt_attention_rows`) block i keeps the rows ``rows[i]`` of its input, ``-> [B, 1, d]``."""
    for i in range(model.n_layers):
        pre = f"blocks.{i}"
        r = None if rows is None else rows[i]
        a = attention(p, f"{pre}.attn", layer_norm(x, p[f"{pre}.attn_norm.weight"], p[f"{pre}.attn_norm.bias"]),
                      model, r)
        x = (x if r is None else x[:, layer_rows(x.shape[1], r)]) + a
        x = x + mlp(p, pre, layer_norm(x, p[f"{pre}.mlp_norm.weight"], p[f"{pre}.mlp_norm.bias"]), gelu_form)
    return x


# --------------------------------------------------------------------------- outputs


@dataclass
class MemoryTrace:
    """Intermediates of the associative memory path (Q queries, C slots).

    addresses: ``[B, T]`` int64 bucket of every position; cand: the selected candidates;
    scores/cache_weights: ``[B, Q, C]``; gate: ``[B, Q]`` masked (and clipped) λ;
    p_cache: ``[B, Q, V]``; router_probs: ``[B, T, S]`` or None.
    """

    addresses: np.ndarray
    cand: routing.Candidates
    scores: np.ndarray
    cache_weights: np.ndarray
    gate: np.ndarray
    p_cache: np.ndarray
    router_probs: np.ndarray | None


@dataclass
class ForwardOutput:
    """Model outputs at the Q query positions (Q = 1 in NT mode, T in AR mode).

    hidden: ``[B, T, d]`` final states; param_log_probs: ``[B, Q, V]`` parametric head;
    log_probs: ``[B, Q, V]`` the predictive distribution in log space (unnormalised under the NT floor);
    target_log_prob: ``[B, Q]`` log p(target) as the loss uses it (None without targets);
    prediction: ``[B, Q]`` int64 argmax under the profile's accuracy definition;
    memory: the memory trace (None for models without a cache).
    """

    hidden: np.ndarray
    param_log_probs: np.ndarray
    log_probs: np.ndarray
    target_log_prob: np.ndarray | None
    prediction: np.ndarray
    memory: MemoryTrace | None

    @property
    def loss(self) -> float:
        if self.target_log_prob is None:
            raise ValueError("forward() was called without targets")
        return float(-self.target_log_prob.mean())


# --------------------------------------------------------------------------- the memory path


def memory_read(
    p: dict[str, np.ndarray],
    tokens: np.ndarray,
    h: np.ndarray,
    model: ModelConfig,
    memory: MemoryConfig,
    profile: ProfileConfig,
    mode: str,
) -> MemoryTrace:
    """Records, routing, scores, cache weights, p_cache and the masked gate for every query.

    h ``[B, T, d]`` final states, h_q those at the Q query positions (:func:`pcaf_core.records.query_positions`).
    Keys ``l2norm(h·W_k)`` ``[B, T, d]`` and queries ``l2norm(h_q·W_q)`` ``[B, Q, d]`` (no bias; ``profile.l2norm``).
    The semantic and hybrid routes read ``router_probs = softmax(router(h)/τ)`` ``[B, T, S]``; router forms
    ``linear_bias`` (``Linear(d, S)`` with bias) or ``layernorm_linear`` (``LN -> Linear(d, S)`` without bias,
    the LayerNorm named ``router_norm``). The raw gate is ``σ(W_2·GELU(W_1·LN h_q))`` ``[B, Q]`` in (0, 1)
    (hidden width d/2; ``pcaf_no_gate``: ``memory.fixed_gate``), then masked (:func:`pcaf_core.mixture.mask_gate`).

    Selection (the integer candidates) is not differentiated: gradients reach W_q, W_k, ρ and the router
    through the scores of the selected slots.
    """
    B, T = tokens.shape
    qpos = records.query_positions(T, mode)
    rec = records.recency(T, mode)
    rho = float(p["memory.recency_scale"])
    addr = hashing.addresses(tokens, memory.context_order, memory.num_buckets,
                             int32_wraparound=profile.hash_int32_wraparound)
    keys = l2_normalize(h @ p["memory.key.weight"], profile.l2norm)
    query = l2_normalize(records.query_rows(h, mode) @ p["memory.query.weight"], profile.l2norm)

    router_probs = overlap = None
    if memory.route in ("semantic", "hybrid"):
        x = h
        if profile.router == "layernorm_linear":
            x = layer_norm(h, p["memory.router_norm.weight"], p["memory.router_norm.bias"])
        router_probs = softmax(linear(p, "memory.router", x) / memory.semantic_temperature)
        overlap = routing.semantic_overlap(router_probs, qpos)

    cand = None
    if memory.route in ("context", "hybrid"):
        sel = mixture.selection_score(query, keys, rec, rho) if memory.candidate_policy == "topk_score" else None
        cand = routing.route_context(addr, qpos, memory.top_k, memory.candidate_policy, sel)
    if memory.route in ("semantic", "hybrid"):
        if memory.semantic_index == "dense":
            sem = routing.route_semantic_dense(overlap, rec, rho, qpos, memory.top_k,
                                               target_leak=profile.semantic_ar_target_leak and mode == "ar")
        else:
            sem = routing.route_semantic_bucketed(routing.semantic_buckets(router_probs), qpos, memory.top_k)
        cand = sem if cand is None else routing.combine_hybrid(cand, sem, dedup=profile.hybrid_dedup)

    scores = mixture.candidate_scores(query, keys, rec, rho, cand, overlap, memory.semantic_score_scale)
    alpha = mixture.cache_weights(scores, cand.valid)
    values = routing.gather_records(records.successor_values(tokens), cand)
    p_cache = mixture.cache_distribution(alpha, values, cand.valid, model.vocab_size)

    if model.variant == "pcaf_no_gate":
        raw = np.full((B, len(qpos)), memory.fixed_gate)
    else:
        g = layer_norm(records.query_rows(h, mode), p["gate.norm.weight"], p["gate.norm.bias"])
        g = linear(p, "gate.out", gelu(linear(p, "gate.hidden", g), profile.gelu))[..., 0]
        raw = 1.0 / (1.0 + np.exp(-g))
    gate = mixture.mask_gate(raw, cand.valid.any(-1), clip_when_empty=profile.gate_clip_when_empty,
                             per_term=mixture.mixture_rule(profile, mode).gate_per_term)
    return MemoryTrace(addr, cand, scores, alpha, gate, p_cache, router_probs)


# --------------------------------------------------------------------------- whole models


def hidden_states(
    p: dict[str, np.ndarray], tokens: np.ndarray, model: ModelConfig, profile: ProfileConfig,
    positions: np.ndarray | None = None, rows: list[tuple[int, int] | None] | None = None,
) -> np.ndarray:
    """Final hidden states ``[B, T, d]`` of the backbone (conv stack or Transformer).

    ``positions`` (Transformers): ``[T]`` the window positions of ``tokens``' columns when they are a
    sub-window (:func:`nt_attention_positions`), which their positional encodings follow; default ``0..T-1``.
    ``rows`` (Transformers, with the sub-window's ``positions``): each block keeps the rows of
    :func:`nt_attention_rows` only, so the result is the last position's state ``[B, 1, d]``.

    Positions (Transformers), added to the embeddings: the trainable table ``pos.table`` ``[max_seq_len, d]``
    (``trainable_jax``, initialised at ``positional_scale``·sinusoids; T is limited by its rows) or fixed
    sinusoids (``fixed_torch``, any T) times ``positional_scale``, computed in float64 and cast to the
    embeddings' dtype, not a parameter.
    """
    T = tokens.shape[1]
    x = p["embed.weight"][tokens]
    if model.variant in TRANSFORMER_VARIANTS:
        pos = np.arange(T) if positions is None else np.asarray(positions)
        span = int(pos.max()) + 1
        if has_positional_table(model, profile):
            if span > model.max_seq_len:
                raise ValueError(f"T={span} exceeds the positional table's {model.max_seq_len} rows")
            x = x + p["pos.table"][pos]
        else:
            pe = sinusoidal_table(span, model.d_model, profile.positional) * profile.positional_scale
            x = x + pe[pos].astype(x.dtype)
        return transformer_stack(p, x, model, profile.gelu, rows)
    return conv_stack(p, x, model, profile.gelu)


def forward(
    params: dict[str, np.ndarray],
    tokens: np.ndarray,
    model: ModelConfig,
    memory: MemoryConfig,
    profile: ProfileConfig,
    mode: str,
    targets: np.ndarray | None = None,
) -> ForwardOutput:
    """Evaluate a model on windows ``tokens`` ``[B, T]`` int, ids in ``[0, V)``.

    mode: ``nt`` (one query, at T-1: Q = 1) or ``ar`` (every position: Q = T).
    targets: NT ``[B]`` or ``[B, 1]`` (the token after the window) or AR ``[B, T]`` (``x_{t+1}``); optional.

    Backends' forwards add two flags that leave outputs out: ``need_log_probs=False`` builds no ``log_probs``,
    ``param_log_probs`` or ``p_cache`` (``[B, Q, V]`` each; a training step needs none of them: the loss reads
    the target entries), ``need_predictions=False`` no ``prediction`` (which needs the head's ``[B, Q, V]``
    log-probs).
    """
    check_params(params, param_shapes(model, memory, profile))
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= model.vocab_size:
        raise ValueError(f"token ids must lie in [0, {model.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    T = tokens.shape[1]
    qpos = records.query_positions(T, mode)
    h = hidden_states(params, tokens, model, profile)
    param_lp = head_log_probs(params, records.query_rows(h, mode), profile.gelu)

    tgt = None
    if targets is not None:
        tgt = np.asarray(targets, dtype=np.int64).reshape(tokens.shape[0], len(qpos))

    if not uses_cache(model):
        tlp = None if tgt is None else np.take_along_axis(param_lp, tgt[..., None], -1)[..., 0]
        return ForwardOutput(h, param_lp, param_lp, tlp, np.argmax(param_lp, -1), None)

    mem = memory_read(params, tokens, h, model, memory, profile, mode)
    rule = mixture.mixture_rule(profile, mode)
    mix_lp = mixture.mixture_log_probs(param_lp, mem.p_cache, mem.gate, nt_floor=rule.nt_floor,
                                       gate_per_term=rule.gate_per_term)
    tlp = None
    if tgt is not None:
        tlp = mixture.target_log_prob(param_lp, mem.p_cache, mem.gate, tgt, nt_floor=rule.nt_floor,
                                      ar_floor=rule.ar_floor, mode=mode, gate_per_term=rule.gate_per_term,
                                      renormalise=rule.renormalise)
    pred = mixture.predictions(mix_lp, param_lp, parametric_only=rule.parametric_accuracy)
    return ForwardOutput(h, param_lp, mix_lp, tlp, pred, mem)
