"""Streaming decode in torch (mirrors :mod:`pcaf_core.streaming`): every model one token at a time with a
state of bounded size, equal to the full AR forward at every step.

:class:`TorchStream` has ``init``, ``step`` (one token of every sequence), ``feed`` (a loop of steps) and
``prefill`` (a fresh state from a whole prompt in one parallel pass, equal to feeding it token by token).
The state's buffers (:mod:`backends.torch.stream_buffers`): a :class:`BucketStore` per route (per bucket
a ring of the K most recent, or the first K, records over a pool of at most ``min(t, buckets·K)``
records, O(1) per append) and a :class:`KVCache` per attention layer (windowed for local attention).

The modules' own layers compute every step (same weights, same numerics as their full forward), so a
stream runs on any device and dtype the model does. Streaming is inference only: ``torch.no_grad``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from backends.torch import hashing, mixture
from backends.torch.layers import elu_plus_one, gelu, l2_normalize
from backends.torch.models import CanonicalLM, PCAFModel, TransformerLM
from backends.torch.routing import Candidates, combine_hybrid
from backends.torch.stream_buffers import BucketStore, KVCache
from pcaf_core.config import TRANSFORMER_VARIANTS
from pcaf_core.params import has_positional_table, sinusoidal_rows
from pcaf_core.streaming import NotStreamableError, StreamLimitError, check_streamable, recency_denominator

__all__ = ["BucketStore", "KVCache", "NotStreamableError", "StepOutput", "StreamLimitError", "TorchStream",
           "TorchStreamState"]


class StepOutput(NamedTuple):
    """One step's prediction of the next token, per sequence (mirrors :class:`pcaf_core.streaming.StepOutput`).

    log_probs / param_log_probs: ``[B, V]``; cand_index: ``[B, C]`` int64 record positions (-1 empty);
    cand_valid: ``[B, C]`` bool; gate: ``[B]`` (the last three None without a cache).
    """

    log_probs: torch.Tensor
    param_log_probs: torch.Tensor
    cand_index: torch.Tensor | None
    cand_valid: torch.Tensor | None
    gate: torch.Tensor | None


class StreamQuery(NamedTuple):
    """What position t asks the memory: bucket address ``[B]``, semantic bucket ``[B]``, unit query
    ``[B, d]``, router probabilities ``[B, S]`` or None."""

    address: torch.Tensor
    sem_bucket: torch.Tensor
    query: torch.Tensor
    probs: torch.Tensor | None


class MemoryRead(NamedTuple):
    """One query's read of the memory: candidates ``[B, C]``, cache weights α ``[B, C]``, slot values
    ``[B, C]`` and the masked gate λ ``[B]``."""

    cand: Candidates
    weights: torch.Tensor
    values: torch.Tensor
    gate: torch.Tensor


class PendingRecord(NamedTuple):
    """The record of the previous position, whose value is the next token: address ``[B]``, semantic
    bucket ``[B]``, unit key ``[B, d]``, router probabilities ``[B, S]`` or None."""

    address: torch.Tensor
    sem_bucket: torch.Tensor
    key: torch.Tensor
    probs: torch.Tensor | None


# --------------------------------------------------------------------------------------------- the stream


def insert_record(state: TorchStreamState, record: PendingRecord, pos: int, value: torch.Tensor) -> None:
    """Offer a completed record (position ``pos``, value ``[B]``) to the state's context and semantic stores."""
    if state.context is not None:
        state.context.insert(record.address, record.key, pos, value, record.probs)
    if state.semantic is not None:
        state.semantic.insert(record.sem_bucket, record.key, pos, value, record.probs)



