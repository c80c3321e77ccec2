"""A corpus of the user's own (``data.name=text``): a folder of plain UTF-8 text, in one of two forms.

* **a file per split**: ``train.txt``, ``valid.txt`` (or ``validation.txt``) and ``test.txt``; every line is a
  row, as in WikiText (``data.rows``: ``nonempty``, the default, or ``lines``);
* **a folder per split**: ``train/``, ``valid/`` (or ``validation/``) and ``test/``, each holding ``*.txt``
  files read in name order; every file is a row (a document, as a PG-19 book), so ``data.rows`` must be
  ``nonempty``.

All three splits take the same form. The folder is named by ``data.data_dir`` and nothing else is searched:
the folder is the corpus, so it is also part of the cache key and of a run's identity
(:func:`pcaf_core.run_identity.location_fields`). Nothing is published to check the files against; their
sha256 digests are recorded in the cache manifest, and a changed file rebuilds the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import DataError, DataNotFoundError

NAME = "text"

SPLIT_NAMES = {"train": ("train",), "validation": ("valid", "validation"), "test": ("test",)}

FORMS = ("files", "folders")  # a .txt file per split (rows are lines) / a folder of .txt files per split

HOW_TO_GET = ("set data.data_dir=<folder> to a folder holding train.txt, valid.txt and test.txt (every line a "
              "row), or train/, valid/ and test/ folders of .txt files (every file a document)")


def corpus_folder(data_dir: str | os.PathLike | None) -> Path:
    """The folder of a ``data.name=text`` corpus, resolved (it names the corpus), or a :class:`DataError`."""
    if data_dir is None or str(data_dir) == "":
        raise DataNotFoundError(f"data.name=text reads a corpus of your own: {HOW_TO_GET}")
    folder = Path(data_dir).expanduser().resolve()
    if not folder.is_dir():
        raise DataNotFoundError(f"data.data_dir={str(data_dir)!r} is not a folder: {HOW_TO_GET}")
    return folder


def _split_entry(folder: Path, split: str) -> tuple[str, Path]:
    """``(form, path)`` of one split: its ``.txt`` file or its folder."""
    found: list[tuple[str, Path]] = []
    for name in SPLIT_NAMES[split]:
        if (folder / f"{name}.txt").is_file():
            found.append(("files", folder / f"{name}.txt"))
        if (folder / name).is_dir():
            found.append(("folders", folder / name))
    if not found:
        names = " or ".join(f"{n}.txt or {n}/" for n in SPLIT_NAMES[split])
        raise DataNotFoundError(f"{folder} has no {split} split ({names}): {HOW_TO_GET}")
    if len(found) > 1:
        raise DataError(f"{folder} has more than one {split} split ({', '.join(p.name for _, p in found)}): "
                        f"keep one of them")
    return found[0]


def corpus_form(folder: Path) -> str:
    """``files`` or ``folders``: the form all three splits of the corpus in ``folder`` take."""
    forms = {split: _split_entry(folder, split)[0] for split in SPLIT_NAMES}
    if len(set(forms.values())) > 1:
        said = ", ".join(f"{split} is a {'file' if f == 'files' else 'folder'}" for split, f in forms.items())
        raise DataError(f"{folder}: the splits must all be .txt files or all be folders ({said})")
    return forms["train"]


def split_files(folder: Path, split: str) -> list[Path]:
    """The files of ``split``: its one ``.txt`` file, or its folder's ``*.txt`` files in name order."""
    form, path = _split_entry(folder, split)
    if form == "files":
        return [path]
    files = sorted(p for p in path.iterdir() if p.name.endswith(".txt") and p.is_file())
    if not files:
        raise DataError(f"{path} holds no .txt files: put the {split} split's documents there, one per file")
    return files
