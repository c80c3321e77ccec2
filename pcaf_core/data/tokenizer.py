"""Word-level tokenizers and the vocabulary (docs/REFERENCE_CODE.md §5.1).

Two tokenizers:

* ``regex`` — the reference's ``re.findall(r"\\w+|[^\\w\\s]", text)``: runs of word characters
  and single punctuation characters, case-sensitive. Applied to the *pre-tokenized* WikiText
  release it splits the literal ``<unk>`` into ``<``, ``unk``, ``>`` and ``@-@`` into ``@``, ``-``,
  ``@``, exactly as the reference regex would.
* ``whitespace`` — ``str.split()``: the tokenization the WikiText ``wiki.*.tokens`` release was
  made with (its text is already space-separated tokens and its OOV words are the literal
  ``<unk>``, which maps to the special id 1).

Vocabulary: specials ``<pad>=0, <unk>=1, <eos>=2``, then the most frequent tokens of the whole
train split with count >= ``min_freq``, at most ``max_vocab - 3`` of them, ties in first-seen
order (``collections.Counter.most_common`` semantics). Tokens equal to a special's spelling
are never ranked: they map to the special's id.

:func:`build_vocab` is the plain, readable definition (a ``Counter``); the cache builder uses
:class:`FirstSeenIds` + :func:`rank_by_count`, which give the identical vocabulary from integer
arrays and are what makes a 100M-token build fast. Tests check the two agree.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from .errors import DataError

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIALS: tuple[str, ...] = (PAD, UNK, EOS)
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2

TOKEN_PATTERN = r"\w+|[^\w\s]"
_TOKEN_RE = re.compile(TOKEN_PATTERN)

TOKENIZERS = ("regex", "whitespace")


def regex_tokenize(text: str) -> list[str]:
    """The reference tokenizer: ``re.findall(r"\\w+|[^\\w\\s]", text)`` (Unicode ``\\w``)."""
    return _TOKEN_RE.findall(text)


def whitespace_tokenize(text: str) -> list[str]:
    """Split on runs of Unicode whitespace (``str.split()``), for pre-tokenized text."""
    return text.split()


def get_tokenizer(name: str) -> Callable[[str], list[str]]:
    """Return the tokenizer function called ``name`` (``regex`` or ``whitespace``)."""
    if name == "regex":
        return regex_tokenize
    if name == "whitespace":
        return whitespace_tokenize
    raise DataError(f"unknown tokenizer {name!r}: set data.tokenizer to one of {list(TOKENIZERS)} or 'auto'")


class Vocabulary:
    """An id <-> token table whose first three entries are ``<pad>, <unk>, <eos>``.

    ``itos[i]`` is the token of id ``i``; :meth:`encode` maps unknown tokens to ``<unk>`` (1).
    The :attr:`sha256` digest identifies the exact table; the cache manifest stores it.
    """

    def __init__(self, itos: Sequence[str]):
        itos = tuple(itos)
        if itos[: len(SPECIALS)] != SPECIALS:
            raise DataError(f"a vocabulary must start with {list(SPECIALS)}, got {list(itos[:3])}")
        stoi = {t: i for i, t in enumerate(itos)}
        if len(stoi) != len(itos):
            dup = [t for t, c in Counter(itos).items() if c > 1][:5]
            raise DataError(f"vocabulary has duplicate tokens {dup}; rebuild the cache")
        self.itos: tuple[str, ...] = itos
        self.stoi: dict[str, int] = stoi

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.itos == other.itos

    def __hash__(self) -> int:
        return hash(self.itos)

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)}, sha256={self.sha256[:12]})"

    @property
    def size(self) -> int:
        return len(self.itos)

    def _canonical_bytes(self) -> bytes:
        return json.dumps(list(self.itos), ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @functools.cached_property
    def sha256(self) -> str:
        """Digest of the canonical JSON encoding of ``itos`` (what :meth:`save` writes); computed once (``itos``
        is a tuple: a 20,000-token table takes ~7 ms to encode)."""
        return hashlib.sha256(self._canonical_bytes()).hexdigest()

    def encode_tokens(self, tokens: Iterable[str]) -> np.ndarray:
        """Token strings -> ``[n] int32`` ids, OOV -> 1."""
        get = self.stoi.get
        return np.fromiter((get(t, UNK_ID) for t in tokens), dtype=np.int32)

    def encode(self, text: str, tokenizer: str = "regex", eos: bool = False) -> np.ndarray:
        """Tokenize ``text`` and map it to ``[n] int32`` ids (``eos`` appends ``<eos>``)."""
        toks = get_tokenizer(tokenizer)(text)
        if eos:
            toks.append(EOS)
        return self.encode_tokens(toks)

    def decode(self, ids: Iterable[int] | np.ndarray) -> list[str]:
        """Ids -> token strings. Raises :class:`DataError` on an id outside ``[0, size)``."""
        out = []
        n = len(self.itos)
        for i in np.asarray(ids, dtype=np.int64).reshape(-1):
            if not 0 <= i < n:
                raise DataError(f"token id {int(i)} is outside the vocabulary [0, {n}); the ids do not "
                                f"come from this vocabulary (rebuild the cache or check data.max_vocab)")
            out.append(self.itos[i])
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as a JSON list (UTF-8); :meth:`load` reads it back."""
        Path(path).write_bytes(self._canonical_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike, expected_sha256: str | None = None) -> Vocabulary:
        """Read a table written by :meth:`save`, optionally checking its digest."""
        p = Path(path)
        try:
            raw = p.read_bytes()
            itos = json.loads(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"cannot read vocabulary {p}: {e}; delete its cache directory "
                            f"{p.parent} and load again to rebuild it") from e
        if not isinstance(itos, list) or not all(isinstance(t, str) for t in itos):
            raise DataError(f"vocabulary {p} is not a JSON list of strings; delete {p.parent} to rebuild it")
        vocab = cls(itos)
        digest = hashlib.sha256(raw).hexdigest()
        if digest == expected_sha256:  # the file holds the canonical encoding, so its digest is the table's
            vocab.sha256 = digest
        if expected_sha256 is not None and vocab.sha256 != expected_sha256:
            raise DataError(f"vocabulary {p} has sha256 {vocab.sha256[:12]}…, the manifest expects "
                            f"{expected_sha256[:12]}…; delete {p.parent} to rebuild the cache")
        return vocab


