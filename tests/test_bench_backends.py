"""The backend-parity report: labels on every row and the 1.5x target judged either way."""

from __future__ import annotations

import csv

from benchmarks.bench_backends import write_results

LABELS = {"machine": "Test CPU, 2 cores, no bf16 matrix unit", "torch": "2.13.0", "jax": "0.7.0", "threads": 2,
          "malloc": "tuned"}


def _row(model: str, torch_ms: float, jax_ms: float) -> dict:
    return {"model": model, "table": "main-303m", "row": "pcaf_context_wt103_t1024", "mode": "ar", "T": 256,
            "batch": 2, "precision": "fp32", "profile": "reference_jax", "dropout": 0.0,
            "torch_step_ms": torch_ms, "jax_step_ms": jax_ms, "torch_tokens_per_s": 512 / torch_ms * 1e3,
            "jax_tokens_per_s": 512 / jax_ms * 1e3, "jax_over_torch_time": round(jax_ms / torch_ms, 3),
            "rounds": 2, "steps_per_sample": 5, **LABELS}


def test_report_labels_every_row_and_judges_the_target_both_ways(tmp_path):
    rows = [_row("within", 100.0, 140.0), _row("jax slower", 100.0, 180.0), _row("torch slower", 300.0, 100.0)]
    md = write_results(rows, tmp_path, LABELS, "python -m benchmarks.bench_backends --rounds 2")
    text = md.read_text()
    assert "Test CPU, 2 cores, no bf16 matrix unit" in text and "torch 2.13.0, jax 0.7.0" in text
    assert "`python -m benchmarks.bench_backends --rounds 2`" in text
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["within"].endswith("| 1.40 | met |")
    assert lines["jax slower"].endswith("| 1.80 | missed by 1.20x |")
    assert lines["torch slower"].endswith("| 0.33 | missed by 2.00x |")
    with open(tmp_path / "bench_backends_cpu.csv") as fh:
        written = list(csv.DictReader(fh))
    assert [r["machine"] for r in written] == [LABELS["machine"]] * 3
