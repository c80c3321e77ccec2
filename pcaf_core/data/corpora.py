"""Corpora: where they live, how each is located, and how their documents are read (their files are checked by
:mod:`pcaf_core.data.verify`, their bytes read by :mod:`pcaf_core.data.files`).

Supported corpora and layouts (docs/REFERENCE_CODE.md §5.1):

=============  =========  ==========================================================
corpus         layout     on disk
=============  =========  ==========================================================
wikitext2/103  ``tokens`` ``wikitext-2/wiki.{train,valid,test}.tokens`` (pre-tokenized release)
wikitext2/103  ``raw``    ``wikitext-2-raw/wiki.{train,valid,test}.raw`` (the paper's release)
pg19, pg19_mini ``raw``   ``pg19-mini/{train,validation,test}/*.txt`` + ``metadata.csv``
text           ``raw``    ``data.data_dir``: ``{train,valid,test}.txt`` or ``{train,valid,test}/*.txt`` (your own)
any but mini   ``hf``     Hugging Face ``datasets`` (optional dependency, needs the hub)
=============  =========  ==========================================================

Each corpus may be present as an unpacked folder or as an archive (``.tar.xz``, ``.tar.gz``,
``.tar``, ``.zip``) in a data directory. Archives are checked against their published sha256
(where one is known) and unpacked once into ``<cache root>/sources/``.

Rows (documents): a WikiText row is a line of its file; a PG-19 row is a whole book; a ``text`` row is a line
of a split's file or a whole file of a split's folder (:mod:`pcaf_core.data.own_corpus`).
``rows="nonempty"`` keeps rows with ``row.strip() != ""`` (the reference); ``rows="lines"``
keeps every WikiText line, blank ones included (the convention of the WikiText release and
of the classic word-language-model code, which appends ``<eos>`` to every line).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import own_corpus
from .errors import DataError, DataNotFoundError
from .files import (
    ARCHIVE_SUFFIXES,
    ENV_CACHE_DIR,
    archive_stem,
    extract_archive,
    file_digest,
    read_text,
    text_lines,
    unreadable,
    verify_archive,
)

SPLITS: tuple[str, ...] = ("train", "validation", "test")
LAYOUTS = ("tokens", "raw", "hf")
ROWS = ("nonempty", "lines")

ENV_DATA_DIR = "PCAF_DATA_DIR"

_WIKI_FILE_SPLIT = {"train": "train", "validation": "valid", "test": "test"}

_HOW_TO_DATA_DIR = (f"put it in a directory and set {ENV_DATA_DIR}=<dir> (or data.data_dir=<dir>, "
                    f"or `make data DATA_DIR=<dir>`)")


@dataclass(frozen=True)
class CorpusSpec:
    """Static facts about one corpus: names on disk, archives, hub id, how to obtain it."""

    name: str
    title: str
    family: str  # "wikitext" (rows are lines), "pg19" (rows are books) or "text" (your own: lines or files)
    dir_names: dict[str, tuple[str, ...]]  # layout -> folder names that hold the files
    archives: dict[str, tuple[str, ...]]  # layout -> archive file names
    hf: tuple[str, str | None] | None  # (dataset path, config name) for layout "hf"
    how_to_get: dict[str, str] = field(default_factory=dict)  # layout -> instructions

    def layouts(self) -> tuple[str, ...]:
        local = tuple(self.dir_names)
        return local + (("hf",) if self.hf else ())


def _wikitext_spec(name: str, title: str, size: str) -> CorpusSpec:
    tok = (f"wikitext-{size}", f"wikitext-{size}-v1")
    raw = (f"wikitext-{size}-raw", f"wikitext-{size}-raw-v1")
    arch_tok = tuple(f"wikitext-{size}-v1{s}" for s in ARCHIVE_SUFFIXES)
    arch_raw = tuple(f"wikitext-{size}-raw-v1{s}" for s in ARCHIVE_SUFFIXES)
    hub = (f"or, with hub access, use data.layout=hf (Salesforce/wikitext, wikitext-{size}-raw-v1; "
           f"needs `pip install -e '.[hub]'`)")
    if size == "2":
        how_tok = ("WikiText-2 ships with the repository as data/wikitext-2-v1.tar.xz: restore that file "
                   "(`git restore data/wikitext-2-v1.tar.xz`), or " + _HOW_TO_DATA_DIR
                   + "; then run `make data`")
    else:
        how_tok = (f"download wikitext-{size}-v1.zip (the official release by Merity et al.; see "
                   f"https://huggingface.co/datasets/Salesforce/wikitext) and " + _HOW_TO_DATA_DIR
                   + f"; {hub}")
    how_raw = (f"download wikitext-{size}-raw-v1.zip (the official raw release by Merity et al.; see "
               f"https://huggingface.co/datasets/Salesforce/wikitext) and " + _HOW_TO_DATA_DIR + f"; {hub}")
    how_hf = "install the optional dependency (`pip install -e '.[hub]'`) and make the Hugging Face hub reachable"
    return CorpusSpec(name=name, title=title, family="wikitext",
                      dir_names={"tokens": tok, "raw": raw},
                      archives={"tokens": arch_tok, "raw": arch_raw},
                      hf=("Salesforce/wikitext", f"wikitext-{size}-raw-v1"),
                      how_to_get={"tokens": how_tok, "raw": how_raw, "hf": how_hf})


CORPORA: dict[str, CorpusSpec] = {
    "wikitext2": _wikitext_spec("wikitext2", "WikiText-2", "2"),
    "wikitext103": _wikitext_spec("wikitext103", "WikiText-103", "103"),
    "pg19_mini": CorpusSpec(
        name="pg19_mini", title="pg19-mini", family="pg19",
        dir_names={"raw": ("pg19-mini",)},
        archives={"raw": tuple(f"pg19-mini{s}" for s in ARCHIVE_SUFFIXES)},
        hf=None,
        how_to_get={"raw": "pg19-mini.tar.xz is in the project's shared data folder (../shared/data beside the "
                           "repository, which is searched automatically): copy it, or the unpacked pg19-mini/ "
                           "folder, into a directory and set " + ENV_DATA_DIR + "=<dir> (or data.data_dir=<dir>, "
                           "or `make data DATA_DIR=<dir>`)",
                    "hf": "pg19-mini has no Hugging Face copy: use data.layout=raw"},
    ),
    "pg19": CorpusSpec(
        name="pg19", title="PG-19", family="pg19",
        dir_names={"raw": ("pg19", "deepmind-gutenberg", "PG-19")},
        archives={"raw": tuple(f"pg19{s}" for s in ARCHIVE_SUFFIXES)},
        hf=("emozilla/pg19", None),
        how_to_get={"raw": "download PG-19 (`gsutil -m cp -r gs://deepmind-gutenberg <dir>/pg19`, see "
                           "https://github.com/google-deepmind/pg19) so that <dir>/pg19/{train,validation,test}/"
                           "*.txt exist, then set " + ENV_DATA_DIR + "=<dir> (or data.data_dir=<dir>); or, with "
                           "hub access, use data.layout=hf (emozilla/pg19; `pip install -e '.[hub]'`)",
                    "hf": "install the optional dependency (`pip install -e '.[hub]'`) and make the Hugging "
                          "Face hub reachable"},
    ),
    own_corpus.NAME: CorpusSpec(
        name=own_corpus.NAME, title="text corpus", family="text", dir_names={"raw": ()}, archives={"raw": ()},
        hf=None, how_to_get={"raw": own_corpus.HOW_TO_GET}),
}


def get_spec(name: str) -> CorpusSpec:
    """The :class:`CorpusSpec` for a ``data.name``."""
    try:
        return CORPORA[name]
    except KeyError:
        raise DataError(f"unknown corpus data.name={name!r}: choose one of {sorted(CORPORA)}") from None


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------

def repo_root() -> Path | None:
    """The project checkout holding this package, or None when installed elsewhere."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def data_search_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Directories searched for corpora, in order.

    An explicit ``data_dir`` is the only place searched. Otherwise: ``$PCAF_DATA_DIR``, the
    repository's ``data/`` (the vendored WikiText-2 archive), then ``../shared/data`` beside
    the repository when it exists.
    """
    if data_dir is not None:
        p = Path(data_dir).expanduser()
        if not p.is_dir():
            raise DataError(f"data.data_dir={str(data_dir)!r} is not a directory: point it at the folder "
                            f"holding the corpora, or leave it unset to use {ENV_DATA_DIR} and the defaults")
        return [p]
    dirs: list[Path] = []
    env = os.environ.get(ENV_DATA_DIR)
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise DataError(f"{ENV_DATA_DIR}={env!r} is not a directory: set it to the folder holding the "
                            f"corpora or unset it")
        dirs.append(p)
    root = repo_root()
    if root is not None:
        for p in (root / "data", root.parent / "shared" / "data"):
            if p.is_dir() and p not in dirs:
                dirs.append(p)
    return dirs


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where caches and unpacked archives go: ``cache_dir``, ``$PCAF_CACHE_DIR``,
    ``<repo>/data_cache``, or ``~/.cache/pcaf`` outside a checkout."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    root = repo_root()
    if root is not None:
        return root / "data_cache"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pcaf"


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------

@dataclass
class Source:
    """One located copy of a corpus in one layout.

    ``origin`` is ``archive`` (``location`` is the archive file), ``directory`` (``location``
    is the corpus folder) or ``hf`` (``location`` is ``dataset[:config]``). Archives are
    unpacked lazily by :meth:`materialize`, so checking a cache never unpacks anything.
    """

    spec: CorpusSpec
    layout: str
    origin: str
    location: str
    _root: Path | None = None
    _archive_sha256: str | None = None
    _hf_cache: dict[str, Any] = field(default_factory=dict)

    # --- description ---------------------------------------------------------------------
    def describe(self) -> str:
        if self.origin == "archive":
            return f"archive {self.location}"
        if self.origin == "directory":
            return f"folder {self.location}"
        return f"Hugging Face dataset {self.location}"

    # --- files -----------------------------------------------------------------------------
    def materialize(self, root: Path) -> Path:
        """The folder holding the corpus files (unpacking a verified archive under ``root``)."""
        if self.origin == "hf":
            raise DataError("internal: a hub source has no folder")
        if self._root is None:
            if self.origin == "directory":
                self._root = Path(self.location)
            else:
                archive = Path(self.location)
                top, self._archive_sha256 = extract_archive(archive, root)
                self._root = _find_corpus_dir(top, self.spec, self.layout)
                if self._root is None:
                    raise DataError(f"archive {archive} does not contain a {self.spec.title} folder "
                                    f"({' or '.join(self.spec.dir_names[self.layout])}) with its train split: "
                                    f"it is not a {self.spec.title} release. {self.spec.how_to_get[self.layout]}")
        return self._root

    def split_files(self, split: str, root: Path) -> list[Path]:
        """The files of ``split`` (WikiText: one file; PG-19: books sorted by file name; text: either)."""
        base = self.materialize(root)
        if self.spec.family == "text":
            return own_corpus.split_files(base, split)
        if self.spec.family == "wikitext":
            ext = "tokens" if self.layout == "tokens" else "raw"
            p = base / f"wiki.{_WIKI_FILE_SPLIT[split]}.{ext}"
            if not p.exists():
                raise DataError(f"{self.spec.title} split {split!r} is missing: {p} does not exist. "
                                f"{self.spec.how_to_get[self.layout]}")
            return [p]
        d = base / split
        if not d.is_dir():
            raise DataError(f"{self.spec.title} split {split!r} is missing: {d} is not a folder. "
                            f"{self.spec.how_to_get[self.layout]}")
        books = sorted(p for p in d.iterdir() if p.name.endswith(".txt"))
        if not books:
            raise DataError(f"{self.spec.title} split {split!r} has no books: {d} holds no *.txt files. "
                            f"{self.spec.how_to_get[self.layout]}")
        return books

    def rows_are_files(self, root: Path) -> bool:
        """Whether a row is a whole file (PG-19's books, a ``text`` corpus with a folder per split), not a line."""
        if self.spec.family == "text":
            return own_corpus.corpus_form(self.materialize(root)) == "folders"
        return self.spec.family == "pg19"

    def iter_documents(self, split: str, rows: str, root: Path) -> Iterator[str]:
        """Yield the rows of ``split`` that become documents (each is followed by ``<eos>``)."""
        if rows not in ROWS:
            raise DataError(f"unknown rows convention {rows!r}: use one of {list(ROWS)}")
        if self.spec.family == "pg19" and rows != "nonempty":
            raise DataError("PG-19 rows are whole books: data.rows must be 'nonempty' (or 'auto')")
        if self.origin == "hf":
            yield from self._iter_hf(split, rows)
            return
        whole_files = self.rows_are_files(root)
        if whole_files and rows != "nonempty":
            raise DataError(f"{self.location}: each .txt file of a split folder is one document, so data.rows "
                            f"must be 'nonempty' (or 'auto'); 'lines' is for a file per split")
        for path in self.split_files(split, root):
            text = read_text(path)
            if whole_files:
                if text.strip():
                    yield text
                continue
            lines = text_lines(text)
            if rows == "lines":
                yield from lines
            else:
                for line in lines:
                    if line.strip():
                        yield line

    # --- hub ---------------------------------------------------------------------------------
    def _hf_dataset(self, split: str) -> Any:
        if split in self._hf_cache:
            return self._hf_cache[split]
        datasets = _import_datasets()
        assert self.spec.hf is not None
        path, config = self.spec.hf
        try:
            ds = datasets.load_dataset(path, config, split=split)
        except Exception as e:  # the hub client raises many types; all mean "could not get it"
            raise DataError(f"could not load {path} ({config}) split {split!r} from the Hugging Face hub: {e}. "
                            f"Check network access and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE, or use a local copy "
                            f"with data.layout=raw ({self.spec.how_to_get.get('raw', '')})") from e
        self._hf_cache[split] = ds
        return ds

    def _iter_hf(self, split: str, rows: str) -> Iterator[str]:
        ds = self._hf_dataset(split)
        names = list(getattr(ds, "column_names", []) or [])
        # The reference falls back from book_text to text for PG-19 mirrors.
        column = next((c for c in ("text", "book_text") if c in names), None)
        if column is None:
            raise DataError(f"Hugging Face dataset {self.location} split {split!r} has no 'text' column "
                            f"(columns: {names}); it is not a supported copy of {self.spec.title}")
        for batch in ds.iter(batch_size=1000):
            for text in batch[column]:
                text = text or ""
                if self.spec.family == "wikitext":
                    # An HF WikiText row is one line of the release file, newline included.
                    text = text.rstrip("\n")
                if rows == "lines" or text.strip():
                    yield text

    # --- fingerprint ---------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """A cheap description of the source's content for cache staleness checks.

        Archive: name, bytes, mtime. Folder: the same for every split file. Hub: dataset id
        and each split's ``datasets`` fingerprint. :func:`fingerprints_match` compares two of
        them, falling back to sha256 when sizes/mtimes differ.
        """
        if self.origin == "archive":
            p = Path(self.location)
            st = _stat(p)
            return {"origin": "archive", "files": [{"rel": p.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}]}
        if self.origin == "directory":
            base = Path(self.location)
            files = []
            for split in SPLITS:
                for p in self.split_files(split, base):
                    st = _stat(p)
                    files.append({"rel": p.relative_to(base).as_posix(), "bytes": st.st_size,
                                  "mtime_ns": st.st_mtime_ns})
            return {"origin": "directory", "files": files}
        fps = {}
        for split in SPLITS:
            ds = self._hf_dataset(split)
            fps[split] = str(getattr(ds, "_fingerprint", "")) or str(len(ds))
        return {"origin": "hf", "dataset": self.location, "fingerprints": fps}

    def full_fingerprint(self) -> dict[str, Any]:
        """:meth:`fingerprint` plus the sha256 of every file (computed at build time)."""
        fp = self.fingerprint()
        if fp["origin"] == "archive":
            self._archive_sha256 = self._archive_sha256 or verify_archive(Path(self.location))
            fp["files"][0]["sha256"] = self._archive_sha256
        elif fp["origin"] == "directory":
            base = Path(self.location)
            for f in fp["files"]:
                f["sha256"] = file_digest(base / f["rel"])
        return fp

    def path_of(self, rel: str) -> Path:
        p = Path(self.location)
        return p if self.origin == "archive" else p / rel


def _import_datasets() -> Any:
    """The optional Hugging Face ``datasets`` module, or a :class:`DataError` saying how to get it."""
    try:
        import datasets  # optional dependency, imported only for layout "hf"
    except ImportError as e:
        raise DataError("data.layout=hf needs the optional `datasets` package: `pip install -e '.[hub]'` (or "
                        "`pip install datasets`). Without hub access, use a local copy with data.layout=raw or "
                        "tokens and PCAF_DATA_DIR (docs/DATA.md)") from e
    return datasets


def _stat(p: Path) -> os.stat_result:
    try:
        return p.stat()
    except OSError as e:
        raise unreadable(p, e) from e


def fingerprints_match(source: Source, recorded: dict[str, Any]) -> tuple[bool, list[dict[str, Any]]]:
    """Whether ``source`` has the content recorded in a manifest.

    Files whose size and mtime are unchanged are trusted; others are re-hashed and compared by
    sha256 (copies and re-extractions keep a cache valid). Returns ``(match, refreshed)``
    where ``refreshed`` is the recorded file list with current mtimes, for rewriting.
    """
    current = source.fingerprint()
    if current.get("origin") != recorded.get("origin"):
        return False, []
    if current["origin"] == "hf":
        return current == {k: recorded.get(k) for k in current}, []
    rec = {f["rel"]: f for f in recorded.get("files", [])}
    cur = {f["rel"]: f for f in current["files"]}
    if current["origin"] == "directory" and set(rec) != set(cur):
        return False, []
    if current["origin"] == "archive":
        # The archive may be found under a different directory; match by content only.
        if len(rec) != 1:
            return False, []
        (r,) = rec.values()
        (c,) = cur.values()
        rec, cur = {"a": r}, {"a": c}
    refreshed = []
    for key, c in cur.items():
        r = rec[key]
        if r.get("bytes") != c["bytes"]:
            return False, []
        if r.get("mtime_ns") != c["mtime_ns"]:
            if file_digest(source.path_of(c["rel"])) != r.get("sha256"):
                return False, []
        refreshed.append({**r, "rel": c["rel"], "mtime_ns": c["mtime_ns"]})
    return True, refreshed


def _find_corpus_dir(base: Path, spec: CorpusSpec, layout: str) -> Path | None:
    """The folder under ``base`` (itself or a known child name) holding the corpus files."""
    for name in spec.dir_names[layout]:
        d = base / name
        if spec.family == "wikitext":
            ext = "tokens" if layout == "tokens" else "raw"
            if (d / f"wiki.train.{ext}").exists():
                return d
        elif (d / "train").is_dir():
            return d
    return None


def locate_source(name: str, layout: str, data_dir: str | os.PathLike | None = None) -> Source:
    """Find ``name`` in ``layout`` in the search directories (archive first, then folder).

    Archives come first because a published checksum can verify them; an unpacked folder
    is accepted too (WikiText-2 token files are then checked against their md5s).
    """
    spec = get_spec(name)
    if layout not in spec.layouts():
        raise DataError(f"{spec.title} has no layout {layout!r}: use one of {list(spec.layouts())}")
    if spec.family == "text":
        folder = own_corpus.corpus_folder(data_dir)  # the folder is the corpus: nothing else is searched
        own_corpus.corpus_form(folder)  # all three splits present, in one form
        return Source(spec, layout, "directory", str(folder))
    if layout == "hf":
        assert spec.hf is not None
        _import_datasets()  # fail before anything is built
        path, config = spec.hf
        return Source(spec, layout, "hf", f"{path}:{config}" if config else path)
    dirs = data_search_dirs(data_dir)
    for d in dirs:
        for a in spec.archives[layout]:
            if (d / a).is_file():
                return Source(spec, layout, "archive", str(d / a))
        found = _find_corpus_dir(d, spec, layout)
        if found is not None:
            return Source(spec, layout, "directory", str(found))
    stem = archive_stem(spec.archives[layout][0])
    looked = ", ".join((f"{stem}.{{{','.join(s[1:] for s in ARCHIVE_SUFFIXES)}}}",)
                       + tuple(f"{n}/" for n in spec.dir_names[layout]))
    if dirs:
        where = ", ".join(str(d) for d in dirs)
    else:
        where = f"no directory (data.data_dir and ${ENV_DATA_DIR} are unset, the repository's data/ is missing)"
    hint = ""
    marker = f"wiki.train.{'tokens' if layout == 'tokens' else 'raw'}" if spec.family == "wikitext" else "train"
    for d in dirs:
        if (d / marker).exists():
            # The folder names which corpus it is (WikiText-2 and -103 share file names).
            hint = (f" ({d} itself holds {marker}: the data directory must be the parent of a folder named "
                    f"{spec.dir_names[layout][0]}/)")
            break
    raise DataNotFoundError(f"{spec.title} (layout {layout!r}) not found: looked for {looked} in {where}{hint}. "
                            f"To fix: {spec.how_to_get[layout]}")
