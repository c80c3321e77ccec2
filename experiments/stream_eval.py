"""The ``stream`` protocol on a trained run: ``python -m experiments.stream_eval run_dir=<run>``.

Reads every document of the run's evaluation split token by token with the torch streaming state and
reports PPL for each memory condition (:mod:`pcaf_core.stream_protocol`: none, the training window, the
last T / 4T / 16T positions, the whole document). Writes ``stream_<table>_<row>_<scale>.{csv,md,png}`` into
``out_dir`` (default ``<run_dir>/stream``) and prints the Markdown path last.

Options (``key=value``): ``multiples`` (``1,4,16``: the sliding horizons in units of T), ``batch`` (8
documents at a time), ``max_docs`` / ``max_doc_tokens`` (0 = all; a cap is written into the outputs),
``policy`` (decode under another candidate policy than the run trained with, e.g. ``recent`` for a
``topk_score`` run; labelled as a deviation), ``threads`` (torch intra-op threads; 0 = torch's default),
``dtype`` (fp32 | fp64), ``checkpoint``, ``out_dir``, ``data.data_dir`` / ``data.cache_dir``.
"""

from __future__ import annotations

import csv
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.allocator import ensure_tunables
from experiments.key_value_args import parse_key_values

USAGE = "usage: python -m experiments.stream_eval run_dir=<run directory> [key=value ...]"


@dataclass
class StreamEvalArgs:
    run_dir: str = ""
    multiples: str = "1,4,16"
    batch: int = 8
    max_docs: int = 0
    max_doc_tokens: int = 0
    policy: str = ""
    dtype: str = "fp32"
    checkpoint: str | None = None
    out_dir: str = ""
    threads: int = 0


def parse_args(argv: list[str]) -> tuple[StreamEvalArgs, dict[str, str]]:
    args, data = parse_key_values(argv, StreamEvalArgs, USAGE)
    if args.dtype not in ("fp32", "fp64"):
        raise ValueError(f"dtype={args.dtype!r} is unknown: expected fp32 or fp64")
    if args.policy not in ("", "recent", "first"):
        raise ValueError(f"policy={args.policy!r} is not streamable: expected recent or first")
    for name in ("batch",):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1")
    return args, data


