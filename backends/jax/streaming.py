"""Streaming decode in JAX (mirrors :mod:`pcaf_core.streaming` and :mod:`backends.torch.streaming`): every
model one token at a time with a fixed-capacity state of static shapes, equal to the full AR forward.

The state of one sequence is a pytree (:class:`JaxStreamState`); :class:`JaxStream` vmaps the per-sequence
step over the batch and jits it, and ``feed`` runs it under ``lax.scan``. Buffers are sized once by
``init(batch, capacity)``, ``capacity`` being the most tokens the stream will read:

* PCAF memory (:class:`JaxBucketStore`): per bucket a ring of K pool rows ``[NB, K]`` over a record pool of
  ``1 + min(capacity, NB·K)`` rows (row 0 a scratch row for dropped records): the K most recent records
  (``recent``, a record entering a full bucket takes its oldest record's row) or the first K (``first``).
  An append is O(1) and a query reads K rows: a step's cost does not depend on t.
* Transformers: a key/value cache per layer of ``capacity`` entries (dense: a step attends over the whole
  static buffer, masked, so its cost is that of the capacity), ``window`` entries (a ring; local) plus
  ``n_global`` (global-local); linear attention keeps its running sums.

Feeding more than ``capacity`` tokens raises :class:`StreamCapacityError` on the host before anything runs
(writes past a static buffer would be dropped silently by XLA).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from backends.jax import hashing, mixture
from backends.jax.layers import elu_plus_one, gelu, wide
from backends.jax.models import CanonicalLM
from backends.jax.routing import Candidates, combine_hybrid
from pcaf_core.config import TRANSFORMER_VARIANTS
from pcaf_core.params import has_positional_table, sinusoidal_table
from pcaf_core.reference import attention_allowed
from pcaf_core.streaming import NotStreamableError, StreamLimitError, check_streamable, recency_denominator

__all__ = ["JaxBucketStore", "JaxStream", "JaxStreamState", "NotStreamableError", "StepOutput",
           "StreamCapacityError", "StreamLimitError"]


class StreamCapacityError(ValueError):
    """More tokens than the stream's static buffers were sized for."""


class StepOutput(NamedTuple):
    """One step's prediction (mirrors :class:`pcaf_core.streaming.StepOutput`): log_probs / param_log_probs
    ``[B, V]``; cand_index ``[B, C]`` int32 record positions (-1 empty); cand_valid ``[B, C]``; gate ``[B]``
    (the last three None without a cache)."""

    log_probs: jax.Array
    param_log_probs: jax.Array
    cand_index: jax.Array | None
    cand_valid: jax.Array | None
    gate: jax.Array | None


@flax.struct.dataclass
class JaxBucketStore:
    """One sequence's bucket store: slot ``[NB, K]`` int32 pool row of ring entry j; count ``[NB]`` int32
    records offered to the bucket; keys ``[P, d]``, pos / value ``[P]`` int32, probs ``[P, S]`` or None:
    the pool (row 0 scratch); used: rows in use (1 + records kept)."""

    slot: jax.Array
    count: jax.Array
    keys: jax.Array
    pos: jax.Array
    value: jax.Array
    probs: jax.Array | None
    used: jax.Array
    policy: str = flax.struct.field(pytree_node=False, default="recent")

    @classmethod
    def empty(cls, buckets: int, top_k: int, d: int, n_probs: int | None, policy: str, capacity: int,
              dtype: Any) -> JaxBucketStore:
        rows = 1 + min(capacity, buckets * top_k)
        return cls(jnp.zeros((buckets, top_k), jnp.int32), jnp.zeros((buckets,), jnp.int32),
                   jnp.zeros((rows, d), dtype), jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32),
                   None if n_probs is None else jnp.zeros((rows, n_probs), dtype), jnp.ones((), jnp.int32), policy)

    def insert(self, ok: jax.Array, address: jax.Array, key: jax.Array, pos: jax.Array, value: jax.Array,
               probs: jax.Array | None) -> JaxBucketStore:
        """Offer the record ``(pos, key [d], value, probs [S])`` to bucket ``address`` when ``ok``: ``recent``
        overwrites the bucket's oldest record when it holds K, ``first`` drops the new record then."""
        K = self.slot.shape[1]
        c = self.count[address]
        j = c % K
        full = c >= K
        old = self.slot[address, j]
        if self.policy == "recent":
            write = ok
            row = jnp.where(full, old, self.used)
        else:
            write = ok & ~full
            row = self.used
        row = jnp.where(write, row, 0)  # a dropped record goes to scratch row 0
        store = self.replace(
            keys=self.keys.at[row].set(key.astype(self.keys.dtype)),
            pos=self.pos.at[row].set(pos), value=self.value.at[row].set(value),
            probs=None if self.probs is None else self.probs.at[row].set(probs.astype(self.probs.dtype)),
            slot=self.slot.at[address, j].set(jnp.where(write, row, old)),
            count=self.count.at[address].add(ok.astype(jnp.int32)),
            used=self.used + (write & ~full).astype(jnp.int32))
        return store

    def read(self, address: jax.Array, min_pos: jax.Array | None
             ) -> tuple[Candidates, jax.Array, jax.Array, jax.Array | None]:
        """Candidates ``[K]`` (positions, spec slot order), keys ``[K, d]``, values ``[K]``, probs ``[K, S]``
        of a query in bucket ``address``; records before ``min_pos`` are invisible."""
        K = self.slot.shape[1]
        c = self.count[address]
        i = jnp.arange(K, dtype=jnp.int32)
        j = (c - 1 - i) % K if self.policy == "recent" else i
        valid = i < jnp.minimum(c, K)
        rows = jnp.where(valid, self.slot[address][j], 0)
        pos = self.pos[rows]
        if min_pos is not None:
            valid = valid & (pos >= min_pos)
        probs = None if self.probs is None else self.probs[rows]
        return Candidates(jnp.where(valid, pos, -1), valid), self.keys[rows], self.value[rows], probs


