"""Corpus files at the byte level: checksums, archives unpacked once and safely, UTF-8 text.

:mod:`pcaf_core.data.corpora` knows which corpus lives where; this module only knows files. Every
failure is a :class:`DataError` that names the file and says how to restore it.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tarfile
import uuid
import zipfile
import zlib
from pathlib import Path

from pcaf_core.fsutil import DiskFullError, file_lock, free_bytes, is_disk_full

from .errors import DataError

#: Environment variable naming the cache root (:func:`pcaf_core.data.corpora.cache_root`).
ENV_CACHE_DIR = "PCAF_CACHE_DIR"

# Published sha256 of the archives the project knows (docs/DATA.md, "Checks"). An archive with
# another name is accepted, but only its own digest can be recorded, not checked.
KNOWN_ARCHIVE_SHA256: dict[str, str] = {
    "wikitext-2-v1.tar.xz": "4aab044110687bdab29933e6290b3e342f0a7839e4757d1f3d671f0a61aa0fbf",
    "pg19-mini.tar.xz": "5252d1922049ad7414baa1238550e3fd4c820f08b90c9c5992fe4fb222c827f1",
}

ARCHIVE_SUFFIXES = (".tar.xz", ".tar.gz", ".tgz", ".tar", ".zip")

# --------------------------------------------------------------------------------------------
# Checksums and archives
# --------------------------------------------------------------------------------------------

def file_digest(path: Path, algo: str = "sha256") -> str:
    """Hex digest of a file, read in 4 MiB blocks."""
    h = hashlib.new(algo)
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    except OSError as e:
        raise unreadable(path, e) from e
    return h.hexdigest()


def unreadable(path: Path, e: OSError) -> DataError:
    return DataError(f"cannot read {path}: {e.strerror or e}. The corpus folder is incomplete or damaged: restore "
                     f"the file (re-unpack the corpus: delete its folder and run `make data`)")


def verify_archive(path: Path) -> str:
    """sha256 of ``path``; raises :class:`DataError` if a published checksum disagrees."""
    digest = file_digest(path)
    expected = KNOWN_ARCHIVE_SHA256.get(path.name)
    if expected is not None and digest != expected:
        raise DataError(f"archive {path} is corrupt or not the published release: sha256 {digest}, "
                        f"expected {expected}. Replace it with a fresh copy (for the vendored WikiText-2: "
                        f"`git restore data/{path.name}`; otherwise copy it again from ../shared/data or "
                        f"its source), then run `make data`")
    return digest


def archive_stem(name: str) -> str:
    for s in ARCHIVE_SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def unpacked_size(archive: Path) -> int | None:
    """Bytes the members of ``archive`` take unpacked (reads the whole archive); None if it cannot tell."""
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                return sum(i.file_size for i in zf.infolist())
        with tarfile.open(archive, "r:*") as tf:
            return sum(m.size for m in tf.getmembers())
    except Exception:  # noqa: BLE001 - only for a message
        return None


def safe_extract(archive: Path, dest: Path) -> None:
    """Unpack ``archive`` into ``dest``, refusing members that would land outside it.

    A full disk is reported as such (with the unpacked size and the free space), another file-system
    error as that error; only a read or format error of the archive itself blames the archive."""
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                for m in zf.namelist():
                    if m.startswith(("/", "\\")) or ".." in Path(m).parts:
                        raise DataError(f"archive {archive} has an unsafe member path {m!r}; refusing to unpack")
                zf.extractall(dest)
        else:
            with tarfile.open(archive, "r:*") as tf:
                tf.extractall(dest, filter="data")
    except DataError:
        raise
    except OSError as e:
        if is_disk_full(e):
            full = DiskFullError(dest.parent, unpacked_size(archive), free_bytes(dest.parent),
                                 doing=f"unpacking {archive.name} into")
            raise DataError(f"{full} (or set {ENV_CACHE_DIR} / data.cache_dir to a larger disk); the partial "
                            f"unpack was removed") from e
        raise DataError(f"cannot unpack {archive} into {dest.parent}: {e.strerror or e} ({e.filename or dest}); "
                        f"this is a file-system error, not a damaged archive: fix it and run `make data` again") from e
    except (EOFError, tarfile.TarError, zipfile.BadZipFile, ValueError, lzma.LZMAError, zlib.error) as e:
        raise DataError(f"cannot unpack {archive}: {e}. The archive is damaged: replace it with a fresh "
                        f"copy and run `make data`") from e


def extract_archive(archive: Path, root: Path) -> tuple[Path, str]:
    """Verify ``archive`` and unpack it once into ``<root>/sources/<stem>-<sha12>``.

    Returns ``(folder, sha256)``. The folder is written under a temporary name and renamed
    into place only when complete, so an interrupted unpack is never mistaken for a good one; the
    temporary folders a killed unpack left behind are removed (under the lock, nobody else writes them).
    """
    digest = verify_archive(archive)
    dest = root / "sources" / f"{archive_stem(archive.name)}-{digest[:12]}"
    marker = dest / ".complete"
    if marker.is_file() and marker.read_text().strip() == digest:
        return dest, digest
    with file_lock(root / ".locks" / f"{dest.name}.lock"):
        if marker.is_file() and marker.read_text().strip() == digest:  # unpacked by another process
            return dest, digest
        dest.parent.mkdir(parents=True, exist_ok=True)
        for orphan in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(orphan, ignore_errors=True)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            safe_extract(archive, tmp)
            (tmp / ".complete").write_text(digest + "\n")
            if dest.exists():  # a half-unpacked folder left by a killed process (no marker)
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest, digest


# --------------------------------------------------------------------------------------------
# Reading text
# --------------------------------------------------------------------------------------------

def read_text(path: Path) -> str:
    """Read a UTF-8 file (universal newlines) or raise a :class:`DataError` saying what to do."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise unreadable(path, e) from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 8]!r}). The file is "
                        f"damaged or in another encoding: restore it from the release (delete the corpus "
                        f"folder and run `make data`)") from e
    if "\r" in text:  # the same line endings as Python's text mode
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def text_lines(text: str) -> list[str]:
    """Lines of a file's text, as iterating the file would give them (no trailing empty line)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines
