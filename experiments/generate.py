"""Generate text from a trained run: ``python -m experiments.generate run_dir=<run> prompt="<text>"``.

Options (``key=value``): ``max_new_tokens`` (50), ``temperature`` (1.0; 0 = greedy), ``top_k`` (0 = all),
``top_p`` (1.0), ``seed`` (0), ``batch`` (1: the prompt repeated, each row sampled independently),
``backend`` (torch | jax), ``dtype`` (fp32 | fp64 | bf16), ``threads`` (torch intra-op threads; 0 = torch's
default), ``checkpoint`` (a checkpoints/step_<N> directory or weights file; default the newest complete
one), ``data.data_dir`` / ``data.cache_dir`` (where the run's corpus and its cache live, for the vocabulary).

Loads the run's canonical safetensors weights and its corpus vocabulary, tokenises the prompt as the run's
corpus was (unknown words become ``<unk>``, with a warning), streams the continuation and prints it
detokenised, then one line of decode speed labelled with backend, dtype and batch. Errors are one line on
stderr and exit status 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from experiments.allocator import ensure_tunables
from experiments.key_value_args import parse_key_values

USAGE = 'usage: python -m experiments.generate run_dir=<run directory> prompt="<text>" [key=value ...]'


@dataclass
class GenerateArgs:
    run_dir: str = ""
    prompt: str = ""
    max_new_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch: int = 1
    backend: str = "torch"
    dtype: str = "fp32"
    checkpoint: str | None = None
    threads: int = 0


def parse_args(argv: list[str]) -> tuple[GenerateArgs, dict[str, str]]:
    """``key=value`` items -> the options and the ``data.*`` location overrides. Values are taken verbatim
    (a prompt may hold spaces, ``=`` or ``:``)."""
    args, data = parse_key_values(argv, GenerateArgs, USAGE)
    if args.backend not in ("torch", "jax"):
        raise ValueError(f"backend={args.backend!r} is unknown: expected torch or jax")
    if args.dtype not in ("fp32", "fp64", "bf16"):
        raise ValueError(f"dtype={args.dtype!r} is unknown: expected fp32, fp64 or bf16")
    if args.batch < 1:
        raise ValueError(f"batch={args.batch} must be >= 1")
    return args, data


def _generate(args: GenerateArgs, run: Any, ids: Any, words: int) -> tuple[Any, float, float]:
    """New tokens ``[batch, n]`` (NumPy), decode tokens/s and prefill seconds, on the chosen backend; only the
    ``words`` ids of the run's vocabulary are generated."""
    import numpy as np

    prompt = np.repeat(ids[None], args.batch, axis=0)
    opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, vocab_limit=words)
    if args.backend == "torch":
        import torch

        from backends.torch.generate import DTYPES, generate

        if args.threads:
            torch.set_num_threads(args.threads)
        out = generate(run, torch.as_tensor(prompt), dtype=DTYPES[args.dtype], **opts)
        return out.new_tokens.cpu().numpy(), out.tokens_per_sec, out.prefill_seconds
    from backends.jax.generate import DTYPES as JAX_DTYPES
    from backends.jax.generate import generate as jax_generate

    out = jax_generate(run, prompt, dtype=JAX_DTYPES[args.dtype], **opts)
    return np.asarray(out.new_tokens), out.tokens_per_sec, out.prefill_seconds


def main(argv: list[str] | None = None) -> int:
    from pcaf_core.config import ConfigError
    from pcaf_core.data import DataError
    from pcaf_core.streaming import NotStreamableError, StreamLimitError
    from pcaf_core.trained_run import (
        RunNotFoundError,
        VocabularyMismatchError,
        detokenize,
        encode_prompt,
        load_vocabulary,
        locate_run,
        run_data_config,
    )
    from pcaf_core.weights import WeightsError

    try:
        args, data = parse_args(sys.argv[1:] if argv is None else argv)
        run = locate_run(args.run_dir, args.checkpoint)
        vocab, tokenizer = load_vocabulary(run, run_data_config(run, data))
        ids, unknown = encode_prompt(vocab, args.prompt, tokenizer)
        if unknown:
            print(f"warning: prompt words not in the vocabulary, read as <unk>: {', '.join(map(repr, unknown[:10]))}"
                  + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""), file=sys.stderr)
        new, tok_s, prefill_s = _generate(args, run, ids, len(vocab))
    except (RunNotFoundError, VocabularyMismatchError, WeightsError, NotStreamableError, StreamLimitError,
            DataError, ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[{run.describe()}]")
    print(f"prompt ({len(ids)} tokens): {detokenize(vocab, ids)}")
    for b in range(args.batch):
        tag = "continuation" if args.batch == 1 else f"continuation {b}"
        print(f"{tag}: {detokenize(vocab, new[b])}")
    print(f"decode: {tok_s:.1f} tokens/s (backend={args.backend}, dtype={args.dtype}, batch={args.batch}, "
          f"{args.max_new_tokens} new tokens per sequence after a {len(ids)}-token prompt, prefill {prefill_s:.3f} s; "
          f"temperature={args.temperature}, top_k={args.top_k}, top_p={args.top_p}, seed={args.seed})")
    return 0


if __name__ == "__main__":
    ensure_tunables()
    sys.exit(main())
