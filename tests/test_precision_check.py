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


@pytest.mark.slow
def test_precision_check_on_jax_and_skipped_where_it_would_use_the_cpu(tmp_path):
    from benchmarks.precision_check import main as precision_check

    page, table = tmp_path / "jax.md", tmp_path / "jax.csv"
    args = ["--scale", "smoke", "--steps", "12", "--every", "6", "--backend", "jax", "--out", str(page), "--csv",
            str(table), f"data.cache_dir={tmp_path / 'cache'}"]
    skipped = run_main(precision_check, [*args, "--accelerator-only"])
    assert skipped.returncode == 0 and "skipped: the jax backend computes on the CPU here" in skipped.stdout
    assert not page.exists() and not table.exists()
    proc = run_main(precision_check, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(table)
    assert [int(r["step"]) for r in rows] == [1, 6, 12] and {r["backend"] for r in rows} == {"jax"}
    text = page.read_text()
    assert "on the jax backend" in text.splitlines()[0] and "--backend jax" in text