@dataclass
class TorchStreamState:
    """Everything a torch stream carries between steps (mirrors :class:`pcaf_core.streaming.StreamState`).

    t: tokens fed so far; batch: sequences; conv: per conv block ``[B, k-1, d]`` LayerNormed inputs,
    oldest first; last_tokens: ``[B, n]``; pending: the previous position's record (None at t = 0);
    context / semantic: the bucket stores; kv: per attention layer a :class:`KVCache`; linear: per
    linear-attention layer ``(Σφ(k)vᵀ [B, H, hd, hd], Σφ(k) [B, H, hd])``.
    """

    t: int
    batch: int
    conv: list[torch.Tensor] = field(default_factory=list)
    last_tokens: torch.Tensor | None = None
    pending: PendingRecord | None = None
    context: BucketStore | None = None
    semantic: BucketStore | None = None
    kv: list[KVCache] = field(default_factory=list)
    linear: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def used_nbytes(self) -> int:
        """Bytes the state needs for what it holds (growing buffers' spare room excluded)."""
        total = sum(x.numel() * x.element_size() for x in self.conv)
        total += sum(s.used_nbytes() for s in (self.context, self.semantic) if s is not None)
        total += sum(c.used_nbytes() for c in self.kv)
        total += sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.linear)
        return total

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (buffers included at their allocated size)."""
        total = sum(x.numel() * x.element_size() for x in self.conv)
        total += sum(s.nbytes() for s in (self.context, self.semantic) if s is not None)
        total += sum(c.nbytes() for c in self.kv)
        total += sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.linear)
        return total


class TorchStream:
    """The streaming form of a torch model (mirrors :class:`pcaf_core.streaming.Stream`).

    Args:
        model: a :class:`~backends.torch.models.PCAFModel` or :class:`~backends.torch.models.TransformerLM`.
        window: the training window T (recency unit 1/D, :func:`pcaf_core.streaming.recency_denominator`);
            default ``model.model_config.max_seq_len`` (the configs set it to ``train.seq_len``).
        mode: the training mode whose recency convention the stream continues.
        horizon: records of the last ``horizon`` positions only (``recent`` policy); None = all.
    """

    def __init__(self, model: CanonicalLM, *, window: int | None = None, mode: str = "ar",
                 horizon: int | None = None) -> None:
        self.net, self.cfg, self.mem, self.prof = model, model.model_config, model.memory_config, model.profile
        check_streamable(self.cfg, self.mem, horizon=horizon)
        self.window = window if window is not None else self.cfg.max_seq_len
        self.mode, self.horizon = mode, horizon
        self.denominator = recency_denominator(self.window, mode)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device

    @property
    def uses_cache(self) -> bool:
        return self.net.uses_cache

    # ----------------------------------------------------------------------------- state

    def init(self, batch: int, *, capacity: int = 0) -> TorchStreamState:
        """The state before the first token of ``batch`` sequences; ``capacity`` reserves room for that
        many tokens (the growing buffers double past it)."""
        cfg, dev, dt = self.cfg, self.device, self.dtype
        state = TorchStreamState(t=0, batch=batch)
        if cfg.variant in TRANSFORMER_VARIANTS:
            H, hd = cfg.n_heads, cfg.head_dim
            for _ in range(cfg.n_layers):
                if cfg.variant == "linear_attention":
                    state.linear.append((torch.zeros((batch, H, hd, hd), dtype=dt, device=dev),
                                         torch.zeros((batch, H, hd), dtype=dt, device=dev)))
                    continue
                ring = cfg.variant != "transformer_dense"
                n = cfg.window if ring else max(capacity, 16)
                cache = KVCache(torch.zeros((batch, H, n, hd), dtype=dt, device=dev),
                                torch.zeros((batch, H, n, hd), dtype=dt, device=dev), [-1] * n, ring)
                if cfg.variant == "transformer_global_local" and cfg.n_global:
                    cache.prefix_keys = torch.zeros((batch, H, cfg.n_global, hd), dtype=dt, device=dev)
                    cache.prefix_values = torch.zeros_like(cache.prefix_keys)
                state.kv.append(cache)
            return state
        state.conv = [torch.zeros((batch, cfg.kernel_size - 1, cfg.d_model), dtype=dt, device=dev)
                      for _ in range(cfg.n_layers)]
        if self.uses_cache:
            mem, d = self.mem, cfg.d_model
            state.last_tokens = torch.zeros((batch, mem.context_order), dtype=torch.int64, device=dev)
            n_probs = mem.semantic_buckets if mem.route in ("semantic", "hybrid") else None
            if mem.route in ("context", "hybrid"):
                state.context = BucketStore.empty(batch, mem.num_buckets, mem.top_k, d, n_probs,
                                                  mem.candidate_policy, capacity, dt, dev)
            if n_probs is not None:
                state.semantic = BucketStore.empty(batch, mem.semantic_buckets, mem.top_k, d, n_probs, "recent",
                                                   capacity, dt, dev)
        return state

    # ----------------------------------------------------------------------------- stepping

    @torch.no_grad()
    def step(self, state: TorchStreamState, tokens: torch.Tensor, *, min_pos: torch.Tensor | None = None
             ) -> tuple[TorchStreamState, StepOutput]:
        """Feed token ``x_t`` of every sequence (``tokens [B]`` int) and predict ``x_{t+1}``.

        ``min_pos`` ``[B]`` (optional) hides records before it, on top of the stream's horizon.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.device).reshape(-1)
        if tokens.shape[0] != state.batch:
            raise ValueError(f"step got {tokens.shape[0]} tokens for a state of {state.batch} sequences")
        h = self.backbone_step(state, tokens)
        param_lp = self.net.head(h)
        if self.uses_cache:
            out = self.memory_step(state, tokens, h, param_lp, min_pos)
        else:
            out = StepOutput(param_lp, param_lp, None, None, None)
        state.t += 1
        return state, out

    def feed(self, state: TorchStreamState, tokens: torch.Tensor) -> tuple[TorchStreamState, StepOutput]:
        """:meth:`step` over ``tokens [B, n]``; outputs stacked on a new axis 1 (``[B, n, ...]``)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.device)
        outs = []
        for i in range(tokens.shape[1]):
            state, out = self.step(state, tokens[:, i])
            outs.append(out)
        return state, StepOutput(*(None if f[0] is None else torch.stack(f, dim=1) for f in zip(*outs, strict=True)))

    def backbone_step(self, state: TorchStreamState, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden state ``[B, d]`` of position ``state.t`` (updates the backbone's part of the state)."""
        if self.cfg.variant in TRANSFORMER_VARIANTS:
            return self._transformer_hidden(state, tokens)
        return self._conv_hidden(state, tokens)

    # ----------------------------------------------------------------------------- backbones

    def _conv_hidden(self, state: TorchStreamState, tokens: torch.Tensor) -> torch.Tensor:
        """Each block's conv reads its ring of k-1 LayerNormed inputs and the current one. ``nn.Conv1d``
        tap j multiplies lag ``k-1-j``, i.e. ring entry j (oldest first)."""
        net: PCAFModel = self.net  # type: ignore[assignment]
        x = net.embed(tokens)
        for i, block in enumerate(net.blocks):
            y = block.norm(x)
            recent = torch.cat([state.conv[i], y[:, None]], dim=1)  # [B, k, d]
            conv = (recent * block.conv.weight[:, 0].T).sum(1) + block.conv.bias
            state.conv[i] = recent[:, 1:]
            x = x + block.mlp_out(gelu(block.mlp_in(conv), block.gelu_form))
        return x

    def _position_row(self, t: int) -> torch.Tensor:
        cfg, prof = self.cfg, self.prof
        if has_positional_table(cfg, prof):
            if t >= cfg.max_seq_len:
                raise StreamLimitError(
                    f"position {t} is past the trainable positional table's {cfg.max_seq_len} rows: a Transformer "
                    f"with positional=trainable_jax reads at most model.max_seq_len={cfg.max_seq_len} tokens")
            return self.net.pos.table[t]
        row = sinusoidal_rows([t], cfg.d_model, prof.positional)[0] * prof.positional_scale
        return torch.as_tensor(row, dtype=torch.float64).to(device=self.device, dtype=self.dtype)

    def _transformer_hidden(self, state: TorchStreamState, tokens: torch.Tensor) -> torch.Tensor:
        net: TransformerLM = self.net  # type: ignore[assignment]
        cfg, t = self.cfg, state.t
        B, d, H, hd = tokens.shape[0], cfg.d_model, cfg.n_heads, cfg.head_dim
        x = net.embed(tokens) + self._position_row(t)
        for i, block in enumerate(net.blocks):
            q, k, v = (y.reshape(B, H, hd) for y in block.attn.qkv(block.attn_norm(x)).split(d, dim=-1))
            if cfg.variant == "linear_attention":
                kv_sum, k_sum = state.linear[i]
                fq, fk = elu_plus_one(q), elu_plus_one(k)
                kv_sum = kv_sum + fk[..., :, None] * v[..., None, :]
                k_sum = k_sum + fk
                state.linear[i] = (kv_sum, k_sum)
                o = (fq[..., None] * kv_sum).sum(-2) / (fq * k_sum).sum(-1, keepdim=True).clamp(min=1e-6)
            else:
                cache = state.kv[i]
                cache.append(t, k, v)
                o = cache.attend(q, t, cfg.variant, cfg.window, cfg.n_global)
            x = x + block.attn.out(o.reshape(B, d))
            x = x + block.mlp_out(gelu(block.mlp_in(block.mlp_norm(x)), block.gelu_form))
        return x

    # ----------------------------------------------------------------------------- the memory

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Unit keys and queries ``[..., d]`` and router probabilities ``[..., S]`` (semantic routes)."""
        net, prof = self.net, self.prof
        keys = l2_normalize(net.memory.key(h), prof.l2norm)
        query = l2_normalize(net.memory.query(h), prof.l2norm)
        probs = None
        if self.mem.route in ("semantic", "hybrid"):
            probs = net.memory.router_probs(h, self.mem.semantic_temperature)
        return keys, query, probs

    def memory_step(self, state: TorchStreamState, tokens: torch.Tensor, h: torch.Tensor, param_lp: torch.Tensor,
                    min_pos: torch.Tensor | None = None) -> StepOutput:
        """:meth:`observe` position t, then :meth:`read_and_mix` its query."""
        query, _ = self.observe(state, tokens, h)
        return self.read_and_mix(state, state.t, query, h, param_lp, min_pos)

    def observe(self, state: TorchStreamState, tokens: torch.Tensor, h: torch.Tensor
                ) -> tuple[StreamQuery, PendingRecord | None]:
        """Position t's address, semantic bucket, query and router probabilities; the previous position's
        record, completed by its value ``x_t`` (``tokens``), goes into the state's stores and is returned (None
        at t = 0) so that other stores can take it too."""
        t, mem = state.t, self.mem
        state.last_tokens = torch.cat([state.last_tokens[:, 1:], tokens[:, None]], dim=1)
        address = hashing.addresses(state.last_tokens, mem.context_order, mem.num_buckets,
                                    int32_wraparound=self.prof.hash_int32_wraparound)[:, -1]
        keys, query, probs = self.project(h)
        sem_bucket = torch.argmax(probs, dim=-1) if probs is not None else torch.zeros_like(address)
        prev = state.pending
        if prev is not None:
            insert_record(state, prev, t - 1, tokens)
        state.pending = PendingRecord(address, sem_bucket, keys, probs)
        return StreamQuery(address, sem_bucket, query, probs), prev

    def raw_gate(self, h: torch.Tensor) -> torch.Tensor:
        """The gate before masking, ``[B]``: the learned gate of ``h``, or the constant of ``pcaf_no_gate``."""
        if self.cfg.variant == "pcaf_no_gate":
            return torch.full_like(h[:, 0], self.mem.fixed_gate)
        return self.net.gate(h)

    def read_memory(self, state: TorchStreamState, t: int, query: StreamQuery, raw_gate: torch.Tensor,
                    min_pos: torch.Tensor | None = None) -> MemoryRead:
        """The query of position t against the state's stores: candidates, cache weights, values, gate.

        ``min_pos [B]`` hides records before it (with the stream's horizon); the ``stream`` evaluation
        protocol reads once per memory condition on one backbone step.
        """
        mem, prof = self.mem, self.prof
        if self.horizon is not None:
            floor = torch.full_like(query.address, t - self.horizon)
            min_pos = floor if min_pos is None else torch.maximum(min_pos, floor)
        parts = []
        if state.context is not None:
            parts.append(state.context.read(query.address, min_pos))
        if state.semantic is not None:
            parts.append(state.semantic.read(query.sem_bucket, min_pos))
        if len(parts) == 2:
            (c1, k1, v1, p1), (c2, k2, v2, p2) = parts
            both = combine_hybrid(Candidates(c1.index[:, None], c1.valid[:, None]),
                                  Candidates(c2.index[:, None], c2.valid[:, None]), dedup=prof.hybrid_dedup)
            cand = Candidates(both.index[:, 0], both.valid[:, 0])
            slot_keys, values, slot_probs = torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), torch.cat([p1, p2], 1)
        else:
            cand, slot_keys, values, slot_probs = parts[0]
        q = query.query
        # rho·(s - t)/D: the spec's rho·s/D shifted by a per-query constant (same softmax), exact in float32.
        rel = (torch.where(cand.valid, cand.index, t) - t).to(q.dtype)
        scores = (slot_keys @ q[:, :, None])[..., 0] / math.sqrt(slot_keys.shape[-1]) \
            + self.net.memory.recency_scale * rel / self.denominator
        if query.probs is not None:
            overlap = (slot_probs @ query.probs[:, :, None])[..., 0]
            scores = scores + mem.semantic_score_scale * torch.log(torch.clamp(overlap, min=1e-6))
        alpha = mixture.cache_weights(scores[:, None], cand.valid[:, None])[:, 0]
        gate = mixture.mask_gate(raw_gate, cand.valid.any(-1), clip_when_empty=prof.gate_clip_when_empty)
        return MemoryRead(cand, alpha, values, gate)

    def read_and_mix(self, state: TorchStreamState, t: int, query: StreamQuery, h: torch.Tensor,
                     param_lp: torch.Tensor, min_pos: torch.Tensor | None = None) -> StepOutput:
        """:meth:`read_memory`, then the mixture over the vocabulary ``log[(1-λ)·p_param + λ·p_cache]``."""
        r = self.read_memory(state, t, query, self.raw_gate(h), min_pos)
        p_cache = mixture.cache_distribution(r.weights[:, None], r.values[:, None], r.cand.valid[:, None],
                                             self.cfg.vocab_size)[:, 0]
        log_probs = mixture.mixture_log_probs(param_lp, p_cache, r.gate, nt_floor=False)
        return StepOutput(log_probs, param_lp, r.cand.index, r.cand.valid, r.gate)

    @staticmethod
    def target_log_prob(read: MemoryRead, param_lp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``log p(target)`` ``[B]`` of the mixture (the exact form, as ``read_and_mix``'s entry) without the
        ``[B, V]`` distribution."""
        lp_y = param_lp.gather(1, target[:, None])
        pc_y = mixture.target_cache_prob(read.weights[:, None], read.values[:, None], read.cand.valid[:, None],
                                         target[:, None])
        return mixture.target_log_prob(lp_y, pc_y, read.gate[:, None], nt_floor=False, ar_floor=False,
                                       mode="ar")[:, 0]

    # ----------------------------------------------------------------------------- prefill

    @torch.no_grad()
    def prefill(self, state: TorchStreamState, tokens: torch.Tensor) -> tuple[TorchStreamState, StepOutput]:
        """Feed a fresh state a whole prompt ``tokens [B, n]`` in one parallel pass (the models' full
        forward pieces); the state and the returned prediction of position n-1 equal ``feed``'s."""
        if state.t:
            raise ValueError("prefill needs a fresh state (t = 0); use step/feed to continue a stream")
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.device)
        B, n = tokens.shape
        if n == 0 or B != state.batch:
            raise ValueError(f"prefill needs [{state.batch}, n >= 1] tokens, got {tuple(tokens.shape)}")
        if self.cfg.variant in TRANSFORMER_VARIANTS:
            h = self._transformer_prefill(state, tokens)
        else:
            h = self._conv_prefill(state, tokens)
        state.t = n
        h_last = h[:, -1]
        param_lp = self.net.head(h_last)
        if not self.uses_cache:
            return state, StepOutput(param_lp, param_lp, None, None, None)
        mem = self.mem
        padded = torch.cat([torch.zeros((B, mem.context_order), dtype=torch.int64, device=self.device), tokens], 1)
        state.last_tokens = padded[:, -mem.context_order:]
        address = hashing.addresses(tokens, mem.context_order, mem.num_buckets,
                                    int32_wraparound=self.prof.hash_int32_wraparound)
        keys, query, probs = self.project(h)
        sem_bucket = torch.argmax(probs, dim=-1) if probs is not None else torch.zeros_like(address)
        rec_probs = None if probs is None else probs[:, :-1]
        if state.context is not None:
            state.context.bulk_load(address[:, :-1], keys[:, :-1], tokens[:, 1:], rec_probs)
        if state.semantic is not None:
            state.semantic.bulk_load(sem_bucket[:, :-1], keys[:, :-1], tokens[:, 1:], rec_probs)
        last_probs = None if probs is None else probs[:, -1]
        state.pending = PendingRecord(address[:, -1], sem_bucket[:, -1], keys[:, -1], last_probs)
        out = self.read_and_mix(state, n - 1, StreamQuery(address[:, -1], sem_bucket[:, -1], query[:, -1], last_probs),
                                h_last, param_lp)
        return state, out

    def _conv_prefill(self, state: TorchStreamState, tokens: torch.Tensor) -> torch.Tensor:
        net: PCAFModel = self.net  # type: ignore[assignment]
        k1 = self.cfg.kernel_size - 1
        x = net.embed(tokens)
        for i, block in enumerate(net.blocks):
            ring = torch.cat([state.conv[i], block.norm(x)], dim=1)
            state.conv[i] = ring[:, ring.shape[1] - k1:]
            x = block(x)
        return x

    def _transformer_prefill(self, state: TorchStreamState, tokens: torch.Tensor) -> torch.Tensor:
        net: TransformerLM = self.net  # type: ignore[assignment]
        cfg = self.cfg
        B, n = tokens.shape
        d, H, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
        table = has_positional_table(cfg, self.prof)
        if table and n > cfg.max_seq_len:
            self._position_row(n - 1)  # raises StreamLimitError
        x = net.embed(tokens)
        x = x + (net.pos(n) if table else net.pos(n, x.dtype, x.device))
        for i, block in enumerate(net.blocks):
            _, k, v = (y.reshape(B, n, H, hd).transpose(1, 2)
                       for y in block.attn.qkv(block.attn_norm(x)).split(d, dim=-1))
            if cfg.variant == "linear_attention":
                fk = elu_plus_one(k)
                state.linear[i] = (fk.transpose(-1, -2) @ v, fk.sum(2))
            elif state.kv[i].ring:
                cache = state.kv[i]
                first = set(range(min(n, cfg.n_global))) if cache.prefix_keys is not None else set()
                for s in sorted(first | set(range(max(0, n - cfg.window), n))):  # at most window + n_global
                    cache.append(s, k[:, :, s], v[:, :, s])
            else:
                cache = state.kv[i]
                cache.reserve(n)
                cache.keys[:, :, :n], cache.values[:, :, :n] = k, v
                cache.pos[:n] = range(n)
                cache.length = n
            x = block(x)
        return x
