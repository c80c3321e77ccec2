"""Text generation with the torch streaming state: :func:`generate` and :func:`load_model`.

``generate(model_or_checkpoint, prompt, max_new_tokens, temperature, top_k, top_p, seed)`` prefills a
:class:`~backends.torch.streaming.TorchStream` with the prompt in one parallel pass, then samples one token
at a time from the model's predictive distribution (the gated mixture for PCAF), each step costing the
same whatever the length so far (PCAF, local conv, local attention) or growing with it (dense attention).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.torch.models import CanonicalLM, build_model
from backends.torch.streaming import TorchStream
from backends.torch.weights import load_canonical
from pcaf_core.trained_run import TrainedRun, load_params, locate_run

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


@dataclass
class Generation:
    """tokens: ``[B, n + new]`` int64 prompt and continuation; new_tokens: ``[B, new]``; prefill_seconds:
    the prompt's parallel pass; decode_seconds: sampling and stepping the new tokens."""

    tokens: torch.Tensor
    new_tokens: torch.Tensor
    prefill_seconds: float
    decode_seconds: float

    @property
    def tokens_per_sec(self) -> float:
        """Generated tokens (all sequences) per second of decoding."""
        n = self.new_tokens.numel()
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def load_model(path: str | Path | TrainedRun, *, checkpoint: str | Path | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
               ) -> tuple[CanonicalLM, TrainedRun]:
    """A trained run's model in evaluation mode: ``path`` is a located run or anything
    :func:`pcaf_core.trained_run.locate_run` accepts."""
    run = path if isinstance(path, TrainedRun) else locate_run(path, checkpoint)
    cfg = run.config
    net = build_model(cfg.model, cfg.memory, cfg.profile, dtype=dtype, device=device)
    load_canonical(net, load_params(run))
    return net.eval(), run


def sample_next(log_probs: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``log_probs [B, V]``: argmax when ``temperature == 0``; otherwise sampled from
    ``softmax(log_probs / temperature)`` restricted to the ``top_k`` most likely tokens (0 = all) and to
    the smallest set whose probability reaches ``top_p`` (1 = all)."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}")
    if temperature == 0:
        return torch.argmax(log_probs, dim=-1)
    logits = log_probs.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first one is always kept).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model_or_checkpoint: CanonicalLM | TrainedRun | str | Path,
    prompt: torch.Tensor | list[int] | list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    *,
    window: int | None = None,
    mode: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    vocab_limit: int | None = None,
) -> Generation:
    """Continue ``prompt`` (``[n]`` or ``[B, n]`` token ids) by ``max_new_tokens`` tokens.

    ``model_or_checkpoint``: a model of this backend, a located :class:`~pcaf_core.trained_run.TrainedRun`, or
    a run directory / checkpoint directory / weights file of a trained run (loaded in ``dtype`` on ``device``).
    ``window``/``mode``: the recency convention
    of the stream (:class:`~backends.torch.streaming.TorchStream`); default the run's ``train.seq_len`` and
    ``train.mode``, or ``model_config.max_seq_len`` and ``ar`` for a bare model. ``seed`` seeds the sampler.
    ``vocab_limit``: only ids below it are generated (a run's vocabulary may hold fewer words than the model's V,
    and the ids past it name none); None: every id.
    """
    if isinstance(model_or_checkpoint, (str, Path, TrainedRun)):
        net, run = load_model(model_or_checkpoint, dtype=dtype, device=device)
        window = window if window is not None else run.config.train.seq_len
        mode = mode if mode is not None else run.config.train.mode
    else:
        net = model_or_checkpoint.eval()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    param = next(net.parameters())
    x = torch.as_tensor(prompt, dtype=torch.int64, device=param.device)
    x = x[None] if x.ndim == 1 else x
    V = net.model_config.vocab_size
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"prompt must be [n] or [B, n] token ids with n >= 1, got shape {tuple(x.shape)}")
    if int(x.min()) < 0 or int(x.max()) >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V}), got [{int(x.min())}, {int(x.max())}]")
    if vocab_limit is not None and not 0 < vocab_limit <= V:
        raise ValueError(f"vocab_limit={vocab_limit} must lie in [1, {V}]")
    unused = None if vocab_limit is None or vocab_limit == V else torch.arange(V, device=param.device) >= vocab_limit
    stream = TorchStream(net, window=window, mode=mode or "ar")
    gen = torch.Generator(device=param.device).manual_seed(seed)
    B, n = x.shape
    start = time.perf_counter()
    state, out = stream.prefill(stream.init(B, capacity=n + max_new_tokens), x)
    prefill_seconds = time.perf_counter() - start
    new = torch.empty((B, max_new_tokens), dtype=torch.int64, device=param.device)
    start = time.perf_counter()
    for i in range(max_new_tokens):
        log_probs = out.log_probs if unused is None else out.log_probs.masked_fill(unused, -torch.inf)
        new[:, i] = sample_next(log_probs, temperature, top_k, top_p, gen)
        if i + 1 < max_new_tokens:
            state, out = stream.step(state, new[:, i])
    decode_seconds = time.perf_counter() - start
    return Generation(torch.cat([x, new], dim=1), new, prefill_seconds, decode_seconds)
