"""A corpus of your own (``data.name=text``): its two forms, its rows and documents, its errors, and that its
folder is what names it (its cache, a run's identity, a checkpoint's config hash). docs/DATA.md §1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from experiments.table_plan import row_config
from paper_tables.sweep import other_settings
from pcaf_core.config import ConfigError, DataConfig
from pcaf_core.config_io import config_hash, config_to_dict
from pcaf_core.data import EOS_ID, DataError, build_vocab, load_corpus
from pcaf_core.data.documents import document_bounds
from pcaf_core.data.tokenizer import regex_tokenize
from pcaf_core.run_identity import identity_digest
from pcaf_core.trained_run import TrainedRun, VocabularyMismatchError, load_vocabulary, run_data_config

SPLITS = {"train": "train", "validation": "valid", "test": "test"}


def write_lines(folder: Path, texts: dict[str, list[str]], valid_name: str = "valid") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in texts.items():
        name = valid_name if split == "validation" else SPLITS[split]
        (folder / f"{name}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


def write_folders(folder: Path, docs: dict[str, list[str]]) -> Path:
    for split, texts in docs.items():
        d = folder / SPLITS[split]
        d.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(texts):
            (d / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


LINES = {"train": ["the cat sat .", "", "the dog sat , then ran .", "a cat ran ."],
         "validation": ["the cat ran .", "", "a dog sat ."], "test": ["the dog ran ."]}
DOCS = {"train": ["the cat sat .\nthe dog sat .\n", "a cat ran .\n\nthe end .\n"],
        "validation": ["the cat ran .\na dog sat .\n"], "test": ["the dog ran .\n", "a cat sat .\n"]}


def text_cfg(folder: Path, cache: Path, **kw) -> DataConfig:
    return DataConfig(name="text", layout="raw", data_dir=str(folder), cache_dir=str(cache), max_vocab=100,
                      min_freq=1, **kw)


def expected(train_docs: list[str], docs: list[str]) -> np.ndarray:
    vocab = build_vocab([regex_tokenize(d) for d in train_docs], 100, 1)
    return np.concatenate([vocab.encode_tokens(regex_tokenize(d) + ["<eos>"]) for d in docs])


@pytest.mark.parametrize("valid_name", ["valid", "validation"])
def test_a_file_per_split_makes_every_nonempty_line_a_row(tmp_path, valid_name):
    folder = write_lines(tmp_path / "corpus", LINES, valid_name)
    c = load_corpus(text_cfg(folder, tmp_path / "cache"))
    assert (c.settings.layout, c.settings.tokenizer, c.settings.rows) == ("raw", "regex", "nonempty")
    train = [line for line in LINES["train"] if line.strip()]
    for split, lines in LINES.items():
        docs = [line for line in lines if line.strip()]
        np.testing.assert_array_equal(np.asarray(c.split(split)), expected(train, docs))
        assert c.split_stats(split)["documents"] == len(docs)
    assert c.manifest["source"]["checks"] == [
        "your own corpus: nothing published to check against; each file's sha256 recorded"]
    # rows=lines keeps the blank lines, each as an <eos> of its own.
    lines = load_corpus(text_cfg(folder, tmp_path / "cache", rows="lines"))
    assert int((np.asarray(lines.train) == EOS_ID).sum()) == len(LINES["train"])
    # A document of the stream protocol is a row.
    assert len(document_bounds(np.asarray(c.train), c.vocab, "text")) == len(train)


def test_a_folder_per_split_makes_every_file_one_document(tmp_path):
    folder = write_folders(tmp_path / "corpus", DOCS)
    # layout=tokens (the default of data.layout) names the same files, as for PG-19.
    c = load_corpus(dataclasses.replace(text_cfg(folder, tmp_path / "cache"), layout="tokens"))
    assert c.settings.layout == "raw"
    for split, docs in DOCS.items():
        np.testing.assert_array_equal(np.asarray(c.split(split)), expected(DOCS["train"], docs))
    bounds = document_bounds(np.asarray(c.test), c.vocab, "text")
    assert len(bounds) == len(DOCS["test"])
    with pytest.raises(DataError, match="each .txt file of a split folder is one document.*'lines' is for a file"):
        load_corpus(text_cfg(folder, tmp_path / "cache2", rows="lines"))


def test_the_folder_names_the_corpus_its_cache_and_its_runs(tmp_path):
    a = write_lines(tmp_path / "a", LINES)
    b = write_lines(tmp_path / "b", {**LINES, "train": LINES["train"] + ["one more line ."]})
    ca = load_corpus(text_cfg(a, tmp_path / "cache"))
    cb = load_corpus(text_cfg(b, tmp_path / "cache"))
    assert ca.cache_dir != cb.cache_dir  # one cache each, side by side, not one rebuilt in turn
    assert load_corpus(text_cfg(a, tmp_path / "cache")).cache_dir == ca.cache_dir
    assert ca.record()["folder"] == str(a.resolve())

    def run(name: str, data_dir: str):
        cfg = row_config("wt2-nt-1024/pcaf_context", "smoke", "torch",
                         [f"data.name={name}", f"data.data_dir={data_dir}"])
        return cfg, {**config_to_dict(cfg), "table": "wt2-nt-1024", "row": "pcaf_context", "scale": {"name": "smoke"}}

    # Another folder is another corpus: another run for a table and for a resumed checkpoint ...
    (ta, da), (tb, db) = run("text", str(a)), run("text", str(b))
    assert identity_digest(da) != identity_digest(db) and config_hash(ta) != config_hash(tb)
    # ... whereas a published corpus found in another folder is the same corpus (its files are checked).
    (wa, dwa), (wb, dwb) = run("wikitext2", str(a)), run("wikitext2", str(b))
    assert identity_digest(dwa) == identity_digest(dwb) and config_hash(wa) == config_hash(wb)
    # A sweep's table gives each folder of a text corpus a line of its own, and pools a published corpus's copies.
    def settings(name: str, data_dir: str) -> dict:
        return {"data.name": name, "data.data_dir": data_dir, "memory.top_k": 4}
    assert other_settings([settings("text", str(a)), settings("text", str(b))], "memory.top_k") == ["data.data_dir"]
    assert other_settings([settings("wikitext2", str(a)), settings("wikitext2", str(b))], "memory.top_k") == []


def test_a_text_corpus_named_on_the_command_line_is_trained_at_every_scale(tmp_path):
    folder = write_lines(tmp_path / "corpus", LINES)
    for scale in ("smoke", "cpu", "paper"):
        cfg = row_config("wt2-nt-1024/pcaf_context", scale, "torch", ["data=text", f"data.data_dir={folder}"])
        assert (cfg.data.name, cfg.data.layout, cfg.data.data_dir) == ("text", "raw", str(folder))


def test_what_is_wrong_with_a_text_corpus_is_said_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="data.name=text reads a corpus of your own: set data.data_dir="):
        DataConfig(name="text", layout="raw")
    with pytest.raises(ConfigError, match="a text corpus is read from its folder: use 'raw'"):
        DataConfig(name="text", layout="hf", data_dir=str(tmp_path))
    with pytest.raises(DataError, match="is not a folder: set data.data_dir=<folder> to a folder holding train.txt"):
        load_corpus(text_cfg(tmp_path / "absent", tmp_path / "cache"))
    partial = write_lines(tmp_path / "partial", {"train": LINES["train"], "validation": LINES["validation"]})
    with pytest.raises(DataError, match=r"has no test split \(test.txt or test/\)"):
        load_corpus(text_cfg(partial, tmp_path / "cache"))
    both = write_lines(tmp_path / "both", LINES)
    (both / "validation.txt").write_text("x y .\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"more than one validation split \(valid.txt, validation.txt\): keep one"):
        load_corpus(text_cfg(both, tmp_path / "cache"))
    mixed = write_lines(tmp_path / "mixed", {"train": LINES["train"], "validation": LINES["validation"]})
    write_folders(mixed, {"test": DOCS["test"]})
    with pytest.raises(DataError, match=r"all be .txt files or all be folders \(.*test is a folder\)"):
        load_corpus(text_cfg(mixed, tmp_path / "cache"))
    empty = write_folders(tmp_path / "empty", {"train": DOCS["train"], "validation": DOCS["validation"]})
    (empty / "test").mkdir()
    with pytest.raises(DataError, match="holds no .txt files: put the test split's documents there"):
        load_corpus(text_cfg(empty, tmp_path / "cache"))


def test_a_trained_run_reads_only_the_vocabulary_it_trained_on(tmp_path):
    """Generation and the stream evaluation may point data.data_dir elsewhere (the corpus moved); a folder
    whose vocabulary is not the one the run's record names is refused in one line, not decoded as nonsense."""
    a = write_lines(tmp_path / "a", LINES)
    b = write_lines(tmp_path / "b", {**LINES, "train": LINES["train"] + ["zebra zebra ."]})
    trained = load_corpus(text_cfg(a, tmp_path / "cache"))
    cfg = row_config("wt2-nt-1024/pcaf_context", "smoke", "torch",
                     ["data=text", f"data.data_dir={a}", f"data.cache_dir={tmp_path / 'cache'}", "data.min_freq=1"])
    run = TrainedRun(tmp_path / "run", cfg, tmp_path / "run" / "model.safetensors", 5, {},
                     vocab_sha256=trained.vocab.sha256)
    moved = write_lines(tmp_path / "moved", LINES)  # the same corpus in another folder: the same vocabulary
    vocab, tokenizer = load_vocabulary(run, run_data_config(run, {"data_dir": str(moved)}))
    assert vocab.sha256 == trained.vocab.sha256 and tokenizer == "regex"
    with pytest.raises(VocabularyMismatchError, match="is not the one run .* trained on .*point data.data_dir"):
        load_vocabulary(run, run_data_config(run, {"data_dir": str(b)}))
