"""Every model of :data:`pcaf_core.config.MODEL_VARIANTS` as an ``nn.Module`` (mirrors
:mod:`pcaf_core.reference`, which describes the models), behind one factory and one forward signature:
:class:`PCAFModel` for the conv backbone, :class:`TransformerLM` for the Transformers.

``model(tokens [B, T] int64, targets, mode)`` returns a :class:`TorchForwardOutput` whose fields mirror
:class:`pcaf_core.reference.ForwardOutput`, plus ``loss`` (mean NLL, differentiable). Evaluation mode
(``model.eval()``) equals the spec; training mode adds the profile's dropout.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from backends.torch import cpu_gemm, hashing, mixture, records, routing
from backends.torch.layers import (
    ConvBlock,
    FixedPositions,
    Gate,
    Head,
    PositionalTable,
    TransformerBlock,
    l2_normalize,
    layer_norm,
    layer_rows,
)
from backends.torch.model_io import TorchForwardOutput, TorchMemoryTrace
from backends.torch.ops import batch_gather
from backends.torch.params import init_params
from backends.torch.routing import Candidates, SelectionInputs
from backends.torch.weights import load_canonical
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
from pcaf_core.routing import ScoreBand


class CanonicalLM(nn.Module, abc.ABC):
    """Shared input checks, head and forward of every model; subclasses provide :meth:`hidden_states`."""

    def __init__(self, model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig) -> None:
        super().__init__()
        self.model_config, self.memory_config, self.profile = model, memory, profile

    @property
    def uses_cache(self) -> bool:
        return uses_cache(self.model_config)

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        """The canonical ``name -> shape`` of this configuration (:func:`pcaf_core.params.param_shapes`)."""
        return param_shapes(self.model_config, self.memory_config, self.profile)

    @abc.abstractmethod
    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """See :func:`pcaf_core.reference.hidden_states` (int64 tokens)."""

    def check_inputs(
        self, tokens: torch.Tensor, targets: torch.Tensor | None, mode: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Check the static properties of ``tokens [B, T]`` and ``targets`` (NT ``[B]`` or ``[B, 1]``, AR
        ``[B, T]``): type, dtype, shape, mode, T within the positional table; return them as int64 with
        targets reshaped to ``[B, Q]``. Raises ValueError naming the bad value and its limit.

        Token-id ranges are not scanned here: that would synchronise the device on every forward. The
        training loop validates each batch once on the host (:func:`pcaf_core.batches.check_batch`);
        code that feeds the model directly can call it too.
        """
        records.check_mode(mode)
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer torch.Tensor [B, T], got {type(tokens).__name__}"
                             + (f" of dtype {tokens.dtype}" if isinstance(tokens, torch.Tensor) else ""))
        if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be [B, T] with B >= 1 and T >= 1, got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if has_positional_table(self.model_config, self.profile) and T > self.model_config.max_seq_len:
            raise ValueError(f"sequence length T={T} exceeds model.max_seq_len={self.model_config.max_seq_len} "
                             "(the trainable positional table's rows)")
        if targets is None:
            return tokens.to(torch.int64), None
        Q = 1 if mode == "nt" else T
        if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point:
            raise ValueError("targets must be an integer torch.Tensor")
        if targets.numel() != B * Q:
            want = "[B] or [B, 1]" if mode == "nt" else "[B, T]"
            raise ValueError(f"{mode} targets must be {want} = {B * Q} ids, got shape {tuple(targets.shape)}")
        return tokens.to(torch.int64), targets.to(torch.int64).reshape(B, Q)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        mode: str = "nt",
        *,
        need_log_probs: bool = True,
        need_predictions: bool = True,
    ) -> TorchForwardOutput:
        """See :func:`pcaf_core.reference.forward`, flags included; returns a :class:`TorchForwardOutput`.

        ``need_predictions`` under the mixture-argmax accuracy builds the mixture too, even when
        ``need_log_probs`` is False.
        """
        tokens, tgt = self.check_inputs(tokens, targets, mode)
        rule = mixture_rule(self.profile, mode)
        # The re-normalised NT loss reads the whole (one-query) mixture, so it needs the full head.
        full_mixture = need_log_probs or (rule.renormalise and tgt is not None and self.uses_cache)
        need_mix = full_mixture or (need_predictions and not rule.parametric_accuracy)
        read = None
        if mode == "nt" and getattr(self, "nt_receptive_field", False):
            h, read = self.nt_receptive_read(tokens, need_p_cache=need_mix)
            h_q = h[:, :1]
        else:
            h = self.hidden_states(tokens)
            h_q = records.query_rows(h, mode)
        if tgt is not None and not (full_mixture or need_predictions):
            # Training: the head at the targets only, without the [B, Q, V] log-softmax graph.
            param_lp = None
            lp_y = self.head.target_log_prob(h_q, tgt)
        else:
            param_lp = self.head(h_q)  # [B, Q, V]
            lp_y = None if tgt is None else param_lp.gather(-1, tgt[..., None])[..., 0]
        if not self.uses_cache:
            pred = torch.argmax(param_lp, dim=-1) if need_predictions else None
            loss = None if lp_y is None else -lp_y.mean()
            return TorchForwardOutput(h, param_lp, param_lp, lp_y, pred, None, loss)

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
            loss = -tlp.mean()
        pred = (mixture.predictions(mix_lp, param_lp, parametric_only=rule.parametric_accuracy)
                if need_predictions else None)
        return TorchForwardOutput(h, param_lp, mix_lp, tlp, pred, mem, loss)


