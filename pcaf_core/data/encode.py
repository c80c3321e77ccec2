"""Encoding a corpus into a token cache's arrays in bounded memory.

:func:`pcaf_core.data.cache.build_cache` owns the folder, the manifest and the locking; this module
turns documents into ids. Tokens get provisional ids in order of first appearance
(:class:`FirstSeenIds`); once the whole train split has been counted, the vocabulary is fixed and a
table maps provisional ids to final ones, chunk by chunk, straight into ``.npy`` files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .files import file_digest
from .tokenizer import EOS, UNK_ID, FirstSeenIds, get_tokenizer

log = logging.getLogger("pcaf_core.data")

COUNT_CHUNK = 1 << 22  # provisional ids are counted (bincount) and written in ~4M-token chunks
MAP_CHUNK = 1 << 24  # provisional -> final ids are mapped in 16M-token chunks (bounded memory)


def encode_train(documents: Iterable[str], tokenizer: str, ids: FirstSeenIds, prov_path: Path,
                 limit: int) -> dict[str, Any]:
    """Tokenize the train split's ``documents`` (each followed by ``<eos>``) into provisional ids.

    Counts every provisional id (for the vocabulary) and writes the first ``limit`` ids
    (``[limit] int32``, raw) to ``prov_path``. Memory stays bounded by one chunk plus the
    token table, whatever the corpus size.
    """
    tokenize = get_tokenizer(tokenizer)
    counts = np.zeros(len(ids), dtype=np.int64)
    pending: list[np.ndarray] = []
    state = {"pending": 0, "written": 0, "documents": 0, "total": 0, "next_log": 10_000_000}

    def flush(f: Any) -> None:
        nonlocal counts
        if not pending:
            return
        cat = np.concatenate(pending)
        pending.clear()
        state["pending"] = 0
        bc = np.bincount(cat, minlength=len(ids))
        if bc.shape[0] > counts.shape[0]:
            counts = np.concatenate([counts, np.zeros(bc.shape[0] - counts.shape[0], dtype=np.int64)])
        counts[: bc.shape[0]] += bc
        room = limit - state["written"]
        if room > 0:
            part = cat[:room]
            part.tofile(f)
            state["written"] += int(part.shape[0])

    with open(prov_path, "wb") as f:
        for doc in documents:
            toks = tokenize(doc)
            toks.append(EOS)
            arr = ids.encode(toks)
            pending.append(arr)
            state["documents"] += 1
            state["total"] += arr.shape[0]
            state["pending"] += arr.shape[0]
            if state["pending"] >= COUNT_CHUNK:
                flush(f)
            if state["total"] >= state["next_log"]:
                log.info("  train: %s tokens, %s documents so far", f"{state['total']:,}", f"{state['documents']:,}")
                state["next_log"] += 10_000_000
        flush(f)
    if counts.shape[0] < len(ids):
        counts = np.concatenate([counts, np.zeros(len(ids) - counts.shape[0], dtype=np.int64)])
    return {"counts": counts, "documents": state["documents"], "total": state["total"],
            "stored": state["written"]}


def map_to_npy(prov: np.ndarray, table: np.ndarray, out_path: Path) -> int:
    """Write ``table[prov]`` (``[n] int32``) as a ``.npy`` in bounded chunks; return its max id."""
    n = int(prov.shape[0])
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.int32, shape=(n,))
    max_id = -1
    for i in range(0, n, MAP_CHUNK):
        block = table[prov[i:i + MAP_CHUNK]]
        out[i:i + block.shape[0]] = block
        if block.size:
            max_id = max(max_id, int(block.max()))
    out.flush()
    del out
    return max_id


def split_counts(counts: np.ndarray, table: np.ndarray, documents: int, total: int) -> dict[str, int]:
    """``<unk>`` and OOV counts of a whole split from its provisional-id counts."""
    unk_total = int(counts[table == UNK_ID].sum())
    literal_unk = int(counts[UNK_ID]) if counts.shape[0] > UNK_ID else 0
    return {"documents": documents, "total_tokens": total, "eos_tokens": documents,
            "unk_tokens": unk_total, "oov_tokens": unk_total - literal_unk}


def encode_eval_split(documents: Iterable[str], tokenizer: str, ids: FirstSeenIds, table: np.ndarray, budget: int,
                      out_path: Path) -> dict[str, Any]:
    """Encode a validation or test split's ``documents`` into ``out_path``; return its manifest entry.

    The split is small enough to hold in memory. Tokens the train split never saw get new
    provisional ids, which the extended ``table`` maps to ``<unk>``. ``budget`` > 0 stores only
    that many leading tokens (the counts still cover the whole split).
    """
    tokenize = get_tokenizer(tokenizer)
    parts = []
    n_documents = 0
    for doc in documents:
        toks = tokenize(doc)
        toks.append(EOS)
        parts.append(ids.encode(toks))
        n_documents += 1
    prov = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    full_table = np.concatenate([table, np.full(len(ids) - table.shape[0], UNK_ID, dtype=np.int32)])
    counts = np.bincount(prov, minlength=len(ids))
    stored = prov.shape[0] if budget == 0 else min(budget, prov.shape[0])
    max_id = map_to_npy(prov[:stored], full_table, out_path)
    log.info("  %s: %s documents, %s tokens", out_path.stem, f"{n_documents:,}", f"{prov.shape[0]:,}")
    return {"file": out_path.name, "stored_tokens": int(stored), "max_id": max_id,
            "sha256": file_digest(out_path), **split_counts(counts, full_table, n_documents, int(prov.shape[0]))}
