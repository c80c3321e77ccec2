"""Figures (PNG + PDF), the sweep table and plot, and the command line."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from paper_tables.__main__ import main
from paper_tables.collect import collect_tables, measured_devices
from paper_tables.figures import (
    best_so_far_curve,
    curve_axis,
    load_curves,
    measured_settings,
    plot_learning_curves,
    plot_speed_quality,
    plot_sweep,
    plot_throughput,
    save_figure,
)
from paper_tables.pipeline import _device_caveat, _vocabulary_caveat
from paper_tables.published import load_published
from paper_tables.specs import get_table
from paper_tables.sweep import aggregate_sweep, load_sweep, swept_value
from pcaf_core.results import RunMetrics, append_curve_row, write_metrics
from pcaf_core.run_record import THROUGHPUT_TIMED_TO_LOSS

TABLE = "wt2-nt-1024"


def _run(run_dir: Path, table: str = TABLE, row: str = "pcaf_context", seed: int = 1, **kw) -> Path:
    fields = dict(table=table, row=row, status="completed", scale="smoke", backend="torch", seed=seed,
                  profile="reference_torch", best_ppl=300.0, final_ppl=310.0, tokens_per_sec=1000.0,
                  unigram_ppl=1200.0)
    fields.update(kw)
    write_metrics(run_dir, RunMetrics(**fields))
    return run_dir


def _assert_png_pdf(png: Path, pdf: Path) -> None:
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000


@pytest.mark.slow
def test_cli_render_writes_tables_and_figures(tmp_path, capsys):
    root = tmp_path / "outputs"
    for i, row in enumerate(["pcaf_context", "pcaf_no_cache", "transformer_dense"]):
        for seed in (1, 2):
            d = _run(root / TABLE / "smoke" / "torch" / row / f"s{seed}", row=row, seed=seed,
                     best_ppl=300.0 + 20 * i + seed, tokens_per_sec=1e4 / (i + 1))
            for step in (1, 10, 20):
                append_curve_row(d, {"step": step, "eval_ppl_reference": 2000.0 / step + 50 * i + seed})
    out = tmp_path / "tables"
    code = main(["render", "--table", TABLE, "--scale", "smoke", "--backend", "torch", "--runs", str(root),
                 "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == str(out / f"{TABLE}_smoke_torch.md")
    for ext in ("md", "tex", "csv"):
        assert (out / f"{TABLE}_smoke_torch.{ext}").stat().st_size > 0
    assert (out / f"{TABLE}_smoke_torch_claims.csv").exists()
    for name in ("curves", "throughput", "speed_quality"):
        _assert_png_pdf(out / f"{TABLE}_smoke_torch_{name}.png", out / f"{TABLE}_smoke_torch_{name}.pdf")


def test_learning_curves_without_any_run_still_make_a_figure(tmp_path):
    spec = get_table("wt103-nt-ablations")
    fig = plot_learning_curves(spec, {})
    groups = {r.group for r in spec.rows}
    assert sum(ax.get_visible() for ax in fig.axes) == len(groups)
    assert all("no learning curves recorded" in [t.get_text() for t in ax.texts] for ax in fig.axes
               if ax.get_visible())
    _assert_png_pdf(*save_figure(fig, tmp_path / "curves"))


def test_learning_curve_panels_say_what_the_runs_measured(tmp_path):
    """A reduced scale may substitute the dataset and T: each panel names the paper's rows and the
    dataset and T its runs actually used."""
    root = tmp_path / "outputs"
    for row in ("pcaf_context", "transformer_dense"):
        d = _run(root / TABLE / "smoke" / "torch" / row / "s1", row=row, dataset="wikitext2", seq_len=64)
        append_curve_row(d, {"step": 1, "eval_ppl_reference": 900.0})
    spec = get_table(TABLE)
    _, aggs = collect_tables(root, [TABLE], "smoke", "torch")
    agg = aggs[TABLE]
    settings = measured_settings(spec, agg)
    assert set(settings.values()) == {"measured: wikitext2, T=64"}
    fig = plot_learning_curves(spec, {}, measured=settings)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles and all(t.startswith("paper rows: ") and "(measured: wikitext2, T=64)" in t for t in titles)


def test_throughput_figure_names_both_machines(tmp_path):
    """The paper's tokens/s come from another machine: the legend names each side's device and the title
    says to compare orderings only."""
    root = tmp_path / "outputs"
    device = "cpu (torch 2.13.0+cpu, 2 threads; peak memory = process max RSS)"
    for row in ("pcaf_context", "local_conv"):
        _run(root / TABLE / "smoke" / "torch" / row / "s1", row=row, device=device)
    spec = get_table(TABLE)
    _, aggs = collect_tables(root, [TABLE], "smoke", "torch")
    agg = aggs[TABLE]
    assert measured_devices(agg) == "cpu (torch 2.13.0+cpu, 2 threads)"
    assert spec.paper_device == "one RTX 3060, PyTorch"
    caveat = _device_caveat(spec, agg)
    assert "compare orderings, not tokens/s" in caveat
    fig = plot_throughput(spec, agg, {TABLE: load_published(TABLE)}, title="t" + caveat)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["measured: cpu (torch 2.13.0+cpu, 2 threads)", "paper: one RTX 3060, PyTorch"]
    assert fig.axes[0].get_yscale() == "log"  # ours ~1K beside the paper's 80K-500K tokens/s
    _assert_png_pdf(*save_figure(fig, tmp_path / "throughput"))
    # The speed-vs-quality figure's x axis is tokens/s too: its legend names the same machines.
    fig = plot_speed_quality(spec, agg, {TABLE: load_published(TABLE)})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["measured (filled): cpu (torch 2.13.0+cpu, 2 threads)", "paper (hollow): one RTX 3060, PyTorch"]


def test_rows_from_two_machines_are_labelled_with_their_machine(tmp_path):
    """Rows finished on different GPUs share a table: each bar and each measured point names its machine
    (without the software after it), which one machine's rows do not need."""
    from paper_tables.figures import plot_speed_quality

    root = tmp_path / "outputs"
    gpus = {"pcaf_context": "NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130); head loss in one tile",
            "local_conv": "NVIDIA H200 (torch 2.11.0+cu130)"}
    for row, device in gpus.items():
        _run(root / TABLE / "smoke" / "torch" / row / "s1", row=row, device=device, tokens_per_sec=1000.0,
             throughput_definition=f"tokens/s {THROUGHPUT_TIMED_TO_LOSS}")
    spec, pubs = get_table(TABLE), {TABLE: load_published(TABLE)}
    _, aggs = collect_tables(root, [TABLE], "smoke", "torch")
    ticks = [t.get_text() for t in plot_throughput(spec, aggs[TABLE], pubs).axes[0].get_xticklabels()]
    assert "PCAF-context [NVIDIA H100 80GB HBM3]" in ticks and "Local conv only [NVIDIA H200]" in ticks
    assert "PCAF no cache" in ticks  # no run: no machine
    assert _device_caveat(spec, aggs[TABLE]) == (
        "\nours ran on several machines (see labels): compare bars of one machine")
    texts = {t.get_text() for t in plot_speed_quality(spec, aggs[TABLE], pubs).axes[0].texts}
    assert {"PCAF-context [NVIDIA H100 80GB HBM3]", "PCAF-context (paper)"} <= texts
    _run(root / TABLE / "smoke" / "torch" / "local_conv" / "s1", row="local_conv", device=gpus["pcaf_context"],
         tokens_per_sec=1000.0, throughput_definition=f"tokens/s {THROUGHPUT_TIMED_TO_LOSS}")
    _, aggs = collect_tables(root, [TABLE], "smoke", "torch")
    ticks = [t.get_text() for t in plot_throughput(spec, aggs[TABLE], pubs).axes[0].get_xticklabels()]
    assert "PCAF-context" in ticks and not any("[" in t for t in ticks)


