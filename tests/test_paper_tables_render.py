"""Collect + claims + render from synthetic run directories written with pcaf_core.results."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
import pytest

from paper_tables.claims import FAILS, HOLDS, NOT_MEASURED, _judge, compare
from paper_tables.collect import aggregate, learning_bar, load_runs
from paper_tables.pipeline import build_report, render_table
from paper_tables.published import load_published
from paper_tables.render import render_markdown
from paper_tables.render_latex_csv import render_csv, render_latex, tex_escape
from paper_tables.spec_types import Claim
from paper_tables.specs import get_table
from pcaf_core.results import RunMetrics, write_metrics
from pcaf_core.run_record import THROUGHPUT_TIMED_TO_LOSS

TABLE = "wt2-nt-1024"


def make_run(root: Path, table: str, row: str, seed: int = 1, scale: str = "smoke", backend: str = "torch",
             name: str | None = None, **kw) -> Path:
    """Write one synthetic run record under ``root/<table>/<scale>/<backend>/<row>/<name>``."""
    fields = dict(table=table, row=row, status="completed", scale=scale, backend=backend,
                  profile=get_table(table).row(row).profile, seed=seed, mode=get_table(table).row(row).mode,
                  seq_len=64, batch_size=4, steps_done=20, steps_planned=20, params=1_000_000, final_ppl=310.0,
                  best_ppl=300.0, acc_at_best=0.11, acc_param_at_best=0.10, tokens_per_sec=20000.0,
                  peak_mem_mb=None, wall_time_s=10.0, unigram_ppl=1500.0, dataset="wikitext2",
                  protocol="reference", device="cpu", deviations=["steps 5000 -> 20 (scale=smoke)"])
    fields.update(kw)
    run_dir = root / table / scale / backend / row / (name or f"seed{seed}")
    write_metrics(run_dir, RunMetrics(**fields))
    return run_dir


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "outputs"
    make_run(root, TABLE, "pcaf_context", seed=1, best_ppl=300.0, final_ppl=320.0, tokens_per_sec=30000.0)
    make_run(root, TABLE, "pcaf_context", seed=2, best_ppl=310.0, final_ppl=330.0, tokens_per_sec=32000.0)
    make_run(root, TABLE, "pcaf_no_cache", best_ppl=350.0, unigram_ppl=900.0)
    make_run(root, TABLE, "pcaf_no_gate", status="failed", error="CUDA out of memory\n(tried 2 GiB)",
             best_ppl=None)
    make_run(root, TABLE, "local_conv", best_ppl=250.0, tokens_per_sec=40000.0, unigram_ppl=None)
    make_run(root, TABLE, "transformer_local", status="running", steps_done=5, best_ppl=None)
    # a failed first attempt and a completed rerun of the same seed: the rerun counts
    make_run(root, TABLE, "transformer_global_local", seed=7, name="attempt1", status="failed", error="killed")
    make_run(root, TABLE, "transformer_global_local", seed=7, name="attempt2", best_ppl=400.0,
             tokens_per_sec=5000.0)
    # other scale / backend: must be ignored
    make_run(root, TABLE, "transformer_dense", scale="cpu", best_ppl=1.0)
    make_run(root, TABLE, "transformer_dense", backend="jax", best_ppl=1.0)
    return root


def _line(md: str, display: str) -> str:
    hits = [ln for ln in md.splitlines() if ln.startswith(f"| {display} |")]
    assert len(hits) == 1, (display, hits)
    return hits[0]


def test_markdown_has_every_paper_row_with_published_and_measured_values(runs, tmp_path):
    paths = render_table(TABLE, "smoke", "torch", runs, tmp_path / "tables", figures=False)
    assert paths["md"].name == "wt2-nt-1024_smoke_torch.md"
    md = paths["md"].read_text()
    pub = load_published(TABLE)
    for row in get_table(TABLE).rows:
        line = _line(md, row.display)
        assert f"{pub.at[row.id, 'best_ppl']:.2f}" in line
        assert f"{pub.at[row.id, 'final_ppl']:.2f}" in line
        assert f"{pub.at[row.id, 'acc']:.4f}" in line
        assert f"{int(pub.at[row.id, 'tok_s']):,}" in line
    assert "305.00 ± 7.07" in _line(md, "PCAF-context")
    assert "31,000 ± 1,414" in _line(md, "PCAF-context")
    assert "ok (n=2)" in _line(md, "PCAF-context")
    assert "missing" in _line(md, "Dense Transformer")
    assert "failed: CUDA out of memory (tried 2 GiB)" in _line(md, "PCAF no gate")
    assert "running (step 5/20)" in _line(md, "Local attn, w=128")
    gl = _line(md, "Global-local attn")
    assert "400.00" in gl and "ok (n=1)" in gl and "failed" not in gl
    assert "Scale: smoke · Backend: torch" in md and "reference_torch" in md
    assert "## Claims" in md and "## Deviations from the paper's settings" in md
    assert "steps 5000 -> 20 (scale=smoke)" in md
    assert "params 26,592,730 -> 1,000,000" in md and "batch 64 -> 4" in md


def test_learning_bar_column(runs):
    report = build_report(TABLE, "smoke", "torch", runs)
    agg = report.agg
    assert agg.at["pcaf_context", "learning_bar"] == "meets"  # 305 <= 1500 / 3
    assert agg.at["pcaf_no_cache", "learning_bar"] == "below bar"  # 350 > 900 / 3
    assert agg.at["local_conv", "learning_bar"] == "no unigram PPL"
    assert agg.at["transformer_dense", "learning_bar"] == "not measured"
    assert learning_bar(500.0, 1500.0) == "meets" and learning_bar(500.01, 1500.0) == "below bar"
    assert learning_bar(None, 1500.0) == "not measured"


def test_claim_verdicts_from_measured_numbers(runs):
    verdicts = {v.claim.id: v for v in build_report(TABLE, "smoke", "torch", runs).verdicts}
    # 305 < 350, but no cache is below its bar (350 > 900 / 3): a quality claim on it is not measured
    assert verdicts["cache_helps"].measured == NOT_MEASURED
    assert verdicts["cache_helps"].measured_detail.startswith("below the learning bar: pcaf_no_cache (measured ")
    assert "pcaf_no_cache=350" in verdicts["cache_helps"].measured_detail
    assert verdicts["beats_local_conv"].measured == FAILS  # 305 > 250 (local conv has no unigram PPL: not gated)
    assert verdicts["beats_local_conv"].measured_detail == "pcaf_context=305 >= local_conv=250 (by 22%)"
    assert verdicts["gate_helps"].measured == NOT_MEASURED  # no gate failed
    assert "pcaf_no_gate" in verdicts["gate_helps"].measured_detail
    assert verdicts["beats_attention"].measured == NOT_MEASURED  # dense missing, local running
    assert verdicts["keeps_local_throughput"].measured == HOLDS  # 31000 > 0.5 * 40000
    assert all(v.published == HOLDS for v in verdicts.values())


def test_claim_detail_states_the_relation_the_numbers_have():
    """The detail never prints the claim's operator between numbers that contradict it."""
    claim = Claim(id="c", text="a beats b and c", left=("a",), op="<", right=("b", "c"), metric="best_ppl")
    spec = get_table(TABLE)

    def judge(values):
        return _judge(claim, spec, lambda table, row, key: values[row])

    assert judge({"a": 1.0, "b": 2.0, "c": 3.0}) == (HOLDS, "a=1 < b=2, c=3 (closest by 2x)")
    assert judge({"a": 4.0, "b": 2.0, "c": 3.0}) == (FAILS, "a=4 >= b=2, c=3 (closest by 33%)")
    assert judge({"a": 2.5, "b": 2.0, "c": 3.0}) == (FAILS, "a=2.5 >= b=2 (by 25%); a=2.5 < c=3 (by 20%)")
    throughput = Claim(id="t", text="", left=("a",), op=">", right=("b",), metric="tok_s", factor=0.5)
    assert _judge(throughput, spec, lambda t, r, k: {"a": 10.0, "b": 30.0}[r]) == (FAILS, "a=10 <= 0.5 x b=30 (by 50%)")


