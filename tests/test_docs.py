"""The documentation stands on its own: generated lists are current."""

from __future__ import annotations

from paper_tables import tables_doc


def test_tables_doc_lists_are_current():
    text = tables_doc.DOC.read_text(encoding="utf-8")
    assert tables_doc.updated(text) == text, "docs/TABLES.md is stale: run `python -m paper_tables docs`"
    assert tables_doc.main(check=True) == 0


def test_tables_doc_check_sees_a_stale_list(tmp_path):
    stale = tmp_path / "TABLES.md"
    text = tables_doc.DOC.read_text(encoding="utf-8")
    row = "| `pcaf_context` | PCAF-context | 1024 |"
    stale.write_text(text.replace(row, row.replace("1024", "999")), encoding="utf-8")
    assert tables_doc.main(check=True, path=stale) == 1
    assert tables_doc.main(path=stale) == 0
    assert stale.read_text(encoding="utf-8") == text


# ----------------------------------------------------------------------------------------------------------
# Everything a committed file cites is in the repository, and no committed file names a machine's paths.

import re  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".mk", ".csv", ".txt", ".sh", ".cfg", ".ini", ""}
DOC_NAME = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_]*\.md)\b")
DOC_PATH = re.compile(r"(?<![\w/.-])((?:docs|data|tests|experiments|paper_tables|pcaf_core|backends|benchmarks)"
                      r"/[\w./-]*\.md)\b")
SECTION = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.md),? §(\d+(?:\.\d+)*)")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MACHINE_PATH = re.compile(r"(?<![\w.~$}-])/(?:work|home|root|tmp|Users|mnt|opt|private|var/folders|scratch)/[\w.-]")


def _committed_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    out = []
    for name in names.splitlines():
        path = REPO / name
        if path.suffix in TEXT_SUFFIXES and path.is_file() and (path.suffix or path.name in ("Makefile", "run")):
            out.append(path)
    return out


def _headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def _missing_citations(paths: list[Path], root: Path = REPO) -> list[str]:
    missing = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(root)
        for name in DOC_NAME.findall(text):
            if not any((base / name).is_file() for base in (REPO, REPO / "docs", path.parent)):
                missing.append(f"{rel}: {name}")
        for name in DOC_PATH.findall(text):
            if not (REPO / name).is_file():
                missing.append(f"{rel}: {name}")
        for doc, section in SECTION.findall(text):
            if (REPO / doc).is_file() and not any(re.match(rf"{re.escape(section)}[ .]", h)
                                                  for h in _headings(REPO / doc)):
                missing.append(f"{rel}: {doc} §{section}")
        if path.suffix == ".md":
            for target in MD_LINK.findall(text):
                if "://" in target or target.startswith(("mailto:", "<")) or "*" in target:
                    continue
                if not (path.parent / target).exists():
                    missing.append(f"{rel}: link {target}")
    return missing


def test_every_cited_document_and_section_exists():
    # This file holds a deliberately broken example for the test below.
    missing = _missing_citations([p for p in _committed_text_files() if p != Path(__file__).resolve()])
    assert not missing, "cited but not in the repository:\n" + "\n".join(sorted(set(missing)))


def test_the_citation_check_sees_what_is_missing(tmp_path):
    bad = tmp_path / "note.py"
    bad.write_text("# see REFERENCE.md, docs/REFERENCE_CODE.md §99.1 and docs/NOWHERE.md; docs/SPEC.md is fine\n")
    link = tmp_path / "page.md"
    link.write_text("[gone](missing/file.md) [there](note.py) [web](https://example.org/x.md)\n")
    assert sorted(_missing_citations([bad, link], root=tmp_path)) == [
        "note.py: REFERENCE.md", "note.py: docs/NOWHERE.md", "note.py: docs/REFERENCE_CODE.md §99.1",
        "page.md: link missing/file.md"]
    assert MACHINE_PATH.search("outputs under /home/someone/x") and not MACHINE_PATH.search("outputs/tables/x.md")


def test_no_committed_file_names_a_machine_path():
    """Tests may build paths in temporary folders; everything else (docs, rendered results, code, configs) is read
    on other machines."""
    found = []
    for path in _committed_text_files():
        rel = path.relative_to(REPO)
        if rel.parts[0] == "tests":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not found, "absolute machine paths:\n" + "\n".join(found)
