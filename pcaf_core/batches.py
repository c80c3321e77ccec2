"""Validation of a run's data before it starts, and of every batch the loop hands to a backend, in NumPy on the host.

Backends do not re-check values: a check inside a model's forward costs a device synchronisation per
call on an accelerator and cannot run under ``jax.jit`` at all, while here it is a min/max over a host
array the loop already holds.
"""

from __future__ import annotations

import numpy as np

from pcaf_core.config import RunConfig
from pcaf_core.params import has_positional_table


def check_batch(inputs: np.ndarray, targets: np.ndarray, cfg: RunConfig) -> None:
    """Raise ValueError when a token id lies outside ``[0, V)`` or the window is longer than the
    model's positional table, naming the offending value and what to change.

    inputs: ``[b, T]`` int; targets: ``[b]`` (NT) or ``[b, T]`` (AR) int.
    """
    V = cfg.model.vocab_size
    hi = max(int(inputs.max()), int(targets.max()))
    lo = min(int(inputs.min()), int(targets.min()))
    if hi >= V or lo < 0:
        bad = hi if hi >= V else lo
        raise ValueError(
            f"token id {bad} is outside the model's vocabulary [0, {V}) (max id in this batch {hi}, "
            f"model.vocab_size={V}); the data and the model disagree: set model.vocab_size to the corpus "
            "vocabulary size or rebuild the token cache"
        )
    T = inputs.shape[1]
    if has_positional_table(cfg.model, cfg.profile) and T > cfg.model.max_seq_len:
        raise ValueError(
            f"window length T={T} exceeds model.max_seq_len={cfg.model.max_seq_len}, the rows of the "
            "trainable positional table; lower train.seq_len or raise model.max_seq_len"
        )


def check_setup(cfg: RunConfig, corpus, eval_tokens: np.ndarray, eval_batch: int, world: int) -> None:
    """Raise ValueError before a run starts when its batches (``train.batch_size`` and ``eval_batch`` windows)
    cannot be split evenly over ``world`` data-parallel processes, or when ``corpus`` (``train`` tokens,
    ``vocab_size``) or ``eval_tokens`` (the evaluation split) holds ids the model cannot embed; each message says
    what to change."""
    from pcaf_core.data import check_token_ids  # the data layer loads on first use

    for what, size in (("train.batch_size", cfg.train.batch_size), ("eval batch size", eval_batch)):
        if size % world:
            raise ValueError(
                f"{what}={size} is not divisible by the {world} data-parallel processes; "
                "the global batch is split evenly across ranks"
            )
    V = int(corpus.vocab_size)
    if V > cfg.model.vocab_size:
        raise ValueError(
            f"the corpus vocabulary has {V} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size >= {V} (the run's vocabulary is data.max_vocab={cfg.data.max_vocab})"
        )
    # One scan of each split here; every batch is checked again before a backend sees it.
    check_token_ids(corpus.train, cfg.model.vocab_size, what="train split")
    check_token_ids(eval_tokens, cfg.model.vocab_size, what=f"{cfg.data.eval_split} split")
