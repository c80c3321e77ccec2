"""End-to-end: run directories -> rendered table files and figures (sweeps: :mod:`paper_tables.sweep`).

A render of some rows of a table (``rows``) writes its own files, ``<table>_<scale>_<backend>_<rows>.*``, so
commands that reproduce different rows of one table side by side never overwrite each other's table; the
whole table is ``<table>_<scale>_<backend>.*``. Each set of files is written under a lock
(``.<stem>.lock`` in the output directory), every file atomically.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from paper_tables.claims import evaluate_claims, referenced_tables
from paper_tables.collect import (
    Expected,
    collect_tables,
    extra_runs,
    measured_devices,
    measured_machines,
    ran_with,
    shown_root,
    unattributed_runs,
)
from paper_tables.figures import (
    curve_axis,
    load_curves,
    measured_settings,
    plot_learning_curves,
    plot_speed_quality,
    plot_throughput,
    save_figure,
)
from paper_tables.published import load_published
from paper_tables.render import Report, render_markdown
from paper_tables.render_latex_csv import render_claims_csv, render_csv, render_latex
from paper_tables.spec_types import select_rows
from paper_tables.specs import get_table
from pcaf_core.fsutil import atomic_write_text, file_lock


def _vocabulary_caveat(agg, scale: str) -> str:
    """A second title line naming the measured vocabulary: perplexities at different vocabularies are not
    on one scale, and a reduced scale may shrink it. At ``scale=paper`` the vocabulary is the paper's, and the
    line says so where a measured row deviates from the paper's settings (the data, for instance); with no
    deviation there is no caveat."""
    if "vocab_size" not in agg.columns:
        return ""
    vocabs = sorted({int(v) for v in agg["vocab_size"].dropna()})
    if not vocabs:
        return ""
    named = "/".join(f"{v:,}" for v in vocabs)
    if scale == "paper":
        deviations = agg["deviations"].dropna() if "deviations" in agg.columns else ()
        if not any(len(d) for d in deviations):
            return ""
        return f"\nmeasured at the paper's V={named}, with the table's deviations: compare orderings, not PPL"
    return f"\nmeasured at V={named}, the paper at its own V: compare orderings, not PPL"


def _device_caveat(spec, agg) -> str:
    """A second title line for a figure that puts the paper's tokens/s beside ours measured elsewhere."""
    here = measured_devices(agg)
    if not spec.paper_device or not here or spec.paper_device in here:
        return ""
    if len(measured_machines(agg)) > 1:  # our rows themselves ran on more than one machine (each bar names its own)
        return "\nours ran on several machines (see labels): compare bars of one machine"
    return "\ntwo machines (legend): compare orderings, not tokens/s"


def rows_tag(rows: str | None) -> str:
    """The file-name part for a row selection: ``""`` for every row, else the globs without wildcards
    (``*_wt103_t1024`` -> ``wt103_t1024``; several joined by ``+``)."""
    if not rows or rows.strip() == "*":
        return ""
    parts = []
    for glob in (g.strip() for g in rows.split(",")):
        text = re.sub(r"[^A-Za-z0-9_.-]+", "_", glob.replace("*", "_").replace("?", "_"))
        text = re.sub(r"_+", "_", text).strip("_.-")
        parts.append(text or "all")
    return "+".join(parts)


def build_report(table: str, scale: str, backend: str, runs: str | os.PathLike[str],
                 profile: str | None = None, rows: str | None = None, expected: Expected | None = None) -> Report:
    """Collect the runs of ``table`` (and of the tables its claims reference) and judge the claims.

    ``rows``: comma-separated globs over row ids (default: every row), see :func:`select_rows`.
    ``expected``: the identity digests each row's runs must have (default: the ones the records carry),
    see :func:`paper_tables.collect.run_role`."""
    spec = select_rows(get_table(table), rows)
    names = [spec.name, *referenced_tables(spec)]
    all_runs, aggs = collect_tables(runs, names, scale, backend, profile, expected)
    pubs = {n: load_published(n) for n in names if get_table(n).has_published}
    stray = unattributed_runs(all_runs)
    mine = all_runs[all_runs["table"] == spec.name] if len(all_runs) else all_runs
    return Report(
        spec=spec, agg=aggs[spec.name], published=pubs.get(spec.name),
        verdicts=evaluate_claims(spec, aggs, pubs), scale=scale, backend=backend, runs_root=shown_root(runs),
        profile_filter=profile, n_records=len(mine),
        unattributed=[f"{d}: table={t or '?'} row={r or '?'}" + (f" ({e})" if e else "")
                      for d, t, r, e in zip(stray["run_dir"], stray["table"], stray["row"], stray["read_error"])],
        extra_runs=_extra_lines(extra_runs(all_runs, spec.name), spec),
    )


def _extra_lines(extra, spec) -> list[str]:
    """One line per run of the table's rows that is not a row's run: where, which row, what it changed."""
    lines = []
    for _, run in extra.iterrows():
        if run["row"] not in spec.row_ids:
            continue
        overrides = ran_with(run["deviations"])
        lines.append(f"`{run['run_dir']}`: {run['row']}, {run['status']}"
                     + (f", best PPL {float(run['best_ppl']):.2f}" if run["best_ppl"] is not None else "")
                     + (f"; ran with `{overrides}`" if overrides else "; its config is not the row's composed config"))
    return lines


def render_table(table: str, scale: str, backend: str, runs: str | os.PathLike[str],
                 out: str | os.PathLike[str], profile: str | None = None, figures: bool = True,
                 rows: str | None = None, expected: Expected | None = None) -> dict[str, Path]:
    """Write ``<stem>.{md,tex,csv}``, ``<stem>_claims.csv`` and (with ``figures``) the
    curves/throughput/speed-quality figures (PNG+PDF) under ``out``, with ``stem`` =
    ``<table>_<scale>_<backend>`` plus ``_<rows>`` for a row selection (module docstring). Returns name -> path."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = rows_tag(rows)
    stem = f"{table}_{scale}_{backend}" + (f"_{tag}" if tag else "")
    with file_lock(out_dir / f".{stem}.lock"):
        return _render_locked(table, scale, backend, runs, out_dir, stem, profile, figures, rows, expected)


def _render_locked(table, scale, backend, runs, out_dir: Path, stem: str, profile, figures: bool, rows,
                   expected) -> dict[str, Path]:
    report = build_report(table, scale, backend, runs, profile, rows, expected)
    paths: dict[str, Path] = {}
    for key, text in (("tex", render_latex(report)), ("csv", render_csv(report)),
                      ("claims", render_claims_csv(report)), ("md", render_markdown(report))):
        path = out_dir / (f"{stem}_claims.csv" if key == "claims" else f"{stem}.{key}")
        atomic_write_text(path, text)
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
                                                + _vocabulary_caveat(report.agg, scale)),
        }
        for name, fig in figs.items():
            png, pdf = save_figure(fig, out_dir / f"{stem}_{name}")
            paths[f"{name}_png"], paths[f"{name}_pdf"] = png, pdf
    return paths
