"""``python -m experiments.analyze_buckets``: a Hydra sweep ends in one report; the topk_score column from a
trained run's keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.analyze_buckets import analyze

REPO = Path(__file__).resolve().parents[1]
CONF = OmegaConf.load(REPO / "experiments" / "conf_tools" / "analyze_buckets.yaml")


@pytest.mark.slow
def test_a_sweep_over_b_ends_in_one_report(tmp_path):
    out, report = tmp_path / "stats", tmp_path / "report" / "buckets.md"
    res = subprocess.run([sys.executable, "-m", "experiments.analyze_buckets", "-m", "B=64,32768", "T=32",
                          "K=[2,16]", "max_windows=6", f"out_dir={out}", f"report={report}"],
                         cwd=REPO, capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.json")) == ["wikitext2_T32_B32768_n1_K2-16.json",
                                                          "wikitext2_T32_B64_n1_K2-16.json"]
    md = report.read_text()
    assert "| WikiText-2 | 32 | 64 |" in md and "| WikiText-2 | 32 | 32768 |" in md  # the table over B
    assert "## Answer" in md and (report.parent / "buckets_recall_vs_k.png").stat().st_size > 0
    assert (report.parent / "buckets_vs_b.png").stat().st_size > 0
    assert "[buckets data=wikitext2 split=validation T=32 B=64 n=1 K=16] overflow" in res.stdout
    # Without run_dir the topk_score policy is not measured, and the line says so rather than printing nan.
    assert "topk_score n/a (run_dir=<a trained run> measures it)" in res.stdout and " nan " not in res.stdout


@pytest.mark.slow  # trains the shared smoke run
def test_topk_score_column_from_a_trained_run(smoke_pcaf_run, tmp_path):
    cfg = OmegaConf.merge(CONF, {"T": 64, "B": 256, "K": [2, 8], "max_windows": 3, "run_dir": str(smoke_pcaf_run),
                                 "out_dir": str(tmp_path), "report": str(tmp_path / "b.md")})
    path = analyze(cfg)
    rec = json.loads(path.read_text())
    assert path.name.endswith("_topk.json") and rec["topk_run"].startswith("wt2-nt-1024/pcaf_context")
    for row in rec["rows"]:
        assert 0 < row["recall_topk_score"] <= row["recall_bucket"]
    assert rec["rows"][0]["recall_topk_score"] <= rec["rows"][1]["recall_topk_score"]
    assert "topk_score keys: wt2-nt-1024/pcaf_context" in (tmp_path / "b.md").read_text()


def test_a_run_of_a_smaller_vocabulary_reads_the_other_words_as_unk():
    from experiments.analyze_buckets import run_ids
    from pcaf_core.data.tokenizer import SPECIALS, Vocabulary

    analysis = Vocabulary([*SPECIALS, "the", "cat", "sat", "mat"])
    run = Vocabulary([*SPECIALS, "the", "sat"])
    unk = run.stoi["<unk>"]
    mapped = run_ids(analysis, run)
    assert mapped.tolist() == [*range(len(SPECIALS)), run.stoi["the"], unk, run.stoi["sat"], unk]
