"""Readers and locating corpora on tiny in-repo fixtures: rows, <eos>, layouts, archives, errors."""

from __future__ import annotations

import io
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pcaf_core.config import ConfigError, DataConfig
from pcaf_core.data import EOS_ID, DataError, build_vocab, data_search_dirs, load_corpus, locate_source
from pcaf_core.data.corpora import repo_root

FIXTURES = Path(__file__).parent / "fixtures" / "data"


def cfg(data_dir: Path, cache: Path, **kw) -> DataConfig:
    return DataConfig(data_dir=str(data_dir), cache_dir=str(cache), **kw)


def file_lines(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def expected_ids(train_docs: list[list[str]], split_docs: list[list[str]], max_vocab: int, min_freq: int = 2):
    """Independent expectation: reference vocabulary, then rows + <eos> concatenated."""
    vocab = build_vocab(train_docs, max_vocab, min_freq)
    return vocab, np.concatenate([vocab.encode_tokens(d + ["<eos>"]) for d in split_docs])


@pytest.fixture
def data_copy(tmp_path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(FIXTURES, dst)
    return dst


def test_tokens_release_every_line_gets_eos(tmp_path):
    """layout=tokens: whitespace tokens, one <eos> after every line, blank lines included."""
    c = load_corpus(cfg(FIXTURES, tmp_path, name="wikitext103", layout="tokens", max_vocab=1000, min_freq=1))
    assert (c.settings.tokenizer, c.settings.rows) == ("whitespace", "lines")
    base = FIXTURES / "wikitext-103"
    train = [line.split() for line in file_lines(base / "wiki.train.tokens")]
    assert len(train) == 9
    for split, fname in [("train", "train"), ("validation", "valid"), ("test", "test")]:
        docs = [line.split() for line in file_lines(base / f"wiki.{fname}.tokens")]
        vocab, ids = expected_ids(train, docs, 1000, 1)
        assert c.vocab == vocab
        np.testing.assert_array_equal(np.asarray(c.split(split)), ids)
        assert int((np.asarray(c.split(split)) == EOS_ID).sum()) == len(docs)
        assert c.split_stats(split)["documents"] == len(docs)
    assert c.train.dtype == np.int32 and isinstance(c.train, np.memmap)
    # The release's literal <unk> is the special id 1, not a word of its own.
    assert "<unk>" not in c.vocab.itos[3:]
    assert c.manifest["splits"]["validation"]["unk_tokens"] == 2  # literal <unk> + unseen "zebra"
    assert c.manifest["splits"]["validation"]["oov_tokens"] == 1


def test_reference_convention_on_tokens_release(tmp_path):
    """tokenizer=regex rows=nonempty on the tokens release: <unk> is split, blank lines dropped."""
    c = load_corpus(cfg(FIXTURES, tmp_path, name="wikitext103", tokenizer="regex", rows="nonempty",
                        max_vocab=1000, min_freq=1))
    lines = [ln for ln in file_lines(FIXTURES / "wikitext-103" / "wiki.train.tokens") if ln.strip()]
    assert len(lines) == 5
    docs = [re.findall(r"\w+|[^\w\s]", ln) for ln in lines]
    vocab, ids = expected_ids(docs, docs, 1000, 1)
    np.testing.assert_array_equal(np.asarray(c.train), ids)
    assert "unk" in c.vocab.stoi and "<" in c.vocab.stoi


def test_raw_layout_reference_rows_and_unicode(tmp_path):
    c = load_corpus(cfg(FIXTURES, tmp_path, name="wikitext103", layout="raw", max_vocab=1000, min_freq=2))
    assert (c.settings.tokenizer, c.settings.rows) == ("regex", "nonempty")
    lines = [ln for ln in file_lines(FIXTURES / "wikitext-103-raw" / "wiki.train.raw") if ln.strip()]
    assert len(lines) == 5  # the whitespace-only " \t " line is not a document
    docs = [re.findall(r"\w+|[^\w\s]", ln) for ln in lines]
    vocab, ids = expected_ids(docs, docs, 1000, 2)
    assert c.vocab == vocab
    np.testing.assert_array_equal(np.asarray(c.train), ids)
    assert "café" in c.vocab.stoi  # Unicode words stay whole; café occurs twice
    assert "Senjō" not in c.vocab.stoi  # once only: below min_freq=2
    assert c.manifest["source"]["layout"] == "raw"


def test_crlf_files_read_like_lf(data_copy, tmp_path):
    lf = load_corpus(cfg(FIXTURES, tmp_path / "a", name="wikitext103", layout="raw", min_freq=1))
    for p in (data_copy / "wikitext-103-raw").iterdir():
        p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n"))
    crlf = load_corpus(cfg(data_copy, tmp_path / "b", name="wikitext103", layout="raw", min_freq=1))
    np.testing.assert_array_equal(np.asarray(lf.train), np.asarray(crlf.train))
    assert lf.vocab == crlf.vocab


def test_pg19_books_are_documents_sorted_by_name(tmp_path):
    c = load_corpus(cfg(FIXTURES, tmp_path, name="pg19", max_vocab=1000, min_freq=1))
    assert c.settings.layout == "raw"  # PG-19 has one text release; the default 'tokens' names it
    books = sorted((FIXTURES / "pg19" / "train").glob("*.txt"))
    texts = [b.read_text(encoding="utf-8") for b in books]
    docs = [re.findall(r"\w+|[^\w\s]", t) for t in texts if t.strip()]
    assert len(docs) == 3  # 0003.txt is blank: no document
    vocab, ids = expected_ids(docs, docs, 1000, 1)
    np.testing.assert_array_equal(np.asarray(c.train), ids)
    assert [c.split_stats(s)["documents"] for s in ("train", "validation", "test")] == [3, 1, 1]
    assert any("metadata.csv: 6 books" in x for x in c.manifest["source"]["checks"])


def test_pg19_rows_must_be_books():
    with pytest.raises(ConfigError, match="whole books"):
        DataConfig(name="pg19", rows="lines")
    with pytest.raises(ConfigError, match="pg19_mini exists only locally"):
        DataConfig(name="pg19_mini", layout="hf")


# --------------------------------------------------------------------------------------------
# Locating data
# --------------------------------------------------------------------------------------------

def test_search_order(monkeypatch, tmp_path):
    monkeypatch.delenv("PCAF_DATA_DIR", raising=False)
    dirs = data_search_dirs()
    root = repo_root()
    assert root is not None and dirs[0] == root / "data"
    monkeypatch.setenv("PCAF_DATA_DIR", str(tmp_path))
    assert data_search_dirs()[0] == tmp_path and root / "data" in data_search_dirs()
    assert data_search_dirs(FIXTURES) == [FIXTURES]  # an explicit data_dir is the only place searched
    monkeypatch.setenv("PCAF_DATA_DIR", str(tmp_path / "nope"))
    with pytest.raises(DataError, match="PCAF_DATA_DIR=.*is not a directory"):
        data_search_dirs()
    with pytest.raises(DataError, match="data.data_dir=.*is not a directory"):
        data_search_dirs(tmp_path / "nope")


def test_missing_wikitext2_names_files_and_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        load_corpus(cfg(empty, tmp_path / "cache"))
    msg = str(e.value)
    assert "WikiText-2" in msg and "wikitext-2-v1.tar.xz" in msg and "wikitext-2/" in msg and str(empty) in msg
    assert "PCAF_DATA_DIR" in msg and "make data" in msg


def test_missing_pg19_mini_and_raw_wikitext_say_how_to_get_them(tmp_path):
    with pytest.raises(DataError, match=r"pg19-mini.*not found.*pg19-mini\.tar\.xz.*PCAF_DATA_DIR"):
        load_corpus(cfg(tmp_path, tmp_path / "cache", name="pg19_mini"))
    with pytest.raises(DataError, match=r"wikitext-103-raw-v1.*layout=hf"):
        locate_source("wikitext103", "raw", tmp_path)


def test_pointing_at_the_corpus_folder_itself_gets_a_hint():
    with pytest.raises(DataError, match=r"wikitext-103-raw itself holds wiki\.train\.raw: the data directory "
                                        r"must be the parent of a folder named wikitext-103-raw/"):
        locate_source("wikitext103", "raw", FIXTURES / "wikitext-103-raw")


def test_hub_layout_without_datasets_package(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match=r"pip install -e '\.\[hub\]'"):
        load_corpus(DataConfig(name="wikitext103", layout="hf", cache_dir=str(tmp_path)))


def _tar_xz(src_dir: Path, arcname: str, out: Path) -> Path:
    with tarfile.open(out, "w:xz") as tf:
        tf.add(src_dir, arcname=arcname)
    return out


def test_archives_are_unpacked_once_and_read_like_folders(tmp_path):
    d = tmp_path / "arch"
    d.mkdir()
    _tar_xz(FIXTURES / "wikitext-103", "wikitext-103", d / "wikitext-103-v1.tar.xz")
    with zipfile.ZipFile(d / "wikitext-103-raw-v1.zip", "w") as zf:
        for p in (FIXTURES / "wikitext-103-raw").iterdir():
            zf.write(p, f"wikitext-103-raw/{p.name}")
    folder = load_corpus(cfg(FIXTURES, tmp_path / "c1", name="wikitext103", min_freq=1))
    packed = load_corpus(cfg(d, tmp_path / "c2", name="wikitext103", min_freq=1))
    np.testing.assert_array_equal(np.asarray(folder.train), np.asarray(packed.train))
    assert packed.manifest["source"]["origin"] == "archive"
    assert packed.manifest["source"]["files"][0]["sha256"]
    unpacked = list((tmp_path / "c2" / "sources").glob("wikitext-103-v1-*"))
    assert len(unpacked) == 1 and (unpacked[0] / ".complete").is_file()
    raw = load_corpus(cfg(d, tmp_path / "c2", name="wikitext103", layout="raw", min_freq=1))
    raw_folder = load_corpus(cfg(FIXTURES, tmp_path / "c1", name="wikitext103", layout="raw", min_freq=1))
    np.testing.assert_array_equal(np.asarray(raw.train), np.asarray(raw_folder.train))


def test_corrupt_archive_fails_its_checksum(tmp_path):
    real = repo_root() / "data" / "wikitext-2-v1.tar.xz"
    bad = tmp_path / "wikitext-2-v1.tar.xz"
    blob = bytearray(real.read_bytes()[:200_000])
    blob[1000] ^= 0xFF
    bad.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        load_corpus(cfg(tmp_path, tmp_path / "cache"))
    msg = str(e.value)
    assert "corrupt" in msg and "sha256" in msg and "4aab0441" in msg and "git restore" in msg
    assert not list((tmp_path / "cache").glob("wikitext2-*"))


def test_damaged_archive_without_published_checksum(tmp_path):
    d = tmp_path / "arch"
    d.mkdir()
    good = _tar_xz(FIXTURES / "wikitext-103", "wikitext-103", tmp_path / "good.tar.xz")
    (d / "wikitext-103-v1.tar.xz").write_bytes(good.read_bytes()[:100])
    with pytest.raises(DataError, match="cannot unpack.*damaged"):
        load_corpus(cfg(d, tmp_path / "cache", name="wikitext103"))
    assert not [p for p in (tmp_path / "cache" / "sources").iterdir() if not p.name.startswith(".")]


def test_archive_with_unsafe_member_is_refused(tmp_path):
    d = tmp_path / "arch"
    d.mkdir()
    with tarfile.open(d / "wikitext-103-v1.tar.xz", "w:xz") as tf:
        data = b"x\n"
        info = tarfile.TarInfo("../evil.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(DataError, match="cannot unpack"):
        load_corpus(cfg(d, tmp_path / "cache", name="wikitext103"))
    assert not (tmp_path / "cache" / "evil.txt").exists()


def test_archive_of_something_else(tmp_path):
    d = tmp_path / "arch"
    d.mkdir()
    _tar_xz(FIXTURES / "pg19", "pg19", d / "wikitext-103-v1.tar.xz")
    with pytest.raises(DataError, match="does not contain a WikiText-103 folder"):
        load_corpus(cfg(d, tmp_path / "cache", name="wikitext103"))


def test_invalid_utf8_is_named(data_copy, tmp_path):
    p = data_copy / "wikitext-103" / "wiki.valid.tokens"
    p.write_bytes(b" good line \n bad \xff\xfe bytes \n")
    with pytest.raises(DataError, match=r"wiki\.valid\.tokens is not valid UTF-8 \(byte 17"):
        load_corpus(cfg(data_copy, tmp_path / "cache", name="wikitext103"))
    assert not list((tmp_path / "cache").glob("wikitext103-*"))


def test_folder_where_a_file_is_expected(data_copy, tmp_path):
    p = data_copy / "wikitext-103" / "wiki.test.tokens"
    p.unlink()
    p.mkdir()
    with pytest.raises(DataError, match=r"cannot read .*wiki\.test\.tokens.*restore the file"):
        load_corpus(cfg(data_copy, tmp_path / "cache", name="wikitext103"))


def test_missing_split_file(data_copy, tmp_path):
    (data_copy / "wikitext-103" / "wiki.valid.tokens").unlink()
    with pytest.raises(DataError, match=r"split 'validation' is missing: .*wiki\.valid\.tokens does not exist"):
        load_corpus(cfg(data_copy, tmp_path / "cache", name="wikitext103"))


def test_pg19_metadata_detects_damaged_and_missing_books(data_copy, tmp_path):
    book = data_copy / "pg19" / "train" / "0002.txt"
    book.write_text("Changed text.\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"0002\.txt has sha256 .*metadata\.csv says"):
        load_corpus(cfg(data_copy, tmp_path / "cache", name="pg19"))
    book.unlink()
    with pytest.raises(DataError, match=r"does not match metadata\.csv \(missing \['0002'\]"):
        load_corpus(cfg(data_copy, tmp_path / "cache", name="pg19"))