class AssociativeMemory(nn.Module):
    """The memory's parameters of :func:`pcaf_core.reference.memory_read`: ``W_q``, ``W_k``, the optional
    semantic router and the recency scale ρ."""

    def __init__(self, d: int, semantic_buckets: int, router_form: str, with_router: bool) -> None:
        super().__init__()
        self.query = cpu_gemm.Linear(d, d, bias=False)
        self.key = cpu_gemm.Linear(d, d, bias=False)
        self.router_form = router_form
        if with_router:
            if router_form == "layernorm_linear":
                self.router_norm = layer_norm(d)
            self.router = cpu_gemm.Linear(d, semantic_buckets, bias=router_form == "linear_bias")
        self.recency_scale = nn.Parameter(torch.tensor(1.0))

    def router_probs(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        """``router_probs`` of :func:`pcaf_core.reference.memory_read`."""
        x = self.router_norm(h) if self.router_form == "layernorm_linear" else h
        return torch.softmax(self.router(x) / temperature, dim=-1)


class PCAFModel(CanonicalLM):
    """PCAF and its conv-backbone relatives (``pcaf``, ``pcaf_no_gate``, ``pcaf_no_cache``, ``local_conv``).

    ``topk_strategy`` (``auto`` | ``dense``) and ``sparse_window`` (M, default 4K) choose how the
    ``topk_score`` context route is computed; both give the spec's candidates.
    """

    def __init__(self, model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig) -> None:
        super().__init__(model, memory, profile)
        if model.variant not in PCAF_VARIANTS and model.variant != "local_conv":
            raise ValueError(f"PCAFModel builds {list(PCAF_VARIANTS) + ['local_conv']}, not {model.variant!r}")
        d, h, V, p = model.d_model, model.d_hidden, model.vocab_size, profile.dropout
        self.embed = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(
            ConvBlock(d, h, model.kernel_size, profile.gelu, p) for _ in range(model.n_layers))
        self.head = Head(d, h, V, profile.gelu, p)
        if has_memory_params(model, profile):
            self.memory = AssociativeMemory(d, memory.semantic_buckets, profile.router,
                                            has_router(model, memory, profile))
            self.gate = Gate(d, profile.gelu)
        self.topk_strategy = "auto"
        self.sparse_window: int | None = None
        # Next-token forwards from receptive fields only (nt_receptive_read); the backends turn it on.
        self.nt_receptive_field = False

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x

    def memory_read(
        self, tokens: torch.Tensor, h: torch.Tensor, mode: str, *, need_p_cache: bool = True
    ) -> tuple[TorchMemoryTrace, torch.Tensor]:
        """See :func:`pcaf_core.reference.memory_read`; returns the trace and the slot values ``[B, Q, C]`` (the
        successor token of each slot's record)."""
        mcfg, prof = self.memory_config, self.profile
        T = tokens.shape[1]
        rec = records.recency(T, mode, h.dtype, h.device)
        h_q = records.query_rows(h, mode)  # [B, Q, d]
        keys = l2_normalize(self.memory.key(h), prof.l2norm)  # [B, T, d]
        query = l2_normalize(self.memory.query(h_q), prof.l2norm)  # [B, Q, d]
        semantic = mcfg.route in ("semantic", "hybrid")
        router_probs = self.memory.router_probs(h, mcfg.semantic_temperature) if semantic else None
        addr, cand, topk_dense, band = self.select_candidates(tokens, mode, query, keys, router_probs)
        return self._read(tokens, addr, cand, topk_dense, query, keys, rec, router_probs,
                          None if router_probs is None else records.query_rows(router_probs, mode), h_q, mode,
                          need_p_cache, band=band)

    def select_candidates(
        self, tokens: torch.Tensor, mode: str, query: torch.Tensor | None, keys: torch.Tensor | None,
        router_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Candidates, torch.Tensor | None, ScoreBand | None]:
        """Addresses ``[B, T]``, the candidates of every query, (``topk_score``) which queries went dense, and
        the band: in full AR, for the ``recent`` context route and the bucketed semantic route (not hybrid),
        the :class:`ScoreBand` of the layout the route read, for :func:`mixture.candidate_scores` to score the
        candidates with blocked GEMMs; else None.

        query ``[B, Q, d]`` / keys ``[B, T, d]`` are read (detached) by ``topk_score`` only, router_probs
        ``[B, T, S]`` by the semantic routes only; selection is never differentiated."""
        mcfg, prof = self.memory_config, self.profile
        T = tokens.shape[1]
        qpos = records.query_positions(T, mode, tokens.device)
        dtype = keys.dtype if keys is not None else torch.float32
        rec = records.recency(T, mode, dtype, tokens.device)
        addr = hashing.addresses(tokens, mcfg.context_order, mcfg.num_buckets,
                                 int32_wraparound=prof.hash_int32_wraparound)
        cand: Candidates | None = None
        topk_dense = band = None
        if mcfg.route in ("context", "hybrid"):
            if mcfg.candidate_policy == "topk_score":
                select = SelectionInputs(query.detach(), keys.detach(), rec, float(self.memory.recency_scale.detach()))
                cand, topk_dense = routing.route_context_topk_score(
                    addr, qpos, mcfg.top_k, select, strategy=self.topk_strategy, sparse_window=self.sparse_window,
                    query_layout=mode)
            else:
                banded = mode == "ar" and mcfg.route == "context" and mcfg.candidate_policy == "recent"
                layout = routing.bucket_layout(addr) if banded else None
                cand = routing.route_context(addr, qpos, mcfg.top_k, mcfg.candidate_policy, query_layout=mode,
                                             layout=layout)
                band = ScoreBand(layout) if banded else None
        if mcfg.route in ("semantic", "hybrid"):
            probs = router_probs.detach()  # ranking is not differentiated; the route term of the score is
            if mcfg.semantic_index == "dense":
                # ρ as a host number: only this route and topk_score rank by it (a device sync, and a
                # graph break under torch.compile, that the other routes do without).
                sem = routing.route_semantic_dense(probs, rec, float(self.memory.recency_scale.detach()), qpos,
                                                   mcfg.top_k,
                                                   target_leak=prof.semantic_ar_target_leak and mode == "ar")
            else:
                sem_buckets = routing.semantic_buckets(probs)
                layout = routing.bucket_layout(sem_buckets) if mode == "ar" and mcfg.route == "semantic" else None
                sem = routing.route_semantic_bucketed(sem_buckets, qpos, mcfg.top_k, query_layout=mode, layout=layout)
                band = ScoreBand(layout) if layout is not None else None
            cand = sem if cand is None else routing.combine_hybrid(cand, sem, dedup=prof.hybrid_dedup)
        return addr, cand, topk_dense, band

    def _read(
        self, tokens: torch.Tensor, addr: torch.Tensor, cand: Candidates, topk_dense: torch.Tensor | None,
        query: torch.Tensor, keys: torch.Tensor, rec: torch.Tensor, router_probs: torch.Tensor | None,
        query_router_probs: torch.Tensor | None, h_q: torch.Tensor, mode: str, need_p_cache: bool,
        slots: Candidates | None = None, trace_router_probs: torch.Tensor | None = None,
        band: ScoreBand | None = None,
    ) -> tuple[TorchMemoryTrace, torch.Tensor]:
        """Scores, cache weights, p_cache and gate of the selected candidates ``cand`` (window positions).

        ``keys`` / ``rec`` / ``router_probs`` are indexed by ``slots`` (default ``cand``): the window's own
        arrays, or those of a receptive-field sub-sequence whose positions ``slots`` names. ``band``: see
        :meth:`select_candidates` (only with the window's own arrays)."""
        mcfg, prof = self.memory_config, self.profile
        if band is not None and slots is not None:
            raise ValueError("a band scores the window's own slots; receptive-field slots have none")
        slots = cand if slots is None else slots
        scores = mixture.candidate_scores(query, keys, rec, self.memory.recency_scale, slots, router_probs,
                                          query_router_probs, mcfg.semantic_score_scale, band=band)
        alpha = mixture.cache_weights(scores, cand.valid)
        values = routing.gather_records(records.successor_values(tokens), cand)
        p_cache = None
        if need_p_cache:
            p_cache = mixture.cache_distribution(alpha, values, cand.valid, self.model_config.vocab_size)
        any_valid, per_term = cand.valid.any(-1), mixture_rule(prof, mode).gate_per_term
        if self.model_config.variant == "pcaf_no_gate":
            raw = torch.full(h_q.shape[:2], mcfg.fixed_gate, dtype=h_q.dtype, device=h_q.device)
            gate = mixture.mask_gate(raw, any_valid, clip_when_empty=prof.gate_clip_when_empty, per_term=per_term)
        else:
            gate = self.gate.masked(h_q, any_valid, clip_when_empty=prof.gate_clip_when_empty, per_term=per_term)
        traced = router_probs if trace_router_probs is None else trace_router_probs
        return TorchMemoryTrace(addr, cand, scores, alpha, gate, p_cache, traced, topk_dense), values

    # ------------------------------------------------------------------ next-token receptive fields

    @property
    def receptive_field(self) -> int:
        """R of :func:`pcaf_core.reference.conv_stack`."""
        return self.model_config.n_layers * (self.model_config.kernel_size - 1) + 1

    def states_at(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, P, d]`` at ``positions`` ``[B, P]`` (in ``[0, T)``) of windows ``tokens``
        ``[B, T]``, from each position's receptive field only (:func:`pcaf_core.reference.conv_stack`)."""
        B, P = positions.shape
        R = self.receptive_field
        idx = positions[..., None] + torch.arange(1 - R, 1, device=tokens.device)  # [B, P, R]
        fields = batch_gather(tokens, idx.clamp(min=0)).reshape(B * P, R)
        return self._field_states(fields, (idx >= 0).reshape(B * P, R)).reshape(B, P, -1)

    def _field_states(self, fields: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The last position's final state ``[N, d]`` of each receptive field ``fields`` ``[N, R]`` (tokens;
        ``valid`` ``[N, R]`` bool, False before the window's start)."""
        x = self.embed(fields)
        for block, rows in zip(self.blocks, nt_conv_rows(self.model_config), strict=True):
            x = block(x, valid, rows)  # each block's MLP on the rows the blocks above read
            valid = layer_rows(valid, rows)
        return x[:, 0]

    def bucket_keys(self, tokens: torch.Tensor, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection inputs of the context route's ``topk_score`` in a next-token window, from the receptive
        fields of the query's bucket only: query ``[B, 1, d]`` and keys ``[B, T, d]``, each key the full forward's
        at the positions whose address is the query's (the records the route can rank) and zero elsewhere (never
        read: the route scores its query's bucket alone).

        A window holds T positions but a query's bucket a few dozen records (26 on average at T=1,024 and 55 at
        T=2,048 on WikiText-2, V=8,000, n=1), each computed on its R-row receptive field with L + (k-1)·L(L-1)/2
        MLP rows (6 for 2 blocks of k = 5) against a full forward's L a position: about a twelfth of the full
        forward's MLP rows at either T. Run without gradients."""
        B, T = tokens.shape
        mcfg, prof = self.memory_config, self.profile
        addr = hashing.addresses(tokens, mcfg.context_order, mcfg.num_buckets,
                                 int32_wraparound=prof.hash_int32_wraparound)
        member = addr == addr[:, qpos]  # [B, T], the query's own position included
        b, pos = member.nonzero(as_tuple=True)  # [N] each, N = the members of every window's bucket
        R = self.receptive_field
        idx = pos[:, None] + torch.arange(1 - R, 1, device=tokens.device)  # [N, R]
        h = self._field_states(tokens[b[:, None], idx.clamp(min=0)], idx >= 0)  # [N, d]
        member_keys = l2_normalize(self.memory.key(h), prof.l2norm)
        keys = member_keys.new_zeros((B, T, member_keys.shape[-1]))
        keys[b, pos] = member_keys
        query = l2_normalize(self.memory.query(h[pos == qpos]), prof.l2norm)  # [B, d]: one query a window
        return query[:, None], keys

    def nt_receptive_read(
        self, tokens: torch.Tensor, *, need_p_cache: bool = True
    ) -> tuple[torch.Tensor, tuple[TorchMemoryTrace, torch.Tensor] | None]:
        """The next-token forward's hidden states and memory read from receptive fields only
        (:func:`pcaf_core.reference.conv_stack`).

        Returns ``[B, 1 + C, d]`` states (the query first, then the candidate slots; C = 0 without a cache)
        and the (trace, slot values) of :meth:`memory_read` (None without a cache).
        """
        mcfg, prof = self.memory_config, self.profile
        B, T = tokens.shape
        qpos = records.query_positions(T, "nt", tokens.device)
        if not self.uses_cache:
            return self.states_at(tokens, qpos.expand(B, 1)), None
        semantic = mcfg.route in ("semantic", "hybrid")
        ranks_by_states = semantic or (mcfg.route in ("context", "hybrid") and mcfg.candidate_policy == "topk_score")
        query_full = keys_full = router_full = None
        if ranks_by_states and not semantic:
            with torch.no_grad():  # topk_score on the context route ranks its query's bucket alone
                query_full, keys_full = self.bucket_keys(tokens, qpos)
        elif ranks_by_states:
            with torch.no_grad():  # every position's state sets its semantic bucket: a full forward
                h_full = self.hidden_states(tokens)
                keys_full = l2_normalize(self.memory.key(h_full), prof.l2norm)
                query_full = l2_normalize(self.memory.query(records.query_rows(h_full, "nt")), prof.l2norm)
                router_full = self.memory.router_probs(h_full, mcfg.semantic_temperature)
        addr, cand, topk_dense, _ = self.select_candidates(tokens, "nt", query_full, keys_full, router_full)
        C = cand.index.shape[-1]
        positions = torch.cat([qpos.expand(B, 1), cand.index[:, 0].clamp(min=0)], dim=1)  # [B, 1 + C]
        h = self.states_at(tokens, positions)
        keys = l2_normalize(self.memory.key(h), prof.l2norm)  # [B, 1 + C, d]
        query = l2_normalize(self.memory.query(h[:, :1]), prof.l2norm)
        rec = records.recency(T, "nt", h.dtype, h.device)[positions]  # [B, 1 + C]
        slot = torch.arange(1, C + 1, device=tokens.device)
        slots = Candidates(torch.where(cand.valid, slot, -1), cand.valid)  # slot c is sub-position 1 + c
        router = self.memory.router_probs(h, mcfg.semantic_temperature) if semantic else None
        read = self._read(tokens, addr, cand, topk_dense, query, keys, rec, router,
                          None if router is None else router[:, :1], h[:, :1], "nt", need_p_cache, slots=slots,
                          trace_router_probs=router_full)
        return h, read


class TransformerLM(CanonicalLM):
    """Transformer baselines: ``transformer_dense`` / ``_local`` / ``_global_local`` and ``linear_attention``
    (positions: :func:`pcaf_core.reference.hidden_states`)."""

    def __init__(self, model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig) -> None:
        super().__init__(model, memory, profile)
        if model.variant not in TRANSFORMER_VARIANTS:
            raise ValueError(f"TransformerLM builds {list(TRANSFORMER_VARIANTS)}, not {model.variant!r}")
        d, h, V, p = model.d_model, model.d_hidden, model.vocab_size, profile.dropout
        self.embed = nn.Embedding(V, d)
        if has_positional_table(model, profile):
            self.pos: nn.Module = PositionalTable(model.max_seq_len, d, profile.positional_scale)
        else:
            self.pos = FixedPositions(d, profile.positional, profile.positional_scale)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, h, model.n_heads, model.variant, model.window, model.n_global, model.linear_chunk,
                             profile.gelu, p, model.attention_impl)
            for _ in range(model.n_layers))
        self.head = Head(d, h, V, profile.gelu, p)
        # Next-token forwards of windowed attention from the sub-window they read (nt_receptive_read); the
        # backends turn it on.
        self.nt_receptive_field = False

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._blocks(self.embed(tokens), self._positions(tokens.shape[1], None))

    def _positions(self, seq_len: int, crop: tuple[int, int] | None) -> torch.Tensor:
        """Positional encodings ``[T, d]`` of a window, or ``[g + R, d]`` of its :func:`nt_attention_crop`."""
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        pe = self.pos(seq_len) if isinstance(self.pos, PositionalTable) else self.pos(seq_len, dtype, device)
        if crop is None:
            return pe
        g, start = crop
        return torch.cat([pe[:g], pe[start:]])

    def _blocks(self, x: torch.Tensor, pe: torch.Tensor,
                rows: list[tuple[int, int] | None] | None = None) -> torch.Tensor:
        """The blocks over embeddings plus positions; ``rows``: block i keeps ``rows[i]`` of its input
        (:func:`pcaf_core.reference.nt_attention_rows`)."""
        x = x + pe
        for i, block in enumerate(self.blocks):
            x = block(x, None if rows is None else rows[i])
        return x

    def nt_receptive_read(self, tokens: torch.Tensor, *, need_p_cache: bool = True) -> tuple[torch.Tensor, None]:
        """The next-token forward's final state ``[B, 1, d]`` from the sub-window of
        :func:`pcaf_core.reference.nt_attention_crop` (the whole window where it has none), each layer computing
        the rows of :func:`pcaf_core.reference.nt_attention_rows` only; no memory read."""
        T = tokens.shape[1]
        crop = nt_attention_crop(self.model_config, T)
        rows = nt_attention_rows(self.model_config, T)
        if rows is None:
            return self.hidden_states(tokens)[:, -1:], None
        sub = tokens if crop is None else torch.cat([tokens[:, :crop[0]], tokens[:, crop[1]:]], dim=1)
        return self._blocks(self.embed(sub), self._positions(T, crop), rows), None


