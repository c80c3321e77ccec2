"""The GPU session's driver run for real at smoke scale on the CPU: ``experiments.gpu_paper_rows`` starts
``experiments.reproduce`` per row, and a row whose tried setting fails (CUDA graphs, which a CPU run refuses) is
trained again without it, as a new run whose record is the row's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from experiments import gpu_paper_rows as gpr
from pcaf_core.results import read_metrics
from pcaf_core.run_identity import identity_digest, read_run_config


@pytest.mark.slow
def test_a_row_whose_graphed_run_fails_is_trained_eager_and_brought_back(tmp_path: Path, monkeypatch,
                                                                         capsys) -> None:
    monkeypatch.setattr(gpr, "CACHE_DIR", tmp_path / "compile_cache")
    out, outputs = tmp_path / "out", tmp_path / "outputs"
    assert gpr.main(["--scale", "smoke", "--device", "cpu", "--step-cost", "", "--out", str(out), "--output-root",
                     str(outputs), "--try-override", "train.compile=cudagraphs",
                     "wt2-nt-1024/transformer_local"]) == 0
    text = capsys.readouterr().out
    assert ("wt2-nt-1024/transformer_local failed with train.compile=cudagraphs: running it again without "
            "(--try-override)") in text
    runs = sorted((outputs / "wt2-nt-1024" / "smoke" / "torch" / "transformer_local").iterdir())
    assert [read_metrics(r).status for r in runs] == ["failed", "completed"]  # the graphed run, kept as it failed
    assert "needs a CUDA device" in (read_metrics(runs[0]).error or "")
    (record,) = (out / "runs" / "wt2-nt-1024" / "smoke" / "torch" / "transformer_local").iterdir()
    assert record.name == runs[1].name and sorted(p.name for p in record.iterdir()) == sorted(gpr.RECORD_FILES)
    assert yaml.safe_load((record / "config.yaml").read_text())["train"]["compile"] == "auto"
    # The tried setting is no part of a run's identity: the failed graphed run and the eager one are the same run.
    assert identity_digest(read_run_config(runs[0])) == identity_digest(read_run_config(record))
    assert read_metrics(record).identity["config"] == identity_digest(read_run_config(record))
    assert (out / gpr.ARCHIVE_NAME).is_file()
