"""``pcaf_core.record_relocate``: a copied record names its checkout's paths relatively, keeps its digests
valid, and a damaged record is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcaf_core.record_check import check_run
from pcaf_core.record_relocate import relocate_record
from pcaf_core.results import RunMetrics, write_metrics

ROOT = "/machine/checkout"


def _record(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"run_dir: {ROOT}/outputs/r1\nother: {ROOT}2/x\n")
    (folder / "curve.csv").write_text("step,eval_ppl_reference\n1,50.0\n")
    write_metrics(folder, RunMetrics(table="t", row="r", status="completed", best_ppl=50.0,
                                     extra={"cwd": ROOT, "cmd": f"run run_dir={ROOT}/outputs/r1",
                                            "list": [f"'{ROOT}'", f"{ROOT}/"]}))
    return folder


def test_paths_under_the_root_become_relative_and_the_record_stays_verified(tmp_path: Path) -> None:
    run = _record(tmp_path / "run")
    assert relocate_record(run, ROOT) is True
    assert (run / "config.yaml").read_text() == f"run_dir: outputs/r1\nother: {ROOT}2/x\n"  # another folder stays
    extra = json.loads((run / "metrics.json").read_text())["extra"]
    assert extra == {"cwd": ".", "cmd": "run run_dir=outputs/r1", "list": ["'.'", ""]}
    assert check_run(run).state == "verified"
    assert relocate_record(run, ROOT) is False  # nothing left to rewrite


def test_a_damaged_record_is_refused(tmp_path: Path) -> None:
    run = _record(tmp_path / "run")
    (run / "curve.csv").write_text("step,eval_ppl_reference\n1,10.0\n")  # edited after the run
    with pytest.raises(ValueError, match="the record is damaged, not relocated"):
        relocate_record(run, ROOT)
    assert ROOT in (run / "config.yaml").read_text()
    with pytest.raises(ValueError, match="needs the absolute folder"):
        relocate_record(run, "checkout")
