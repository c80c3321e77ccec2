"""Canonical parameter names and shapes, defined once for every variant.

Conventions (shared by both backends through safetensors):
* Linear weights are ``[in, out]`` with ``y = x @ W + b``.
* The causal depthwise conv weight is ``[k, d]`` indexed by lag: ``out_t = Σ_lag w[lag]·y_{t-lag} + b``.
* The fused attention projection ``attn.qkv.weight`` is ``[d, 3d]`` with columns ``[q | k | v]``, each
  split into heads of ``head_dim`` contiguous columns.
* ``memory.recency_scale`` (ρ) is a 0-d scalar.

Which parameters exist depends on the variant and on two profile switches
(``router_in_context_models``, ``local_conv_full_param_set``) and ``positional``; this is how the
paper's parameter counts arise (docs/REFERENCE_CODE.md §1.4).
"""

from __future__ import annotations

import math

import numpy as np

from pcaf_core.config import (
    CACHE_VARIANTS,
    PCAF_VARIANTS,
    TRANSFORMER_VARIANTS,
    MemoryConfig,
    ModelConfig,
    ProfileConfig,
)

Shapes = dict[str, tuple[int, ...]]


def _linear(name: str, n_in: int, n_out: int, bias: bool = True) -> Shapes:
    out: Shapes = {f"{name}.weight": (n_in, n_out)}
    if bias:
        out[f"{name}.bias"] = (n_out,)
    return out


def _norm(name: str, d: int) -> Shapes:
    return {f"{name}.weight": (d,), f"{name}.bias": (d,)}


def _head(model: ModelConfig) -> Shapes:
    d, h, V = model.d_model, model.d_hidden, model.vocab_size
    return {**_norm("head.norm", d), **_linear("head.hidden", d, h), **_linear("head.out", h, V)}


def has_memory_params(model: ModelConfig, profile: ProfileConfig) -> bool:
    """Whether W_q, W_k, the gate and ρ exist (used or not)."""
    if model.variant in PCAF_VARIANTS:
        return True
    return model.variant == "local_conv" and profile.local_conv_full_param_set


def has_router(model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig) -> bool:
    """Whether the semantic router exists: needed by semantic/hybrid routes, carried unused by the
    reference JAX code in every PCAF-family model."""
    if not has_memory_params(model, profile):
        return False
    uses = model.variant in CACHE_VARIANTS and memory.route in ("semantic", "hybrid")
    return uses or profile.router_in_context_models


def uses_cache(model: ModelConfig) -> bool:
    return model.variant in CACHE_VARIANTS


def has_positional_table(model: ModelConfig, profile: ProfileConfig) -> bool:
    return model.variant in TRANSFORMER_VARIANTS and profile.positional == "trainable_jax"


