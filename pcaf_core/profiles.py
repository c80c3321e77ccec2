"""Compat profiles: named sets of the switches in :class:`pcaf_core.config.ProfileConfig`.

* ``reference_jax`` reproduces the TPU tables (the paper's JAX trainer).
* ``reference_torch`` reproduces the WikiText-2 RTX 3060 tables (the paper's PyTorch trainer).
* ``corrected`` is the normative behaviour: every correctness quirk off, JAX architecture choices.

docs/SPEC.md gives the formula behind each switch.
"""

from __future__ import annotations

import dataclasses

from pcaf_core.config import MATMUL_PRECISIONS, PROFILE_MATMUL_PRECISION, ConfigError, ProfileConfig, RunConfig

PROFILES: dict[str, ProfileConfig] = {
    "reference_jax": ProfileConfig(
        name="reference_jax",
        hash_int32_wraparound=True,
        gelu="tanh",
        l2norm="rsqrt_eps",
        router="linear_bias",
        router_in_context_models=True,
        local_conv_full_param_set=True,
        positional="trainable_jax",
        init="jax_normal",
        semantic_ar_target_leak=True,
        hybrid_dedup=False,
        nt_mixture_floor=True,
        ar_mixture_floor=True,
        ar_accuracy_parametric_only=True,
        gate_clip_when_empty=True,
        nt_gate_per_term_clamp=False,
        nt_loss_renormalise=False,
        dropout=0.0,
        grad_clip_norm=0.0,
        weight_decay_all_params=True,
    ),
    "reference_torch": ProfileConfig(
        name="reference_torch",
        hash_int32_wraparound=False,
        gelu="erf",
        l2norm="max_eps",
        router="layernorm_linear",
        # The RTX tables' 26,592,730 parameters come from a model without router parameters.
        router_in_context_models=False,
        local_conv_full_param_set=False,
        positional="fixed_torch",
        init="torch_default",
        semantic_ar_target_leak=True,
        hybrid_dedup=False,
        nt_mixture_floor=True,
        ar_mixture_floor=True,
        ar_accuracy_parametric_only=True,
        gate_clip_when_empty=True,
        nt_gate_per_term_clamp=True,
        nt_loss_renormalise=True,
        dropout=0.1,
        grad_clip_norm=1.0,
        weight_decay_all_params=True,
    ),
    "corrected": ProfileConfig(
        name="corrected",
        hash_int32_wraparound=False,
        gelu="tanh",
        l2norm="rsqrt_eps",
        router="linear_bias",
        router_in_context_models=False,
        local_conv_full_param_set=False,
        positional="trainable_jax",
        init="jax_normal",
        semantic_ar_target_leak=False,
        hybrid_dedup=True,
        nt_mixture_floor=False,
        ar_mixture_floor=False,
        ar_accuracy_parametric_only=False,
        gate_clip_when_empty=False,
        nt_gate_per_term_clamp=False,
        nt_loss_renormalise=False,
        dropout=0.0,
        grad_clip_norm=0.0,
        weight_decay_all_params=True,
    ),
}


def get_profile(name: str, **overrides: object) -> ProfileConfig:
    """Return a fresh copy of profile ``name`` with individual switches overridden."""
    if name not in PROFILES:
        raise ConfigError(f"profile.name={name!r} is unknown: expected one of {sorted(PROFILES)}")
    try:
        return dataclasses.replace(PROFILES[name], **overrides)
    except TypeError as exc:  # unknown switch name
        raise ConfigError(f"profile override {sorted(overrides)} is invalid: {exc}") from exc


def matmul_precision(cfg: RunConfig) -> str:
    """The float32 matmul precision ``cfg`` trains and evaluates with: ``train.matmul_precision``, or the
    profile's (:data:`PROFILE_MATMUL_PRECISION`) when it says ``profile``. One of
    :data:`pcaf_core.config.MATMUL_PRECISIONS`."""
    chosen = cfg.train.matmul_precision
    if chosen != "profile":
        return chosen
    if cfg.profile.name not in PROFILE_MATMUL_PRECISION:
        raise ConfigError(f"profile.name={cfg.profile.name!r} has no default matmul precision: set "
                          f"train.matmul_precision to one of {list(MATMUL_PRECISIONS)}")
    return PROFILE_MATMUL_PRECISION[cfg.profile.name]


def resolve_matmul_precision(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``train.matmul_precision=profile`` replaced by the profile's value (a copy; ``cfg``
    itself when there is nothing to resolve), so the config, its hash and the record name what ran."""
    if cfg.train.matmul_precision != "profile":
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, matmul_precision=matmul_precision(cfg)))