def build_vocab(documents: Iterable[Sequence[str]], max_vocab: int, min_freq: int = 2) -> Vocabulary:
    """The reference vocabulary from tokenized train documents (readable definition).

    ``Counter.most_common`` sorts by count with a stable sort over the Counter's insertion
    order, so equal counts keep first-seen order.
    """
    counter: Counter[str] = Counter()
    for toks in documents:
        counter.update(toks)
    for s in SPECIALS:
        counter.pop(s, None)
    itos = list(SPECIALS)
    for tok, c in counter.most_common(max(0, max_vocab - len(SPECIALS))):
        if c < min_freq:
            break
        itos.append(tok)
    return Vocabulary(itos)


class FirstSeenIds:
    """Assigns every distinct token a *provisional* id in order of first appearance.

    The specials take ids 0, 1, 2 up front, so a literal ``<unk>`` in the text is already id 1.
    Encoding a document is one C-level ``map`` over a ``defaultdict`` whose factory is the
    dict's own ``__len__`` (a new token gets the next id), which is what keeps big builds fast.
    """

    def __init__(self) -> None:
        ids: defaultdict[str, int] = defaultdict()
        ids.default_factory = ids.__len__
        for s in SPECIALS:
            ids[s]
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    def encode(self, tokens: list[str]) -> np.ndarray:
        """``tokens`` -> ``[len(tokens)] int32`` provisional ids (new tokens are registered)."""
        return np.fromiter(map(self._ids.__getitem__, tokens), dtype=np.int32, count=len(tokens))

    def tokens(self) -> list[str]:
        """Token strings in provisional-id order."""
        return list(self._ids)


def rank_by_count(counts: np.ndarray, tokens: Sequence[str], max_vocab: int,
                  min_freq: int) -> tuple[Vocabulary, np.ndarray]:
    """Vocabulary and id map from provisional-id counts.

    Args:
        counts: ``[P] int64`` occurrences of each provisional id in the whole train split.
        tokens: the ``P`` token strings in provisional-id order (first-seen order).
    Returns:
        ``(vocab, table)`` where ``table`` is ``[P] int32`` mapping provisional -> final id
        (OOV -> 1). Same result as :func:`build_vocab`: sort by count descending, ties by
        provisional id, i.e. first-seen order.
    """
    n_special = len(SPECIALS)
    p = len(tokens)
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape[0] != p:
        raise DataError(f"internal: {counts.shape[0]} counts for {p} tokens")
    cand = np.arange(n_special, p, dtype=np.int64)
    cand = cand[counts[n_special:] >= min_freq]
    # lexsort: last key is primary. Primary = count descending, secondary = first-seen order.
    order = cand[np.lexsort((cand, -counts[cand]))]
    chosen = order[: max(0, max_vocab - n_special)]
    table = np.full(p, UNK_ID, dtype=np.int32)
    table[:n_special] = np.arange(n_special, dtype=np.int32)
    table[chosen] = np.arange(n_special, n_special + chosen.size, dtype=np.int32)
    itos = list(SPECIALS) + [tokens[i] for i in chosen.tolist()]
    return Vocabulary(itos), table


def check_token_ids(ids: np.ndarray, vocab_size: int, what: str = "token ids", fix: str | None = None) -> None:
    """Raise :class:`DataError` unless every id lies in ``[0, vocab_size)``.

    Args:
        ids: integer array of any shape (e.g. a ``[N] int32`` split or a ``[B, T]`` batch);
            scanned in chunks, so a memory-mapped split is never copied whole.
        vocab_size: V, e.g. ``model.vocab_size`` before training on a corpus.
        what: names the array in the message. ``fix``: what to do (a default is given).
    """
    arr = np.asarray(ids)
    if arr.size == 0:
        return
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    flat = arr.reshape(-1)
    chunk = 1 << 24
    for i in range(0, flat.shape[0], chunk):
        block = flat[i:i + chunk]
        lo, hi = int(block.min()), int(block.max())
        if lo >= 0 and hi < vocab_size:
            continue
        bad = np.flatnonzero((block < 0) | (block >= vocab_size))[0]
        value = int(block[bad])
        hint = fix or (f"if V={vocab_size} is the model's vocabulary, set model.vocab_size to the corpus "
                       f"vocabulary size (corpus.vocab_size, i.e. data.max_vocab or fewer); if the ids come "
                       f"from a cache, delete that cache folder and load again to rebuild it")
        raise DataError(f"{what}: token id {value} at flat position {i + int(bad)} is outside [0, {vocab_size}) "
                        f"(min {lo}, max {hi} in that block). {hint}")