def test_quality_claims_need_every_row_over_the_bar_and_throughput_claims_do_not(runs):
    make_run(runs, TABLE, "pcaf_no_cache", best_ppl=350.0, unigram_ppl=1200.0)  # bar 400: meets
    verdicts = {v.claim.id: v for v in build_report(TABLE, "smoke", "torch", runs).verdicts}
    assert verdicts["cache_helps"].measured == HOLDS  # 305 < 350, both over the bar
    make_run(runs, TABLE, "pcaf_context", seed=1, best_ppl=600.0, tokens_per_sec=30000.0)
    make_run(runs, TABLE, "pcaf_context", seed=2, best_ppl=600.0, tokens_per_sec=32000.0)  # bar 500: below
    verdicts = {v.claim.id: v for v in build_report(TABLE, "smoke", "torch", runs).verdicts}
    assert verdicts["cache_helps"].measured == NOT_MEASURED
    assert verdicts["keeps_local_throughput"].measured == HOLDS  # tokens/s does not depend on learning


def test_throughput_claims_need_one_machine_and_quality_claims_do_not(tmp_path):
    """Rows finished on different GPUs render into one table, but their tokens/s are not compared: a claim on
    what the machine sets is not measured, and its detail names each row's machine and the numbers."""
    root = tmp_path / "outputs"
    h100, h200 = "NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)", "NVIDIA H200 (torch 2.11.0+cu130)"

    def gpu_run(row: str, device: str, **kw) -> None:
        make_run(root, TABLE, row, device=device, throughput_definition=f"tokens/s {THROUGHPUT_TIMED_TO_LOSS}", **kw)

    gpu_run("pcaf_context", f"{h100}; head loss in one tile", best_ppl=300.0, tokens_per_sec=30000.0)
    gpu_run("local_conv", f"{h100}; compiled", best_ppl=250.0, tokens_per_sec=40000.0)
    gpu_run("pcaf_no_cache", h200, best_ppl=350.0, tokens_per_sec=41000.0)
    verdicts = {v.claim.id: v for v in build_report(TABLE, "smoke", "torch", root).verdicts}
    # One machine, how each step was computed aside (after the ';'): compared.
    assert verdicts["keeps_local_throughput"].measured == HOLDS
    assert verdicts["cache_helps"].measured == HOLDS  # quality: the machine does not matter
    gpu_run("local_conv", h200, best_ppl=250.0, tokens_per_sec=40000.0)  # rerun elsewhere, the same seed
    verdicts = {v.claim.id: v for v in build_report(TABLE, "smoke", "torch", root).verdicts}
    assert verdicts["cache_helps"].measured == HOLDS  # pcaf_context on the H100, no cache on the H200: quality
    verdict = verdicts["keeps_local_throughput"]
    assert verdict.measured == NOT_MEASURED
    assert verdict.measured_detail == (f"rows from different machines, not comparable: pcaf_context on {h100}; "
                                       f"local_conv on {h200} (measured pcaf_context=30,000 > 0.5 x "
                                       "local_conv=40,000 (by 50%))")


