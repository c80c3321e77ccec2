"""Analytic FLOPs of a training step, from the spec's shapes (what the benchmark's fraction of peak divides by).

Only matrix products and the depthwise convolution count (2 FLOPs per multiply-add); LayerNorm, GELU,
softmax, dropout, gathers and the optimiser do not, so a step's measured time always carries work these
formulas leave out. A training step is counted as 3x its forward (the backward of a product costs two
products: one for the input's gradient, one for the weight's).

Forward FLOPs per position, with d = ``d_model``, h = ``d_hidden``, V = ``vocab_size``, L = ``n_layers``,
k = ``kernel_size``, S = ``semantic_buckets``, C = candidate slots (K; 2K on the hybrid route):

- conv backbone (PCAF family, local conv), per position: ``L·(2kd + 4dh)``;
- Transformer backbone, per position: ``L·(8d² + 4dh)`` (fused qkv 6d², out 2d², MLP 4dh) plus attention
  ``L·4d·n`` with n the keys a query reads: (t+1) causal keys for dense attention, min(t+1, w) for local,
  summed over the window's queries (the masked-dense local attention of this suite computes all T keys;
  ``attention_keys="computed"`` counts those);
- head, per predicted position: ``2dh + 2hV``;
- PCAF cache (``pcaf``, ``pcaf_no_gate``): keys ``2d²`` per record, query ``2d²`` and scores ``2Cd`` per query,
  the gate ``d² + d`` per query (``pcaf`` only), the router ``2dS`` per position and the route term ``2CS``
  per query (semantic and hybrid routes).

Full AR predicts at every position: a window's forward is T backbone positions, T heads, T queries.
A next-token window predicts once. Two counts are defined for it:

- ``full_window``: the formulation the paper's code computes, the backbone over all T positions, T−1 records
  and one head;
- ``receptive_field``: what a receptive-field step executes (``PCAFModel.nt_receptive_read``): the backbone on 1 + C
  receptive fields of R = L·(k − 1) + 1 positions (C keys), each block's conv over its input rows and its MLP over
  the rows it keeps (:func:`pcaf_core.reference.nt_conv_rows`), one head; routes that rank by states (``topk_score``
  context, semantic, hybrid) add one forward (no backward) over the window of the backbone and of what ranks (the
  router ``2dS``, the key and query projections ``4d²``). That is the JAX backend's selection; torch's
  ``topk_score`` on the context route computes the keys of the query's bucket alone, from their receptive fields
  (:func:`pcaf_core.reference.conv_stack`), a count the data sets and this one bounds from above. Windowed attention
  computes the sub-window of :func:`pcaf_core.reference.nt_attention_crop` (the g global positions and the last R =
  L·(w − 1) + 1), each layer only the rows of :func:`pcaf_core.reference.nt_attention_rows`: the ``qkv`` projection
  ``6d²`` over the layer's input rows, the queries, the output projection ``2d²`` and the MLP over the rows it
  keeps; dense attention the full window below its top layer and the last row at the top, linear attention the full
  window.
"""

from __future__ import annotations

from pcaf_core.config import CACHE_VARIANTS, TRANSFORMER_VARIANTS, MemoryConfig, ModelConfig
from pcaf_core.reference import attention_mask, layer_rows, nt_attention_crop, nt_attention_rows, nt_conv_rows

NT_COUNTS = ("full_window", "receptive_field")


def _candidates(memory: MemoryConfig) -> int:
    return 2 * memory.top_k if memory.route == "hybrid" else memory.top_k


def _ranks_by_states(memory: MemoryConfig) -> bool:
    return memory.route in ("semantic", "hybrid") or memory.candidate_policy == "topk_score"


def conv_position_flops(model: ModelConfig) -> float:
    """Forward FLOPs of the conv backbone at one position: ``L·(2kd + 4dh)``."""
    d, h = model.d_model, model.d_hidden
    return model.n_layers * (2 * model.kernel_size * d + 4 * d * h)


def receptive_conv_flops(model: ModelConfig) -> float:
    """Forward FLOPs of the conv backbone on one position's R-token receptive field, each block's conv over its
    input rows and its MLP over the rows it keeps (:func:`pcaf_core.reference.nt_conv_rows`)."""
    d, h = model.d_model, model.d_hidden
    n, total = model.n_layers * (model.kernel_size - 1) + 1, 0.0
    for _, last in nt_conv_rows(model):
        total += 2 * model.kernel_size * d * n + 4 * d * h * last
        n = last
    return total


def head_flops(model: ModelConfig) -> float:
    """Forward FLOPs of the vocabulary head at one predicted position: ``2dh + 2hV``."""
    return 2 * model.d_model * model.d_hidden + 2 * model.d_hidden * model.vocab_size