def param_shapes(model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig) -> Shapes:
    """Ordered canonical ``name -> shape`` of every parameter of the model."""
    d, h, V = model.d_model, model.d_hidden, model.vocab_size
    shapes: Shapes = {"embed.weight": (V, d)}
    if model.variant in TRANSFORMER_VARIANTS:
        if has_positional_table(model, profile):
            shapes["pos.table"] = (model.max_seq_len, d)
        for i in range(model.n_layers):
            p = f"blocks.{i}"
            shapes.update(_norm(f"{p}.attn_norm", d))
            shapes.update(_linear(f"{p}.attn.qkv", d, 3 * d))
            shapes.update(_linear(f"{p}.attn.out", d, d))
            shapes.update(_norm(f"{p}.mlp_norm", d))
            shapes.update(_linear(f"{p}.mlp_in", d, h))
            shapes.update(_linear(f"{p}.mlp_out", h, d))
        shapes.update(_head(model))
        return shapes
    for i in range(model.n_layers):
        p = f"blocks.{i}"
        shapes.update(_norm(f"{p}.norm", d))
        shapes[f"{p}.conv.weight"] = (model.kernel_size, d)
        shapes[f"{p}.conv.bias"] = (d,)
        shapes.update(_linear(f"{p}.mlp_in", d, h))
        shapes.update(_linear(f"{p}.mlp_out", h, d))
    shapes.update(_head(model))
    if has_memory_params(model, profile):
        shapes.update(_linear("memory.query", d, d, bias=False))
        shapes.update(_linear("memory.key", d, d, bias=False))
        if has_router(model, memory, profile):
            S = memory.semantic_buckets
            if profile.router == "linear_bias":
                shapes.update(_linear("memory.router", d, S, bias=True))
            else:
                shapes.update(_norm("memory.router_norm", d))
                shapes.update(_linear("memory.router", d, S, bias=False))
        shapes.update(_norm("gate.norm", d))
        shapes.update(_linear("gate.hidden", d, d // 2))
        shapes.update(_linear("gate.out", d // 2, 1))
        shapes["memory.recency_scale"] = ()
    return shapes


# The common recipe's exclusions from weight decay besides "fewer than 2 dims" (norm gains, biases, the
# 0-d ρ): the trainable positional table is 2-d and named explicitly.
NO_DECAY_NAMES = ("pos.table", "memory.recency_scale")


def decayed(name: str, shape: tuple[int, ...], decay_all: bool) -> bool:
    """Whether AdamW's weight decay applies to canonical parameter ``name`` of ``shape``.

    ``decay_all`` (``profile.weight_decay_all_params``, every reference profile) decays every parameter:
    embeddings, LayerNorm gains and biases, ρ and the positional table. Otherwise norms, biases, ρ and
    the positional table are left undecayed (the common recipe).
    """
    return decay_all or not (len(shape) < 2 or name in NO_DECAY_NAMES)


def count_params(model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig) -> int:
    """Number of parameters, from the canonical shapes alone (no allocation)."""
    return sum(math.prod(s) for s in param_shapes(model, memory, profile).values())


def sinusoidal_table(seq_len: int, d: int, form: str) -> np.ndarray:
    """``[T, d]`` float64 sinusoidal positions.

    ``trainable_jax``: ``half = ceil(d/2)``, ``freq_i = exp(-ln(1e4)·i/(half-1))``;
    ``fixed_torch``: ``freq_i = exp(-2i·ln(1e4)/d)``. Even columns sin, odd columns cos.
    """
    return sinusoidal_rows(np.arange(seq_len), d, form)


def sinusoidal_rows(positions: np.ndarray, d: int, form: str) -> np.ndarray:
    """Rows ``positions`` of :func:`sinusoidal_table` (any positions, e.g. the next one of a stream):
    ``[N, d]`` float64 from ``[N]`` integer positions."""
    pos = np.asarray(positions, dtype=np.float64).reshape(-1)[:, None]
    if form == "trainable_jax":
        half = math.ceil(d / 2)
        freq = np.exp(-math.log(1e4) * np.arange(half) / max(half - 1, 1))
    elif form == "fixed_torch":
        freq = np.exp(np.arange(0, d, 2) * (-math.log(1e4) / d))
    else:
        raise ValueError(f"positional form {form!r} is unknown")
    table = np.zeros((pos.shape[0], d))
    table[:, 0::2] = np.sin(pos * freq)[:, : len(range(0, d, 2))]
    table[:, 1::2] = np.cos(pos * freq)[:, : d // 2]
    return table


def init_params(
    model: ModelConfig, memory: MemoryConfig, profile: ProfileConfig, seed: int = 0, dtype: type = np.float64
) -> dict[str, np.ndarray]:
    """Canonical initialisation (the reference JAX scheme), as NumPy arrays.

    Embeddings N(0, 0.02²); Linear weights N(0, 1/fan_in), biases 0; conv N(0, 1/k), bias 0;
    LayerNorm gain 1, bias 0; ρ = 1; the positional table (if trainable) starts at the sinusoids times
    ``profile.positional_scale``.
    Backends may initialise differently (``profile.init``); cross-backend tests load these arrays.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(model, memory, profile).items():
        if name == "embed.weight":
            w = rng.normal(0.0, 0.02, shape)
        elif name == "pos.table":
            w = sinusoidal_table(shape[0], shape[1], "trainable_jax") * profile.positional_scale
        elif name == "memory.recency_scale":
            w = np.array(1.0)
        elif name.endswith("conv.weight"):
            w = rng.normal(0.0, 1.0 / math.sqrt(shape[0]), shape)
        elif name.endswith(".weight") and len(shape) == 2:
            w = rng.normal(0.0, 1.0 / math.sqrt(shape[0]), shape)
        elif name.endswith(".weight"):  # LayerNorm gain
            w = np.ones(shape)
        else:
            w = np.zeros(shape)
        out[name] = np.asarray(w, dtype=dtype)
    return out


def check_params(params: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped key."""
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    wrong = sorted(
        f"{k}: got {tuple(np.shape(params[k]))}, expected {expected[k]}"
        for k in set(expected) & set(params)
        if tuple(np.shape(params[k])) != tuple(expected[k])
    )
    if missing or extra or wrong:
        raise ValueError(
            "parameter dict does not match the model's canonical shapes "
            f"(missing: {missing or 'none'}; unexpected: {extra or 'none'}; mis-shaped: {wrong or 'none'}). "
            "Check that the checkpoint was written for the same model/memory/profile config."
        )
