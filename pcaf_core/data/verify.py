"""What is published about a corpus's files, checked: the archive's sha256, WikiText-2's token-file md5s, and
pg19-mini's ``metadata.csv`` (every book present, in its split, with its sha256).

:func:`verify_source` runs when a token cache is built (``pcaf_core.data.cache``) and in ``make data``; it returns
what it checked, which the cache's manifest records, and raises a :class:`DataError` that says how to restore a
file that does not match.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from .corpora import SPLITS, Source
from .errors import DataError
from .files import KNOWN_ARCHIVE_SHA256, file_digest, read_text

# md5 of the unpacked WikiText-2 v1 token files (identical to the official wikitext-2-v1.zip).
WIKITEXT2_TOKENS_MD5: dict[str, str] = {
    "train": "34a77ebe59551b3a3b3d8c0a2797c976",
    "validation": "d756d22ab2310e7e60c094bea5c5a8eb",
    "test": "781c9418ab9414bd09e4aad825aae752",
}


def verify_source(source: Source, root: Path) -> list[str]:
    """Check the unpacked files against what is published about them; return what was checked.

    WikiText-2 token files: md5 of each split. pg19-mini style ``metadata.csv`` (with
    ``id, split, sha256`` columns): every book present, in its split, with its sha256.
    """
    checks: list[str] = []
    if source.origin == "archive":
        known = KNOWN_ARCHIVE_SHA256.get(Path(source.location).name)
        checks.append(f"archive sha256 {'matches the published value' if known else 'recorded (none published)'}")
    if source.origin == "hf":
        return checks + ["hub dataset (integrity is the hub client's job)"]
    if source.spec.family == "text":
        return checks + ["your own corpus: nothing published to check against; each file's sha256 recorded"]
    if source.spec.name == "wikitext2" and source.layout == "tokens":
        for split, md5 in WIKITEXT2_TOKENS_MD5.items():
            (p,) = source.split_files(split, root)
            got = file_digest(p, "md5")
            if got != md5:
                raise DataError(f"{p} has md5 {got}, expected {md5} (WikiText-2 v1 release): the file is damaged "
                                f"or from another release. Restore it (delete its folder and run `make data`)")
        checks.append("WikiText-2 token files match the release md5s")
    if source.spec.family == "pg19":
        base = source.materialize(root)
        meta = base / "metadata.csv"
        if meta.is_file():
            n = _verify_pg19_metadata(source, base, meta, root)
            if n:
                checks.append(f"metadata.csv: {n} books present with matching sha256")
            else:
                checks.append("metadata.csv has no per-book checksums (not verified)")
        else:
            checks.append("no metadata.csv (books not verified)")
    return checks


def _verify_pg19_metadata(source: Source, base: Path, meta: Path, root: Path) -> int:
    rows = list(csv.DictReader(io.StringIO(read_text(meta))))
    if not rows or not {"id", "split", "sha256"} <= set(rows[0]):
        return 0
    for split in SPLITS:
        listed = {r["id"] for r in rows if r["split"] == split}
        present = {p.stem for p in source.split_files(split, root)}
        if listed != present:
            missing = sorted(listed - present)[:5]
            extra = sorted(present - listed)[:5]
            raise DataError(f"{base / split} does not match metadata.csv (missing {missing}, unexpected {extra}): "
                            f"the corpus folder is incomplete; re-unpack it (delete it and run `make data`)")
    for r in rows:
        p = base / r["split"] / f"{r['id']}.txt"
        got = file_digest(p)
        if got != r["sha256"]:
            raise DataError(f"{p} has sha256 {got[:16]}…, metadata.csv says {r['sha256'][:16]}…: the book is "
                            f"damaged; re-unpack the corpus (delete its folder and run `make data`)")
    return len(rows)