def test_throughput_within_a_decade_is_drawn_on_a_linear_axis_from_zero(tmp_path):
    """Bars on a log axis that starts just under the smallest one make a 10% gap look like a factor."""
    audit = "semantic-leak-audit"
    root = tmp_path / "outputs"
    for row, tok_s in (("pcaf_semantic_corrected", 2400.0), ("pcaf_context_corrected", 3100.0)):
        _run(root / audit / "smoke" / "torch" / row / "s1", table=audit, row=row, tokens_per_sec=tok_s)
    _, aggs = collect_tables(root, [audit], "smoke", "torch")
    ax = plot_throughput(get_table(audit), aggs[audit], {}).axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0


def test_next_token_curves_are_drawn_against_windows_seen(tmp_path):
    """Rows of a next-token table train different batches (attention 8, PCAF 32): the curves' x axis is
    windows seen (targets), tokens_seen / T, on a log scale; without token counts it falls back to steps."""
    root = tmp_path / "outputs"
    for row, batch in (("pcaf_context", 32), ("transformer_dense", 8)):
        d = _run(root / TABLE / "smoke" / "torch" / row / "s1", row=row, seq_len=64)
        for step in (1, 10):
            append_curve_row(d, {"step": step, "tokens_seen": step * batch * 64, "eval_ppl_reference": 900.0 / step})
    spec = get_table(TABLE)
    _, aggs = collect_tables(root, [TABLE], "smoke", "torch")
    assert curve_axis(spec, aggs[TABLE]) == "windows"
    curves = load_curves(spec, aggs[TABLE], x="windows")
    assert list(curves["pcaf_context"][0].index) == [32, 320]
    assert list(curves["transformer_dense"][0].index) == [8, 80]
    fig = plot_learning_curves(spec, curves, x="windows")
    ax = next(a for a in fig.axes if a.get_visible())
    assert ax.get_xlabel() == "training windows seen (one target each)" and ax.get_xscale() == "log"
    append_curve_row(root / TABLE / "smoke" / "torch" / "pcaf_context" / "s1", {"step": 20, "eval_ppl_reference": 40.0})
    _, aggs = collect_tables(root, [TABLE], "smoke", "torch")
    assert curve_axis(spec, aggs[TABLE]) == "step"  # one evaluation without a token count


