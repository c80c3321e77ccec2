"""Token caches on tiny fixtures: manifest, reuse, staleness, budgets, atomicity, hub path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import pcaf_core.data.cache as cache_mod
import pcaf_core.data.encode as encode_mod
from pcaf_core.config import DataConfig
from pcaf_core.data import DataError, check_token_ids, load_corpus, read_manifest, resolve_settings
from pcaf_core.data.corpora import repo_root

FIXTURES = Path(__file__).parent / "fixtures" / "data"
ROOT = repo_root()


def cfg(data_dir: Path, cache: Path, **kw) -> DataConfig:
    kw.setdefault("name", "wikitext103")
    kw.setdefault("min_freq", 1)
    return DataConfig(data_dir=str(data_dir), cache_dir=str(cache), **kw)


@pytest.fixture
def data_copy(tmp_path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(FIXTURES, dst)
    return dst


def no_build(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the cache was rebuilt although it was valid")

    monkeypatch.setattr(cache_mod, "_build_into", fail)


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_manifest_records_what_was_built(tmp_path):
    c = load_corpus(cfg(FIXTURES, tmp_path))
    m = read_manifest(c.cache_dir)
    assert m == c.manifest
    assert m["settings"] == {"name": "wikitext103", "layout": "tokens", "tokenizer": "whitespace", "rows": "lines",
                             "max_vocab": 20000, "min_freq": 1}
    assert c.cache_dir.name == f"wikitext103-tokens-v20000-{c.settings.key}"
    assert m["source"]["origin"] == "directory" and m["source"]["layout"] == "tokens"
    assert [f["rel"] for f in m["source"]["files"]] == ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"]
    assert all(len(f["sha256"]) == 64 for f in m["source"]["files"])
    assert m["vocab"]["size"] == c.vocab_size and m["vocab"]["sha256"] == c.vocab.sha256
    assert m["tokenizer"] == {"name": "whitespace", "pattern": None, "rows": "lines",
                              "specials": {"<pad>": 0, "<unk>": 1, "<eos>": 2}}
    for split, info in m["splits"].items():
        assert info["total_tokens"] == info["stored_tokens"] == c.split(split).shape[0]
    assert sorted(p.name for p in c.cache_dir.iterdir()) == ["manifest.json", "test.npy", "train.npy",
                                                             "validation.npy", "vocab.json"]
    rec = c.record()
    assert rec["layout"] == "tokens" and rec["vocab_size"] == c.vocab_size and rec["tokens"]["train"] > 0


def test_valid_cache_is_reused_without_rebuilding(tmp_path, monkeypatch):
    first = load_corpus(cfg(FIXTURES, tmp_path))
    no_build(monkeypatch)
    again = load_corpus(cfg(FIXTURES, tmp_path))
    np.testing.assert_array_equal(np.asarray(first.train), np.asarray(again.train))
    assert again.vocab == first.vocab


def test_other_settings_get_their_own_cache(tmp_path):
    small = load_corpus(cfg(FIXTURES, tmp_path, max_vocab=8))
    big = load_corpus(cfg(FIXTURES, tmp_path, max_vocab=20))
    assert (small.vocab_size, big.vocab_size) == (8, 20)
    assert small.cache_dir != big.cache_dir and small.cache_dir.exists() and big.cache_dir.exists()
    assert small.vocab.itos == big.vocab.itos[:8]  # same ranking, cut earlier
    check_token_ids(small.train, 8)


def test_cache_built_with_other_settings_is_detected_and_rebuilt(tmp_path):
    c = load_corpus(cfg(FIXTURES, tmp_path, max_vocab=8))
    m = json.loads((c.cache_dir / "manifest.json").read_text())
    m["settings"]["max_vocab"] = 9  # a folder whose content does not match its name
    (c.cache_dir / "manifest.json").write_text(json.dumps(m))
    msgs: list[str] = []
    again = load_corpus(cfg(FIXTURES, tmp_path, max_vocab=8), on_build=msgs.append)
    assert len(msgs) == 1 and "other settings" in msgs[0] and "'max_vocab': (9, 8)" in msgs[0]
    assert again.manifest["settings"]["max_vocab"] == 8 and again.vocab_size == 8


def test_changed_source_triggers_rebuild_touch_does_not(data_copy, tmp_path, monkeypatch):
    c1 = load_corpus(cfg(data_copy, tmp_path))
    train = data_copy / "wikitext-103" / "wiki.train.tokens"
    # Same bytes, new mtime (a copy or a re-extraction): verified by sha256, no rebuild.
    st = train.stat()
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    msgs: list[str] = []
    c2 = load_corpus(cfg(data_copy, tmp_path), on_build=msgs.append)
    assert msgs == []
    rec = {f["rel"]: f for f in read_manifest(c2.cache_dir)["source"]["files"]}
    assert rec["wiki.train.tokens"]["mtime_ns"] == st.st_mtime_ns + 10**9  # remembered for the next stat check
    # New content: rebuilt, with the new line's tokens.
    with open(train, "a", encoding="utf-8") as f:
        f.write(" brand new line \n")
    c3 = load_corpus(cfg(data_copy, tmp_path), on_build=msgs.append)
    assert len(msgs) == 1 and "source changed" in msgs[0]
    assert c3.train.shape[0] == c1.train.shape[0] + 4 and "brand" in c3.vocab.stoi


def test_budgets_truncate_and_vocab_comes_from_whole_train(tmp_path, monkeypatch):
    full = load_corpus(cfg(FIXTURES, tmp_path / "a"))
    cut = load_corpus(cfg(FIXTURES, tmp_path / "b", max_train_tokens=10, max_eval_tokens=3))
    assert cut.train.shape[0] == 10 and cut.valid.shape[0] == 3 and cut.test.shape[0] == 3
    np.testing.assert_array_equal(np.asarray(cut.train), np.asarray(full.train)[:10])
    np.testing.assert_array_equal(np.asarray(cut.valid), np.asarray(full.valid)[:3])
    assert cut.vocab == full.vocab  # budgets never change the vocabulary
    m = cut.manifest["splits"]["train"]
    assert m["stored_tokens"] == 10 and m["total_tokens"] == full.train.shape[0]
    # A larger budget than the stored prefix rebuilds; a budget beyond the split is the whole split.
    msgs: list[str] = []
    more = load_corpus(cfg(FIXTURES, tmp_path / "b", max_train_tokens=10**9), on_build=msgs.append)
    assert "prefix" in msgs[0] and more.train.shape[0] == full.train.shape[0]
    # The whole-split cache serves every smaller budget without a rebuild.
    no_build(monkeypatch)
    again = load_corpus(cfg(FIXTURES, tmp_path / "b", max_train_tokens=7, max_eval_tokens=2))
    assert again.train.shape[0] == 7 and again.valid.shape[0] == 2


def test_eval_split_selects_validation_or_test(tmp_path):
    v = load_corpus(cfg(FIXTURES, tmp_path))
    t = load_corpus(cfg(FIXTURES, tmp_path, eval_split="test"))
    assert v.eval is v.valid and t.eval is t.test
    assert v.split("valid") is v.valid
    with pytest.raises(DataError, match="unknown split"):
        v.split("dev")


def test_interrupted_build_leaves_nothing_trusted(tmp_path, monkeypatch):
    real = encode_mod.map_to_npy
    calls = {"n": 0}

    def fail_midway(prov, table, out_path):
        calls["n"] += 1
        real(prov[: len(prov) // 2], table, out_path)  # a half-written array, then the failure
        raise KeyboardInterrupt

    monkeypatch.setattr(encode_mod, "map_to_npy", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(cfg(FIXTURES, tmp_path))
    assert calls["n"] == 1
    settings = resolve_settings(cfg(FIXTURES, tmp_path))
    assert not (tmp_path / settings.dir_name).exists()
    assert not list(tmp_path.glob(f".{settings.dir_name}*"))  # the temporary folder was removed
    monkeypatch.setattr(encode_mod, "map_to_npy", real)
    msgs: list[str] = []
    c = load_corpus(cfg(FIXTURES, tmp_path), on_build=msgs.append)
    assert "no cache yet" in msgs[0] and c.train.shape[0] == c.manifest["splits"]["train"]["total_tokens"]


KILL_MIDWAY = """
import os, sys
import pcaf_core.data.cache as cache
import pcaf_core.data.encode as encode
from pcaf_core.config import DataConfig
real = encode.map_to_npy
def die(prov, table, out_path):
    real(prov[: len(prov) // 2], table, out_path)
    os._exit(9)  # no cleanup at all, as after SIGKILL or a power cut
encode.map_to_npy = die
cache.load_corpus(DataConfig(name="wikitext103", min_freq=1, data_dir={data!r}, cache_dir={cache!r}),
                  rebuild={rebuild})
"""


def test_killed_build_is_not_trusted_and_is_cleaned_up(tmp_path):
    r = run_py(KILL_MIDWAY.format(data=str(FIXTURES), cache=str(tmp_path), rebuild=False))
    assert r.returncode == 9, r.stderr
    settings = resolve_settings(cfg(FIXTURES, tmp_path))
    assert not (tmp_path / settings.dir_name).exists()
    leftovers = list(tmp_path.glob(f".{settings.dir_name}.tmp-*"))
    assert len(leftovers) == 1  # the killed process could not clean up
    msgs: list[str] = []
    c = load_corpus(cfg(FIXTURES, tmp_path), on_build=msgs.append)
    assert "no cache yet" in msgs[0]
    assert not list(tmp_path.glob(f".{settings.dir_name}.*"))  # orphan removed by the next build
    check_token_ids(c.train, c.vocab_size)


def test_killed_rebuild_keeps_the_previous_good_cache(tmp_path, monkeypatch):
    good = load_corpus(cfg(FIXTURES, tmp_path))
    expect = np.asarray(good.train).copy()
    r = run_py(KILL_MIDWAY.format(data=str(FIXTURES), cache=str(tmp_path), rebuild=True))
    assert r.returncode == 9, r.stderr
    no_build(monkeypatch)
    again = load_corpus(cfg(FIXTURES, tmp_path))
    np.testing.assert_array_equal(np.asarray(again.train), expect)


def test_half_written_or_damaged_cache_folders_are_rebuilt(tmp_path):
    c = load_corpus(cfg(FIXTURES, tmp_path))
    for damage in ("manifest", "npy", "vocab", "garbage-manifest"):
        if damage == "manifest":
            (c.cache_dir / "manifest.json").unlink()
        elif damage == "npy":
            np.save(c.cache_dir / "train.npy", np.asarray(c.train)[:-1])
        elif damage == "vocab":
            (c.cache_dir / "vocab.json").write_text('["<pad>", "<unk>", "<eos>"]')
        else:
            (c.cache_dir / "manifest.json").write_text('{"format_version": 1, "settings": {}}')
        msgs: list[str] = []
        c = load_corpus(cfg(FIXTURES, tmp_path), on_build=msgs.append)
        assert len(msgs) == 1, damage
        check_token_ids(c.train, c.vocab_size)


def test_out_of_range_ids_in_a_cache_give_a_clear_error(tmp_path):
    c = load_corpus(cfg(FIXTURES, tmp_path))
    arr = np.load(c.cache_dir / "validation.npy", mmap_mode="r+")
    arr[2] = c.vocab_size + 5
    arr.flush()
    del arr
    # The manifest's digest catches it first; with the digest forged too, the id range check still does.
    manifest_path = c.cache_dir / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["splits"]["validation"]["sha256"] = cache_mod.file_digest(c.cache_dir / "validation.npy")
    manifest_path.write_text(json.dumps(m))
    with pytest.raises(DataError, match=rf"token id {c.vocab_size + 5} at flat position 2 .*delete .* to rebuild"):
        load_corpus(cfg(FIXTURES, tmp_path))
    # And the trainer-side check: a model vocabulary smaller than the corpus's.
    fresh = load_corpus(cfg(FIXTURES, tmp_path / "x"))
    with pytest.raises(DataError, match="set model.vocab_size to the corpus vocabulary size"):
        check_token_ids(fresh.train, 5, what="train split")


def test_cache_is_used_when_the_source_is_gone(data_copy, tmp_path, caplog):
    c = load_corpus(cfg(data_copy, tmp_path))
    shutil.rmtree(data_copy / "wikitext-103")
    again = load_corpus(cfg(data_copy, tmp_path))
    np.testing.assert_array_equal(np.asarray(again.train), np.asarray(c.train))
    assert "freshness cannot be checked" in caplog.text
    with pytest.raises(DataError, match="not found"):
        load_corpus(cfg(data_copy, tmp_path / "other"))  # no source and no cache


def test_concurrent_loads_build_once(tmp_path):
    code = f"""
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pcaf_core.config import DataConfig
    from pcaf_core.data import load_corpus
    c = load_corpus(DataConfig(name="pg19", min_freq=1, data_dir={str(FIXTURES)!r}, cache_dir={str(tmp_path)!r}))
    print(c.vocab.sha256, c.train.shape[0])
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0]
    assert sum(err.count("\nbuilt ") + err.startswith("built ") for _, err in outs) == 1


class FakeDataset:
    """Just enough of ``datasets.Dataset`` for the reader: column_names, iter(), _fingerprint."""

    def __init__(self, rows: list[str], fingerprint: str):
        self.rows = rows
        self.column_names = ["text"]
        self._fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self.rows)

    def iter(self, batch_size: int):
        for i in range(0, len(self.rows), batch_size):
            yield {"text": self.rows[i:i + batch_size]}


