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