def _falling(first: float, later: list[float], step: int) -> pd.Series:
    return pd.Series([first, *later], index=[step // 500, *range(step, step * (len(later) + 1), step)]).cummin()


def test_learning_curves_leave_out_the_first_evaluations_transient():
    """As the paper's curve figures: a first evaluation near the vocabulary size (here 20,000) would flatten the
    late differences between rows into a sliver; the PPL axis starts at 10% of training, from a factor of 1.06
    above the highest line there, and says so. The x axis starts at the earliest of those evaluations."""
    from paper_tables.figures import focused_limits

    spec = get_table(TABLE)
    curves = {"pcaf_context": [_falling(4000.0, [600.0, 400.0, 300.0, 250.0, 240.0], 32_000)],
              "transformer_dense": [_falling(20000.0, [700.0, 500.0, 450.0, 420.0, 410.0], 16_000)]}
    assert focused_limits([c[0] for c in curves.values()]) == pytest.approx((16_000 / 1.25, 240.0 / 1.06, 700.0 * 1.06))
    fig = plot_learning_curves(spec, curves, x="windows")
    ax = next(a for a in fig.axes if a.get_visible())
    assert ax.get_ylim() == pytest.approx((240.0 / 1.06, 700.0 * 1.06))
    assert ax.get_xlim()[0] == pytest.approx(16_000 / 1.25)
    assert ax.get_ylabel() == "best-so-far validation PPL\n(from 10% of training on)"
    labels = [t.get_text() for t in ax.get_yticklabels() if 240 / 1.06 <= t.get_position()[1] <= 742]
    assert labels == ["250", "300", "350", "400", "500", "600", "700"]  # every 50 below a factor of 4


def test_learning_curves_of_few_evaluations_keep_the_full_range():
    """Two evaluations (the cpu-scale tables' first and last) or a transient that is not above the rest: the axis
    is left as matplotlib chooses, with every point on it."""
    from paper_tables.figures import focused_limits

    two = pd.Series([3000.0, 400.0], index=[32, 8000])
    assert focused_limits([two]) is None
    assert focused_limits([two, _falling(4000.0, [600.0, 400.0, 300.0], 32_000)]) is None
    flat = pd.Series([500.0, 500.0, 480.0, 470.0], index=[1, 100, 200, 300])
    assert focused_limits([flat]) is None
    fig = plot_learning_curves(get_table(TABLE), {"pcaf_context": [two]}, x="windows")
    ax = next(a for a in fig.axes if a.get_visible())
    assert ax.get_ylim()[0] < 400.0 < 3000.0 < ax.get_ylim()[1]
    assert ax.get_ylabel() == "best-so-far validation PPL"


def test_a_figure_renders_to_the_same_bytes_twice(tmp_path):
    """No creation date in the PDF: re-rendering unchanged records leaves the committed files unchanged."""
    spec = get_table(TABLE)
    curves = {"pcaf_context": [_falling(4000.0, [600.0, 400.0, 300.0], 32_000)]}
    first = save_figure(plot_learning_curves(spec, curves, x="windows"), tmp_path / "a")
    second = save_figure(plot_learning_curves(spec, curves, x="windows"), tmp_path / "b")
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes()


def test_cli_rejects_unknown_table_with_the_valid_names(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["render", "--table", "wt2", "--scale", "smoke", "--backend", "torch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown table 'wt2'" in err and "main-303m" in err and "semantic-leak-audit" in err


def test_cli_list_prints_experiment_names(capsys):
    assert main(["list", "--table", "main-303m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(get_table("main-303m").rows)
    assert "experiment=main-303m/pcaf_context_wt103_t1024" in "\n".join(lines)


def test_best_so_far_curve_is_a_running_minimum():
    rows = [{"step": 1, "eval_ppl_reference": 500.0}, {"step": 5, "eval_ppl_reference": None},
            {"step": 10, "eval_ppl_reference": 300.0}, {"step": 20, "eval_ppl_reference": 350.0}]
    curve = best_so_far_curve(rows)
    assert list(curve.index) == [1, 10, 20] and list(curve.values) == [500.0, 300.0, 300.0]


def _multirun(root: Path) -> None:
    for job, (k, seed) in enumerate([(4, 1), (4, 2), (16, 1), (16, 2), (64, 1)]):
        d = root / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "config.yaml").write_text(f"memory:\n  top_k: {k}\ntrain:\n  seed: {seed}\n")
        failed = k == 64
        _run(d, table="sweeps-41m", row="pcaf_topk16", seed=seed, status="failed" if failed else "completed",
             error="diverged" if failed else None, best_ppl=None if failed else 100.0 - k / 4 + seed,
             device="cpu (torch 2.13.0+cpu, 2 threads; peak memory = process max RSS)", matmul_precision="highest")
    _run(root / "by_override" / "run", table="sweeps-41m", row="pcaf_topk16", seed=3, best_ppl=80.0,
         overrides=["memory.top_k=32"])
    _run(root / "unknown", table="sweeps-41m", row="pcaf_topk16", seed=4)


def test_sweep_reads_values_and_aggregates(tmp_path):
    _multirun(tmp_path)
    value, source = swept_value(tmp_path / "0", tmp_path, "memory.top_k")
    assert value == 4 and source.endswith("config.yaml")
    df = load_sweep(tmp_path, "memory.top_k")
    agg = aggregate_sweep(df, "memory.top_k").set_index("memory.top_k")
    assert list(agg.index) == [4, 16, 32, 64]
    assert agg.at[4, "n_runs"] == 2 and agg.at[4, "best_ppl"] == pytest.approx(100.0 - 1 + 1.5)
    assert agg.at[32, "best_ppl"] == 80.0
    assert agg.at[64, "n_runs"] == 0 and agg.at[64, "n_failed"] == 1 and agg.at[64, "best_ppl"] is None


def test_cli_sweep_writes_table_and_plot(tmp_path, capsys):
    _multirun(tmp_path / "multirun")
    out = tmp_path / "sweep_out"
    assert main(["sweep", "--runs", str(tmp_path / "multirun"), "--param", "memory.top_k", "--out", str(out)]) == 0
    md_path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert md_path == out / "sweep_memory.top_k.md"
    md = md_path.read_text()
    assert "| 4 | 100.50 ± 0.71 |" in md
    assert ("- Row: sweeps-41m/pcaf_topk16 · Scale: smoke · Backend: torch · Profile: reference_torch · "
            "Seeds: 1, 2, 3, 4 · Precision: fp32, fp32 (matmul highest) · Device: cpu (torch 2.13.0+cpu, 2 threads)"
            ) in md  # every number carries its labels (two runs recorded no device nor matmul precision)
    assert "1 failed: diverged" in md
    assert "Runs without a value for `memory.top_k`" in md and "unknown" in md
    _assert_png_pdf(out / "sweep_memory.top_k.png", out / "sweep_memory.top_k.pdf")
    assert pd.read_csv(out / "sweep_memory.top_k.csv")["memory.top_k"].tolist() == [4, 16, 32, 64]


def test_plot_sweep_handles_categorical_values_and_bad_columns(tmp_path):
    df = pd.DataFrame({"memory.route": ["context", "semantic", "context"], "best_ppl": [90.0, 95.0, 92.0]})
    fig = plot_sweep(df, x="memory.route", ylabel="best validation PPL (reference protocol)")
    assert fig.axes[0].get_ylabel() == "best validation PPL (reference protocol)"
    # Categories are points: no line through them suggests an order between routes.
    (bars,) = fig.axes[0].containers
    line = bars.lines[0]  # the means (the others are the error bars' caps)
    assert line.get_linestyle() == "None" and list(line.get_xdata()) == [0, 1]
    numeric = plot_sweep(pd.DataFrame({"memory.top_k": [4, 8], "best_ppl": [90.0, 95.0]}), x="memory.top_k")
    assert numeric.axes[0].containers[0].lines[0].get_linestyle() == "-"
    png, pdf = save_figure(fig, tmp_path / "route")
    _assert_png_pdf(png, pdf)
    with pytest.raises(KeyError, match="plot_sweep needs columns"):
        plot_sweep(df, x="memory.top_k")


def test_load_curves_uses_completed_runs_only(tmp_path):
    from paper_tables.collect import aggregate, load_runs
    from paper_tables.figures import load_curves

    for seed, status in ((1, "completed"), (2, "failed")):
        d = _run(tmp_path / f"s{seed}", seed=seed, status=status, error="boom" if status == "failed" else None)
        append_curve_row(d, {"step": 1, "eval_ppl_reference": 900.0 + seed})
    spec = get_table(TABLE)
    curves = load_curves(spec, aggregate(load_runs(tmp_path), spec))
    assert list(curves) == ["pcaf_context"] and len(curves["pcaf_context"]) == 1
    assert curves["pcaf_context"][0].iloc[0] == 901.0


def test_render_sweep_over_several_keys(tmp_path):
    from paper_tables.sweep import render_sweep

    _multirun(tmp_path / "multirun")
    paths = render_sweep(tmp_path / "multirun", ["memory.top_k", "train.seed"], tmp_path / "out")
    assert [p.name for p in paths] == [
        "sweep_memory.top_k.csv", "sweep_memory.top_k.png", "sweep_memory.top_k.pdf", "sweep_memory.top_k.md",
        "sweep_train.seed.csv", "sweep_train.seed.png", "sweep_train.seed.pdf", "sweep_train.seed.md",
    ]
    assert "| 1 |" in paths[-1].read_text() and "| 2 |" in paths[-1].read_text()
    with pytest.raises(KeyError, match="unknown sweep metric"):
        render_sweep(tmp_path / "multirun", "memory.top_k", tmp_path / "out", y="loss")


# --------------------------------------------------------------------------- speed vs quality


def _text_boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    ax = fig.axes[0]
    # Text.get_window_extent: the text alone (an Annotation's own extent includes its leader line).
    return {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}, ax


def test_speed_quality_names_every_point_and_no_label_overlaps_a_label_or_a_marker(tmp_path):
    from paper_tables.figures import plot_speed_quality
    from paper_tables.published import load_published
    from paper_tables.spec_types import select_rows

    # The default table's cpu numbers: every measured point within 2.7k-3.3k tokens/s.
    values = dict(transformer_dense=(239.6, 3082), transformer_local=(233.1, 3011), local_conv=(168.7, 3231),
                  pcaf_context=(148.2, 2768), pcaf_semantic=(117.9, 2761), pcaf_semantic_corrected=(241.0, 3050))
    for row, (ppl, tok) in values.items():
        _run(tmp_path / row, table="main-303m", row=f"{row}_wt103_t1024", scale="cpu", best_ppl=ppl,
             tokens_per_sec=tok, profile=get_table("main-303m").row(f"{row}_wt103_t1024").profile)
    spec = select_rows(get_table("main-303m"), "*_wt103_t1024")
    _, aggs = collect_tables(tmp_path, ["main-303m"], "cpu", "torch")
    fig = plot_speed_quality(spec, aggs["main-303m"], {"main-303m": load_published("main-303m")})
    boxes, ax = _text_boxes(fig)
    assert {r.display for r in spec.rows} <= set(boxes)  # measured points: the model's name, never the row id
    assert {f"{r.display} (paper)" for r in spec.rows if r.published_key} <= set(boxes)
    assert not any(r.id in boxes for r in spec.rows)
    items = list(boxes.items())
    for i, (a, box_a) in enumerate(items):
        for b, box_b in items[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
    markers = [ax.transData.transform(xy) for c in ax.collections for xy in c.get_offsets()]
    assert len(markers) == 11  # 6 measured + 5 paper points
    for name, box in boxes.items():
        assert not any(box.contains(x, y) for x, y in markers), name
    # Each measured point is joined to its paper point by a line of the model's colour.
    assert len(ax.lines) == 5


@pytest.mark.slow
def test_speed_quality_of_a_large_table_has_one_panel_per_group(tmp_path):
    """sweeps-41m's 29 rows: one panel per sweep, each titled by its group, with every point labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from paper_tables.figures import SPEED_QUALITY_PANEL_ROWS, plot_speed_quality
    from paper_tables.published import load_published

    spec = get_table("sweeps-41m")
    assert len(spec.rows) > SPEED_QUALITY_PANEL_ROWS
    for k, row in enumerate(spec.rows):
        _run(tmp_path / row.id, table="sweeps-41m", row=row.id, scale="cpu", best_ppl=300.0 + k,
             tokens_per_sec=1000.0 * (k + 1), profile=row.profile)
    _, aggs = collect_tables(tmp_path, ["sweeps-41m"], "cpu", "torch")
    fig = plot_speed_quality(spec, aggs["sweeps-41m"], {"sweeps-41m": load_published("sweeps-41m")})
    FigureCanvasAgg(fig).draw()
    groups = list(dict.fromkeys(r.group for r in spec.rows))
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == [f"paper rows: {g}" for g in groups]
    for ax, group in zip(visible, groups):
        rows = [r for r in spec.rows if r.group == group]
        texts = {t.get_text() for t in ax.texts}
        assert len([t for t in texts if not t.endswith("(paper)")]) == len(rows), group


def test_sweep_table_labels_throughput_measured_while_jobs_shared_the_machine(tmp_path):
    """Jobs run at once (``make sweep LAUNCHER=local JOBS=2``) time each other: the sweep table marks their
    tokens/s and says why, as the paper tables do; a value whose runs ran alone is not marked."""
    from paper_tables.sweep import render_sweep
    from pcaf_core.results import read_metrics

    _multirun(tmp_path / "multirun")
    record = read_metrics(tmp_path / "multirun" / "2")  # top_k 16, seed 1
    record.extra["shared_machine"] = {"method": "proc", "samples": 2, "shared_samples": 2,
                                      "others": ["pid 1: python -m submitit.core._submit"]}
    write_metrics(tmp_path / "multirun" / "2", record)
    md = render_sweep(tmp_path / "multirun", "memory.top_k", tmp_path / "out")[-1].read_text()
    lines = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| ")}
    assert "(shared)" in lines["| 16"] and "(shared)" not in lines["| 4"]
    assert "(shared): tokens/s measured while sharing the machine" in md


def test_the_vocabulary_caveat_names_the_paper_s_vocabulary_at_the_paper_s_scale():
    """Below the paper's scale the figure warns that the vocabularies differ; at the paper's scale the vocabulary
    is the paper's, so the line says so, and only where a row deviates from the paper's settings."""
    agg = pd.DataFrame({"vocab_size": [8000, 8000], "deviations": [[], []]})
    assert _vocabulary_caveat(agg, "cpu") == "\nmeasured at V=8,000, the paper at its own V: compare orderings, not PPL"
    agg = pd.DataFrame({"vocab_size": [20000, None], "deviations": [["data.layout=tokens (command line)"], None]})
    assert _vocabulary_caveat(agg, "paper") == ("\nmeasured at the paper's V=20,000, with the table's deviations: "
                                                "compare orderings, not PPL")
    assert _vocabulary_caveat(pd.DataFrame({"vocab_size": [20000], "deviations": [[]]}), "paper") == ""
    assert _vocabulary_caveat(pd.DataFrame({"vocab_size": [None]}), "cpu") == ""
