"""Streaming decode: every model one token at a time with a bounded state (docs/SPEC.md, "Streaming decode").

Feeding ``x_0, x_1, …`` through :meth:`Stream.step` gives, at step t, the predictive distribution of the
full-autoregressive forward (:func:`pcaf_core.reference.forward`, ``mode="ar"``) at position t: the same
candidate records slot for slot and the same log-probabilities. What each model keeps between steps:

* conv backbone (PCAF family, ``local_conv``): per block the LayerNormed inputs of the last ``k-1``
  positions (zeros before the stream's start, as the window's left padding);
* PCAF memory: the last ``n`` tokens (for the address of the next position), the record of the previous
  position waiting for its value, and per address bucket at most K records ``(position, key, value
  [, router probabilities])``: the K most recent under ``recent`` (a ring), the first K under ``first``
  (later records are dropped). A query reads exactly the records the full forward's route would pick, so
  the stream is exact for any length while the memory holds at most ``B·K`` records. The bucketed
  semantic route keeps the K most recent records per semantic bucket likewise;
* Transformers: a key/value cache per layer (the last ``window`` positions for local attention, plus the
  first ``n_global`` for global-local), or the running sums of linear attention.

Not streamable with a bounded state (:class:`NotStreamableError`): the ``topk_score`` policy and the dense
semantic route rank every earlier record by a score that depends on the query, so no record can ever be
dropped.

Recency. The full forward's recency of record s is ``s / D`` with ``D = T-1`` (AR) or ``T-2`` (NT), T the
window. A stream is built for a window T (the model's training window) and keeps ``r_s = s / D`` past T:
the recency gap between two records stays ``(s - s')/D`` as in training. Scores use ``ρ·(s - t)/D``, which
differs from ``ρ·s/D`` by the same constant for every slot of a query, so the softmax, the ranking and
the distribution are unchanged, and float32 backends keep their precision on long streams.

Positions. PCAF and local conv have no positional signal and stream for ever. A Transformer with a
trainable table (``positional=trainable_jax``) has ``max_seq_len`` rows and cannot read a position past
them (:class:`StreamLimitError`); with fixed sinusoids it streams for ever.

Readable NumPy, float64 when the parameters are; it mutates the state it is given and returns it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pcaf_core import hashing, mixture, routing
from pcaf_core.config import CACHE_VARIANTS, MODES, TRANSFORMER_VARIANTS, MemoryConfig, ModelConfig, ProfileConfig
from pcaf_core.params import check_params, has_positional_table, param_shapes, sinusoidal_rows, uses_cache
from pcaf_core.reference import (
    attention_allowed,
    elu_plus_one,
    gelu,
    head_log_probs,
    l2_normalize,
    layer_norm,
    linear,
    mlp,
    softmax,
)

STREAMABLE_POLICIES = ("recent", "first")


class NotStreamableError(ValueError):
    """The configuration has no exact streaming state of bounded size. The message says why and what
    streams instead."""


class StreamLimitError(ValueError):
    """The stream reached a position the model cannot represent (a trainable positional table's end)."""


def check_streamable(model: ModelConfig, memory: MemoryConfig, *, horizon: int | None = None) -> None:
    """Raise :class:`NotStreamableError` when ``model``/``memory`` cannot stream exactly with a bounded state.

    ``horizon`` (records older than the last ``horizon`` positions are invisible) needs the ``recent``
    policy: the first K records of a sliding horizon are not the first K of the bucket.
    """
    if model.variant not in CACHE_VARIANTS:
        return
    context = memory.route in ("context", "hybrid")
    semantic = memory.route in ("semantic", "hybrid")
    if context and memory.candidate_policy not in STREAMABLE_POLICIES:
        raise NotStreamableError(
            f"memory.candidate_policy={memory.candidate_policy!r} is not streamable: it ranks every earlier "
            "record of the bucket by q_t·k_s, so no record can be dropped; use a model trained with "
            "memory.candidate_policy=recent or first")
    if semantic and memory.semantic_index != "bucketed":
        raise NotStreamableError(
            "memory.semantic_index='dense' is not streamable: it ranks every earlier record by its router "
            "overlap with the query, so no record can be dropped; use memory.semantic_index=bucketed")
    if horizon is not None:
        if horizon < 1:
            raise ValueError(f"horizon={horizon} must be >= 1 (or None for the whole stream)")
        if context and memory.candidate_policy != "recent":
            raise NotStreamableError(
                f"a memory horizon needs memory.candidate_policy='recent', not {memory.candidate_policy!r}: the "
                "first K records inside a sliding horizon are not the first K of the bucket")


def recency_denominator(window: int, mode: str) -> int:
    """D of the recency ``r_s = s / D`` for training window T: ``T-1`` in AR, ``T-2`` in NT, at least 1
    (as :func:`pcaf_core.records.recency`)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown: expected one of {list(MODES)}")
    if window < 2:
        raise ValueError(f"window={window} must be >= 2")
    return max(window - 2, 1) if mode == "nt" else max(window - 1, 1)


class Record(NamedTuple):
    """One successor record: position s, bucket address, unit key ``[d]``, value ``x_{s+1}`` (-1 while it
    is pending), router probabilities ``[S]`` (semantic and hybrid routes, else None) and semantic bucket."""

    pos: int
    address: int
    key: np.ndarray
    value: int
    probs: np.ndarray | None
    sem_bucket: int


class StepOutput(NamedTuple):
    """What one step predicts for the next token, per sequence.

    log_probs: ``[B, V]`` the predictive distribution (the mixture for cache models); param_log_probs:
    ``[B, V]`` the parametric head; cand_index: ``[B, C]`` int64 record positions, -1 = empty, in the
    spec's slot order; cand_valid: ``[B, C]`` bool; gate: ``[B]`` masked λ (the last three None for
    models without a cache).
    """

    log_probs: np.ndarray
    param_log_probs: np.ndarray
    cand_index: np.ndarray | None
    cand_valid: np.ndarray | None
    gate: np.ndarray | None


@dataclass
class StreamState:
    """Everything a stream carries between steps (B sequences).

    t: tokens fed so far (the position of the next token);
    conv: per conv block ``[B, k-1, d]``, the LayerNormed block inputs of the last k-1 positions, oldest first;
    last_tokens: ``[B, n]`` the last n tokens, 0 before the start (the address's left padding);
    pending: per sequence the record of position t-1, whose value arrives with the next token;
    context / semantic: per sequence ``bucket -> deque`` of at most K records, oldest first;
    kv: per attention layer ``(keys [B, H, N, hd], values [B, H, N, hd], positions [N])``;
    linear: per linear-attention layer ``(Σφ(k)vᵀ [B, H, hd, hd], Σφ(k) [B, H, hd])``.
    """

    t: int
    conv: list[np.ndarray] = field(default_factory=list)
    last_tokens: np.ndarray | None = None
    pending: list[Record | None] = field(default_factory=list)
    context: list[dict[int, deque]] = field(default_factory=list)
    semantic: list[dict[int, deque]] = field(default_factory=list)
    kv: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    linear: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def num_records(self) -> int:
        """Records held by the memory (all sequences, both routes)."""
        return sum(len(dq) for store in self.context + self.semantic for dq in store.values())


class Stream:
    """The streaming form of one model (canonical parameters, configs), for a training window T.

    Args:
        params: canonical parameter dict (:func:`pcaf_core.params.param_shapes`).
        window: the training window T: sets the recency unit ``1/D`` (:func:`recency_denominator`).
        mode: the training mode whose recency convention the stream continues (``ar`` or ``nt``).
        horizon: records of the last ``horizon`` positions only (``s >= t - horizon``); None = all the
            memory holds. Needs the ``recent`` policy.
    """

    def __init__(self, params: dict[str, np.ndarray], model: ModelConfig, memory: MemoryConfig,
                 profile: ProfileConfig, *, window: int, mode: str = "ar", horizon: int | None = None) -> None:
        check_params(params, param_shapes(model, memory, profile))
        check_streamable(model, memory, horizon=horizon)
        self.p, self.model, self.memory, self.profile = params, model, memory, profile
        self.window, self.mode, self.horizon = window, mode, horizon
        self.denominator = recency_denominator(window, mode)

    @property
    def uses_cache(self) -> bool:
        return uses_cache(self.model)

    # ----------------------------------------------------------------------------- state

    def init(self, batch: int) -> StreamState:
        """The state before the first token of ``batch`` sequences."""
        m, d = self.model, self.model.d_model
        state = StreamState(t=0)
        if m.variant in TRANSFORMER_VARIANTS:
            hd = m.head_dim
            for _ in range(m.n_layers):
                if m.variant == "linear_attention":
                    state.linear.append((np.zeros((batch, m.n_heads, hd, hd)), np.zeros((batch, m.n_heads, hd))))
                else:
                    empty = np.zeros((batch, m.n_heads, 0, hd))
                    state.kv.append((empty, empty.copy(), np.zeros(0, dtype=np.int64)))
            return state
        state.conv = [np.zeros((batch, m.kernel_size - 1, d)) for _ in range(m.n_layers)]
        if self.uses_cache:
            state.last_tokens = np.zeros((batch, self.memory.context_order), dtype=np.int64)
            state.pending = [None] * batch
            state.context = [{} for _ in range(batch)]
            state.semantic = [{} for _ in range(batch)]
        return state

    # ----------------------------------------------------------------------------- one step

    def step(self, state: StreamState, tokens: np.ndarray) -> tuple[StreamState, StepOutput]:
        """Feed token ``x_t`` of every sequence (``tokens [B]`` int) and predict ``x_{t+1}``."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.min() < 0 or tokens.max() >= self.model.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.model.vocab_size}), got "
                             f"[{tokens.min()}, {tokens.max()}]")
        if self.model.variant in TRANSFORMER_VARIANTS:
            h = self._transformer_hidden(state, tokens)
        else:
            h = self._conv_hidden(state, tokens)
        param_lp = head_log_probs(self.p, h, self.profile.gelu)
        if not self.uses_cache:
            state.t += 1
            return state, StepOutput(param_lp, param_lp, None, None, None)
        log_probs, index, valid, gate = self._memory_step(state, tokens, h, param_lp)
        state.t += 1
        return state, StepOutput(log_probs, param_lp, index, valid, gate)

    def feed(self, state: StreamState, tokens: np.ndarray) -> tuple[StreamState, StepOutput]:
        """:meth:`step` over ``tokens [B, n]``; the outputs stacked along a new axis 1 (``[B, n, ...]``)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        outs = []
        for i in range(tokens.shape[1]):
            state, out = self.step(state, tokens[:, i])
            outs.append(out)
        stacked = [None if f[0] is None else np.stack(f, axis=1) for f in zip(*outs, strict=True)]
        return state, StepOutput(*stacked)

    # ----------------------------------------------------------------------------- backbones

    def _conv_hidden(self, state: StreamState, tokens: np.ndarray) -> np.ndarray:
        """Final hidden state ``[B, d]`` at position t: each block's causal conv reads the ring of its last
        k-1 LayerNormed inputs and the current one (``out_t = Σ_lag w[lag]·y_{t-lag} + b``)."""
        p, k = self.p, self.model.kernel_size
        x = p["embed.weight"][tokens]
        for i in range(self.model.n_layers):
            pre = f"blocks.{i}"
            y = layer_norm(x, p[f"{pre}.norm.weight"], p[f"{pre}.norm.bias"])
            recent = np.concatenate([state.conv[i], y[:, None]], axis=1)  # [B, k, d], positions t-k+1 .. t
            w = p[f"{pre}.conv.weight"]
            conv = p[f"{pre}.conv.bias"] + sum(w[lag] * recent[:, k - 1 - lag] for lag in range(k))
            state.conv[i] = recent[:, 1:]
            x = x + mlp(p, pre, conv, self.profile.gelu)
        return x

    def _position_row(self, t: int) -> np.ndarray:
        m, prof = self.model, self.profile
        if has_positional_table(m, prof):
            if t >= m.max_seq_len:
                raise StreamLimitError(
                    f"position {t} is past the trainable positional table's {m.max_seq_len} rows: a Transformer "
                    f"with positional=trainable_jax reads at most model.max_seq_len={m.max_seq_len} tokens")
            return self.p["pos.table"][t]
        return sinusoidal_rows(np.array([t]), m.d_model, prof.positional)[0] * prof.positional_scale

    def _transformer_hidden(self, state: StreamState, tokens: np.ndarray) -> np.ndarray:
        """Final hidden state ``[B, d]`` at position t from the per-layer caches."""
        p, m, t = self.p, self.model, state.t
        B, d, H, hd = len(tokens), m.d_model, m.n_heads, m.head_dim
        x = p["embed.weight"][tokens] + self._position_row(t).astype(p["embed.weight"].dtype)
        for i in range(m.n_layers):
            pre = f"blocks.{i}"
            y = layer_norm(x, p[f"{pre}.attn_norm.weight"], p[f"{pre}.attn_norm.bias"])
            qkv = linear(p, f"{pre}.attn.qkv", y)
            q, k, v = (qkv[:, j * d : (j + 1) * d].reshape(B, H, hd) for j in range(3))
            if m.variant == "linear_attention":
                kv_sum, k_sum = state.linear[i]
                fq, fk = elu_plus_one(q), elu_plus_one(k)
                kv_sum = kv_sum + fk[..., :, None] * v[..., None, :]
                k_sum = k_sum + fk
                state.linear[i] = (kv_sum, k_sum)
                num = np.einsum("bhd,bhde->bhe", fq, kv_sum)
                den = np.maximum((fq * k_sum).sum(-1, keepdims=True), 1e-6)
                o = num / den
            else:
                keys, values, pos = state.kv[i]
                keys = np.concatenate([keys, k[:, :, None]], axis=2)
                values = np.concatenate([values, v[:, :, None]], axis=2)
                pos = np.append(pos, t)
                allowed = attention_allowed(t, pos, m.variant, m.window, m.n_global)
                logits = np.einsum("bhd,bhnd->bhn", q, keys) / np.sqrt(hd)
                o = np.einsum("bhn,bhnd->bhd", softmax(np.where(allowed, logits, -np.inf)), values)
                # A key invisible to the next position is invisible to every later one: drop it.
                keep = attention_allowed(t + 1, pos, m.variant, m.window, m.n_global)
                state.kv[i] = (keys[:, :, keep], values[:, :, keep], pos[keep])
            x = x + linear(p, f"{pre}.attn.out", o.reshape(B, d))
            x = x + mlp(p, pre, layer_norm(x, p[f"{pre}.mlp_norm.weight"], p[f"{pre}.mlp_norm.bias"]),
                        self.profile.gelu)
        return x

    # ----------------------------------------------------------------------------- the memory

    def _memory_step(self, state: StreamState, tokens: np.ndarray, h: np.ndarray, param_lp: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Store the previous position's record (its value is ``x_t``), read the query's buckets, mix."""
        p, mem, prof, t = self.p, self.memory, self.profile, state.t
        B, V = len(tokens), self.model.vocab_size
        state.last_tokens = np.concatenate([state.last_tokens[:, 1:], tokens[:, None]], axis=1)
        address = hashing.addresses(state.last_tokens, mem.context_order, mem.num_buckets,
                                    int32_wraparound=prof.hash_int32_wraparound)[:, -1]
        keys = l2_normalize(h @ p["memory.key.weight"], prof.l2norm)
        query = l2_normalize(h @ p["memory.query.weight"], prof.l2norm)
        semantic = mem.route in ("semantic", "hybrid")
        probs = None
        if semantic:
            x = h
            if prof.router == "layernorm_linear":
                x = layer_norm(h, p["memory.router_norm.weight"], p["memory.router_norm.bias"])
            probs = softmax(linear(p, "memory.router", x) / mem.semantic_temperature)
        sem_bucket = routing.semantic_buckets(probs[:, None])[:, 0] if semantic else np.zeros(B, dtype=np.int64)

        for b in range(B):
            prev = state.pending[b]
            if prev is not None:
                self._store(state, b, prev._replace(value=int(tokens[b])))
            state.pending[b] = Record(t, int(address[b]), keys[b], -1, None if probs is None else probs[b],
                                      int(sem_bucket[b]))

        K = mem.top_k
        slots: list[list[Record | None]] = []
        for b in range(B):
            ctx = self._read(state.context[b], int(address[b]), t, mem.candidate_policy) if mem.route != "semantic" \
                else []
            sem = self._read(state.semantic[b], int(sem_bucket[b]), t, "recent") if semantic else []
            if mem.route == "hybrid":
                slots.append(ctx + [None] * (K - len(ctx)) + sem + [None] * (K - len(sem)))
            else:
                picked = ctx if mem.route == "context" else sem
                slots.append(picked + [None] * (K - len(picked)))
        C = len(slots[0])
        index = np.array([[r.pos if r is not None else -1 for r in row] for row in slots], dtype=np.int64)
        valid = index >= 0
        if mem.route == "hybrid":
            cand = routing.combine_hybrid(routing.Candidates(index[:, None, :K], valid[:, None, :K]),
                                          routing.Candidates(index[:, None, K:], valid[:, None, K:]),
                                          dedup=prof.hybrid_dedup)
            index, valid = cand.index[:, 0], cand.valid[:, 0]

        d = keys.shape[-1]
        slot_keys = np.zeros((B, C, d), dtype=h.dtype)
        slot_values = np.zeros((B, C), dtype=np.int64)
        slot_pos = np.zeros((B, C), dtype=np.int64)
        slot_probs = np.ones((B, C, probs.shape[-1]), dtype=h.dtype) if semantic else None
        for b in range(B):
            for c, r in enumerate(slots[b]):
                if r is not None and valid[b, c]:
                    slot_keys[b, c], slot_values[b, c], slot_pos[b, c] = r.key, r.value, r.pos
                    if semantic:
                        slot_probs[b, c] = r.probs
        rho = float(p["memory.recency_scale"])
        scores = np.einsum("bd,bcd->bc", query, slot_keys) / np.sqrt(d) + rho * (slot_pos - t) / self.denominator
        if semantic:
            overlap = np.einsum("bs,bcs->bc", probs, slot_probs)
            scores = scores + mem.semantic_score_scale * np.log(np.maximum(overlap, mixture.SEMANTIC_OVERLAP_FLOOR))
        alpha = mixture.cache_weights(scores[:, None], valid[:, None])
        p_cache = mixture.cache_distribution(alpha, slot_values[:, None], valid[:, None], V)[:, 0]

        if self.model.variant == "pcaf_no_gate":
            raw = np.full(B, mem.fixed_gate)
        else:
            g = layer_norm(h, p["gate.norm.weight"], p["gate.norm.bias"])
            g = linear(p, "gate.out", gelu(linear(p, "gate.hidden", g), prof.gelu))[..., 0]
            raw = 1.0 / (1.0 + np.exp(-g))
        gate = mixture.mask_gate(raw, valid.any(-1), clip_when_empty=prof.gate_clip_when_empty)
        log_probs = mixture.mixture_log_probs(param_lp, p_cache, gate, nt_floor=False)
        return log_probs, index, valid, gate

    def _store(self, state: StreamState, b: int, rec: Record) -> None:
        """Insert a completed record: the K most recent per bucket (``recent``: the oldest is evicted) or
        the first K (``first``: later records are dropped); semantic buckets keep the K most recent."""
        K, mem = self.memory.top_k, self.memory
        if mem.route in ("context", "hybrid"):
            dq = state.context[b].setdefault(rec.address, deque(maxlen=K))
            if mem.candidate_policy == "recent" or len(dq) < K:
                dq.append(rec)  # under `recent` a full deque drops its oldest record
        if mem.route in ("semantic", "hybrid"):
            state.semantic[b].setdefault(rec.sem_bucket, deque(maxlen=K)).append(rec)

    def _read(self, store: dict[int, deque], bucket: int, t: int, policy: str) -> list[Record]:
        """The records of ``bucket`` a query at t reads, in the spec's slot order (most recent first under
        ``recent``, earliest first under ``first``), within the horizon."""
        records = list(store.get(bucket, ()))
        if policy == "recent":
            records = records[::-1]
        if self.horizon is not None:
            records = [r for r in records if r.pos >= t - self.horizon]
        return records