def test_cross_table_claim_reads_the_other_table(tmp_path):
    root = tmp_path / "outputs"
    make_run(root, "wt2-nt-2048", "pcaf_context", best_ppl=280.0)
    make_run(root, "wt2-nt-1024", "pcaf_context", best_ppl=300.0)
    verdicts = {v.claim.id: v for v in build_report("wt2-nt-2048", "smoke", "torch", root).verdicts}
    assert verdicts["longer_context_helps"].measured == HOLDS
    make_run(root, "wt2-nt-1024", "pcaf_context", best_ppl=250.0)  # same seed, rewritten later
    verdicts = {v.claim.id: v for v in build_report("wt2-nt-2048", "smoke", "torch", root).verdicts}
    assert verdicts["longer_context_helps"].measured == FAILS


def test_unreadable_record_shows_as_failed_row(tmp_path):
    root = tmp_path / "outputs"
    bad = root / TABLE / "smoke" / "torch" / "pcaf_no_cache" / "seed1"
    bad.mkdir(parents=True)
    (bad / "metrics.json").write_text("{truncated")
    stray = root / "elsewhere"
    stray.mkdir()
    (stray / "metrics.json").write_text("[]")
    report = build_report(TABLE, "smoke", "torch", root)
    assert report.agg.at["pcaf_no_cache", "status"] == "failed"
    assert "unreadable metrics.json" in report.agg.at["pcaf_no_cache", "status_text"]
    md = render_markdown(report)
    assert "failed: unreadable metrics.json" in md


