"""The ``stream`` evaluation protocol: every memory condition equals a direct streaming computation, and
``python -m experiments.stream_eval`` writes its labelled table, CSV and plot from a smoke run."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from backends.torch import build_model
from backends.torch.stream_eval import evaluate_stream
from backends.torch.streaming import TorchStream
from experiments import stream_eval
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile
from pcaf_core.stream_protocol import conditions

T = 6


def _net(policy: str):
    model = ModelConfig(variant="pcaf", vocab_size=20, d_model=8, d_hidden=16, n_layers=1, kernel_size=3,
                        max_seq_len=T)
    memory = MemoryConfig(route="hybrid", semantic_index="bucketed", candidate_policy=policy, num_buckets=5,
                          top_k=2, semantic_buckets=3, semantic_temperature=0.3)
    net = build_model(model, memory, get_profile("corrected"), seed=1, dtype=torch.float64)
    with torch.no_grad():
        net.memory.recency_scale.fill_(2.0)
    return net.eval()


def _nll(stream, doc, min_pos=None, param=False) -> float:
    """-Σ log p(x_{t+1}) of one document fed alone, optional min_pos(t) bound on the readable records."""
    state, total = stream.init(1), 0.0
    for t in range(len(doc) - 1):
        bound = None if min_pos is None else torch.tensor([min_pos(t)])
        state, out = stream.step(state, torch.tensor([doc[t]]), min_pos=bound)
        lp = out.param_log_probs if param else out.log_probs
        total -= float(lp[0, doc[t + 1]])
    return total


def test_every_condition_equals_a_direct_stream_of_each_document():
    net = _net("recent")
    stream = TorchStream(net, window=T)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 9, n) for n in (23, 5, 17)]  # two groups of batch 2, uneven lengths
    conds = conditions(T, "recent", (1, 2))
    results, timing = evaluate_stream(stream, docs, conds, batch=2)
    assert timing["tokens"] == 45 and [r.targets for r in results] == [42] * len(conds)
    want = {
        "none": sum(_nll(stream, d, param=True) for d in docs),
        "window": sum(_nll(stream, d, min_pos=lambda t: T * (t // T)) for d in docs),
        f"last_{T}": sum(_nll(stream, d, min_pos=lambda t: t - T) for d in docs),
        f"last_{2 * T}": sum(_nll(stream, d, min_pos=lambda t: t - 2 * T) for d in docs),
        "document": sum(_nll(stream, d) for d in docs),
    }
    got = {r.condition.name: r.nll_sum for r in results}
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-9), name
    assert len(set(round(v, 6) for v in got.values())) == len(got)  # the conditions differ


def test_first_policy_has_no_sliding_horizons():
    assert [c.name for c in conditions(T, "first")] == ["none", "window", "document"]


@pytest.mark.slow  # trains the shared smoke run
def test_stream_eval_command_writes_a_labelled_table_and_plot(smoke_pcaf_run, tmp_path, capsys):
    base = [f"run_dir={smoke_pcaf_run}", "max_docs=2", "max_doc_tokens=80", "threads=1", "batch=2"]
    assert stream_eval.main(base + [f"out_dir={tmp_path / 'first'}"]) == 0
    md = (tmp_path / "first" / "stream_wt2-nt-1024_pcaf_context_smoke.md").read_text()
    assert "protocol: stream" in md and "policy first" in md and "| document |" in md and "last_" not in md
    assert stream_eval.main(base + [f"out_dir={tmp_path / 'recent'}", "policy=recent", "multiples=1,2"]) == 0
    out = tmp_path / "recent"
    md = (out / "stream_wt2-nt-1024_pcaf_context_smoke.md").read_text()
    assert "deviation: decoded under candidate_policy=recent, trained with first" in md
    with open(out / "stream_wt2-nt-1024_pcaf_context_smoke.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["condition"] for r in rows] == ["none", "window", "last_32", "last_64", "document"]
    assert all(r["protocol"] == "stream" and r["scale"] == "smoke" and float(r["ppl"]) > 1 for r in rows)
    assert (out / "stream_wt2-nt-1024_pcaf_context_smoke.png").stat().st_size > 0
    assert capsys.readouterr().out.strip().endswith("stream_wt2-nt-1024_pcaf_context_smoke.md")
    assert stream_eval.main([f"run_dir={smoke_pcaf_run}", "policy=topk_score"]) == 2
