"""AdamW as the reference trainers use it (docs/REFERENCE_CODE.md §4.5, §5.4), with Optax.

``optax.adamw`` is exactly the reference update ``p ← p − lr·(m̂/(√v̂+ε) + wd·p)``: bias-corrected
moments (``scale_by_adam``), then the decoupled decay ``wd·p`` added to the update
(``add_decayed_weights``), then the step ``−lr·update`` (``torch.optim.AdamW`` computes the same
arithmetic, decaying first). The reference decays **every** parameter; with
``profile.weight_decay_all_params=False`` the decay mask follows :func:`pcaf_core.params.decayed` over
the canonical names (no decay on norms, biases, ρ and the positional table), the same rule the torch
backend applies.

Gradient clipping by global norm (``profile.grad_clip_norm > 0``) runs first, on the raw gradients, as
``torch.nn.utils.clip_grad_norm_`` does before the torch step.

The learning rate is not an Optax schedule: the loop owns it (:func:`pcaf_core.schedule.lr_for`, float64
arithmetic, identical for both backends) and hands one value per step. ``optax.inject_hyperparams``
makes it a field of the optimiser state (``opt_state.hyperparams["learning_rate"]``) that
:func:`set_learning_rate` overwrites before each update, so a new value per step neither recompiles
the step nor goes through an Optax schedule's own step counter; the other hyper-parameters stay Python
constants. The stored rate has the parameters' dtype (float32 unless ``jax_enable_x64``), the precision
the update is computed in anyway.

Parameters that the forward never uses (e.g. the router of a context-route model under
``reference_jax``, docs/REFERENCE_CODE.md §7.16) get an exact zero gradient from ``jax.grad``; AdamW still decays
them, as the reference does (torch needs ``fill_missing_grads`` for that, JAX does not).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcaf_core.config import ProfileConfig, TrainConfig
from pcaf_core.params import decayed

LR_KEY = "learning_rate"
_STATIC = ("b1", "b2", "eps", "weight_decay", "mask", "clip_norm")


def decay_mask(params_tree: Any, decay_all: bool) -> Any:
    """A pytree of bools shaped like ``params_tree`` (the nested linen parameter tree): True where
    :func:`pcaf_core.params.decayed` says the canonical parameter behind that leaf is decayed.

    The mask is derived through the canonical conversion (``weights.to_canonical`` /
    ``weights.to_variables``) with marker values, so it does not depend on how the linen tree names or
    lays out a parameter.
    """
    from backends.jax import weights  # the model-side conversion; imported where it is needed

    canonical = weights.to_canonical(params_tree)
    markers = {name: np.full(np.shape(v), 1.0 if decayed(name, tuple(np.shape(v)), decay_all) else 0.0,
                             dtype=np.float32)
               for name, v in canonical.items()}
    tree = weights.to_variables(markers)["params"]

    def leaf(path: Any, x: Any) -> bool:
        x = np.asarray(x)
        if x.size == 0:
            return bool(decay_all)
        if not (np.all(x == 1.0) or np.all(x == 0.0)):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} mixes decayed and undecayed canonical "
                             "entries; the decay mask needs one rule per array")
        return bool(x.flat[0] == 1.0)

    mask = jax.tree_util.tree_map_with_path(leaf, tree)
    if jax.tree_util.tree_structure(mask) != jax.tree_util.tree_structure(params_tree):
        raise ValueError("weights.to_variables(weights.to_canonical(params)) does not rebuild the parameter tree's "
                         "structure; the decay mask cannot be aligned")
    return mask


def _adamw(
    learning_rate: Any, *, b1: float, b2: float, eps: float, weight_decay: float, mask: Any, clip_norm: float
) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
    if clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    return adamw


def build_optimizer(
    train: TrainConfig, profile: ProfileConfig, params_tree: Any, *, mask: Any = None
) -> optax.GradientTransformation:
    """AdamW with the run's betas, eps and weight decay, the profile's decay rule and clipping.

    params_tree: the nested linen parameter tree (only its structure, names and shapes are read).
    mask: a bool pytree shaped like ``params_tree`` overriding :func:`decay_mask` (for trees that are
    not a model's parameters).
    The learning rate is injected (``opt_state.hyperparams["learning_rate"]``, initialised to
    ``train.lr``); the train step sets the loop's value each step with :func:`set_learning_rate`.
    """
    if mask is None:
        mask = decay_mask(params_tree, profile.weight_decay_all_params)
    factory = optax.inject_hyperparams(_adamw, static_args=_STATIC)
    return factory(learning_rate=float(train.lr), b1=float(train.beta1), b2=float(train.beta2),
                   eps=float(train.eps), weight_decay=float(train.weight_decay), mask=mask,
                   clip_norm=float(profile.grad_clip_norm))


def set_learning_rate(opt_state: Any, lr: jax.Array) -> Any:
    """``opt_state`` (of :func:`build_optimizer`) with the learning rate of the next update set to
    ``lr`` (cast to the stored dtype). Traceable: use it inside the jitted step."""
    hyper = dict(opt_state.hyperparams)
    hyper[LR_KEY] = jnp.asarray(lr, dtype=hyper[LR_KEY].dtype)
    return opt_state._replace(hyperparams=hyper)


def learning_rate(opt_state: Any) -> float:
    """The learning rate of the last update (or ``train.lr`` before the first)."""
    return float(np.asarray(opt_state.hyperparams[LR_KEY]))


def update_count(opt_state: Any) -> int:
    """Number of optimiser updates applied so far (the injected state's step counter)."""
    return int(np.asarray(opt_state.count))
