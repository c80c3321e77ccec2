"""Every experiment file trains end to end at scale=smoke (one batched driver call per table)."""

from __future__ import annotations

import pytest

from experiments.reproduce import main as reproduce
from experiments.reproduce import table_rows
from paper_tables.collect import load_runs

TABLES = ["wt2-nt-1024", "wt2-nt-2048", "wt103-nt-baselines", "wt103-nt-ablations", "sweeps-41m", "main-303m",
          "semantic-leak-audit"]


@pytest.mark.slow
@pytest.mark.parametrize("table", TABLES)
def test_every_row_of_the_table_smoke_runs(table, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PCAF_NO_PROGRESS", "1")
    assert reproduce(["--table", table, "--scale", "smoke", "--output-root", str(tmp_path), "--no-render"]) == 0
    runs = load_runs(tmp_path)
    runs = runs[runs["table"] == table]
    assert set(runs["row"]) == set(table_rows(table))
    failed = runs[runs["status"] != "completed"]
    assert failed.empty, failed[["row", "error"]].to_string()
    assert (runs["scale"] == "smoke").all() and (runs["backend"] == "torch").all()
    assert runs["best_ppl"].notna().all() and runs["full_ppl"].notna().all()
    assert all(any("(scale=smoke)" in d for d in devs) for devs in runs["deviations"])
    if table == "sweeps-41m":  # multi-seed rows ran once per seed
        assert (runs[runs["row"] == "pcaf_context_wt103"]["seed"].sort_values().tolist() == [1234, 2345, 3456])
