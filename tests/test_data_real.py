"""The real corpora: WikiText-2 (vendored) and pg19-mini, built into a fresh cache per session.

pg19-mini is found through the usual search (``$PCAF_DATA_DIR``, the repository's ``data/``,
``../shared/data``); see docs/DATA.md. The ``python -m pcaf_core.data`` commands run in this process
(tests/entry_points.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from pcaf_core.config import DataConfig
from pcaf_core.data import (
    DataError,
    FullEvalWindows,
    TokenizedCorpus,
    WindowSampler,
    build_vocab,
    load_corpus,
)
from pcaf_core.data.cli import count_conventions
from pcaf_core.data.cli import main as data_main
from pcaf_core.data.corpora import repo_root
from pcaf_core.data.files import read_text, text_lines
from tests.entry_points import Result, run_main

ROOT = repo_root()

WT2 = {"documents": {"train": 36_718, "validation": 3_760, "test": 4_358},
       "tokens": {"train": 2_088_628, "validation": 217_646, "test": 245_569}}
PG19_MINI = {"documents": {"train": 127, "validation": 7, "test": 6},
             "tokens": {"train": 17_943_842, "validation": 1_004_312, "test": 1_026_336}}


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real_cache")


@pytest.fixture(scope="session")
def wt2(real_cache) -> TokenizedCorpus:
    return load_corpus(DataConfig(name="wikitext2", max_vocab=20000, cache_dir=str(real_cache)))


@pytest.fixture(scope="session")
def pg19_mini(real_cache) -> TokenizedCorpus:
    return load_corpus(DataConfig(name="pg19_mini", max_vocab=32000, cache_dir=str(real_cache)))


def cli(*args: str) -> Result:
    """``python -m pcaf_core.data ARGS``."""
    return run_main(data_main, list(args))


def test_wikitext2_vocab_and_token_counts(wt2):
    assert wt2.vocab_size == 20_000
    assert wt2.train.shape[0] == 2_088_628  # one <eos> per line of wiki.train.tokens
    for split in ("train", "validation", "test"):
        st = wt2.split_stats(split)
        assert st["documents"] == WT2["documents"][split]
        assert st["total_tokens"] == st["loaded_tokens"] == WT2["tokens"][split]
    assert wt2.manifest["source"]["origin"] == "archive"
    assert wt2.manifest["source"]["files"][0]["rel"] == "wikitext-2-v1.tar.xz"
    assert "WikiText-2 token files match the release md5s" in wt2.manifest["source"]["checks"]
    assert wt2.layout == "tokens" and wt2.settings.tokenizer == "whitespace"


@pytest.mark.slow
def test_wikitext2_matches_the_plain_definition(wt2, real_cache):
    """Vocabulary = Counter.most_common over whitespace tokens; ids = lines + <eos>, OOV -> <unk>."""
    src = next((real_cache / "sources").glob("wikitext-2-v1-*")) / "wikitext-2"
    train = [line.split() for line in text_lines(read_text(src / "wiki.train.tokens"))]
    vocab = build_vocab(train, 20_000, 2)
    assert wt2.vocab == vocab
    valid = [line.split() + ["<eos>"] for line in text_lines(read_text(src / "wiki.valid.tokens"))]
    np.testing.assert_array_equal(np.asarray(wt2.valid), vocab.encode_tokens(t for d in valid for t in d))
    head = [t for d in train[:2000] for t in d + ["<eos>"]]
    np.testing.assert_array_equal(np.asarray(wt2.train[: len(head)]), vocab.encode_tokens(head))


@pytest.mark.slow
def test_wikitext2_reference_protocol_counts(real_cache):
    """The reference's regex + non-empty rows on the same release (the number reported beside)."""
    ref = load_corpus(DataConfig(name="wikitext2", tokenizer="regex", rows="nonempty", cache_dir=str(real_cache)))
    assert ref.vocab_size == 20_000
    assert ref.split_stats("train")["documents"] == 23_767
    assert ref.train.shape[0] == 2_253_209
    counts = {(c["tokenizer"], c["rows"]): c["tokens"] for c in count_conventions(
        DataConfig(name="wikitext2", cache_dir=str(real_cache)))}
    assert counts == {("whitespace", "lines"): 2_088_628, ("whitespace", "nonempty"): 2_075_677,
                      ("regex", "lines"): 2_266_160, ("regex", "nonempty"): 2_253_209}


