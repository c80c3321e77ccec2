"""The JAX implementation of :class:`pcaf_core.backend.Backend`.

``JaxBackend`` owns the numerics of one process: the linen model, Optax AdamW with clipping, dropout
keys, precision, data-parallel placement and the JAX state files. The loop (``pcaf_core.loop``) owns
the cadence, validation, evaluation reduction, bookkeeping and checkpoint layout;
``backends.jax.train`` builds this backend and hands it to the loop.

Data parallelism (:mod:`backends.jax.sharding`): one mesh axis ``"data"`` over the devices in use. The
state is replicated, a training batch is split row-wise over the mesh, and the jitted step computes the
gradient of the global mean loss (XLA inserts the all-reduce), so N devices take the step one device
takes on the same global batch, up to float summation order. Across hosts, each process feeds the
loop's slice of the global batch (``rank = jax.process_index()``); evaluation runs on each process's
own devices only, because the loop deals full-split batches round-robin to ranks and a computation
spanning every process would need every process to call it the same number of times.

Dropout: step ``s`` (1-based) draws from ``fold_in(PRNGKey(train.seed), s)``, a function of the seed
and the step alone, so a resumed run draws the masks the uninterrupted run drew, and the mask of a row
does not depend on how the batch is split over devices (JAX's partitionable threefry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from backends.jax import checkpoint as ckpt
from backends.jax import sharding, weights
from backends.jax.layers import attention_kernel
from backends.jax.optim import build_optimizer, set_learning_rate
from backends.jax.precision import matmul_precision as matmul_precision_context
from pcaf_core.backend import EvalOutputs
from pcaf_core.config import WINDOWED_VARIANTS, RunConfig, attention_label, head_loss_chunks, head_loss_label
from pcaf_core.params import check_params, param_shapes
from pcaf_core.profiles import matmul_precision
from pcaf_core.sysinfo import peak_rss_mb


@flax.struct.dataclass
class JaxState:
    """The train state, a pytree replicated over the mesh.

    params: the nested linen parameter tree (float32 master weights, whatever the compute dtype);
    opt_state: the Optax AdamW state; step: int32 scalar, optimiser steps taken; key: ``uint32[2]``
    the run's base dropout key (constant; step ``s`` uses ``fold_in(key, s)``).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    key: jax.Array


@dataclass
class _Compiled:
    """What one config needs besides the state: model, optimiser and the jitted steps."""

    module: Any
    tx: optax.GradientTransformation
    train: Any
    eval: Any
    matmul_precision: str
    """``train.matmul_precision`` resolved: the steps are traced and run inside its context."""


# Jitted steps by (mesh devices, numerics key): runs of one process that differ only in seeds, lengths or
# cadence (a Hydra multirun over seeds, a resumed run) reuse one compilation.
_COMPILED: dict[tuple[Any, ...], _Compiled] = {}
_COMPILED_MAX = 16


def numerics_key(cfg: RunConfig) -> tuple[Any, ...]:
    """Everything the jitted steps and the optimiser depend on: the model, memory and profile sections
    and the forward's and AdamW's training settings. Seeds, the learning rate (the loop hands it to
    every step), step counts, data and evaluation settings are left out."""
    t = cfg.train
    return (repr(cfg.model), repr(cfg.memory), repr(cfg.profile), t.mode, t.precision, t.weight_decay,
            t.beta1, t.beta2, t.eps, t.head_loss, t.head_position_chunk, t.head_vocab_chunk, matmul_precision(cfg))


def compute_dtype(cfg: RunConfig) -> Any:
    """The activations' dtype for ``train.precision`` (parameters stay float32)."""
    return jnp.bfloat16 if cfg.train.precision == "bf16" else jnp.float32


