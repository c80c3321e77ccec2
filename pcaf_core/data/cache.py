"""Token caches: build once, verify on every load, rebuild when stale.

A cache is one folder ``<cache root>/<name>-<layout>-v<max_vocab>-<key>/`` holding

* ``train.npy``, ``validation.npy``, ``test.npy`` — ``[N] int32`` token ids of each split
  (rows joined with ``<eos>`` after each), loaded memory-mapped;
* ``vocab.json`` — the vocabulary (JSON list, id order);
* ``manifest.json`` — settings, source fingerprint (with sha256), vocabulary hash and size,
  per-split documents / token counts / ``<unk>`` counts, the sha256 of each split's ``.npy`` file,
  and how long the build took.

Every load verifies the arrays against those digests (docs/DATA.md gives the cost), so a flipped
byte is never trained on: a cache whose arrays do not match, or whose manifest predates the
digests, is rebuilt with a warning that says why (or refused when the source is not there).

``key`` hashes everything that changes the token ids (corpus, layout, tokenizer, rows,
max_vocab, min_freq, format version). Budgets do not: a cache stores each split whole, or
(when built for a budget) a prefix at least as long as the budget, and a later request is
served whenever the stored prefix is long enough. The vocabulary is always that of the
whole, untruncated train split.

Builds are atomic: everything is written into a hidden temporary folder beside the cache,
fsync'd, and renamed into place with the manifest written last, so a killed or failed build
leaves nothing a later load would trust. A file lock serialises concurrent builders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pcaf_core.fsutil import atomic_write_bytes, file_lock, fsync_path

from . import encode, own_corpus
from .corpora import (
    SPLITS,
    Source,
    cache_root,
    fingerprints_match,
    get_spec,
    locate_source,
)
from .errors import DataError, DataNotFoundError
from .files import file_digest
from .tokenizer import (
    SPECIALS,
    TOKEN_PATTERN,
    FirstSeenIds,
    Vocabulary,
    check_token_ids,
    get_tokenizer,
    rank_by_count,
)
from .verify import verify_source

if TYPE_CHECKING:
    from pcaf_core.config import DataConfig

log = logging.getLogger("pcaf_core.data")

FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------
# Settings and budgets
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CorpusSettings:
    """Everything that determines the token ids of a cache (``auto`` values resolved)."""

    name: str
    layout: str
    tokenizer: str
    rows: str
    max_vocab: int
    min_freq: int
    # The corpus folder, for a corpus of your own (data.name=text), where the folder is what names the corpus;
    # '' (and left out of as_dict and the key) for the published corpora, whose caches do not move with them.
    folder: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["folder"]:
            del d["folder"]
        return d

    @property
    def key(self) -> str:
        blob = json.dumps({"format_version": FORMAT_VERSION, **self.as_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def dir_name(self) -> str:
        return f"{self.name}-{self.layout}-v{self.max_vocab}-{self.key}"


def resolve_settings(cfg: DataConfig) -> CorpusSettings:
    """Resolve ``auto`` fields of a :class:`~pcaf_core.config.DataConfig`.

    * PG-19 corpora have one text release (a file per book), and so does a corpus of your own
      (``data.name=text``): layouts ``tokens`` and ``raw`` both name it, recorded as ``raw``.
    * ``tokenizer=auto``: ``whitespace`` for the pre-tokenized WikiText ``tokens`` release (its
      text is already tokens; the regex would split ``<unk>`` and ``@-@``), else ``regex``
      (the reference).
    * ``rows=auto``: ``lines`` for the WikiText ``tokens`` release (every line followed by
      ``<eos>``, the convention its published token counts use: WikiText-2 train = 2,088,628),
      else ``nonempty`` (the reference: each non-empty line / each book).
    """
    spec = get_spec(cfg.name)
    layout = cfg.layout
    if spec.family in ("pg19", "text") and layout == "tokens":
        layout = "raw"
    if layout not in spec.layouts():
        raise DataError(f"{spec.title} has no layout {layout!r}: set data.layout to one of {list(spec.layouts())}")
    release = spec.family == "wikitext" and layout == "tokens"
    tokenizer = getattr(cfg, "tokenizer", "auto")
    rows = getattr(cfg, "rows", "auto")
    if tokenizer == "auto":
        tokenizer = "whitespace" if release else "regex"
    if rows == "auto":
        rows = "lines" if release else "nonempty"
    get_tokenizer(tokenizer)  # validates the name
    if spec.family == "pg19" and rows != "nonempty":
        raise DataError("PG-19 rows are whole books: data.rows must be 'nonempty' or 'auto'")
    folder = str(own_corpus.corpus_folder(cfg.data_dir)) if spec.family == "text" else ""
    return CorpusSettings(name=cfg.name, layout=layout, tokenizer=tokenizer, rows=rows,
                          max_vocab=int(cfg.max_vocab), min_freq=int(cfg.min_freq), folder=folder)


@dataclass(frozen=True)
class Budgets:
    """Token budgets (0 = the whole split): ``train`` for train, ``eval`` for validation and test."""

    train: int = 0
    eval: int = 0

    def for_split(self, split: str) -> int:
        return self.train if split == "train" else self.eval


# --------------------------------------------------------------------------------------------
# The loaded corpus
# --------------------------------------------------------------------------------------------

@dataclass
class TokenizedCorpus:
    """A corpus as ``[N] int32`` token-id arrays plus its vocabulary and manifest.

    ``train`` / ``valid`` / ``test`` are memory-mapped (read-only) and already truncated to
    ``data.max_train_tokens`` / ``data.max_eval_tokens``; ``eval`` is the split named by
    ``data.eval_split``. Every id lies in ``[0, vocab_size)`` (checked on load).
    """

    settings: CorpusSettings
    vocab: Vocabulary
    manifest: dict[str, Any]
    cache_dir: Path
    eval_split: str
    arrays: dict[str, np.ndarray] = field(repr=False)

    @property
    def train(self) -> np.ndarray:
        return self.arrays["train"]

    @property
    def valid(self) -> np.ndarray:
        return self.arrays["validation"]

    @property
    def test(self) -> np.ndarray:
        return self.arrays["test"]

    @property
    def eval(self) -> np.ndarray:
        return self.arrays[self.eval_split]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def layout(self) -> str:
        return self.settings.layout

    def split(self, name: str) -> np.ndarray:
        """Token ids of ``train``, ``validation`` (or ``valid``) or ``test``."""
        name = "validation" if name == "valid" else name
        if name not in self.arrays:
            raise DataError(f"unknown split {name!r}: use one of {list(self.arrays)}")
        return self.arrays[name]

    def split_stats(self, name: str) -> dict[str, Any]:
        """Manifest counts of a split (whole split) plus the loaded length."""
        name = "validation" if name == "valid" else name
        return {**self.manifest["splits"][name], "loaded_tokens": int(self.arrays[name].shape[0])}

    def record(self) -> dict[str, Any]:
        """What a result record should carry about its data: corpus, layout, tokenizer, sizes."""
        return {
            **self.settings.as_dict(),
            "cache_key": self.settings.key,
            "vocab_size": self.vocab_size,
            "vocab_sha256": self.vocab.sha256,
            "source": self.manifest["source"]["location"],
            "source_origin": self.manifest["source"]["origin"],
            "eval_split": self.eval_split,
            "tokens": {s: int(a.shape[0]) for s, a in self.arrays.items()},
        }


# --------------------------------------------------------------------------------------------
# Validation of an existing cache
# --------------------------------------------------------------------------------------------

def read_manifest(cache_dir: Path) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of ``cache_dir``, or None when absent or unreadable."""
    try:
        return json.loads((cache_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _stale_reason(cache_dir: Path, settings: CorpusSettings, budgets: Budgets,
                  source: Source | None) -> tuple[str | None, dict[str, Any] | None]:
    """Why the cache at ``cache_dir`` cannot be trusted for this request (None: it can)."""
    try:
        return _check_cache(cache_dir, settings, budgets, source)
    except (KeyError, TypeError, AttributeError) as e:  # a manifest written by hand or another version
        return f"malformed manifest ({type(e).__name__}: {e})", None


def _check_cache(cache_dir: Path, settings: CorpusSettings, budgets: Budgets,
                 source: Source | None) -> tuple[str | None, dict[str, Any] | None]:
    if not cache_dir.exists():
        return "no cache yet", None
    m = read_manifest(cache_dir)
    if m is None:
        return "no readable manifest (an interrupted or damaged build)", None
    if m.get("format_version") != FORMAT_VERSION:
        return f"cache format {m.get('format_version')} != {FORMAT_VERSION}", None
    if m.get("settings") != settings.as_dict():
        rec = m.get("settings") or {}
        diff = {k: (rec.get(k), v) for k, v in settings.as_dict().items() if rec.get(k) != v}
        return f"built with other settings (recorded, requested): {diff}", None
    for split in SPLITS:
        info = m.get("splits", {}).get(split)
        if info is None:
            return f"split {split} missing from the manifest", None
        need = budgets.for_split(split)
        need = info["total_tokens"] if need == 0 else min(need, info["total_tokens"])
        if info["stored_tokens"] < need:
            return (f"{split} holds a {info['stored_tokens']:,}-token prefix, {need:,} requested "
                    f"(a larger token budget)"), None
        p = cache_dir / info["file"]
        try:
            arr = np.load(p, mmap_mode="r")
        except (OSError, ValueError) as e:
            return f"{p.name} unreadable ({e})", None
        if arr.dtype != np.int32 or arr.ndim != 1 or arr.shape[0] != info["stored_tokens"]:
            return f"{p.name} has shape {arr.shape} {arr.dtype}, manifest says {info['stored_tokens']} int32", None
        del arr
        if "sha256" not in info:
            return ("its manifest has no checksums of the token arrays (built by an earlier version of the suite); "
                    "rebuilt once so that every load can verify them"), None
        if file_digest(p) != info["sha256"]:
            return (f"{p} does not match the sha256 in its manifest: the array was changed or damaged after the "
                    "build (a flipped byte would change the results)"), None
    try:
        vocab_sha = hashlib.sha256((cache_dir / m["vocab"]["file"]).read_bytes()).hexdigest()
    except OSError:
        return "vocabulary file missing or unreadable", None
    if vocab_sha != m["vocab"]["sha256"]:
        return "vocabulary file does not match the manifest's sha256", None
    if source is not None:
        ok, refreshed = fingerprints_match(source, m["source"])
        if not ok:
            return f"the source changed since the build ({source.describe()})", None
        if refreshed and (refreshed != m["source"].get("files") or m["source"]["location"] != source.location):
            # Same content, new mtimes or place (a copy or a re-extraction): remember them so
            # the next load is a stat-only check again.
            m["source"]["files"] = refreshed
            m["source"]["location"] = source.location
            try:
                atomic_write_bytes(cache_dir / "manifest.json", _manifest_bytes(m))
            except OSError:
                pass  # a read-only cache stays valid; the next load just re-hashes again
    return None, m


def _manifest_bytes(m: dict[str, Any]) -> bytes:
    return (json.dumps(m, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------

def _build_into(tmp: Path, settings: CorpusSettings, source: Source, root: Path,
                budgets: Budgets) -> dict[str, Any]:
    """Write a complete cache into the empty folder ``tmp``; return its manifest."""
    t0 = time.perf_counter()
    spec = get_spec(settings.name)
    checks = verify_source(source, root)
    fingerprint = source.full_fingerprint()
    ids = FirstSeenIds()

    # Train: counts over the whole split define the vocabulary; only the budget is stored.
    limit = budgets.train if budgets.train > 0 else np.iinfo(np.int64).max
    prov_path = tmp / "train.prov.bin"
    tr = encode.encode_train(source.iter_documents("train", settings.rows, root), settings.tokenizer, ids,
                             prov_path, limit)
    if tr["total"] == 0:
        raise DataError(f"{spec.title} train split has no tokens ({source.describe()}): the files are empty; "
                        f"restore the corpus (`make data`)")
    vocab, table = rank_by_count(tr["counts"], ids.tokens(), settings.max_vocab, settings.min_freq)
    # Memory-mapped, so a multi-GB train split is mapped chunk by chunk, never loaded whole.
    prov = np.memmap(prov_path, dtype=np.int32, mode="r") if tr["stored"] else np.zeros(0, dtype=np.int32)
    max_id = encode.map_to_npy(prov, table, tmp / "train.npy")
    del prov
    prov_path.unlink()
    splits: dict[str, Any] = {"train": {"file": "train.npy", "stored_tokens": tr["stored"], "max_id": max_id,
                                        "sha256": file_digest(tmp / "train.npy"),
                                        **encode.split_counts(tr["counts"], table, tr["documents"], tr["total"])}}
    train_types = int(np.count_nonzero(tr["counts"][len(SPECIALS):]))
    log.info("  train: %s documents, %s tokens, %s types -> vocabulary %s",
             f"{tr['documents']:,}", f"{tr['total']:,}", f"{train_types:,}", f"{len(vocab):,}")

    # Validation / test: small enough to hold in memory; new tokens map to <unk>.
    for split in SPLITS[1:]:
        splits[split] = encode.encode_eval_split(source.iter_documents(split, settings.rows, root),
                                                 settings.tokenizer, ids, table, budgets.eval, tmp / f"{split}.npy")

    for info in splits.values():
        if info["max_id"] >= len(vocab):
            raise DataError(f"internal: token id {info['max_id']} >= vocabulary size {len(vocab)}")
    vocab.save(tmp / "vocab.json")
    return {
        "format_version": FORMAT_VERSION,
        "key": settings.key,
        "settings": settings.as_dict(),
        "corpus": {"title": spec.title, "family": spec.family},
        "source": {"origin": source.origin, "location": source.location, "layout": settings.layout,
                   "checks": checks, **{k: v for k, v in fingerprint.items() if k != "origin"}},
        "tokenizer": {"name": settings.tokenizer,
                      "pattern": TOKEN_PATTERN if settings.tokenizer == "regex" else None,
                      "rows": settings.rows, "specials": {s: i for i, s in enumerate(SPECIALS)}},
        "vocab": {"file": "vocab.json", "size": len(vocab), "sha256": vocab.sha256,
                  "max_vocab": settings.max_vocab, "min_freq": settings.min_freq, "train_types": train_types},
        "splits": splits,
        "build": {"seconds": round(time.perf_counter() - t0, 3),
                  "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
                  "budgets": asdict(budgets), "python": platform.python_version(), "numpy": np.__version__},
    }


def _install(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` folder to ``final`` (replacing a stale one) atomically enough:
    at every instant ``final`` is absent, the old cache, or the complete new one."""
    for p in tmp.iterdir():
        fsync_path(p)
    fsync_path(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_cache(settings: CorpusSettings, source: Source, root: Path, budgets: Budgets = Budgets(),
                *, force: bool = False) -> tuple[Path, dict[str, Any]]:
    """Build (or find ready) the cache for ``settings`` under ``root``; return ``(dir, manifest)``.

    Holds a lock for the cache key; re-checks under the lock (another process may just have
    built it); removes temporary folders left by killed builds; writes into a fresh temporary
    folder, manifest last, and installs it with :func:`os.replace`.
    """
    final = root / settings.dir_name
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".locks" / f"{settings.dir_name}.lock"):
        if not force:
            reason, m = _stale_reason(final, settings, budgets, source)
            if reason is None and m is not None:
                return final, m
        for orphan in root.glob(f".{settings.dir_name}.*"):
            shutil.rmtree(orphan, ignore_errors=True)  # we hold the lock: nobody else is writing these
        tmp = root / f".{settings.dir_name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            manifest = _build_into(tmp, settings, source, root, budgets)
            atomic_write_bytes(tmp / "manifest.json", _manifest_bytes(manifest))
            _install(tmp, final)
            log.info("built %s in %.1f s", final, time.perf_counter() - t0)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final, manifest


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def _open(final: Path, manifest: dict[str, Any], settings: CorpusSettings, budgets: Budgets,
          eval_split: str) -> TokenizedCorpus:
    vocab = Vocabulary.load(final / manifest["vocab"]["file"], expected_sha256=manifest["vocab"]["sha256"])
    if len(vocab) != manifest["vocab"]["size"]:
        raise DataError(f"{final}: vocabulary has {len(vocab)} entries, manifest says {manifest['vocab']['size']}; "
                        f"delete {final} and load again to rebuild")
    arrays: dict[str, np.ndarray] = {}
    for split in SPLITS:
        info = manifest["splits"][split]
        arr = np.load(final / info["file"], mmap_mode="r")
        n = budgets.for_split(split)
        arr = arr if n == 0 else arr[: min(n, arr.shape[0])]
        check_token_ids(arr, len(vocab), what=f"{final.name}/{info['file']}",
                        fix=f"the cache is damaged: delete {final} and load again to rebuild it")
        arrays[split] = arr
    return TokenizedCorpus(settings=settings, vocab=vocab, manifest=manifest, cache_dir=final,
                           eval_split=eval_split, arrays=arrays)


def load_corpus(cfg: DataConfig, *, rebuild: bool = False,
                on_build: Callable[[str], None] | None = None) -> TokenizedCorpus:
    """The corpus of ``cfg`` as token arrays, built into the cache on first use.

    Locates the source (``data.data_dir`` / ``$PCAF_DATA_DIR`` / the repository's ``data/`` /
    ``../shared/data``, or the hub for ``layout=hf``), checks the cache against settings,
    source fingerprint and budgets, (re)builds it when needed, and opens it memory-mapped.
    When the source cannot be found but a complete cache for the same settings exists, the
    cache is used (with a warning: its freshness cannot be checked). ``rebuild`` forces a
    build; ``on_build`` (e.g. ``print``) is told why a build happens.
    """
    settings = resolve_settings(cfg)
    budgets = Budgets(train=int(cfg.max_train_tokens), eval=int(cfg.max_eval_tokens))
    root = cache_root(cfg.cache_dir)
    final = root / settings.dir_name
    try:
        source = locate_source(settings.name, settings.layout, cfg.data_dir)
    except DataNotFoundError as e:
        if rebuild:
            raise
        reason, m = _stale_reason(final, settings, budgets, None)
        if reason is not None and final.exists():
            raise DataError(f"the cache {final} cannot be used ({reason}) and its source, needed to rebuild it, is "
                            f"not found: {e}") from e
        if reason is not None or m is None:
            raise
        log.warning("%s: source not found; using the cache %s built from %s (its freshness cannot be checked)",
                    settings.name, final, m["source"]["location"])
        return _open(final, m, settings, budgets, cfg.eval_split)
    reason, m = ("rebuild requested", None) if rebuild else _stale_reason(final, settings, budgets, source)
    if reason is not None or m is None:
        msg = f"building the {settings.name} cache ({reason}) from {source.describe()} into {final}"
        # Rebuilding a cache that exists (damaged, out of date) is worth a warning; a first build is routine.
        log.log(logging.WARNING if final.exists() and not rebuild else logging.INFO, msg)
        if on_build is not None:
            on_build(msg)
        final, m = build_cache(settings, source, root, budgets, force=rebuild)
    return _open(final, m, settings, budgets, cfg.eval_split)
