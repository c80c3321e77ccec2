"""Every experiment file trains end to end at scale=smoke (one batched driver call per table; the first table
through `make reproduce-table`, whose rendered table is checked too)."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest

from experiments.reproduce import main as reproduce
from experiments.table_plan import table_rows
from paper_tables.collect import load_runs
from paper_tables.published import load_published
from paper_tables.specs import get_table

REPO = Path(__file__).resolve().parents[1]
TABLES = ["wt2-nt-2048", "wt103-nt-baselines", "wt103-nt-ablations", "sweeps-41m", "main-303m",
          "semantic-leak-audit"]  # and wt2-nt-1024 through make, below


def _check_smoke_runs(table: str, root: Path) -> None:
    runs = load_runs(root)
    runs = runs[runs["table"] == table]
    assert set(runs["row"]) == set(table_rows(table))
    failed = runs[runs["status"] != "completed"]
    assert failed.empty, failed[["row", "error"]].to_string()
    assert (runs["scale"] == "smoke").all() and (runs["backend"] == "torch").all()
    assert runs["best_ppl"].notna().all() and runs["full_ppl"].notna().all()
    assert all(any("(scale=smoke)" in d for d in devs) for devs in runs["deviations"])
    if table == "sweeps-41m":  # multi-seed rows ran once per seed
        assert (runs[runs["row"] == "pcaf_context_wt103"]["seed"].sort_values().tolist() == [1234, 2345, 3456])


@pytest.mark.slow
@pytest.mark.parametrize("table", TABLES)
def test_every_row_of_the_table_smoke_runs(table, tmp_path, monkeypatch):
    monkeypatch.setenv("PCAF_NO_PROGRESS", "1")
    assert reproduce(["--table", table, "--scale", "smoke", "--output-root", str(tmp_path), "--no-render"]) == 0
    _check_smoke_runs(table, tmp_path)


@pytest.mark.slow
def test_make_reproduce_table_smoke_renders_every_paper_row(tmp_path):
    out = tmp_path / "outputs"
    res = subprocess.run(["make", "--no-print-directory", "reproduce-table", "TABLE=wt2-nt-1024", "SCALE=smoke",
                          f"OUTPUTS={out}"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PCAF_NO_PROGRESS": "1"}, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _check_smoke_runs("wt2-nt-1024", out)
    md_path = Path(res.stdout.strip().splitlines()[-1])
    assert md_path == out / "tables" / "wt2-nt-1024_smoke_torch.md"
    for suffix in (".tex", ".csv", "_claims.csv", "_curves.png", "_curves.pdf", "_throughput.png",
                   "_speed_quality.pdf"):
        path = out / "tables" / f"wt2-nt-1024_smoke_torch{suffix}"
        assert path.exists() and path.stat().st_size > 0, path
    md = md_path.read_text()
    spec = get_table("wt2-nt-1024")
    published = load_published("wt2-nt-1024").set_index("row")
    table_lines = [line for line in md.splitlines() if line.startswith("| ")]
    for row in spec.rows:
        line = next((ln for ln in table_lines if ln.startswith(f"| {row.display} |")), None)
        assert line is not None, f"row {row.display} missing from the table"
        assert f"{published.loc[row.id, 'best_ppl']:.2f}" in line  # published value beside the measured one
        assert "missing" not in line and "failed" not in line
    assert "Scale: smoke" in md and "Backend: torch" in md and "reference_torch" in md
    with open(out / "tables" / "wt2-nt-1024_smoke_torch.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(spec.rows)
