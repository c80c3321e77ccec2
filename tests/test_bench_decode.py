"""The decode benchmark measures what it says at a tiny context (its full run is a measurement, not a test)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_decode import MODELS, measure_contexts, write_results


@pytest.mark.slow
def test_decode_benchmark_rows_and_report(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [measure_contexts(label, variant, 1, (20, 40), steps=2, warmup=1) for label, variant in MODELS]
    finally:
        torch.set_num_threads(n)
    assert [[r["context"] for r in group] for group in rows] == [[20, 40]] * 3
    pcaf, dense, conv = (group[1] for group in rows)
    assert all(r["status"] == "ok" and r["per_token_ms"] > 0 for group in rows for r in group)
    # Growth per generated token: a record (key 128 floats + position + value) for PCAF, keys and values of
    # 2 layers for the dense Transformer, nothing for local conv.
    assert pcaf["bytes_per_token_per_seq"] == 128 * 4 + 8 + 8
    assert dense["bytes_per_token_per_seq"] == 2 * 2 * 128 * 4
    assert dense["state_mb_per_seq"] == round(40 * 2048 / 2**20, 3)
    assert conv["bytes_per_token_per_seq"] == 0
    md = write_results([r for group in rows for r in group], tmp_path, "test", "python -m benchmarks.bench_decode")
    text = md.read_text()
    assert "**Flatness, batch 1:** PCAF's per-token time at 40 tokens" in text
    assert (tmp_path / "decode_cpu.png").stat().st_size > 0 and (tmp_path / "decode_cpu.csv").exists()
