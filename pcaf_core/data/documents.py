"""Documents of a token stream: WikiText articles, PG-19 books and the rows of a corpus of your own, for
evaluations that read a whole document at a time (the ``stream`` protocol).

A split is stored as one concatenated stream with ``<eos>`` after every row (docs/DATA.md §2). PG-19 rows
are books, and a ``text`` corpus's rows are its documents (a line of a split's file, or a whole file of a
split's folder), so such a document is the tokens up to and including its ``<eos>``. WikiText rows are lines; an article
starts at its title line ``= Title =`` (a line that begins with ``=`` not followed by another ``=``; section
headings are ``= = Section = =``) and runs to the next title.
"""

from __future__ import annotations

import numpy as np

from .corpora import get_spec
from .tokenizer import EOS_ID

TITLE_MARK = "="


def document_bounds(tokens: np.ndarray, vocab, corpus: str) -> np.ndarray:
    """``[n_docs, 2]`` int64 ``(start, end)`` of every document of ``tokens`` (end exclusive), in order and
    covering the whole stream (text before the first WikiText title belongs to the first article).

    ``corpus`` is the ``data.name`` (its family decides: rows for PG-19 and ``text``, articles for WikiText).
    """
    x = np.asarray(tokens)
    n = len(x)
    if n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if get_spec(corpus).family in ("pg19", "text"):
        ends = np.flatnonzero(x == EOS_ID) + 1
    else:
        mark = vocab.stoi.get(TITLE_MARK)
        if mark is None:
            return np.array([[0, n]], dtype=np.int64)
        line_start = np.concatenate([[True], x[:-1] == EOS_ID])
        nxt = np.concatenate([x[1:], [EOS_ID]])
        starts = np.flatnonzero(line_start & (x == mark) & (nxt != mark) & (nxt != EOS_ID))
        ends = starts[1:]  # each title ends the previous article; the first one's leading lines join it
    ends = np.unique(np.concatenate([ends[(ends > 0) & (ends < n)], [n]]))
    starts = np.concatenate([[0], ends[:-1]])
    return np.stack([starts, ends], axis=1).astype(np.int64)
