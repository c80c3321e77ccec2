"""Every model of :data:`pcaf_core.config.MODEL_VARIANTS` as a ``flax.linen`` Module (mirrors
:mod:`pcaf_core.reference`, which describes the models), behind one factory and one call signature:
:class:`PCAFModel` for the conv backbone, :class:`TransformerLM` for the Transformers.

``module.apply(variables, tokens [B, T] int, targets, mode, deterministic=..., need_log_probs=...,
need_predictions=..., rngs=...)`` returns a :class:`JaxForwardOutput` (:mod:`backends.jax.model_io`).
``mode`` and the ``need_*`` flags are static Python values. ``deterministic=True`` equals the spec;
``deterministic=False`` adds the profile's dropout (``rngs={"dropout": key}``).

Submodule and parameter names are the canonical names with list indices as ``blocks_0``
(:mod:`backends.jax.weights` converts), and ``module.init`` creates every canonical parameter, the
unused ones included, so ``jax.eval_shape(module.init, ...)`` counts a configuration's parameters.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from backends.jax import hashing, mixture, records, routing
from backends.jax.layers import (
    ConvBlock,
    Dense,
    Embed,
    Gate,
    Head,
    LayerNorm,
    PositionalTable,
    TransformerBlock,
    fixed_positions,
    l2_normalize,
    layer_rows,
    wide,
)
from backends.jax.model_io import JaxForwardOutput, JaxMemoryTrace, check_inputs
from backends.jax.ops import argmax_last, batch_gather
from backends.jax.routing import Candidates, SelectionInputs
from pcaf_core.config import (
    PCAF_VARIANTS,
    TRANSFORMER_VARIANTS,
    MemoryConfig,
    ModelConfig,
    ProfileConfig,
)
from pcaf_core.mixture import mixture_rule
from pcaf_core.params import has_memory_params, has_positional_table, has_router, param_shapes, uses_cache
from pcaf_core.reference import nt_attention_crop, nt_attention_rows, nt_conv_rows
from pcaf_core.routing import ScoreBand, topk_sparse_window

Dtype = Any


# The selection steps as jitted programs keyed by their few static values (not by the whole
# configuration): eager callers (evaluation, tests) dispatch a handful of cached computations instead of
# the routing's hundreds of small ops, and configurations that share K or a policy share the programs.
# Under an outer jax.jit they are inlined.
_addresses = jax.jit(hashing.addresses, static_argnums=(1, 2), static_argnames=("int32_wraparound",))
_route_context = jax.jit(routing.route_context, static_argnums=(2, 3), static_argnames=("query_layout",))
_route_context_topk_score = jax.jit(routing.route_context_topk_score, static_argnums=(2,),
                                    static_argnames=("query_layout",))
_route_semantic_dense = jax.jit(routing.route_semantic_dense, static_argnums=(4,), static_argnames=("target_leak",))
_route_semantic_bucketed = jax.jit(
    lambda probs, qpos, top_k, layout=None: routing.route_semantic_bucketed(
        routing.semantic_buckets(probs), qpos, top_k, layout=layout),
    static_argnums=(2,))
_bucket_layout = jax.jit(routing.bucket_layout)
_semantic_layout = jax.jit(lambda probs: routing.bucket_layout(routing.semantic_buckets(probs)))
_combine_hybrid = jax.jit(routing.combine_hybrid, static_argnames=("dedup",))


def select_candidates(
    tokens: jax.Array,
    query: jax.Array,
    keys: jax.Array,
    router_probs: jax.Array | None,
    recency: jax.Array,
    rho: jax.Array,
    *,
    context_order: int,
    num_buckets: int,
    int32_wraparound: bool,
    route: str,
    semantic_index: str,
    policy: str,
    top_k: int,
    target_leak: bool,
    dedup: bool,
    mode: str,
) -> tuple[jax.Array, Candidates, jax.Array | None, ScoreBand | None]:
    """Addresses ``[B, T]`` int32, the selected :class:`Candidates` of every query (spec slot order), for
    the ``topk_score`` context route which queries it scored densely (``[B, Q]`` bool, else None), and the
    band: in full AR, for the ``recent`` and ``topk_score`` context routes and the bucketed semantic route
    (not hybrid), the :class:`ScoreBand` of the layout the route read, for :func:`mixture.candidate_scores`
    to score the candidates with blocked GEMMs; else None.

    tokens ``[B, T]``; query ``[B, Q, d]`` and keys ``[B, T, d]`` unit vectors; router_probs ``[B, T, S]``
    (semantic and hybrid routes, else None); recency ``[T]``; rho the recency scale. Selection is integer
    valued and not differentiated: every float input passes through ``stop_gradient``. The keyword
    arguments are static configuration values.
    """
    T = tokens.shape[1]
    qpos = records.query_positions(T, mode)
    query, keys, rho = (jax.lax.stop_gradient(x) for x in (query, keys, rho))
    addr = _addresses(tokens, context_order, num_buckets, int32_wraparound=int32_wraparound)
    cand: Candidates | None = None
    topk_dense = band = None
    if route in ("context", "hybrid"):
        banded = mode == "ar" and route == "context" and policy in ("recent", "topk_score")
        layout = _bucket_layout(addr) if banded else None
        if policy == "topk_score":
            select = SelectionInputs(query, keys, recency, rho)
            cand, topk_dense = _route_context_topk_score(addr, qpos, top_k, select, query_layout=mode, layout=layout)
            band = ScoreBand(layout, topk_sparse_window(top_k)) if banded else None
        else:
            cand = _route_context(addr, qpos, top_k, policy, query_layout=mode, layout=layout)
            band = ScoreBand(layout) if banded else None
    if route in ("semantic", "hybrid"):
        probs = jax.lax.stop_gradient(router_probs)
        if semantic_index == "dense":
            sem = _route_semantic_dense(probs, recency, rho, qpos, top_k, target_leak=target_leak)
        else:
            layout = _semantic_layout(probs) if mode == "ar" and route == "semantic" else None
            sem = _route_semantic_bucketed(probs, qpos, top_k, layout)
            band = ScoreBand(layout) if layout is not None else None
        cand = sem if cand is None else _combine_hybrid(cand, sem, dedup=dedup)
    return addr, cand, topk_dense, band

class CanonicalLM(nn.Module):
    """Shared checks, head and forward of every model; subclasses provide ``hidden_states`` and, for
    cache models, ``memory_read``."""

    model_config: ModelConfig
    memory_config: MemoryConfig
    profile: ProfileConfig
    dtype: Dtype = jnp.float32
    # Next-token forwards from receptive fields only (PCAFModel.nt_receptive_read); the backend sets it.
    nt_receptive_field: bool = False
    # (position chunk, vocabulary chunk) of the training loss's head tiles, or None (layers.Head.chunks).
    head_chunks: tuple[int, int] | None = None

    @property
    def uses_cache(self) -> bool:
        return uses_cache(self.model_config)

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        """The canonical ``name -> shape`` of this configuration (:func:`pcaf_core.params.param_shapes`)."""
        return param_shapes(self.model_config, self.memory_config, self.profile)

    def hidden_states(self, tokens: jax.Array, deterministic: bool) -> jax.Array:  # pragma: no cover
        raise NotImplementedError

    def __call__(
        self,
        tokens: jax.Array,
        targets: jax.Array | None = None,
        mode: str = "nt",
        *,
        deterministic: bool = True,
        need_log_probs: bool = True,
        need_predictions: bool = True,
    ) -> JaxForwardOutput:
        """See :func:`pcaf_core.reference.forward`, flags included; ``mode`` and the flags are static.

        ``deterministic``: dropout off (evaluation) when True. ``need_predictions`` builds the mixture too
        (for ``prediction_mixture``).
        """
        tokens, tgt = check_inputs(self.model_config, self.profile, tokens, targets, mode)
        rule = mixture_rule(self.profile, mode)
        # The re-normalised NT loss reads the whole (one-query) mixture, so it needs the full head.
        full_mixture = need_log_probs or (rule.renormalise and tgt is not None and self.uses_cache)
        need_mix = full_mixture or need_predictions
        read = None
        if mode == "nt" and self.nt_receptive_field and not self.is_initializing():
            h, read = self.nt_receptive_read(tokens, deterministic, need_p_cache=need_mix)
            h_q = h[:, :1]
        else:
            h = self.hidden_states(tokens, deterministic)
            h_q = records.query_rows(h, mode)
        if tgt is not None and not (full_mixture or need_predictions):
            param_lp = None
            lp_y = self.head.target_log_prob(h_q, tgt, deterministic)
        else:
            param_lp = self.head(h_q, deterministic)  # [B, Q, V]
            lp_y = None if tgt is None else jnp.take_along_axis(param_lp, tgt[..., None], axis=-1)[..., 0]
        pred_param = argmax_last(param_lp) if need_predictions else None
        if not self.uses_cache:
            if self.is_initializing():
                self.init_unused(h_q)
            loss = None if lp_y is None else -jnp.mean(lp_y)
            return JaxForwardOutput(h, param_lp, param_lp, lp_y, pred_param, pred_param, pred_param, None, loss)

        mem, cand_values = read if read is not None else self.memory_read(tokens, h, mode, need_p_cache=need_mix)
        mix_lp = None
        if need_mix:
            mix_lp = mixture.mixture_log_probs(param_lp, mem.p_cache, mem.gate, nt_floor=rule.nt_floor,
                                               gate_per_term=rule.gate_per_term)
        tlp = loss = None
        if tgt is not None and rule.renormalise:
            tlp = mixture.renormalised_target_log_prob(mix_lp, tgt)
        elif tgt is not None:
            pc_y = mixture.target_cache_prob(mem.cache_weights, cand_values, mem.cand.valid, tgt)
            tlp = mixture.target_log_prob(lp_y, pc_y, mem.gate, nt_floor=rule.nt_floor, ar_floor=rule.ar_floor,
                                          mode=mode, gate_per_term=rule.gate_per_term)
        if tlp is not None:
            loss = -jnp.mean(tlp)
        pred = pred_mix = None
        if need_predictions:
            pred_mix = argmax_last(mix_lp)
            pred = mixture.predictions(mix_lp, param_lp, parametric_only=rule.parametric_accuracy)
        return JaxForwardOutput(h, param_lp, mix_lp, tlp, pred, pred_mix, pred_param, mem, loss)

    def init_unused(self, h_q: jax.Array) -> None:
        """Create parameters the forward does not use (``module.init`` only); none by default."""


class AssociativeMemory(nn.Module):
    """The memory's parameters of :func:`pcaf_core.reference.memory_read`: ``W_q``, ``W_k``, the optional
    semantic router and the recency scale ρ. Projections run in ``dtype``; their outputs are widened to at
    least float32 for normalisation, selection and scoring.
    """

    d_model: int
    semantic_buckets: int
    router_form: str
    with_router: bool
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        self.query = Dense(self.d_model, use_bias=False, dtype=self.dtype)
        self.key = Dense(self.d_model, use_bias=False, dtype=self.dtype)
        if self.with_router:
            if self.router_form == "layernorm_linear":
                self.router_norm = LayerNorm(dtype=self.dtype)
            self.router = Dense(self.semantic_buckets, use_bias=self.router_form == "linear_bias", dtype=self.dtype)
        self.recency_scale = self.param("recency_scale", nn.initializers.ones, (), jnp.float32)

    def project(self, h: jax.Array, h_q: jax.Array, l2norm: str) -> tuple[jax.Array, jax.Array]:
        """Unit keys ``[B, T, d]`` and queries ``[B, Q, d]`` in ``wide(dtype)``."""
        work = wide(self.dtype)
        keys = l2_normalize(self.key(h).astype(work), l2norm)
        query = l2_normalize(self.query(h_q).astype(work), l2norm)
        return keys, query

    def router_probs(self, h: jax.Array, temperature: float) -> jax.Array:
        """``router_probs`` of :func:`pcaf_core.reference.memory_read`, in ``wide(dtype)``."""
        x = self.router_norm(h) if self.router_form == "layernorm_linear" else h
        return jax.nn.softmax(self.router(x).astype(wide(self.dtype)) / temperature, axis=-1)

    def __call__(self, h: jax.Array) -> None:
        """Create every parameter (``module.init`` of models that carry the memory unused)."""
        self.project(h, h, "rsqrt_eps")
        if self.with_router:
            self.router_probs(h, 1.0)


class PCAFModel(CanonicalLM):
    """PCAF and its conv-backbone relatives (``pcaf``, ``pcaf_no_gate``, ``pcaf_no_cache``, ``local_conv``)."""

    def setup(self) -> None:
        model, memory, profile = self.model_config, self.memory_config, self.profile
        if model.variant not in PCAF_VARIANTS and model.variant != "local_conv":
            raise ValueError(f"PCAFModel builds {list(PCAF_VARIANTS) + ['local_conv']}, not {model.variant!r}")
        d, hid, V, p = model.d_model, model.d_hidden, model.vocab_size, profile.dropout
        self.embed = Embed(V, d, out_dtype=wide(self.dtype))
        self.blocks = [ConvBlock(d, hid, model.kernel_size, profile.gelu, p, dtype=self.dtype)
                       for _ in range(model.n_layers)]
        self.head = Head(hid, V, profile.gelu, p, dtype=self.dtype, chunks=self.head_chunks)
        if has_memory_params(model, profile):
            self.memory = AssociativeMemory(d, memory.semantic_buckets, profile.router,
                                            has_router(model, memory, profile), dtype=self.dtype)
            self.gate = Gate(d, profile.gelu, dtype=self.dtype)

    def hidden_states(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        """See :func:`pcaf_core.reference.hidden_states`; in ``wide(dtype)``."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, deterministic)
        return x

    def init_unused(self, h_q: jax.Array) -> None:
        if has_memory_params(self.model_config, self.profile):
            self.memory(h_q)
            self.gate(h_q)

    def memory_read(
        self, tokens: jax.Array, h: jax.Array, mode: str, *, need_p_cache: bool = True
    ) -> tuple[JaxMemoryTrace, jax.Array]:
        """See :func:`pcaf_core.reference.memory_read`; returns the trace and the slot values ``[B, Q, C]`` (the
        successor token of each slot's record)."""
        mcfg = self.memory_config
        T = tokens.shape[1]
        work = wide(self.dtype)
        rec = records.recency(T, mode, work)
        h_q = records.query_rows(h, mode)
        keys, query = self.memory.project(h, h_q, self.profile.l2norm)
        semantic = mcfg.route in ("semantic", "hybrid")
        router_probs = self.memory.router_probs(h, mcfg.semantic_temperature) if semantic else None
        addr, cand, topk_dense, band = self._select(tokens, query, keys, router_probs, rec, mode)
        query_router = None
        if router_probs is not None:
            query_router = router_probs[:, T - 1:] if mode == "nt" else router_probs
        if self.is_initializing() and not semantic and self.memory.with_router:
            self.memory.router_probs(h, mcfg.semantic_temperature)
        return self._read(tokens, addr, cand, topk_dense, query, keys, rec, router_probs, query_router, h_q, mode,
                          need_p_cache, band=band)

    def _select(self, tokens: jax.Array, query: jax.Array | None, keys: jax.Array | None,
                router_probs: jax.Array | None, rec: jax.Array, mode: str) -> tuple[jax.Array, Candidates, Any, Any]:
        """:func:`select_candidates` with this model's configuration."""
        mcfg, prof = self.memory_config, self.profile
        rho = self.memory.recency_scale.astype(wide(self.dtype))
        return select_candidates(
            tokens, query, keys, router_probs, rec, rho,
            context_order=mcfg.context_order, num_buckets=mcfg.num_buckets,
            int32_wraparound=prof.hash_int32_wraparound, route=mcfg.route, semantic_index=mcfg.semantic_index,
            policy=mcfg.candidate_policy, top_k=mcfg.top_k,
            target_leak=prof.semantic_ar_target_leak and mode == "ar", dedup=prof.hybrid_dedup, mode=mode)

    def _read(
        self, tokens: jax.Array, addr: jax.Array, cand: Candidates, topk_dense: jax.Array | None,
        query: jax.Array, keys: jax.Array, rec: jax.Array, router_probs: jax.Array | None,
        query_router_probs: jax.Array | None, h_q: jax.Array, mode: str, need_p_cache: bool,
        slots: Candidates | None = None, trace_router_probs: jax.Array | None = None,
        band: ScoreBand | None = None,
    ) -> tuple[JaxMemoryTrace, jax.Array]:
        """Scores, cache weights, p_cache and gate of the selected candidates ``cand`` (window positions).

        ``keys`` / ``rec`` / ``router_probs`` are indexed by ``slots`` (default ``cand``): the window's own
        arrays, or those of a receptive-field sub-sequence whose positions ``slots`` names. ``band``: see
        :func:`select_candidates` (only with the window's own arrays)."""
        mcfg, prof = self.memory_config, self.profile
        work = wide(self.dtype)
        rho = self.memory.recency_scale.astype(work)
        slots = cand if slots is None else slots
        if band is not None and slots is not cand:
            raise ValueError("a band scores the window's own slots; receptive-field slots have none")
        scores = mixture.candidate_scores(query, keys, rec, rho, slots, router_probs, query_router_probs,
                                          mcfg.semantic_score_scale, band=band)
        alpha = mixture.cache_weights(scores, cand.valid)
        values = routing.gather_records(records.successor_values(tokens), cand)
        p_cache = None
        if need_p_cache:
            p_cache = mixture.cache_distribution(alpha, values, cand.valid, self.model_config.vocab_size)
        if self.model_config.variant == "pcaf_no_gate":
            raw = jnp.full(h_q.shape[:2], mcfg.fixed_gate, dtype=work)
            if self.is_initializing():
                self.gate(h_q)
        else:
            raw = self.gate(h_q)
        gate = mixture.mask_gate(raw, jnp.any(cand.valid, axis=-1), clip_when_empty=prof.gate_clip_when_empty,
                                 per_term=mixture_rule(prof, mode).gate_per_term)
        traced = router_probs if trace_router_probs is None else trace_router_probs
        return JaxMemoryTrace(addr, cand, scores, alpha, gate, p_cache, traced, topk_dense), values

    # ------------------------------------------------------------------ next-token receptive fields

    @property
    def receptive_field(self) -> int:
        """R of :func:`pcaf_core.reference.conv_stack`."""
        return self.model_config.n_layers * (self.model_config.kernel_size - 1) + 1

    def states_at(self, tokens: jax.Array, positions: jax.Array, deterministic: bool = True) -> jax.Array:
        """Final hidden states ``[B, P, d]`` at ``positions`` ``[B, P]`` of windows ``tokens`` ``[B, T]``, from
        each position's receptive field only (:func:`pcaf_core.reference.conv_stack`), in static shapes."""
        B, P = positions.shape
        R = self.receptive_field
        idx = positions[..., None] + jnp.arange(1 - R, 1)  # [B, P, R]
        valid = (idx >= 0).reshape(B * P, R)
        x = self.embed(batch_gather(tokens, jnp.maximum(idx, 0)).reshape(B * P, R))
        for block, rows in zip(self.blocks, nt_conv_rows(self.model_config), strict=True):
            x = block(x, deterministic, valid, rows)  # each block's MLP on the rows the blocks above read
            valid = layer_rows(valid, rows)
        return x.reshape(B, P, -1)

    def nt_receptive_read(
        self, tokens: jax.Array, deterministic: bool = True, *, need_p_cache: bool = True
    ) -> tuple[jax.Array, tuple[JaxMemoryTrace, jax.Array] | None]:
        """The next-token forward's states and memory read from receptive fields only
        (:func:`pcaf_core.reference.conv_stack`): ``[B, 1 + C, d]`` states (the query, then the C candidate
        slots) and the (trace, slot values) of :meth:`memory_read` (None without a cache). Routes that rank by
        states select on a full forward under ``stop_gradient``."""
        mcfg, prof = self.memory_config, self.profile
        B, T = tokens.shape
        work = wide(self.dtype)
        qpos = jnp.full((B, 1), T - 1, dtype=jnp.int32)
        if not self.uses_cache:
            return self.states_at(tokens, qpos, deterministic), None
        semantic = mcfg.route in ("semantic", "hybrid")
        ranks_by_states = semantic or (mcfg.route in ("context", "hybrid") and mcfg.candidate_policy == "topk_score")
        rec_full = records.recency(T, "nt", work)
        query_full = keys_full = router_full = None
        if ranks_by_states:
            h_full = jax.lax.stop_gradient(self.hidden_states(tokens, deterministic))
            keys_full, query_full = self.memory.project(h_full, h_full[:, T - 1:], prof.l2norm)
            if semantic:
                router_full = self.memory.router_probs(h_full, mcfg.semantic_temperature)
        addr, cand, topk_dense, _ = self._select(tokens, query_full, keys_full, router_full, rec_full, "nt")
        C = cand.index.shape[-1]
        positions = jnp.concatenate([qpos, jnp.maximum(cand.index[:, 0], 0).astype(jnp.int32)], axis=1)
        h = self.states_at(tokens, positions, deterministic)  # [B, 1 + C, d]
        keys, query = self.memory.project(h, h[:, :1], prof.l2norm)
        rec = rec_full[positions]  # [B, 1 + C]
        slot = jnp.arange(1, C + 1, dtype=cand.index.dtype)
        slots = Candidates(jnp.where(cand.valid, slot, -1), cand.valid)  # slot c is sub-position 1 + c
        router = self.memory.router_probs(h, mcfg.semantic_temperature) if semantic else None
        read = self._read(tokens, addr, cand, topk_dense, query, keys, rec, router,
                          None if router is None else router[:, :1], h[:, :1], "nt", need_p_cache, slots=slots,
                          trace_router_probs=router_full)
        return h, read


