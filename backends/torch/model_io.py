"""A torch model's outputs (mirrors :mod:`backends.jax.model_io`): :class:`TorchForwardOutput` and
:class:`TorchMemoryTrace`, whose fields mirror :class:`pcaf_core.reference.ForwardOutput`. The input checks
are :meth:`backends.torch.models.CanonicalLM.check_inputs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.torch.routing import Candidates


@dataclass
class TorchMemoryTrace:
    """Intermediates of the associative memory path (Q queries, C slots).

    addresses: ``[B, T]`` int64 bucket of every position; cand: the selected :class:`Candidates`;
    scores / cache_weights: ``[B, Q, C]``; gate: ``[B, Q]`` masked (and clipped) λ;
    p_cache: ``[B, Q, V]`` or None when full distributions were not requested;
    router_probs: ``[B, T, S]`` or None (context route);
    topk_dense: ``[B, Q]`` bool, which queries the ``topk_score`` context route scored densely
    (None for the other policies and routes).
    """

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
    """Model outputs at the Q query positions (Q = 1 in NT mode, T in AR mode).

    hidden: ``[B, T, d]`` final states (next-token with ``nt_receptive_field``: ``[B, 1 + C, d]``, the
        query's state and its C candidate slots' states, :meth:`PCAFModel.nt_receptive_read`);
    param_log_probs: ``[B, Q, V]`` parametric head; None when neither log-probs nor predictions were
        requested (a training step reads the head at the targets only);
    log_probs: ``[B, Q, V]`` the predictive distribution in log space (unnormalised under the NT floor),
        None when neither requested nor needed for the predictions;
    target_log_prob: ``[B, Q]`` log p(target) as the loss uses it (None without targets);
    prediction: ``[B, Q]`` int64 argmax under the profile's accuracy definition (None when not requested);
    memory: the memory trace (None without a cache);
    loss: mean NLL, a 0-d tensor with grad (None without targets).
    """

    hidden: torch.Tensor
    param_log_probs: torch.Tensor | None
    log_probs: torch.Tensor | None
    target_log_prob: torch.Tensor | None
    prediction: torch.Tensor | None
    memory: TorchMemoryTrace | None
    loss: torch.Tensor | None
