"""Text generation with the JAX streaming state (mirrors :mod:`backends.torch.generate`).

``generate(model_or_checkpoint, prompt, max_new_tokens, temperature, top_k, top_p, seed)`` feeds the prompt
through :class:`~backends.jax.streaming.JaxStream` (one ``lax.scan``), then samples and steps the new
tokens in a second ``lax.scan``. Both programs are compiled ahead of time and the reported seconds exclude
compilation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from backends.jax.models import CanonicalLM, build_model
from backends.jax.ops import argmax_last
from backends.jax.streaming import JaxStream
from backends.jax.weights import to_variables
from pcaf_core.trained_run import TrainedRun, load_params, locate_run

DTYPES = {"fp32": jnp.float32, "fp64": jnp.float64, "bf16": jnp.bfloat16}


@dataclass
class Generation:
    """tokens: ``[B, n + new]`` int32 prompt and continuation; new_tokens: ``[B, new]``; prefill_seconds /
    decode_seconds: the two programs' run times (compilation excluded); compile_seconds: both compilations."""

    tokens: np.ndarray
    new_tokens: np.ndarray
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float

    @property
    def tokens_per_sec(self) -> float:
        n = self.new_tokens.size
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def load_model(path: str | Path | TrainedRun, *, checkpoint: str | Path | None = None, dtype: Any = jnp.float32
               ) -> tuple[CanonicalLM, dict, TrainedRun]:
    """A trained run's module and variables (float32 parameters; ``dtype`` is the compute dtype)."""
    run = path if isinstance(path, TrainedRun) else locate_run(path, checkpoint)
    cfg = run.config
    module = build_model(cfg.model, cfg.memory, cfg.profile, dtype=dtype)
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    return module, to_variables(load_params(run), param_dtype), run


def sample_next(log_probs: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """One token per row of ``log_probs [B, V]`` (as :func:`backends.torch.generate.sample_next`): argmax at
    ``temperature == 0``, else sampled after the ``top_k`` and ``top_p`` cuts. Static settings."""
    if temperature == 0:
        return argmax_last(log_probs)
    logits = log_probs.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        drop = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
        b = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[b, order].set(jnp.where(drop, -jnp.inf, sorted_logits))
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model_or_checkpoint: Any,
    prompt: Any,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    *,
    variables: dict | None = None,
    window: int | None = None,
    mode: str | None = None,
    dtype: Any = jnp.float32,
    vocab_limit: int | None = None,
) -> Generation:
    """Continue ``prompt`` (``[n]`` or ``[B, n]`` ids) by ``max_new_tokens`` tokens.

    ``model_or_checkpoint``: a module (then ``variables`` too), a located
    :class:`~pcaf_core.trained_run.TrainedRun`, or a run directory / checkpoint directory / weights file.
    ``window``/``mode`` default to the run's ``train.seq_len``/``train.mode`` (a bare module:
    ``max_seq_len``, ``ar``). ``seed`` seeds ``jax.random``. ``vocab_limit``: only ids below it are generated
    (as :func:`backends.torch.generate.generate`); None: every id.
    """
    if isinstance(model_or_checkpoint, (str, Path, TrainedRun)):
        module, variables, run = load_model(model_or_checkpoint, dtype=dtype)
        window = window if window is not None else run.config.train.seq_len
        mode = mode if mode is not None else run.config.train.mode
    else:
        module = model_or_checkpoint
        if variables is None:
            raise ValueError("a bare module needs its variables: generate(module, prompt, ..., variables=...)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}")
    x = np.asarray(prompt, dtype=np.int64)
    x = x[None] if x.ndim == 1 else x
    V = module.model_config.vocab_size
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"prompt must be [n] or [B, n] token ids with n >= 1, got shape {x.shape}")
    if x.min() < 0 or x.max() >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V}), got [{x.min()}, {x.max()}]")
    if vocab_limit is not None and not 0 < vocab_limit <= V:
        raise ValueError(f"vocab_limit={vocab_limit} must lie in [1, {V}]")
    words = V if vocab_limit is None else vocab_limit
    B, n = x.shape
    stream = JaxStream(module, variables, window=window, mode=mode or "ar")
    # One extra step after the last sample keeps the decode loop uniform.
    state = stream.init(B, capacity=n + max_new_tokens)
    pos_table, step = stream.pos_table, stream.batched_step

    def prefill(v, s, toks, pt):
        s, outs = jax.lax.scan(lambda st, tok: step(v, st, tok, pt), s, toks.T)
        return s, outs.log_probs[-1]

    def decode(v, s, lp, key, pt):
        def body(carry, _):
            st, lp, key = carry
            key, sub = jax.random.split(key)
            if words < V:
                lp = jnp.where(jnp.arange(V) < words, lp, -jnp.inf)
            tok = sample_next(lp, sub, temperature, top_k, top_p)
            st, out = step(v, st, tok, pt)
            return (st, out.log_probs, key), tok

        _, toks = jax.lax.scan(body, (s, lp, key), None, length=max_new_tokens)
        return toks.T

    tokens = jnp.asarray(x, jnp.int32)
    key = jax.random.PRNGKey(seed)
    start = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(variables, state, tokens, pos_table).compile()
    state_shape, lp_shape = jax.eval_shape(prefill, variables, state, tokens, pos_table)
    decode_c = jax.jit(decode).lower(variables, state_shape, lp_shape, key, pos_table).compile()
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    state, lp = jax.block_until_ready(prefill_c(variables, state, tokens, pos_table))
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    new = np.asarray(jax.block_until_ready(decode_c(variables, state, lp, key, pos_table)))
    decode_seconds = time.perf_counter() - start
    return Generation(np.concatenate([x.astype(np.int32), new], axis=1), new, prefill_seconds, decode_seconds,
                      compile_seconds)
