"""A torch model's outputs (mirrors :mod:`backends.jax.model_io`): :class:`TorchForwardOutput` and
:class:`TorchMemoryTrace`, whose fields mirror :class:`pcaf_core.reference.ForwardOutput`. The input checks
are :meth:`backends.torch.models.CanonicalLM.check_inputs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.torch.routing import Candidates


@dataclass
class TorchMemoryTrace:
    """The fields of :class:`pcaf_core.reference.MemoryTrace` as tensors (``addresses`` int64), with ``p_cache``
    None when full distributions were not requested, plus ``topk_dense``: ``[B, Q]`` bool, which queries the
    ``topk_score`` context route scored densely (None for the other policies and routes)."""

    addresses: torch.Tensor
    cand: Candidates
    scores: torch.Tensor
    cache_weights: torch.Tensor
    gate: torch.Tensor
    p_cache: torch.Tensor | None
    router_probs: torch.Tensor | None
    topk_dense: torch.Tensor | None = None


@dataclass
class TorchForwardOutput:
    """The fields of :class:`pcaf_core.reference.ForwardOutput` as tensors, plus ``loss`` (mean NLL, a 0-d
    tensor with grad; None without targets). Differences: ``hidden`` is ``[B, 1 + C, d]`` for next-token with
    ``nt_receptive_field`` (the query's state and its C candidate slots', :meth:`PCAFModel.nt_receptive_read`; C = 0
    for the Transformers, :meth:`TransformerLM.nt_receptive_read`);
    ``param_log_probs``, ``log_probs`` and ``prediction`` are None when not requested (a training step reads
    the head at the targets only)."""

    hidden: torch.Tensor
    param_log_probs: torch.Tensor | None
    log_probs: torch.Tensor | None
    target_log_prob: torch.Tensor | None
    prediction: torch.Tensor | None
    memory: TorchMemoryTrace | None
    loss: torch.Tensor | None