def attention_key_count(model: ModelConfig, seq_len: int, attention_keys: str = "model") -> float:
    """Keys read by all T queries of a window, summed: causal (t+1), or min(t+1, w) for local attention
    (``attention_keys="computed"``: all T keys wherever the attention is a masked dense product)."""
    T = seq_len
    causal = T * (T + 1) / 2
    if model.variant == "transformer_dense" or model.variant == "linear_attention":
        return causal
    if attention_keys == "computed":
        return float(T * T)
    w = min(model.window, T)
    local = w * (w + 1) / 2 + (T - w) * w  # min(t+1, w) summed over t
    if model.variant == "transformer_global_local":
        g = min(model.n_global, T)
        local += sum(max(0, min(g, t + 1 - w)) for t in range(w, T)) if g else 0
    return local


def _attention_rows_flops(model: ModelConfig, seq_len: int, attention_keys: str) -> float:
    """The blocks of a next-token window of softmax attention, layer by layer over the rows of
    :func:`pcaf_core.reference.nt_attention_rows` (module docstring)."""
    d, h = model.d_model, model.d_hidden
    g, start = nt_attention_crop(model, seq_len) or (0, 0)
    n = g + seq_len - start
    total = 0.0
    for rows in nt_attention_rows(model, seq_len):
        kept = layer_rows(n, rows)
        m = len(kept)
        if attention_keys == "computed":
            keys = m * n
        else:
            keys = int(attention_mask(n, model.variant, model.window, model.n_global)[kept].sum())
        total += 6 * d * d * n + (2 * d * d + 4 * d * h) * m + 4 * d * keys
        n = m
    return total


def forward_flops(model: ModelConfig, memory: MemoryConfig, mode: str, seq_len: int, *,
                  nt_count: str = "full_window", attention_keys: str = "model") -> float:
    """Forward FLOPs of one window of ``seq_len`` tokens (module docstring). Returns FLOPs, not per token."""
    if nt_count not in NT_COUNTS:
        raise ValueError(f"nt_count {nt_count!r} is unknown: expected one of {list(NT_COUNTS)}")
    T, d = seq_len, model.d_model
    ar = mode == "ar"
    heads = T if ar else 1
    if model.variant in TRANSFORMER_VARIANTS:
        rows = None if ar or nt_count == "full_window" else nt_attention_rows(model, T)
        if rows is not None:
            return _attention_rows_flops(model, T, attention_keys) + heads * head_flops(model)
        per_pos = model.n_layers * (8 * d * d + 4 * d * model.d_hidden)
        attn = model.n_layers * 4 * d * attention_key_count(model, T, attention_keys)
        return T * per_pos + attn + heads * head_flops(model)
    C = _candidates(memory)
    cache = model.variant in CACHE_VARIANTS
    if ar or nt_count == "full_window":
        records, queries = (T if ar else T - 1), heads
        backbone = T * conv_position_flops(model)
    else:
        records, queries = (C if cache else 0), 1
        backbone = (1 + C if cache else 1) * receptive_conv_flops(model)
    total = backbone + heads * head_flops(model)
    if cache:
        semantic = memory.route in ("semantic", "hybrid")
        total += 2 * d * d * (records + queries) + 2 * C * d * queries
        if model.variant == "pcaf":
            total += (d * d + d) * queries
        if semantic:
            routed = T if ar else records + queries  # full AR: every position is both a record and a query
            total += 2 * d * memory.semantic_buckets * routed + 2 * C * memory.semantic_buckets * queries
    return float(total)


def train_step_flops(model: ModelConfig, memory: MemoryConfig, mode: str, seq_len: int, batch: int, *,
                     nt_count: str = "full_window", attention_keys: str = "model") -> float:
    """FLOPs of one training step (forward and backward, 3x the forward) of ``batch`` windows.

    With ``nt_count="receptive_field"`` a next-token step of a cache model that ranks by states also counts
    the selection pass: one forward of the backbone over the whole window, without backward."""
    fwd = forward_flops(model, memory, mode, seq_len, nt_count=nt_count, attention_keys=attention_keys)
    total = 3 * fwd
    if (mode == "nt" and nt_count == "receptive_field" and model.variant in CACHE_VARIANTS
            and _ranks_by_states(memory)):
        per_pos = conv_position_flops(model)
        if memory.route in ("semantic", "hybrid"):
            per_pos += 2 * model.d_model * memory.semantic_buckets
        if memory.route in ("context", "hybrid") and memory.candidate_policy == "topk_score":
            per_pos += 4 * model.d_model * model.d_model
        total += seq_len * per_pos
    return float(batch * total)