def auto_precision(device: str | None = None) -> tuple[str, str]:
    """What ``train.precision=auto`` trains in on JAX's ``device`` platform (None: the default one):
    ``(precision, why)``. bf16 on TPU and GPU; float32 on CPU, where XLA's bf16 dots bought no speed even
    with a bf16 matrix unit (a cpu-scale step: 282 ms bf16 against 266 ms float32, docs/results/README.md)."""
    platform = jax.default_backend() if device in (None, "auto") else str(device)
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        return "bf16", f"XLA on {platform} multiplies bf16 in hardware"
    return "fp32", "XLA:CPU's bf16 matrix products are no faster than float32"


class JaxBackend:
    """The JAX implementation of :class:`pcaf_core.backend.Backend`.

    device: ``None``/``"auto"`` (JAX's default platform: TPU or GPU when present), ``"cpu"``, ``"gpu"``
    or ``"tpu"``. num_devices: how many of this process's devices the data mesh uses (default 1);
    ``None`` uses every device of every process (required in a multi-process job; see
    :func:`backends.jax.sharding.select_devices`).
    rank / world_size follow the processes (``jax.process_index()`` / ``jax.process_count()``): the loop
    hands each process its slice of the global batch, and the mesh splits it further over devices.
    """

    name = "jax"
    # What a checkpoint of this backend holds beside the shared canonical weights (backends.jax.checkpoint);
    # the loop writes it into every checkpoint, so another backend's resume is refused by name.
    checkpoint_format = "jax-1: model.safetensors, optimizer.safetensors"

    def __init__(self, device: str | None = None, *, num_devices: int | None = 1) -> None:
        platform = None if device in (None, "auto") else str(device)
        self.devices = sharding.select_devices(platform, num_devices)
        self.mesh = sharding.data_mesh(self.devices)
        self.local_mesh = sharding.local_mesh(self.mesh)
        self.repl = sharding.replicated(self.mesh)
        self.rank = jax.process_index()
        self.world_size = jax.process_count()
        self.num_devices = len(self.devices)
        first = self.devices[0]
        n = self.num_devices
        where = f"{n} device{'s' if n > 1 else ''}"
        if self.world_size > 1:
            where += f" over {self.world_size} processes"
        if first.platform == "cpu":
            self.device = f"cpu (jax {jax.__version__}, {where}; peak memory = process max RSS)"
        else:
            self.device = f"{first.device_kind} (jax {jax.__version__}, {first.platform}, {where})"
        self._compiled: _Compiled | None = None

    # ------------------------------------------------------------------ distributed members

    def barrier(self) -> None:
        """Wait for every process (no-op alone)."""
        sharding.barrier()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum ``values`` over processes in float64 (identity alone)."""
        return sharding.all_reduce_sum(values)

    def auto_precision(self) -> tuple[str, str]:
        """``train.precision=auto`` on this backend's devices (:func:`auto_precision`)."""
        return auto_precision(self.devices[0].platform)

    def versions(self) -> dict[str, str]:
        """jax, jaxlib, flax, optax and safetensors versions."""
        import flax
        import jaxlib
        import safetensors

        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
                "optax": optax.__version__, "safetensors": safetensors.__version__}

    # ------------------------------------------------------------------ build

    def _check_batches(self, cfg: RunConfig) -> None:
        n, size = self.num_devices, cfg.train.batch_size
        if size % n:
            raise ValueError(f"train.batch_size={size} is not divisible by the {n} devices of the data mesh; the "
                             "global batch is split evenly across devices: change the batch size or world_size")

    def _compile(self, cfg: RunConfig, params: Any) -> _Compiled:
        """Model, optimiser and jitted steps for ``cfg`` (reused while the config stays the same)."""
        self._check_batches(cfg)
        labels = [head_loss_label(head_loss_chunks(cfg, self.num_devices))]
        if cfg.model.variant in WINDOWED_VARIANTS:
            labels.append(attention_label(attention_kernel(cfg.model.attention_impl)))
        for label in labels:
            if label not in self.device.split("; "):
                self.device += f"; {label}"
        key = (tuple(self.devices), numerics_key(cfg))
        if key in _COMPILED:
            self._compiled = _COMPILED[key]
            return self._compiled
        from backends.jax.models import build_model

        # Next-token runs compute each prediction from the receptive fields it reads (PCAFModel. and
        # TransformerLM.nt_receptive_read): the same loss and gradients at a fraction of the window's work.
        chunks = head_loss_chunks(cfg, self.num_devices)
        module = build_model(cfg.model, cfg.memory, cfg.profile, dtype=compute_dtype(cfg),
                             nt_receptive_field=cfg.train.mode == "nt", head_chunks=chunks)
        tx = build_optimizer(cfg.train, cfg.profile, params)
        mode = cfg.train.mode

        def train_step(state: JaxState, x: jax.Array, y: jax.Array, lr: jax.Array) -> tuple[JaxState, jax.Array]:
            step = state.step + 1
            dropout_key = jax.random.fold_in(state.key, step)

            def loss_fn(params: Any) -> jax.Array:
                out = module.apply({"params": params}, x, y, mode, deterministic=False, need_log_probs=False,
                                   need_predictions=False, rngs={"dropout": dropout_key})
                return out.loss.astype(jnp.float32)

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            opt_state = set_learning_rate(state.opt_state, lr)
            updates, opt_state = tx.update(grads, opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return state.replace(params=params, opt_state=opt_state, step=step), loss

        def eval_step(params: Any, x: jax.Array, y: jax.Array, mode: str) -> tuple[jax.Array, ...]:
            out = module.apply({"params": params}, x, y, mode, deterministic=True, need_log_probs=True,
                               need_predictions=True)
            return out.target_log_prob.astype(jnp.float32), out.prediction_mixture, out.prediction_param

        # Donated buffers let the new state reuse the old one's memory; the CPU runtime cannot reuse
        # them and would warn at every compilation.
        donate = (0,) if self.devices[0].platform != "cpu" else ()
        self._compiled = _Compiled(
            module=module, tx=tx,
            train=jax.jit(train_step, donate_argnums=donate, out_shardings=(self.repl, self.repl)),
            eval=jax.jit(eval_step, static_argnames="mode"),
            matmul_precision=matmul_precision(cfg),
        )
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = self._compiled
        return self._compiled

    def _place(self, params: Any, opt_state: Any, step: Any, key: Any) -> JaxState:
        host = JaxState(params=params, opt_state=opt_state, step=np.asarray(step, dtype=np.int32),
                        key=np.asarray(key, dtype=np.uint32))
        return sharding.put_replicated(host, self.mesh)

    def init(self, cfg: RunConfig) -> JaxState:
        """Initial weights (``backends.jax.params.init_params`` seeded by ``train.seed``, drawn as
        ``profile.init`` says), a fresh AdamW state and the run's dropout key."""
        from backends.jax.params import init_params

        return self.from_canonical(cfg, init_params(cfg.model, cfg.memory, cfg.profile, seed=cfg.train.seed))

    def from_canonical(self, cfg: RunConfig, canonical: Mapping[str, Any]) -> JaxState:
        """A fresh train state (new AdamW state, step 0, the run's dropout key) holding the canonical
        weights ``canonical`` (``name -> array``, checked against ``pcaf_core.params.param_shapes``), e.g.
        the spec's ``pcaf_core.params.init_params`` or weights converted from the torch backend. The
        master weights are float32."""
        shapes = param_shapes(cfg.model, cfg.memory, cfg.profile)
        check_params({k: np.asarray(v) for k, v in canonical.items()}, shapes)
        host = {name: np.asarray(canonical[name], dtype=np.float32) for name in shapes}
        params = jax.tree_util.tree_map(np.asarray, weights.to_variables(host)["params"])
        compiled = self._compile(cfg, params)
        opt_state = set_learning_rate(compiled.tx.init(params), cfg.train.lr)
        return self._place(params, opt_state, 0, jax.random.PRNGKey(cfg.train.seed))

    def save(self, state: JaxState, path: Path) -> None:
        """Weights (canonical safetensors) and optimiser state, step and key (``optimizer.safetensors``)
        into ``path``; the state is replicated, so process 0 alone writes."""
        if self.rank == 0:
            ckpt.save_train_state(Path(path), state.params, state.opt_state, state.step, state.key)

    def load(self, path: Path, cfg: RunConfig) -> JaxState:
        """Rebuild the state :meth:`save` wrote into ``path``: the same arrays, bit for bit."""
        path = Path(path)
        params = ckpt.load_weights(path / ckpt.WEIGHTS_FILE, param_shapes(cfg.model, cfg.memory, cfg.profile))
        compiled = self._compile(cfg, params)
        template = jax.eval_shape(compiled.tx.init, params)
        opt_state, step, key = ckpt.load_optimizer_file(path / ckpt.OPTIMIZER_FILE, template)
        return self._place(params, opt_state, step, key)

    def param_count(self, state: JaxState) -> int:
        """Number of parameter elements (every canonical parameter, used or not, as the paper counts)."""
        return int(sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(state.params)))

    def peak_memory_mb(self) -> float | None:
        """The largest ``peak_bytes_in_use`` of this process's mesh devices (MiB), or the process's peak
        RSS where the device reports no memory statistics (CPU)."""
        peaks = []
        for d in self.local_mesh.devices.flat:
            stats = d.memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                peaks.append(stats["peak_bytes_in_use"])
        return max(peaks) / 2**20 if peaks else peak_rss_mb()

    # ------------------------------------------------------------------ steps

    def _need(self) -> _Compiled:
        if self._compiled is None:
            raise RuntimeError("JaxBackend: call init(cfg) or load(path, cfg) before stepping")
        return self._compiled

    def train_step(self, state: JaxState, inputs: np.ndarray, targets: np.ndarray, lr: float, *,
                   wait: bool = True) -> tuple[JaxState, float | jax.Array]:
        """One AdamW step at ``lr`` on this process's rows of the global batch; returns the new state
        and the global batch's mean training loss (the same on every process; ``wait=False``: as the 0-d
        array the step is computing, :meth:`pcaf_core.backend.Backend.train_step`). On an accelerator the
        old state's buffers are donated to the new one: use only the returned state afterwards."""
        compiled = self._need()
        x = sharding.put_batch(np.ascontiguousarray(inputs, dtype=np.int32), self.mesh)
        y = sharding.put_batch(np.ascontiguousarray(targets, dtype=np.int32), self.mesh)
        with matmul_precision_context(compiled.matmul_precision):
            state, loss = compiled.train(state, x, y, np.float32(lr))
        if not wait:  # dispatched: float() of this copy's loss waits for the step
            return state, loss if loss.is_fully_addressable else loss.addressable_data(0)
        # Reading the loss waits for the step, so the loop's step timer measures the whole step.
        return state, float(sharding.first_replica(loss))

    def eval_batch(self, state: JaxState, inputs: np.ndarray, targets: np.ndarray, mode: str) -> EvalOutputs:
        """Per-target log-probs and the predictive and parametric argmax of ``inputs [b, T]`` (dropout
        off), computed on this process's devices. Rows are padded to a multiple of the local device
        count and the padding is cut from the outputs."""
        compiled = self._need()
        b = inputs.shape[0]
        n = self.local_mesh.devices.size
        pad = (-b) % n
        x = np.ascontiguousarray(inputs, dtype=np.int32)
        y = np.ascontiguousarray(targets, dtype=np.int32)
        if pad:
            x = np.concatenate([x, np.repeat(x[:1], pad, axis=0)])
            y = np.concatenate([y, np.repeat(y[:1], pad, axis=0)])
        params = sharding.to_mesh(state.params, self.local_mesh)
        rows = sharding.batch_sharded(self.local_mesh)
        with matmul_precision_context(compiled.matmul_precision):
            tlp, pred, pred_param = compiled.eval(params, jax.device_put(x, rows), jax.device_put(y, rows), mode)
        return EvalOutputs(
            target_log_prob=np.asarray(tlp, dtype=np.float64)[:b],
            prediction=np.asarray(pred, dtype=np.int64)[:b],
            prediction_param=np.asarray(pred_param, dtype=np.int64)[:b],
        )