def test_wikitext2_windows(wt2):
    x, y = WindowSampler(wt2.train, 1024, 8, mode="ar", seed=10001).next_batch()
    assert x.shape == y.shape == (8, 1024) and int(x.max()) < wt2.vocab_size
    full = FullEvalWindows(wt2.valid, 1024, 16, mode="ar")
    assert full.num_targets == 217_645
    assert FullEvalWindows(wt2.valid, 1024, 16, mode="nt").num_targets == 212


@pytest.mark.slow
def test_pg19_mini_books_tokens_and_vocab(pg19_mini, real_cache):
    assert pg19_mini.vocab_size == 32_000
    for split in ("train", "validation", "test"):
        st = pg19_mini.split_stats(split)
        assert st["documents"] == PG19_MINI["documents"][split]
        assert st["total_tokens"] == PG19_MINI["tokens"][split]
    assert (pg19_mini.settings.layout, pg19_mini.settings.tokenizer, pg19_mini.settings.rows) == (
        "raw", "regex", "nonempty")
    assert "metadata.csv: 140 books present with matching sha256" in pg19_mini.manifest["source"]["checks"]
    # The first book, encoded independently, opens the train stream and ends with <eos>.
    book = next((real_cache / "sources").glob("pg19-mini-*")) / "pg19-mini" / "train" / "0000.txt"
    toks = re.findall(r"\w+|[^\w\s]", read_text(book)) + ["<eos>"]
    np.testing.assert_array_equal(np.asarray(pg19_mini.train[: len(toks)]), pg19_mini.vocab.encode_tokens(toks))


@pytest.mark.slow
def test_summary_command_shows_the_acceptance_numbers(wt2, pg19_mini, real_cache):
    r = cli("summary", "data=wikitext2", f"data.cache_dir={real_cache}", "--json", "-q")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["vocab_size"] == 20_000 and s["splits"]["train"]["total_tokens"] == 2_088_628
    assert s["cache_dir"] == str(wt2.cache_dir)
    r = cli("summary", "data=wikitext2", f"data.cache_dir={real_cache}", "--conventions", "-q")
    assert r.returncode == 0, r.stderr
    assert "20,000" in r.stdout and "2,088,628" in r.stdout and "2,253,209" in r.stdout
    assert "reference protocol" in r.stdout and str(wt2.cache_dir) in r.stdout and "OOV rate" in r.stdout
    r = cli("summary", "data=pg19_mini", "data.max_vocab=32000", f"data.cache_dir={real_cache}", "-q")
    assert r.returncode == 0, r.stderr
    assert "32,000" in r.stdout and "17,943,842" in r.stdout and "pg19_mini" in r.stdout


def test_cli_reports_errors_with_what_to_do(tmp_path):
    r = cli("summary", "data=wikitext2", f"data.data_dir={tmp_path}", f"data.cache_dir={tmp_path}")
    assert r.returncode == 2 and "error: WikiText-2" in r.stderr and "PCAF_DATA_DIR" in r.stderr
    r = cli("summary", "data=wikitext2", "data.max_vocab=lots")
    assert r.returncode == 2 and "data.max_vocab must be an integer" in r.stderr
    r = cli("summary", "data=wikitext2", "data.vocab=1")
    assert r.returncode == 2 and "unknown override 'data.vocab'" in r.stderr
    r = cli("prepare", "data=pg19_mini", f"data.data_dir={tmp_path}", f"data.cache_dir={tmp_path}", "--optional")
    assert r.returncode == 0 and "skipping pg19-mini" in r.stdout and "pg19-mini.tar.xz" in r.stdout


def test_unpacked_wikitext2_folder_is_accepted_and_md5_checked(wt2, real_cache, tmp_path):
    unpacked = next((real_cache / "sources").glob("wikitext-2-v1-*"))
    folder = load_corpus(DataConfig(name="wikitext2", data_dir=str(unpacked), cache_dir=str(tmp_path / "c")))
    assert folder.manifest["source"]["origin"] == "directory"
    assert folder.vocab == wt2.vocab
    np.testing.assert_array_equal(np.asarray(folder.train), np.asarray(wt2.train))
    damaged = tmp_path / "d" / "wikitext-2"
    shutil.copytree(unpacked / "wikitext-2", damaged)
    text = (damaged / "wiki.test.tokens").read_bytes()
    (damaged / "wiki.test.tokens").write_bytes(text.replace(b" the ", b" teh ", 1))
    with pytest.raises(DataError, match=r"wiki\.test\.tokens has md5 .*expected 781c9418"):
        load_corpus(DataConfig(name="wikitext2", data_dir=str(damaged.parent), cache_dir=str(tmp_path / "c2")))
