"""``benchmarks/bench_head_loss``: both forms on both backends at a toy shape write labelled rows."""

from __future__ import annotations

import pytest

from benchmarks import bench_head_loss
from benchmarks.common import read_csv


@pytest.mark.slow
def test_toy_run_writes_a_row_per_backend_and_form(tmp_path):
    out = tmp_path / "head_loss.csv"
    assert bench_head_loss.main(["--out", str(out), "--rounds", "1", "--shapes", "24x8x50",
                                 "--chunks", "7x16"]) == 0
    rows = read_csv(out)
    assert [(r["backend"], r["form"]) for r in rows] == [("torch", "full"), ("torch", "chunked 7x16"),
                                                        ("jax", "full"), ("jax", "chunked 7x16")]
    assert all(float(r["ms"]) > 0 and float(r["peak_mb"]) >= 0 and r["what"] == "head loss" for r in rows)
    assert all(r["threads"] and r["machine"] for r in rows)