def _torch_default_fixups(module: CanonicalLM) -> None:
    """Library defaults of the reference torch modules where ours differ from plain ``nn.Linear``:
    ``nn.MultiheadAttention`` initialises its fused in-projection Xavier-uniform with zero biases and
    zeroes its out-projection bias."""
    for m in module.modules():
        if isinstance(m, TransformerBlock):
            nn.init.xavier_uniform_(m.attn.qkv.weight)
            nn.init.zeros_(m.attn.qkv.bias)
            nn.init.zeros_(m.attn.out.bias)


def build_model(
    model: ModelConfig,
    memory: MemoryConfig,
    profile: ProfileConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    head_chunks: tuple[int, int] | None = None,
) -> PCAFModel | TransformerLM:
    """Build and initialise the model of ``model.variant``.

    Initialisation follows ``profile.init``: ``jax_normal`` draws the canonical scheme of
    :func:`pcaf_core.params.init_params` from a torch generator seeded with ``seed``; ``torch_default``
    keeps the library defaults (drawn under ``torch.manual_seed(seed)`` without touching the caller's
    global RNG state). Either way ρ starts at 1 and a trainable positional table at the sinusoids.
    ``head_chunks``: the training loss reads the head tile by tile (:attr:`backends.torch.layers.Head.chunks`).
    """
    cls = TransformerLM if model.variant in TRANSFORMER_VARIANTS else PCAFModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = cls(model, memory, profile)
        if profile.init == "torch_default":
            _torch_default_fixups(net)
    # Under ``torch.device("meta")`` (shape-only builds, e.g. parameter counting) there are no values to set.
    if profile.init == "jax_normal" and not any(p.is_meta for p in net.parameters()):
        load_canonical(net, init_params(model, memory, profile, seed=seed))
    net.head.chunks = head_chunks
    return net.to(device=device, dtype=dtype)