def test_empty_or_absent_root_renders_all_missing(tmp_path):
    report = build_report(TABLE, "paper", "jax", tmp_path / "does-not-exist")
    assert set(report.agg["status"]) == {"missing"}
    md = render_markdown(report)
    for row in get_table(TABLE).rows:
        assert _line(md, row.display).endswith("| — | missing |")
    assert all(v.measured == NOT_MEASURED for v in report.verdicts)


def test_latex_and_csv_renderers(runs):
    report = build_report(TABLE, "smoke", "torch", runs)
    tex = render_latex(report)
    assert r"\begin{tabular}" in tex and r"\label{tab:repro-wt2-nt-1024}" in tex
    assert r"305.00 $\pm$ 7.07" in tex and r"pcaf\_context" in tex and "missing" in tex
    assert tex_escape("a_b & 5% -> x") == r"a\_b \& 5\% $\to$ x"
    df = pd.read_csv(io.StringIO(render_csv(report))).set_index("row")
    assert list(df.index) == list(get_table(TABLE).row_ids)
    assert df.at["pcaf_context", "best_ppl_paper"] == pytest.approx(223.95)
    assert df.at["pcaf_context", "best_ppl_ours"] == pytest.approx(305.0)
    assert df.at["pcaf_context", "best_ppl_ours_std"] == pytest.approx(math.sqrt(50))
    assert math.isnan(df.at["transformer_dense", "best_ppl_ours"])
    assert df.at["transformer_dense", "status"] == "missing"
    assert df.at["pcaf_no_gate", "status"] == "failed"


def test_percent_and_million_units_and_batch_in_parentheses(tmp_path):
    root = tmp_path / "outputs"
    make_run(root, "main-303m", "pcaf_semantic_wt103_t2048", scale="cpu", backend="jax", batch_size=8,
             acc_param_at_best=0.2512, acc_at_best=0.3, tokens_per_sec=21300.0)
    md = render_markdown(build_report("main-303m", "cpu", "jax", root))
    line = [ln for ln in md.splitlines() if "| PCAF-semantic | WikiText-103 | 2048 |" in ln][0]
    assert "0.61M (32) / 0.89M (256)" in line  # printed
    assert "0.0213M (8)" in line  # measured, 3 significant digits, own batch
    assert "25.12%" in line  # full-AR accuracy = parametric head, in percent
    assert "36.31" in line


