"""End-to-end: run directories -> rendered table files and figures (sweeps: :mod:`paper_tables.sweep`)."""

from __future__ import annotations

import os
from pathlib import Path

from paper_tables.claims import evaluate_claims, referenced_tables
from paper_tables.collect import collect_tables, unattributed_runs
from paper_tables.figures import (
    curve_axis,
    load_curves,
    measured_devices,
    measured_settings,
    plot_learning_curves,
    plot_speed_quality,
    plot_throughput,
    save_figure,
)
from paper_tables.published import load_published
from paper_tables.render import Report, render_claims_csv, render_csv, render_latex, render_markdown
from paper_tables.specs import get_table, select_rows


def _vocabulary_caveat(agg) -> str:
    """A second title line naming the measured vocabulary: perplexities at different vocabularies are not
    on one scale, and a reduced scale may shrink it."""
    if "vocab_size" not in agg.columns:
        return ""
    vocabs = sorted({int(v) for v in agg["vocab_size"].dropna()})
    if not vocabs:
        return ""
    return f"\nmeasured at V={'/'.join(f'{v:,}' for v in vocabs)}, the paper at its own V: compare orderings, not PPL"


def _device_caveat(spec, agg) -> str:
    """A second title line for a figure that puts the paper's tokens/s beside ours measured elsewhere."""
    here = measured_devices(agg)
    if not spec.paper_device or not here or spec.paper_device in here:
        return ""
    return "\ntwo machines (legend): compare orderings, not tokens/s"


def build_report(table: str, scale: str, backend: str, runs: str | os.PathLike[str],
                 profile: str | None = None, rows: str | None = None) -> Report:
    """Collect the runs of ``table`` (and of the tables its claims reference) and judge the claims.

    ``rows``: comma-separated globs over row ids (default: every row), see :func:`select_rows`."""
    spec = select_rows(get_table(table), rows)
    names = [spec.name, *referenced_tables(spec)]
    all_runs, aggs = collect_tables(runs, names, scale, backend, profile)
    pubs = {n: load_published(n) for n in names if get_table(n).has_published}
    stray = unattributed_runs(all_runs)
    mine = all_runs[all_runs["table"] == spec.name] if len(all_runs) else all_runs
    return Report(
        spec=spec, agg=aggs[spec.name], published=pubs.get(spec.name),
        verdicts=evaluate_claims(spec, aggs, pubs), scale=scale, backend=backend, runs_root=str(runs),
        profile_filter=profile, n_records=len(mine),
        unattributed=[f"{d}: table={t or '?'} row={r or '?'}" + (f" ({e})" if e else "")
                      for d, t, r, e in zip(stray["run_dir"], stray["table"], stray["row"], stray["read_error"])],
    )


def render_table(table: str, scale: str, backend: str, runs: str | os.PathLike[str],
                 out: str | os.PathLike[str], profile: str | None = None, figures: bool = True,
                 rows: str | None = None) -> dict[str, Path]:
    """Write ``<table>_<scale>_<backend>.{md,tex,csv}``, ``..._claims.csv`` and (with ``figures``) the
    curves/throughput/speed-quality figures (PNG+PDF) under ``out``. Returns name -> path."""
    report = build_report(table, scale, backend, runs, profile, rows)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{table}_{scale}_{backend}"
    paths: dict[str, Path] = {}
    for key, text in (("tex", render_latex(report)), ("csv", render_csv(report)),
                      ("claims", render_claims_csv(report)), ("md", render_markdown(report))):
        path = out_dir / (f"{stem}_claims.csv" if key == "claims" else f"{stem}.{key}")
        path.write_text(text, encoding="utf-8")
        paths[key] = path
    if figures:
        spec = report.spec
        pubs = {spec.name: report.published} if report.published is not None else {}
        axis = curve_axis(spec, report.agg)
        figs = {
            "curves": plot_learning_curves(spec, load_curves(spec, report.agg, x=axis),
                                           title=f"{table} ({scale}, {backend}): best-so-far validation PPL",
                                           measured=measured_settings(spec, report.agg), x=axis),
            "throughput": plot_throughput(spec, report.agg, pubs,
                                          title=f"{table} ({scale}, {backend}): throughput"
                                          + _device_caveat(spec, report.agg)),
            "speed_quality": plot_speed_quality(spec, report.agg, pubs,
                                                title=f"{table} ({scale}, {backend}): speed vs quality"
                                                + _vocabulary_caveat(report.agg)),
        }
        for name, fig in figs.items():
            png, pdf = save_figure(fig, out_dir / f"{stem}_{name}")
            paths[f"{name}_png"], paths[f"{name}_pdf"] = png, pdf
    return paths