@flax.struct.dataclass
class JaxStreamState:
    """One sequence's stream state (batched by ``vmap``: every leaf gains a leading B axis).

    t: tokens fed; conv: ``[L, k-1, d]`` LayerNormed block inputs, oldest first; last_tokens: ``[n]``;
    pending: ``(address, sem_bucket, key [d], probs [S] | None)`` of position t-1; context / semantic:
    bucket stores; kv_keys / kv_values: ``[L, N, H, hd]``, kv_pos: ``[N]`` int32 (-1 empty); lin_kv:
    ``[L, H, hd, hd]``, lin_k: ``[L, H, hd]``.
    """

    t: jax.Array
    conv: jax.Array | None = None
    last_tokens: jax.Array | None = None
    pending: tuple | None = None
    context: JaxBucketStore | None = None
    semantic: JaxBucketStore | None = None
    kv_keys: jax.Array | None = None
    kv_values: jax.Array | None = None
    kv_pos: jax.Array | None = None
    lin_kv: jax.Array | None = None
    lin_k: jax.Array | None = None


def state_nbytes(state: JaxStreamState) -> int:
    """Bytes held by a (batched) state's arrays."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))


class JaxStream:
    """The streaming form of a JAX model (mirrors :class:`pcaf_core.streaming.Stream`).

    Args:
        module: a model of :func:`backends.jax.models.build_model`; variables: ``{"params": ...}``.
        window / mode / horizon: as :class:`pcaf_core.streaming.Stream` (window default ``max_seq_len``).
    """

    def __init__(self, module: CanonicalLM, variables: dict, *, window: int | None = None, mode: str = "ar",
                 horizon: int | None = None) -> None:
        self.module, self.variables = module, variables
        self.cfg, self.mem, self.prof = module.model_config, module.memory_config, module.profile
        check_streamable(self.cfg, self.mem, horizon=horizon)
        self.window = window if window is not None else self.cfg.max_seq_len
        self.mode, self.horizon = mode, horizon
        self.denominator = recency_denominator(self.window, mode)
        self.work = wide(module.dtype)
        # (variables, state, tokens [B], pos_table) -> (state, StepOutput): pure, for callers' own jit/scan.
        self.batched_step = jax.vmap(self._step_one, in_axes=(None, 0, 0, None))
        step = self.batched_step
        self._step = jax.jit(step)
        self._feed = jax.jit(lambda v, s, x, pt: jax.lax.scan(lambda st, tok: step(v, st, tok, pt), s, x.T))
        self._capacity = 0
        self._pos_table: jax.Array | None = None

    @property
    def pos_table(self) -> jax.Array | None:
        """The fixed-sinusoid rows ``[capacity, d]`` of the last :meth:`init` (None for other models): the
        last argument of :attr:`batched_step`."""
        return self._pos_table

    @property
    def uses_cache(self) -> bool:
        return self.module.uses_cache

    # ----------------------------------------------------------------------------- state

    def init(self, batch: int, capacity: int) -> JaxStreamState:
        """The state before the first token of ``batch`` sequences, with buffers for ``capacity`` tokens."""
        cfg, mem, work = self.cfg, self.mem, self.work
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 (the most tokens the stream will read)")
        if has_positional_table(cfg, self.prof) and capacity > cfg.max_seq_len:
            raise StreamLimitError(
                f"capacity {capacity} is past the trainable positional table's {cfg.max_seq_len} rows: a Transformer "
                f"with positional=trainable_jax reads at most model.max_seq_len={cfg.max_seq_len} tokens")
        self._capacity = capacity
        one = JaxStreamState(t=jnp.zeros((), jnp.int32))
        if cfg.variant in TRANSFORMER_VARIANTS:
            L, H, hd = cfg.n_layers, cfg.n_heads, cfg.head_dim
            if not has_positional_table(cfg, self.prof):
                table = sinusoidal_table(capacity, cfg.d_model, self.prof.positional) * self.prof.positional_scale
                self._pos_table = jnp.asarray(table, dtype=work)
            if cfg.variant == "linear_attention":
                one = one.replace(lin_kv=jnp.zeros((L, H, hd, hd), work), lin_k=jnp.zeros((L, H, hd), work))
            else:
                n = self._kv_entries(capacity)
                one = one.replace(kv_keys=jnp.zeros((L, n, H, hd), work), kv_values=jnp.zeros((L, n, H, hd), work),
                                  kv_pos=jnp.full((n,), -1, jnp.int32))
        else:
            one = one.replace(conv=jnp.zeros((cfg.n_layers, cfg.kernel_size - 1, cfg.d_model), work))
            if self.uses_cache:
                d = cfg.d_model
                n_probs = mem.semantic_buckets if mem.route in ("semantic", "hybrid") else None
                pending = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((d,), work),
                           None if n_probs is None else jnp.zeros((n_probs,), work))
                one = one.replace(last_tokens=jnp.zeros((mem.context_order,), jnp.int32), pending=pending)
                if mem.route in ("context", "hybrid"):
                    one = one.replace(context=JaxBucketStore.empty(mem.num_buckets, mem.top_k, d, n_probs,
                                                                   mem.candidate_policy, capacity, work))
                if n_probs is not None:
                    one = one.replace(semantic=JaxBucketStore.empty(mem.semantic_buckets, mem.top_k, d, n_probs,
                                                                    "recent", capacity, work))
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (batch, *x.shape)), one)

    def _kv_entries(self, capacity: int) -> int:
        """Cache entries: every position (dense), or ``[n_global prefix | ring of window]``."""
        cfg = self.cfg
        if cfg.variant == "transformer_dense":
            return capacity
        return cfg.window + (cfg.n_global if cfg.variant == "transformer_global_local" else 0)

    # ----------------------------------------------------------------------------- host entry points

    def _check(self, state: JaxStreamState, n: int) -> None:
        t = int(state.t[0])
        if t + n > self._capacity:
            raise StreamCapacityError(f"the stream was sized for {self._capacity} tokens (init capacity) and has read "
                                      f"{t}; {n} more do not fit: init a state with a larger capacity")

    def step(self, state: JaxStreamState, tokens: Any) -> tuple[JaxStreamState, StepOutput]:
        """Feed ``tokens [B]`` (position t of every sequence) and predict the next token."""
        self._check(state, 1)
        return self._step(self.variables, state, jnp.asarray(tokens, jnp.int32), self._pos_table)

    def feed(self, state: JaxStreamState, tokens: Any) -> tuple[JaxStreamState, StepOutput]:
        """``lax.scan`` of the step over ``tokens [B, n]``; outputs ``[B, n, ...]``."""
        tokens = jnp.asarray(tokens, jnp.int32)
        self._check(state, tokens.shape[1])
        state, outs = self._feed(self.variables, state, tokens, self._pos_table)
        return state, jax.tree_util.tree_map(lambda x: jnp.swapaxes(x, 0, 1), outs)

    # ----------------------------------------------------------------------------- one sequence, one token

    def _step_one(self, variables: dict, st: JaxStreamState, token: jax.Array, pos_table: jax.Array | None
                  ) -> tuple[JaxStreamState, StepOutput]:
        bound = self.module.bind(variables)
        if self.cfg.variant in TRANSFORMER_VARIANTS:
            st, h = self._transformer_hidden(bound, st, token, pos_table)
        else:
            st, h = self._conv_hidden(bound, st, token)
        param_lp = bound.head(h[None])[0]
        if not self.uses_cache:
            return st.replace(t=st.t + 1), StepOutput(param_lp, param_lp, None, None, None)
        st, out = self._memory(bound, st, token, h, param_lp)
        return st.replace(t=st.t + 1), out

    def _conv_hidden(self, bound: nn.Module, st: JaxStreamState, token: jax.Array) -> tuple[JaxStreamState, jax.Array]:
        """Each block's conv reads its k-1 LayerNormed inputs and the current one (weight ``[k, d]`` by lag)."""
        x = bound.embed(token[None])[0]
        rings = []
        for i, block in enumerate(bound.blocks):
            y = block.norm(x[None])[0]
            recent = jnp.concatenate([st.conv[i].astype(y.dtype), y[None]], axis=0)  # [k, d], oldest first
            w = block.conv.variables["params"]["weight"].astype(block.dtype)
            b = block.conv.variables["params"]["bias"].astype(block.dtype)
            conv = b + jnp.sum(w[::-1] * recent.astype(block.dtype), axis=0)  # lag k-1-j at ring entry j
            rings.append(recent[1:])
            branch = block.mlp_out(gelu(block.mlp_in(conv[None]), block.gelu_form))[0]
            x = x + branch.astype(x.dtype)
        return st.replace(conv=jnp.stack(rings).astype(st.conv.dtype)), x

    def _transformer_hidden(self, bound: nn.Module, st: JaxStreamState, token: jax.Array,
                            pos_table: jax.Array | None) -> tuple[JaxStreamState, jax.Array]:
        cfg, t = self.cfg, st.t
        d, H, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
        x = bound.embed(token[None])[0]
        if has_positional_table(cfg, self.prof):
            x = x + bound.pos.variables["params"]["table"][t].astype(x.dtype)
        else:
            x = x + pos_table[t].astype(x.dtype)
        kv_pos, entry, prefix, g = st.kv_pos, None, None, 0
        if cfg.variant != "linear_attention":
            n = kv_pos.shape[0]
            if cfg.variant == "transformer_dense":
                entry = t
            else:
                g = cfg.n_global if cfg.variant == "transformer_global_local" else 0
                entry = g + t % cfg.window
                prefix = jnp.where(t < g, t, n) if g else None  # n is out of range: the write is dropped
            kv_pos = kv_pos.at[entry].set(t)
            if prefix is not None:
                kv_pos = kv_pos.at[prefix].set(t, mode="drop")
        keys, values, lin_kv, lin_k = st.kv_keys, st.kv_values, st.lin_kv, st.lin_k
        for i, block in enumerate(bound.blocks):
            qkv = block.attn.qkv(block.attn_norm(x[None]))[0]
            q, k, v = (qkv[j * d:(j + 1) * d].reshape(H, hd) for j in range(3))
            if cfg.variant == "linear_attention":
                work = self.work
                fq, fk = elu_plus_one(q.astype(work)), elu_plus_one(k.astype(work))
                lin_kv = lin_kv.at[i].add(fk[:, :, None] * v.astype(work)[:, None, :])
                lin_k = lin_k.at[i].add(fk)
                o = jnp.einsum("hd,hde->he", fq, lin_kv[i]) / jnp.maximum(
                    jnp.sum(fq * lin_k[i], axis=-1, keepdims=True), 1e-6)
            else:
                keys = keys.at[i, entry].set(k.astype(keys.dtype))
                values = values.at[i, entry].set(v.astype(values.dtype))
                if prefix is not None:
                    keys = keys.at[i, prefix].set(k.astype(keys.dtype), mode="drop")
                    values = values.at[i, prefix].set(v.astype(values.dtype), mode="drop")
                ok = (kv_pos >= 0) & attention_allowed(t, kv_pos, cfg.variant, cfg.window, cfg.n_global)
                if g:  # prefix entries hold the positions < n_global; the ring's copies of them are masked
                    ok = ok & ((jnp.arange(kv_pos.shape[0]) < g) | (kv_pos >= g))
                work = wide(q.dtype)
                logits = jnp.einsum("hd,nhd->hn", q.astype(work), keys[i].astype(work)) / math.sqrt(hd)
                probs = jax.nn.softmax(jnp.where(ok[None], logits, -jnp.inf), axis=-1)
                o = jnp.einsum("hn,nhd->hd", probs, values[i].astype(work))
            x = x + block.attn.out(o.reshape(1, d).astype(block.dtype))[0].astype(x.dtype)
            y = block.mlp_out(gelu(block.mlp_in(block.mlp_norm(x[None])), block.gelu_form))[0]
            x = x + y.astype(x.dtype)
        return st.replace(kv_keys=keys, kv_values=values, kv_pos=kv_pos, lin_kv=lin_kv, lin_k=lin_k), x

    # ----------------------------------------------------------------------------- the memory

    def _memory(self, bound: nn.Module, st: JaxStreamState, token: jax.Array, h: jax.Array, param_lp: jax.Array
                ) -> tuple[JaxStreamState, StepOutput]:
        """Store the previous position's record (value ``x_t``), read the query's buckets, mix."""
        mem, prof, t = self.mem, self.prof, st.t
        last = jnp.concatenate([st.last_tokens[1:], token[None].astype(jnp.int32)])
        address = hashing.addresses(last, mem.context_order, mem.num_buckets,
                                    int32_wraparound=prof.hash_int32_wraparound)[-1]
        keys, query = bound.memory.project(h[None], h[None], prof.l2norm)
        key, query = keys[0], query[0]
        semantic = mem.route in ("semantic", "hybrid")
        probs = bound.memory.router_probs(h[None], mem.semantic_temperature)[0] if semantic else None
        sem_bucket = jnp.argmax(probs).astype(jnp.int32) if semantic else jnp.zeros((), jnp.int32)
        p_addr, p_sem, p_key, p_probs = st.pending
        ok = t > 0
        value = token.astype(jnp.int32)
        context, sem_store = st.context, st.semantic
        if context is not None:
            context = context.insert(ok, p_addr, p_key, t - 1, value, p_probs)
        if sem_store is not None:
            sem_store = sem_store.insert(ok, p_sem, p_key, t - 1, value, p_probs)
        st = st.replace(last_tokens=last, context=context, semantic=sem_store,
                        pending=(address, sem_bucket, key.astype(p_key.dtype),
                                 None if probs is None else probs.astype(p_probs.dtype)))

        min_pos = None if self.horizon is None else t - self.horizon
        parts = [s.read(a, min_pos) for s, a in ((context, address), (sem_store, sem_bucket)) if s is not None]
        if len(parts) == 2:
            (c1, k1, v1, q1), (c2, k2, v2, q2) = parts
            both = combine_hybrid(c1, c2, dedup=prof.hybrid_dedup)
            cand, slot_keys = both, jnp.concatenate([k1, k2])
            values, slot_probs = jnp.concatenate([v1, v2]), jnp.concatenate([q1, q2])
        else:
            cand, slot_keys, values, slot_probs = parts[0]
        work = self.work
        rho = bound.memory.variables["params"]["recency_scale"].astype(work)
        d = slot_keys.shape[-1]
        # rho·(s - t)/D: the spec's rho·s/D shifted by a per-query constant (same softmax), exact in float32.
        rel = (jnp.where(cand.valid, cand.index, t) - t).astype(work)
        scores = slot_keys.astype(work) @ query.astype(work) / math.sqrt(d) + rho * rel / self.denominator
        if probs is not None:
            overlap = slot_probs.astype(work) @ probs.astype(work)
            scores = scores + mem.semantic_score_scale * jnp.log(jnp.maximum(overlap, 1e-6))
        alpha = mixture.cache_weights(scores[None, None], cand.valid[None, None])
        p_cache = mixture.cache_distribution(alpha, values[None, None], cand.valid[None, None],
                                             self.cfg.vocab_size)[0, 0]
        if self.cfg.variant == "pcaf_no_gate":
            raw = jnp.asarray(mem.fixed_gate, work)
        else:
            raw = bound.gate(h[None])[0]
        gate = mixture.mask_gate(raw, jnp.any(cand.valid), clip_when_empty=prof.gate_clip_when_empty)
        log_probs = mixture.mixture_log_probs(param_lp, p_cache, gate, nt_floor=False)
        return st, StepOutput(log_probs, param_lp, cand.index, cand.valid, gate)


def stack_outputs(outs: list[StepOutput]) -> StepOutput:
    """Per-step outputs ``[B, ...]`` stacked to ``[B, n, ...]`` (host helper for tests and tools)."""
    return StepOutput(*(None if f[0] is None else np.stack([np.asarray(x) for x in f], axis=1)
                        for f in zip(*outs, strict=True)))