def test_leak_audit_has_no_published_column_and_judges_profiles(tmp_path):
    root = tmp_path / "outputs"
    for route, ref, corr in (("pcaf_semantic", 40.0, 60.0), ("pcaf_hybrid", 41.0, 58.0),
                             ("pcaf_context", 55.0, 56.0)):
        make_run(root, "semantic-leak-audit", f"{route}_reference_jax", scale="cpu", best_ppl=ref, full_ppl=ref)
        make_run(root, "semantic-leak-audit", f"{route}_corrected", scale="cpu", best_ppl=corr, full_ppl=corr)
    report = build_report("semantic-leak-audit", "cpu", "torch", root)
    verdicts = {v.claim.id: v.measured for v in report.verdicts}
    assert verdicts == {
        "leak_inflates_semantic": HOLDS, "leak_inflates_semantic_full": HOLDS, "leak_inflates_hybrid": HOLDS,
        "context_unaffected": HOLDS, "semantic_beats_context_reference": HOLDS,
        "semantic_beats_context_corrected": FAILS,
    }
    md = render_markdown(report)
    assert "(paper)" not in md and "n/a (not in the paper)" in md
    assert "reference_jax, corrected" in md or "corrected, reference_jax" in md


def test_load_runs_filters_and_aggregate_order(runs):
    df = load_runs(runs, table=TABLE, scale="smoke", backend="torch")
    assert set(df["scale"]) == {"smoke"} and set(df["backend"]) == {"torch"}
    assert len(load_runs(runs)) == len(df) + 2
    agg = aggregate(df, get_table(TABLE))
    assert list(agg.index) == list(get_table(TABLE).row_ids)
    assert agg.at["pcaf_context", "n_runs"] == 2 and agg.at["pcaf_context", "seeds"] == [1, 2]
    assert agg.at["transformer_global_local", "n_failed"] == 0


@pytest.mark.parametrize(
    "op, left, right, factor, tol, expected",
    [("<", 1.0, 2.0, 1.0, 0.0, True), ("<", 2.0, 2.0, 1.0, 0.0, False), ("<=", 2.0, 2.0, 1.0, 0.0, True),
     (">", 3.0, 2.0, 1.0, 0.0, True), (">=", 2.7, 2.0, 1.4, 0.0, False), (">=", 2.8, 2.0, 1.4, 0.0, True),
     ("~=", 104.0, 100.0, 1.0, 0.05, True), ("~=", 106.0, 100.0, 1.0, 0.05, False),
     ("<", math.nan, 2.0, 1.0, 0.0, False)],
)
def test_compare(op, left, right, factor, tol, expected):
    assert compare(op, left, right, factor, tol) is expected


def test_compare_rejects_unknown_operator():
    with pytest.raises(ValueError, match="unknown claim operator"):
        compare("==", 1.0, 1.0)


# --------------------------------------------------------------------------- headline verdicts

_HEAD_ROWS = ("transformer_dense", "transformer_local", "local_conv", "pcaf_context", "pcaf_semantic",
              "pcaf_semantic_corrected")


def _default_table_runs(root: Path, corrected_ppl: float | None) -> None:
    ppl = dict(transformer_dense=239.57, transformer_local=233.11, local_conv=168.74, pcaf_context=148.17,
               pcaf_semantic=117.90, pcaf_semantic_corrected=corrected_ppl)
    for row in _HEAD_ROWS:
        if ppl[row] is not None:
            make_run(root, "main-303m", f"{row}_wt103_t1024", scale="cpu", best_ppl=ppl[row])


def test_default_table_opens_with_the_two_profile_verdict_and_both_numbers(tmp_path):
    _default_table_runs(tmp_path, corrected_ppl=259.40)
    report = build_report("main-303m", "cpu", "torch", tmp_path, rows="*_wt103_t1024")
    md = render_markdown(report)
    first = md.splitlines()[2]
    assert first == (
        '**Verdict, WikiText-103 T=1024:** the paper\'s claim "PCAF-semantic has the best perplexity" holds under '
        "`reference_jax` (best PPL 117.90 against 148.17 for PCAF-context) and fails under `corrected`, where the "
        "full-AR semantic route cannot read the target (best PPL 259.40 against 148.17 for PCAF-context).")
    assert "PCAF-semantic (corrected: no target leak)" in md
    assert "PCAF-semantic has the best perplexity" in render_latex(report).splitlines()[0]


