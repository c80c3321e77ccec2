"""``python -m pcaf_core.data``: prepare corpora and summarise their caches.

Usage::

    python -m pcaf_core.data summary data=wikitext2 [data.max_vocab=20000] [--conventions] [--json] [--optional]
    python -m pcaf_core.data prepare data=pg19_mini data.max_vocab=32000 [--optional] [--rebuild]

``data=NAME`` picks the corpus; ``data.FIELD=VALUE`` sets any :class:`~pcaf_core.config.DataConfig`
field (``null`` for None). ``prepare`` locates the corpus, verifies its checksums, unpacks it
and builds the cache; with ``--optional`` a corpus that is not present is reported (with how
to get it) and skipped instead of failing. ``summary`` loads (building if needed) and prints
splits, documents, tokens, vocabulary size, ``<unk>``/OOV rates and the cache location;
``--conventions`` also counts the train split under each tokenizer / rows convention.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from pcaf_core.config import ConfigError, DataConfig

from .cache import TokenizedCorpus, load_corpus, resolve_settings
from .corpora import cache_root, get_spec, locate_source
from .errors import DataError, DataNotFoundError
from .tokenizer import get_tokenizer
from .verify import verify_source

_ROWS_TEXT = {"lines": "every line (blank ones too) + <eos>", "nonempty": "each non-empty row + <eos>"}
_LAYOUT_TEXT = {("wikitext", "tokens"): "the pre-tokenized wiki.*.tokens release",
                ("wikitext", "raw"): "the raw wiki.*.raw release", ("wikitext", "hf"): "Hugging Face datasets",
                ("pg19", "raw"): "one text file per book", ("pg19", "hf"): "Hugging Face datasets",
                ("text", "raw"): "your own text: a line or a file per row"}


def parse_overrides(items: list[str]) -> DataConfig:
    """``["data=pg19_mini", "data.max_vocab=32000"]`` -> a validated :class:`DataConfig`."""
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise DataError(f"cannot parse {item!r}: overrides look like data=NAME or data.FIELD=VALUE")
        if key == "data":
            values["name"] = raw
            continue
        if not key.startswith("data.") or key[5:] not in fields:
            raise DataError(f"unknown override {key!r}: use data=NAME or data.FIELD=VALUE with FIELD one of "
                            f"{sorted(fields)}")
        name = key[5:]
        default = fields[name].default
        optional = "None" in str(fields[name].type)
        if optional and raw.lower() in ("null", "none", ""):
            values[name] = None
        elif isinstance(default, int):
            try:
                values[name] = int(raw)
            except ValueError:
                raise DataError(f"data.{name} must be an integer, got {raw!r}") from None
        else:
            values[name] = raw
    return DataConfig(**values)


def count_conventions(cfg: DataConfig) -> list[dict[str, Any]]:
    """Train-split document and token counts (one ``<eos>`` per row) under every convention.

    WikiText, and a ``text`` corpus with a file per split: tokenizer {whitespace, regex} x rows {lines,
    nonempty}; PG-19 and a ``text`` corpus with a folder per split: rows are files.
    """
    settings = resolve_settings(cfg)
    source = locate_source(settings.name, settings.layout, cfg.data_dir)
    root = cache_root(cfg.cache_dir)
    wikitext = not source.rows_are_files(root)  # rows are lines: both row conventions apply
    out = []
    for tok_name in ("whitespace", "regex"):
        tok = get_tokenizer(tok_name)
        n_rows = n_nonempty = n_tokens = 0
        for doc in source.iter_documents("train", "lines" if wikitext else "nonempty", root):
            n_rows += 1
            if doc.strip():  # blank rows have no tokens under either tokenizer
                n_nonempty += 1
                n_tokens += len(tok(doc))
        options = [("lines", n_rows), ("nonempty", n_nonempty)] if wikitext else [("nonempty", n_nonempty)]
        for rows, docs in options:
            out.append({"tokenizer": tok_name, "rows": rows, "documents": docs, "tokens": n_tokens + docs,
                        "active": (tok_name, rows) == (settings.tokenizer, settings.rows),
                        "reference": (tok_name, rows) == ("regex", "nonempty")})
    return out


def summarize(corpus: TokenizedCorpus) -> dict[str, Any]:
    """A JSON-able summary of a loaded corpus (what ``summary --json`` prints)."""
    m = corpus.manifest
    splits = {}
    for split in corpus.arrays:
        st = corpus.split_stats(split)
        words = max(1, st["total_tokens"] - st["eos_tokens"])
        splits[split] = {**st, "unk_rate": st["unk_tokens"] / words, "oov_rate": st["oov_tokens"] / words}
    return {
        "corpus": corpus.settings.name, "title": m["corpus"]["title"], "family": m["corpus"]["family"],
        "settings": corpus.settings.as_dict(),
        "source": {k: m["source"][k] for k in ("origin", "location", "checks")},
        "vocab_size": corpus.vocab_size, "vocab_sha256": corpus.vocab.sha256,
        "train_types": m["vocab"]["train_types"], "cache_dir": str(corpus.cache_dir),
        "eval_split": corpus.eval_split, "splits": splits, "build_seconds": m["build"]["seconds"],
    }


def format_summary(s: dict[str, Any], conventions: list[dict[str, Any]] | None = None) -> str:
    """Human-readable rendering of :func:`summarize` (and optional convention counts)."""
    st = s["settings"]
    lines = [
        f"{s['title']} ({s['corpus']}), layout {st['layout']}: {_LAYOUT_TEXT[(s['family'], st['layout'])]}",
        f"  source       {s['source']['origin']} {s['source']['location']}",
        f"  checks       {'; '.join(s['source']['checks']) or '-'}",
        f"  tokenizer    {st['tokenizer']}; rows: {_ROWS_TEXT[st['rows']]}",
        f"  vocabulary   {s['vocab_size']:,} (max_vocab {st['max_vocab']}, min_freq {st['min_freq']}; "
        f"{s['train_types']:,} distinct train tokens; sha256 {s['vocab_sha256'][:12]})",
        f"  cache        {s['cache_dir']}",
        "",
        f"  {'split':<11}{'documents':>11}{'tokens':>13}{'loaded':>13}{'<unk>':>11}{'<unk> rate':>11}"
        f"{'OOV rate':>10}",
    ]
    for name, sp in s["splits"].items():
        mark = " (eval)" if name == s["eval_split"] else ""
        lines.append(f"  {name:<11}{sp['documents']:>11,}{sp['total_tokens']:>13,}{sp['loaded_tokens']:>13,}"
                     f"{sp['unk_tokens']:>11,}{sp['unk_rate']:>11.2%}{sp['oov_rate']:>10.2%}{mark}")
    lines.append("  tokens count one <eos> per document; rates are over non-<eos> tokens; OOV excludes "
                 "<unk> already present in the text")
    if conventions:
        lines += ["", "  train split under each convention (one <eos> per row):",
                  f"  {'tokenizer':<12}{'rows':<10}{'documents':>11}{'tokens':>13}"]
        for c in conventions:
            tags = [t for t, on in (("active", c["active"]), ("reference protocol", c["reference"])) if on]
            lines.append(f"  {c['tokenizer']:<12}{c['rows']:<10}{c['documents']:>11,}{c['tokens']:>13,}"
                         f"  {', '.join(tags)}".rstrip())
    return "\n".join(lines)


def _prepare(cfg: DataConfig, optional: bool, rebuild: bool) -> int:
    settings = resolve_settings(cfg)
    spec = get_spec(settings.name)
    try:
        source = locate_source(settings.name, settings.layout, cfg.data_dir)
    except DataNotFoundError as e:
        if optional:
            print(f"skipping {spec.title}: {e}")
            return 0
        raise
    print(f"{spec.title}: {source.describe()}")
    root = cache_root(cfg.cache_dir)
    for check in verify_source(source, root):
        print(f"  ok: {check}")
    corpus = load_corpus(cfg, rebuild=rebuild)
    print(format_summary(summarize(corpus)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcaf_core.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("summary", "prepare"))
    parser.add_argument("overrides", nargs="*", help="data=NAME and data.FIELD=VALUE")
    parser.add_argument("--conventions", action="store_true", help="summary: count train tokens per convention")
    parser.add_argument("--json", action="store_true", help="summary: print JSON")
    parser.add_argument("--optional", action="store_true", help="skip (exit 0) a corpus that is not present")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cache even if it is valid")
    parser.add_argument("-q", "--quiet", action="store_true", help="no build progress on stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    try:
        cfg = parse_overrides(args.overrides)
        if args.command == "prepare":
            return _prepare(cfg, args.optional, args.rebuild)
        try:
            corpus = load_corpus(cfg, rebuild=args.rebuild)
        except DataNotFoundError as e:
            if args.optional:
                print(f"skipping {get_spec(cfg.name).title}: {e}")
                return 0
            raise
        summary = summarize(corpus)
        conventions = count_conventions(cfg) if args.conventions else None
        if args.json:
            print(json.dumps({**summary, "conventions": conventions}, indent=2))
        else:
            print(format_summary(summary, conventions))
        return 0
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