class TransformerLM(CanonicalLM):
    """Transformer baselines: ``transformer_dense`` / ``_local`` / ``_global_local`` and ``linear_attention``
    (positions: :func:`pcaf_core.reference.hidden_states`)."""

    def setup(self) -> None:
        model, profile = self.model_config, self.profile
        if model.variant not in TRANSFORMER_VARIANTS:
            raise ValueError(f"TransformerLM builds {list(TRANSFORMER_VARIANTS)}, not {model.variant!r}")
        d, hid, V, p = model.d_model, model.d_hidden, model.vocab_size, profile.dropout
        self.embed = Embed(V, d, out_dtype=wide(self.dtype))
        if has_positional_table(model, profile):
            self.pos = PositionalTable(model.max_seq_len, d, profile.positional_scale)
        self.blocks = [TransformerBlock(d, hid, model.n_heads, model.variant, model.window, model.n_global,
                                        model.linear_chunk, profile.gelu, p, dtype=self.dtype,
                                        attention_impl=model.attention_impl)
                       for _ in range(model.n_layers)]
        self.head = Head(hid, V, profile.gelu, p, dtype=self.dtype, chunks=self.head_chunks)

    def hidden_states(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        """See :func:`pcaf_core.reference.hidden_states`; in ``wide(dtype)``."""
        return self._blocks(self.embed(tokens), tokens.shape[1], None, deterministic)

    def _blocks(self, x: jax.Array, seq_len: int, crop: tuple[int, int] | None, deterministic: bool,
                rows: list[tuple[int, int] | None] | None = None) -> jax.Array:
        """The blocks over embeddings ``x`` plus the positional encodings of a window of ``seq_len``, or of its
        :func:`~pcaf_core.reference.nt_attention_crop` sub-window (``crop``, static); ``rows`` (static): block i
        keeps ``rows[i]`` of its input (:func:`~pcaf_core.reference.nt_attention_rows`)."""
        model, profile = self.model_config, self.profile
        if has_positional_table(model, profile):
            pe = self.pos(seq_len).astype(x.dtype)
        else:
            pe = fixed_positions(seq_len, model.d_model, profile.positional, profile.positional_scale, x.dtype)
        if crop is not None:
            g, start = crop
            pe = jnp.concatenate([pe[:g], pe[start:]])
        x = x + pe
        for i, block in enumerate(self.blocks):
            x = block(x, deterministic, None if rows is None else rows[i])
        return x

    def nt_receptive_read(
        self, tokens: jax.Array, deterministic: bool = True, *, need_p_cache: bool = True
    ) -> tuple[jax.Array, None]:
        """The next-token forward's final state ``[B, 1, d]`` from the sub-window of
        :func:`pcaf_core.reference.nt_attention_crop` (the whole window where it has none), each layer computing
        the rows of :func:`pcaf_core.reference.nt_attention_rows` only; no memory read."""
        T = tokens.shape[1]
        crop = nt_attention_crop(self.model_config, T)
        rows = nt_attention_rows(self.model_config, T)
        if rows is None:
            return self.hidden_states(tokens, deterministic)[:, -1:], None
        sub = tokens if crop is None else jnp.concatenate([tokens[:, :crop[0]], tokens[:, crop[1]:]], axis=1)
        return self._blocks(self.embed(sub), T, crop, deterministic, rows), None


def _config_hash(self: CanonicalLM) -> int:
    """Hash of a model by its configuration values: the config dataclasses are mutable (unhashable), and
    a module must be hashable to serve as a static argument of ``jax.jit``."""
    return hash((type(self).__name__, repr(self.model_config), repr(self.memory_config), repr(self.profile),
                 str(jnp.dtype(self.dtype)), self.nt_receptive_field, self.head_chunks, self.name))


# Assigned after class creation: linen's dataclass transform would replace a __hash__ defined in the body.
PCAFModel.__hash__ = _config_hash  # type: ignore[method-assign]
TransformerLM.__hash__ = _config_hash  # type: ignore[method-assign]


def build_model(
    model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig, *, dtype: Dtype = jnp.float32,
    nt_receptive_field: bool = False, head_chunks: tuple[int, int] | None = None,
) -> PCAFModel | TransformerLM:
    """The Module of ``model.variant``; ``dtype`` is the compute dtype of matmuls (float32, bfloat16 for
    the bf16 precision, float64 under x64). Parameters come from :func:`backends.jax.params.init_params`
    through :func:`backends.jax.weights.to_variables` (they stay float32 under bf16 compute).
    ``nt_receptive_field``: next-token forwards from receptive fields only (:meth:`PCAFModel.nt_receptive_read`,
    :meth:`TransformerLM.nt_receptive_read`). ``head_chunks``: the training loss reads the head tile by tile
    (:attr:`backends.jax.layers.Head.chunks`)."""
    if model.variant in TRANSFORMER_VARIANTS:
        return TransformerLM(model, memory, profile, dtype=dtype, nt_receptive_field=nt_receptive_field,
                             head_chunks=head_chunks)
    return PCAFModel(model, memory, profile, dtype=dtype, nt_receptive_field=nt_receptive_field,
                     head_chunks=head_chunks)