def _multiples(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(m) for m in text.split(",") if m.strip())
    except ValueError:
        raise ValueError(f"multiples must be integers separated by commas, got {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"multiples must be integers >= 1, got {text!r}")
    return out


def write_outputs(out_dir: Path, stem: str, header: list[str], results: list, window: int, labels: dict[str, Any]
                  ) -> Path:
    """CSV (one row per condition, labels in every row), Markdown (labels, table, definitions) and a plot
    of PPL against the memory horizon. Returns the Markdown path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pcaf_core.fsutil import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{**labels, "condition": r.condition.name, "memory": r.condition.describe(window),
             "horizon_tokens": r.condition.horizon if r.condition.kind == "last" else "",
             "ppl": f"{r.ppl:.4f}", "nll": f"{r.nll:.6f}", "targets": r.targets} for r in results]
    csv_path = out_dir / f"{stem}.csv"
    with open(csv_path.with_suffix(".csv.tmp"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    csv_path.with_suffix(".csv.tmp").replace(csv_path)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    sliding = [r for r in results if r.condition.kind == "last"]
    doc = next(r for r in results if r.condition.kind == "document")
    xs = [r.condition.horizon / window for r in sliding]
    doc_x = max(xs + [1.0]) * 4
    ax.plot(xs + [doc_x], [r.ppl for r in sliding] + [doc.ppl], "o-", label="memory of the last H positions")
    ax.annotate("whole\ndocument", (doc_x, doc.ppl), textcoords="offset points", xytext=(0, 8), ha="center",
                fontsize=8)
    for r, style in ((next(r for r in results if r.condition.kind == "none"), ":"),
                     (next(r for r in results if r.condition.kind == "window"), "--")):
        ax.axhline(r.ppl, linestyle=style, color="grey", label=f"{r.condition.describe(window)}: {r.ppl:.1f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"memory horizon H / T (T = {window})")
    ax.set_ylabel("PPL (protocol=stream)")
    ax.set_title(f"{labels['row']} ({labels['scale']}, {labels['dataset']} {labels['split']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = out_dir / f"{stem}.png"
    fig.savefig(png.with_suffix(".tmp.png"), dpi=120)
    plt.close(fig)
    png.with_suffix(".tmp.png").replace(png)

    lines = [f"# Memory beyond the window: {labels['table']}/{labels['row']} ({labels['scale']})", ""]
    lines += [f"- {h}" for h in header] + ["", "| condition | readable records | PPL | NLL | predicted tokens |",
                                           "|---|---|---|---|---|"]
    lines += [f"| {r.condition.name} | {r.condition.describe(window)} | {r.ppl:.2f} | {r.nll:.4f} | {r.targets:,} |"
              for r in results]
    lines += ["", f"![PPL against memory horizon]({png.name})", "",
              "Every condition reads the same documents with the same backbone and head (the local path sees its "
              "usual receptive field throughout); only the records the query may read differ. A bucket holds at "
              "most K records in every condition (docs/EXPERIMENTS.md, `stream` protocol)."]
    md = out_dir / f"{stem}.md"
    atomic_write_text(md, "\n".join(lines) + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    import torch

    from backends.torch.generate import DTYPES, load_model
    from backends.torch.stream_eval import evaluate_stream
    from backends.torch.streaming import TorchStream
    from pcaf_core.config import ConfigError
    from pcaf_core.data import DataError, load_corpus
    from pcaf_core.data.documents import document_bounds
    from pcaf_core.stream_protocol import PROTOCOL, conditions
    from pcaf_core.streaming import NotStreamableError
    from pcaf_core.trained_run import RunNotFoundError, VocabularyMismatchError, locate_run, run_data_config
    from pcaf_core.weights import WeightsError

    try:
        args, locations = parse_args(sys.argv[1:] if argv is None else argv)
        multiples = _multiples(args.multiples)
        run = locate_run(args.run_dir, args.checkpoint)
        cfg = run.config
        trained_policy = cfg.memory.candidate_policy
        if args.policy and args.policy != trained_policy:
            run = dataclasses.replace(run, config=dataclasses.replace(
                cfg, memory=dataclasses.replace(cfg.memory, candidate_policy=args.policy)))
        net, run = load_model(run, dtype=DTYPES[args.dtype])
        stream = TorchStream(net, window=cfg.train.seq_len, mode=cfg.train.mode)
        data = run_data_config(run, locations)
        corpus = load_corpus(data)
        bounds = document_bounds(corpus.eval, corpus.vocab, data.name)
    except (RunNotFoundError, VocabularyMismatchError, WeightsError, NotStreamableError, DataError, ConfigError,
            ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_docs:
        bounds = bounds[: args.max_docs]
    docs = [corpus.eval[s:e] for s, e in bounds]
    if args.max_doc_tokens:
        docs = [d[: args.max_doc_tokens] for d in docs]
    docs = [d for d in docs if len(d) >= 2]
    T, policy = cfg.train.seq_len, run.config.memory.candidate_policy
    conds = conditions(T, policy, multiples)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"[{run.describe()}] protocol={PROTOCOL}: {len(docs)} documents, {sum(map(len, docs)):,} tokens of "
          f"{data.name} {data.eval_split}, conditions {[c.name for c in conds]}", file=sys.stderr)
    start = time.perf_counter()
    results, timing = evaluate_stream(stream, docs, conds, batch=args.batch,
                                      progress=lambda m: print(f"  {m}", file=sys.stderr))
    wall = time.perf_counter() - start
    lengths = [len(d) for d in docs]
    labels = {"table": run.labels.get("table", "?"), "row": run.labels.get("row", "?"),
              "scale": run.labels.get("scale", "?"), "profile": cfg.profile.name, "seed": cfg.train.seed,
              "step": run.step, "protocol": PROTOCOL, "backend": "torch", "dtype": args.dtype,
              "dataset": data.name, "split": data.eval_split, "T": T, "K": cfg.memory.top_k,
              "buckets": cfg.memory.num_buckets, "policy": policy}
    deviations = []
    if policy != trained_policy:
        deviations.append(f"decoded under candidate_policy={policy}, trained with {trained_policy}")
    if args.max_docs or args.max_doc_tokens:
        deviations.append(f"capped: max_docs={args.max_docs or 'all'}, max_doc_tokens={args.max_doc_tokens or 'all'}")
    if data.max_eval_tokens:
        deviations.append(f"evaluation split truncated to data.max_eval_tokens={data.max_eval_tokens}")
    header = [
        f"run: `{run.run_dir}` ({run.describe()})",
        f"protocol: {PROTOCOL}; backend torch, dtype {args.dtype}; training window T = {T} ({cfg.train.mode}), "
        f"K = {cfg.memory.top_k}, B = {cfg.memory.num_buckets}, n = {cfg.memory.context_order}, policy {policy}",
        f"data: {data.name} {data.eval_split}, {len(docs)} documents, {sum(lengths):,} tokens "
        f"(median {int(sorted(lengths)[len(lengths) // 2]):,}, longest {max(lengths):,})",
        f"wall time {wall:.0f} s ({timing['steps']:,} steps of batch <= {args.batch}, "
        f"{timing['tokens'] / max(timing['seconds'], 1e-9):.0f} document tokens/s)",
        "command: `python -m experiments.stream_eval " + " ".join(sys.argv[1:] if argv is None else argv) + "`",
    ] + [f"deviation: {d}" for d in deviations]
    out_dir = Path(args.out_dir) if args.out_dir else run.run_dir / "stream"
    stem = f"stream_{labels['table']}_{labels['row']}_{labels['scale']}"
    md = write_outputs(out_dir, stem, header, results, T, labels)
    for r in results:
        print(f"[{labels['table']}/{labels['row']} scale={labels['scale']} protocol={PROTOCOL} "
              f"memory={r.condition.name}] PPL {r.ppl:.2f} over {r.targets:,} tokens", file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":
    ensure_tunables()
    sys.exit(main())