def test_headline_says_not_measured_and_names_the_missing_row(tmp_path):
    _default_table_runs(tmp_path, corrected_ppl=None)
    md = render_markdown(build_report("main-303m", "cpu", "torch", tmp_path, rows="*_wt103_t1024"))
    line = md.splitlines()[2]
    assert "holds under `reference_jax`" in line and "is not measured under `corrected`" in line
    assert "no value for pcaf_semantic_corrected_wt103_t1024" in line


def test_headlines_follow_the_row_selection():
    spec = get_table("main-303m")
    assert len(spec.headlines) == 4
    from paper_tables.spec_types import select_rows

    assert [h.label for h in select_rows(spec, "*_wt103_t1024").headlines] == ["WikiText-103 T=1024"]
    assert select_rows(spec, "pcaf_semantic_wt103_t1024,pcaf_context_wt103_t1024").headlines == ()


def test_backend_comparison_puts_both_backends_side_by_side_with_the_difference(tmp_path):
    from paper_tables.__main__ import main

    for row, (torch_ppl, jax_ppl) in {"pcaf_context": (300.0, 306.0), "local_conv": (250.0, 245.0)}.items():
        make_run(tmp_path / "runs", TABLE, row, best_ppl=torch_ppl, full_ppl=torch_ppl - 10, tokens_per_sec=20000.0)
        make_run(tmp_path / "runs", TABLE, row, backend="jax", best_ppl=jax_ppl, full_ppl=jax_ppl - 10,
                 tokens_per_sec=16000.0)
    make_run(tmp_path / "runs", TABLE, "pcaf_no_cache", best_ppl=350.0)  # torch only
    assert main(["backends", "--table", TABLE, "--scale", "smoke", "--runs", str(tmp_path / "runs"),
                 "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / f"{TABLE}_smoke_torch_vs_jax.md").read_text()
    context = _line(md, "PCAF-context")
    assert "| 300.00 | 306.00 | +6.00 (+2.0%) | 290.00 | 296.00 | +6.00 (+2.1%) | 20,000 | 16,000 | 0.80 |" in context
    assert "| 250.00 | 245.00 | -5.00 (-2.0%) |" in _line(md, "Local conv only")
    assert _line(md, "Dense Transformer").count("not measured") == 9
    assert "| 350.00 | not measured | not measured |" in _line(md, "PCAF no cache")
    frame = pd.read_csv(tmp_path / "out" / f"{TABLE}_smoke_torch_vs_jax.csv").set_index("row")
    assert frame.at["pcaf_context", "best_ppl_diff"] == pytest.approx(6.0)
    assert "## Claims on each backend" in md


def test_backend_comparison_gives_a_throughput_ratio_on_one_device_only(tmp_path):
    """JAX on an H200 beside torch on an H100: the perplexities compare, the tokens/s do not; one device for
    both (whatever each backend's software) gives the ratio."""
    from paper_tables.backend_diff import render_backend_comparison

    runs = tmp_path / "runs"
    timed = {"throughput_definition": f"tokens/s {THROUGHPUT_TIMED_TO_LOSS}"}
    make_run(runs, TABLE, "pcaf_context", tokens_per_sec=20000.0, device="NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)",
             **timed)
    make_run(runs, TABLE, "pcaf_context", backend="jax", best_ppl=306.0, tokens_per_sec=16000.0,
             device="NVIDIA H200 (jax 0.11.2, gpu, 1 device)", **timed)
    paths = render_backend_comparison(TABLE, "smoke", runs, tmp_path / "out", rows="pcaf_context")
    line = _line(paths["md"].read_text(), "PCAF-context")
    assert "| 300.00 | 306.00 | +6.00 (+2.0%) |" in line
    assert line.endswith("| 20,000 | 16,000 | not comparable: NVIDIA H100 80GB HBM3 / NVIDIA H200 |")
    make_run(runs, TABLE, "pcaf_context", backend="jax", best_ppl=306.0, tokens_per_sec=16000.0,
             device="NVIDIA H100 80GB HBM3 (jax 0.11.2, gpu, 1 device)", **timed)  # rerun beside torch's
    paths = render_backend_comparison(TABLE, "smoke", runs, tmp_path / "out", rows="pcaf_context")
    assert _line(paths["md"].read_text(), "PCAF-context").endswith("| 20,000 | 16,000 | 0.80 |")
    # Each side's machine, precision and seeds head the page.
    labels = [ln for ln in paths["md"].read_text().splitlines() if ln.startswith(("- torch: ", "- JAX: "))]
    assert labels == ["- torch: Device(s): NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130) · Precision: fp32 · Seed(s): 1",
                      "- JAX: Device(s): NVIDIA H100 80GB HBM3 (jax 0.11.2, gpu, 1 device) · Precision: fp32 · "
                      "Seed(s): 1"]


def test_at_the_paper_s_budget_the_bar_says_how_the_paper_s_own_models_fare(tmp_path):
    """The bar is not applied to rows trained at the paper's budget; the definition says why in numbers: 6 of
    tab:main1024's 7 published best PPLs are above a third of the tokenized split's unigram PPL. At a stand-in
    scale the sentence is left out."""
    root = tmp_path / "runs"
    make_run(root, TABLE, "pcaf_context", scale="paper", best_ppl=238.7, unigram_ppl=754.8)
    make_run(root, TABLE, "local_conv", scale="paper", best_ppl=323.5, unigram_ppl=754.8)
    md = render_markdown(build_report(TABLE, "paper", "torch", root))
    assert ("so there the bar is shown and not applied: the paper's own models would fail it too (6 of 7 published "
            "best PPLs are above 754.8 / 3 = 251.6).") in md
    make_run(root, TABLE, "pcaf_context", best_ppl=300.0, unigram_ppl=1500.0)  # smoke scale
    assert "the paper's own models would fail it" not in render_markdown(build_report(TABLE, "smoke", "torch", root))


def test_caption_names_precision_and_every_seed_once(runs, tmp_path):
    """The table's caption says what arithmetic trained the rows and with which seeds: seeds 1 and 2 of two rows and
    7 of another, each listed once; the float32 matmul precision where the records name it."""
    make_run(runs, TABLE, "local_conv", seed=2, name="second", matmul_precision="highest")
    md = render_markdown(build_report(TABLE, "smoke", "torch", runs))
    assert "- Precision: fp32 (float32 matmuls: highest) · Seed(s): 1, 2, 7." in md.splitlines()


def test_accelerator_throughput_timed_to_the_launches_is_set_aside():
    """Records whose accelerator steps were timed only until their launches returned keep every other number; their
    tokens/s is not used, and the row's deviations say why. CPU records and records timed to the loss stand."""
    from paper_tables.collect import LAUNCH_TIMED_NOTE, _set_aside_launch_timed_throughput
    from pcaf_core.run_record import THROUGHPUT_DEFINITION

    old = THROUGHPUT_DEFINITION.replace(", timed until its loss is on the host (so an accelerator's queued work is "
                                        "included)", "")
    assert old != THROUGHPUT_DEFINITION
    cases = [("NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)", old, None),
             ("NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)", THROUGHPUT_DEFINITION, 5e6),
             ("cpu (torch 2.13.0+cpu, 2 threads)", old, 5e6)]
    for device, definition, want in cases:
        rec = {"device": device, "throughput_definition": definition, "tokens_per_sec": 5e6, "best_ppl": 200.0,
               "deviations": ["data.layout=tokens (command line)"]}
        _set_aside_launch_timed_throughput(rec)
        assert rec["tokens_per_sec"] == want and rec["best_ppl"] == 200.0
        assert (LAUNCH_TIMED_NOTE in rec["deviations"]) == (want is None)