def test_hub_layout_reads_rows_like_the_raw_files(tmp_path, monkeypatch):
    """layout=hf with a stand-in ``datasets`` module: rows are the raw file's lines."""
    names = {"train": "train", "validation": "valid", "test": "test"}
    calls = []

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        text = (FIXTURES / "wikitext-103-raw" / f"wiki.{names[split]}.raw").read_text(encoding="utf-8")
        rows = [line + "\n" for line in text.split("\n")[:-1]]  # HF WikiText rows keep their newline
        return FakeDataset(rows, fingerprint=f"fp-{split}")

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    hub = load_corpus(DataConfig(name="wikitext103", layout="hf", min_freq=1, cache_dir=str(tmp_path / "h")))
    raw = load_corpus(cfg(FIXTURES, tmp_path / "r", layout="raw"))
    assert ("Salesforce/wikitext", "wikitext-103-raw-v1", "train") in calls
    assert (hub.settings.tokenizer, hub.settings.rows) == ("regex", "nonempty")
    for split in ("train", "validation", "test"):
        np.testing.assert_array_equal(np.asarray(hub.split(split)), np.asarray(raw.split(split)))
    assert hub.manifest["source"]["fingerprints"] == {s: f"fp-{s}" for s in names}
    # Same hub fingerprints: reused; a new fingerprint (new dataset revision): rebuilt.
    msgs: list[str] = []
    load_corpus(DataConfig(name="wikitext103", layout="hf", min_freq=1, cache_dir=str(tmp_path / "h")),
                on_build=msgs.append)
    assert msgs == []
    fake.load_dataset = lambda path, config, split: FakeDataset(load_dataset(path, config, split).rows, "new")
    load_corpus(DataConfig(name="wikitext103", layout="hf", min_freq=1, cache_dir=str(tmp_path / "h")),
                on_build=msgs.append)
    assert len(msgs) == 1 and "source changed" in msgs[0]

