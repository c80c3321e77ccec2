"""Tokenizers, vocabulary rules (specials, min_freq, ties, OOV) and the id validator."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcaf_core.data import (
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    DataError,
    Vocabulary,
    build_vocab,
    check_token_ids,
    regex_tokenize,
    whitespace_tokenize,
)
from pcaf_core.data.tokenizer import FirstSeenIds, get_tokenizer, rank_by_count


def fast_vocab(docs: list[list[str]], max_vocab: int, min_freq: int) -> tuple[Vocabulary, np.ndarray, np.ndarray]:
    """The cache builder's path: provisional ids -> bincount -> rank. Returns (vocab, table, prov ids)."""
    ids = FirstSeenIds()
    prov = [ids.encode(list(d)) for d in docs]
    cat = np.concatenate(prov) if prov else np.zeros(0, dtype=np.int32)
    counts = np.bincount(cat, minlength=len(ids))
    vocab, table = rank_by_count(counts, ids.tokens(), max_vocab, min_freq)
    return vocab, table, cat


def test_regex_tokenizer_is_the_reference_findall():
    text = " Senjō no Valkyria 3 : <unk> Chronicles ( 日本語 ) , role @-@ playing naïve café's 1,000 "
    assert regex_tokenize(text) == re.findall(r"\w+|[^\w\s]", text)
    # The pre-tokenized release's markers are split by the reference regex, as documented.
    assert regex_tokenize("a <unk> b @-@ c") == ["a", "<", "unk", ">", "b", "@", "-", "@", "c"]
    assert regex_tokenize("Senjō 日本語") == ["Senjō", "日本語"]  # Unicode word characters stay whole


def test_whitespace_tokenizer_keeps_release_tokens_whole():
    assert whitespace_tokenize(" a <unk> b @-@ c \t d\u3000e ") == ["a", "<unk>", "b", "@-@", "c", "d", "e"]
    assert whitespace_tokenize("   ") == []
    with pytest.raises(DataError, match="unknown tokenizer"):
        get_tokenizer("bpe")


def test_specials_come_first_and_ties_keep_first_seen_order():
    # b and a both occur twice; b is seen first, so b ranks before a. c, d, e occur once.
    docs = [["b", "c", "a"], ["a", "b", "d", "e"]]
    v = build_vocab(docs, max_vocab=10, min_freq=1)
    assert v.itos[:3] == SPECIALS
    assert (PAD_ID, UNK_ID, EOS_ID) == (0, 1, 2)
    assert v.itos[3:] == ("b", "a", "c", "d", "e")


def test_min_freq_and_max_vocab_cut_the_ranking():
    docs = [["x", "y", "y", "z", "z", "z", "w"]]
    assert build_vocab(docs, max_vocab=10, min_freq=2).itos[3:] == ("z", "y")
    assert build_vocab(docs, max_vocab=4, min_freq=1).itos[3:] == ("z",)  # max_vocab counts the specials
    assert len(build_vocab(docs, max_vocab=100, min_freq=1)) == 3 + 4


def test_oov_maps_to_unk_and_literal_specials_keep_their_ids():
    v = build_vocab([["the", "cat", "the", "<unk>", "<unk>", "<unk>"]], max_vocab=10, min_freq=1)
    assert "<unk>" not in v.itos[3:]  # a literal special is never ranked as a word
    ids = v.encode_tokens(["the", "dog", "<unk>", "<eos>", "<pad>"])
    assert ids.dtype == np.int32
    assert ids.tolist() == [v.stoi["the"], UNK_ID, UNK_ID, EOS_ID, PAD_ID]
    assert v.encode("the cat", tokenizer="whitespace", eos=True).tolist() == [3, 4, EOS_ID]


def test_fast_path_matches_counter_definition_on_fixture():
    docs = [["b", "c", "a", "<unk>"], [], ["a", "b", "d", "e", "e", "<eos>"], ["c", "f"]]
    for max_vocab, min_freq in [(4, 1), (5, 2), (100, 1), (100, 3)]:
        ref = build_vocab(docs, max_vocab, min_freq)
        fast, table, prov = fast_vocab(docs, max_vocab, min_freq)
        assert fast == ref
        flat = [t for d in docs for t in d]
        assert table[prov].tolist() == ref.encode_tokens(flat).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(list("abcdefghij") + ["<unk>", "<eos>", "é", "日"]), max_size=30),
                max_size=8),
       st.integers(4, 16), st.integers(1, 3))
def test_fast_path_matches_counter_definition_property(docs, max_vocab, min_freq):
    ref = build_vocab(docs, max_vocab, min_freq)
    fast, table, prov = fast_vocab(docs, max_vocab, min_freq)
    assert fast == ref
    flat = [t for d in docs for t in d]
    assert table[prov].tolist() == ref.encode_tokens(flat).tolist()
    # Counter.most_common semantics, spelled out: count descending, then first occurrence.
    counts = Counter(t for t in flat if t not in SPECIALS)
    first = {}
    for i, t in enumerate(flat):
        first.setdefault(t, i)
    expected = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], first[t]))
    assert list(ref.itos[3:]) == expected[: max_vocab - 3]


def test_vocabulary_save_load_and_hash(tmp_path):
    v = build_vocab([["naïve", "日本", "naïve", "\"", "\\"]], max_vocab=10, min_freq=1)
    p = tmp_path / "vocab.json"
    v.save(p)
    w = Vocabulary.load(p, expected_sha256=v.sha256)
    assert w == v and w.sha256 == v.sha256
    assert build_vocab([["a"]], 10, 1).sha256 != v.sha256
    p.write_text('["<pad>", "<unk>", "<eos>", "other"]', encoding="utf-8")
    with pytest.raises(DataError, match="rebuild"):
        Vocabulary.load(p, expected_sha256=v.sha256)
    p.write_text("not json", encoding="utf-8")
    with pytest.raises(DataError, match="cannot read vocabulary"):
        Vocabulary.load(p)
    with pytest.raises(DataError, match="must start with"):
        Vocabulary(["a", "b", "c"])
    with pytest.raises(DataError, match="outside the vocabulary"):
        v.decode([0, len(v)])
    assert v.decode(np.array([3, 1])) == ["naïve", "<unk>"]


def test_check_token_ids_names_the_problem_and_the_fix():
    check_token_ids(np.array([0, 5, 9], dtype=np.int32), 10)
    check_token_ids(np.zeros((0,), dtype=np.int32), 10)
    with pytest.raises(DataError, match=r"token id 10 at flat position 2 is outside \[0, 10\).*model.vocab_size"):
        check_token_ids(np.array([[0, 5], [10, 1]], dtype=np.int32), 10, what="batch")
    with pytest.raises(DataError, match="token id -1"):
        check_token_ids(np.array([3, -1]), 10)
    with pytest.raises(DataError, match="must be integers"):
        check_token_ids(np.array([0.5]), 10)
