"""The committed paper-scale tables are what their committed run records render to (``make paper-results``).

A renderer change, or records added under ``docs/results/runs`` without rendering, would otherwise leave
``docs/results`` stating what the records no longer say.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.paper_results import COMPARED_ROWS, render_commands, render_committed
from pcaf_core.results import RunMetrics, write_metrics

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


@pytest.mark.slow
def test_the_committed_paper_tables_are_what_their_records_render(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the tables name the records' root as given: docs/results/runs
    assert render_committed(out=tmp_path, figures=False) == 0
    written = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))  # not the render locks
    for table in ("wt2-nt-1024", "wt2-nt-2048"):
        for backend in ("torch", "jax"):
            assert {f"{table}_paper_{backend}{end}" for end in (".md", ".csv", ".tex", "_claims.csv")} <= set(written)
        assert {f"{table}_paper_torch_vs_jax.md", f"{table}_paper_torch_vs_jax.csv"} <= set(written)
    stale = [name for name in written if (tmp_path / name).read_bytes() != (RESULTS / name).read_bytes()]
    assert not stale, f"docs/results/{stale} differ from what their records render to: run `make paper-results`"


def _record(runs: Path, table: str, backend: str, row: str) -> None:
    write_metrics(runs / table / "paper" / backend / row / "seed1-x",
                  RunMetrics(table=table, row=row, status="completed", scale="paper", backend=backend, seed=1))


def test_each_backend_with_records_is_rendered_with_its_training_overrides(tmp_path):
    """A table renders on each backend that has records, with that backend's name for the GPU; torch beside JAX
    only where both have records, over the compared rows and any other row JAX ran."""
    runs = tmp_path / "runs"
    _record(runs, "wt2-nt-1024", "torch", "pcaf_context")
    commands = render_commands(runs, tmp_path / "out", figures=False)
    assert [c[:6] for c in commands] == [["render", "--table", "wt2-nt-1024", "--scale", "paper", "--backend"]]
    assert commands[0][6:] == ["torch", "--runs", str(runs), "--out", str(tmp_path / "out"), "--no-figures",
                               "backend.device=cuda", "data.layout=tokens"]
    _record(runs, "wt2-nt-1024", "jax", "transformer_dense")
    _record(runs, "wt2-nt-2048", "jax", "pcaf_context")
    commands = render_commands(runs, tmp_path / "out")
    assert [(c[0], c[2], c[6] if c[0] == "render" else None) for c in commands] == [
        ("render", "wt2-nt-1024", "torch"), ("render", "wt2-nt-1024", "jax"), ("backends", "wt2-nt-1024", None),
        ("render", "wt2-nt-2048", "jax")]
    jax_render, backends = commands[1], commands[2]
    assert jax_render[-2:] == ["backend.device=gpu", "data.layout=tokens"] and "--no-figures" not in jax_render
    rows = backends[backends.index("--rows") + 1].split(",")
    assert sorted(rows) == sorted({*COMPARED_ROWS, "transformer_dense"})
    assert backends[-4:] == ["torch:backend.device=cuda", "torch:data.layout=tokens", "jax:backend.device=gpu",
                             "jax:data.layout=tokens"]
