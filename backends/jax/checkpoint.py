"""JAX side of a checkpoint directory (the loop writes ``loop_state.json`` and the manifest beside these).

``<run_dir>/checkpoints/step_<N>/``

* ``model.safetensors`` — the weights as the canonical parameter dict (``backends.jax.weights``), so
  the torch backend or the NumPy reference reads them unchanged.
* ``optimizer.safetensors`` — the Optax state, the step counter and the dropout PRNG key: one tensor per
  leaf of ``jax.tree_util.tree_flatten_with_path(opt_state)``, named ``opt_state<keystr>``
  (e.g. ``opt_state.inner_state[1].inner_state[0].mu['head']['out']['kernel']``), plus ``step`` and
  ``rng_key``. The header records the state's tree structure and leaf names;
  :func:`load_optimizer_file` refuses a file whose structure, names, shapes or dtypes differ from the
  optimiser the config builds.

Why safetensors and not Orbax: a checkpoint here is one flat file per state with no pickle, written
once by process 0 (the state is replicated), read back bit for bit (the same bytes, the same dtypes),
and covered by the loop's sha256 manifest of the directory; Orbax's directory of per-array files and
asynchronous commits would duplicate what the loop already does (atomic directory rename, ``latest``
pointer, pruning) without adding anything a replicated data-parallel state needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors
import safetensors.numpy

from backends.jax import weights
from backends.jax.sharding import first_replica
from pcaf_core.weights import load_canonical

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_FORMAT = "pcaf-jax-optimizer"
OPT_PREFIX = "opt_state"
STEP_KEY = "step"
RNG_KEY = "rng_key"


class OptimizerStateError(ValueError):
    """An optimiser-state file does not fit the optimiser this config builds; the message says what to do."""


def flatten_named(opt_state: Any) -> tuple[dict[str, Any], Any]:
    """``(name -> leaf, treedef)`` of an Optax state; names are ``opt_state`` + the leaf's keystr."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    named = {OPT_PREFIX + jax.tree_util.keystr(path): leaf for path, leaf in leaves}
    if len(named) != len(leaves):
        raise ValueError("two optimiser-state leaves share one key string; the state cannot be stored by name")
    return named, treedef


def save_weights(path: Path, params: Any, metadata: dict[str, str] | None = None) -> None:
    """The nested linen parameter tree ``params`` as canonical safetensors at ``path`` (replicated arrays
    are read from this process's first copy)."""
    host = jax.tree_util.tree_map(first_replica, params)
    weights.save_safetensors(Path(path), host, metadata=metadata)


def load_weights(path: Path, expected: dict[str, tuple[int, ...]]) -> Any:
    """The nested linen parameter tree (host NumPy leaves) stored canonically in ``path``, checked
    against ``expected`` (``pcaf_core.params.param_shapes``): a missing, extra or mis-shaped key, a
    foreign file or non-finite values fail with one line naming the file."""
    return weights.to_variables(load_canonical(Path(path), expected))["params"]


def _host(x: Any) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d leaf (the update counter) into shape [1].
    return np.array(first_replica(x), order="C", copy=True)


def save_optimizer(path: Path, opt_state: Any, step: Any, rng_key: Any) -> None:
    """Write ``opt_state`` (any Optax state pytree), ``step`` (int scalar) and ``rng_key`` (the raw
    ``uint32[2]`` dropout key) to ``path`` as one safetensors file."""
    named, treedef = flatten_named(opt_state)
    tensors = {name: _host(leaf) for name, leaf in named.items()}
    tensors[STEP_KEY] = _host(step)
    tensors[RNG_KEY] = _host(rng_key)
    meta = {"format": OPTIMIZER_FORMAT, "treedef": str(treedef), "names": json.dumps(list(named))}
    safetensors.numpy.save_file(tensors, str(path), metadata=meta)


def save_train_state(directory: Path, params: Any, opt_state: Any, step: Any, rng_key: Any) -> None:
    """Write ``model.safetensors`` and ``optimizer.safetensors`` into ``directory``.

    params: the nested linen parameter tree; opt_state: the Optax state; step: int32 scalar; rng_key:
    the ``uint32[2]`` dropout key.
    """
    directory = Path(directory)
    save_weights(directory / WEIGHTS_FILE, params, metadata={"step": str(int(first_replica(step)))})
    save_optimizer(directory / OPTIMIZER_FILE, opt_state, step, rng_key)


def _mismatch(path: Path, what: str) -> OptimizerStateError:
    return OptimizerStateError(
        f"{path}: {what}; the optimiser state was written by a different optimiser configuration or code "
        "version: resume with the config that wrote it, or start over in a new run directory"
    )


def load_optimizer_file(path: Path, opt_template: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """Read ``optimizer.safetensors`` against ``opt_template`` (a freshly initialised state of the same
    optimiser). Returns ``(opt_state as host arrays in the template's tree, step, rng_key)``; raises
    :class:`OptimizerStateError` (one line) on any structural difference."""
    path = Path(path)
    if not path.is_file():
        raise OptimizerStateError(f"{path} is missing; the checkpoint is incomplete: resume from another one")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as fh:
            meta = dict(fh.metadata() or {})
        tensors = safetensors.numpy.load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged header
        raise OptimizerStateError(f"{path} is not a readable safetensors file ({exc}); resume from another "
                                  "checkpoint") from exc
    if meta.get("format") != OPTIMIZER_FORMAT:
        raise _mismatch(path, f"format tag {meta.get('format')!r} is not {OPTIMIZER_FORMAT!r}")
    template, treedef = flatten_named(opt_template)
    if meta.get("treedef") != str(treedef):
        raise _mismatch(path, "the stored state's tree structure differs from this optimiser's")
    stored = set(tensors) - {STEP_KEY, RNG_KEY}
    missing = sorted(set(template) - stored) + [k for k in (STEP_KEY, RNG_KEY) if k not in tensors]
    extra = sorted(stored - set(template))
    if missing or extra:
        raise _mismatch(path, f"entries missing {missing[:3]} / unexpected {extra[:3]}")
    for name, leaf in template.items():
        got, want, shape = tensors[name], np.dtype(leaf.dtype), tuple(leaf.shape)
        if got.shape != shape or got.dtype != want:
            raise _mismatch(path, f"{name} is {got.dtype}{list(got.shape)}, expected {want}{list(shape)}")
    opt_state = jax.tree_util.tree_unflatten(treedef, [tensors[name] for name in template])
    return opt_state, tensors[STEP_KEY], tensors[RNG_KEY]
