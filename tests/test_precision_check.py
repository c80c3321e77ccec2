"""``make bench-precision`` end to end at smoke scale: the CSV that benchmarks/precision_check.py writes is the one
the benchmark report judges the CPU's bf16 learning curves from, labelled with the machine and the run. The command
(``python -m benchmarks.precision_check``) runs in this process (tests/entry_points.py)."""

from __future__ import annotations

import pytest

from benchmarks.bench_report import render
from benchmarks.common import read_csv
from tests.entry_points import run_main


@pytest.mark.slow
def test_precision_check_writes_labelled_curves_the_report_judges(tmp_path):
    from benchmarks.precision_check import main as precision_check

    bench = tmp_path / "bench"
    page = tmp_path / "results" / "bf16-vs-fp32.md"
    proc = run_main(precision_check, ["--scale", "smoke", "--steps", "12", "--every", "6", "--out", str(page),
                                      "--csv", str(bench / "precision.csv"), f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(bench / "precision.csv")
    assert [int(r["step"]) for r in rows] == [1, 6, 12]
    for r in rows:
        assert r["row"] == "main-303m/pcaf_context_wt103_t1024" and r["scale"] == "smoke" and r["steps"] == "12"
        assert r["machine"] and r["torch"] and float(r["fp32_tokens_per_s"]) > 0 and float(r["bf16_tokens_per_s"]) > 0
        assert abs(abs(float(r["fp32_eval_loss"]) - float(r["bf16_eval_loss"])) - float(r["abs_diff"])) < 1e-9
    text = page.read_text()
    assert rows[0]["machine"] in text and "| 12 |" in text
    report = render(bench, tmp_path / "results" / "bench.md").read_text()
    line = [x for x in report.splitlines() if x.startswith("| bf16 learning curves match fp32 within noise |")]
    assert len(line) == 1 and "smoke scale, 12 steps" in line[0] and rows[0]["machine"] in line[0]
    assert "**met**" in line[0] or "**missed" in line[0]
