"""Figures with matplotlib's object API (no pyplot: no global state, no GUI backend, the Agg and PDF
canvases are picked by file type). Each ``plot_*`` returns a :class:`~matplotlib.figure.Figure`;
:func:`save_figure` writes it as PNG and PDF.

- :func:`plot_learning_curves`: best-so-far validation PPL (reference protocol) vs step, one line
  per row (mean over seeds at each step), one panel per row group, as the paper's curve figures.
- :func:`plot_throughput`: training tokens/s per row, measured beside published (log scale).
- :func:`plot_speed_quality`: tokens/s vs best PPL, measured (filled) and published (hollow).
- :func:`plot_sweep`: a metric vs the swept value of a Hydra multirun (mean ± std over runs).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from paper_tables.claims import paper_value
from paper_tables.specs import TableSpec
from pcaf_core.results import read_curve

CURVE_METRIC = "eval_ppl_reference"


def save_figure(fig: Figure, stem: str | os.PathLike[str]) -> list[Path]:
    """Write ``<stem>.png`` (150 dpi) and ``<stem>.pdf``; returns both paths. Figures use the
    constrained layout, so labels are kept inside the canvas without a tight bounding box."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    return paths


def _empty_note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4")


def best_so_far_curve(rows: list[dict[str, Any]], metric: str = CURVE_METRIC) -> pd.Series:
    """Best-so-far (running minimum) of ``metric`` indexed by step, from :func:`read_curve` rows;
    rows without the metric (steps without an evaluation) are skipped."""
    points = [(r["step"], float(r[metric])) for r in rows
              if r.get(metric) is not None and r.get("step") is not None and not isinstance(r.get(metric), str)]
    if not points:
        return pd.Series(dtype=float)
    s = pd.Series([v for _, v in points], index=[int(k) for k, _ in points], dtype=float)
    s = s[~s.index.duplicated(keep="last")].sort_index()
    return s.cummin()


def load_curves(spec: TableSpec, agg: pd.DataFrame) -> dict[str, list[pd.Series]]:
    """Best-so-far curves per row: of its completed runs, or of its running runs when none completed
    (failed attempts are left out)."""
    out: dict[str, list[pd.Series]] = {}
    for row in spec.rows:
        if row.id not in agg.index or agg.at[row.id, "status"] not in ("ok", "running"):
            continue
        curves = [best_so_far_curve(read_curve(d)) for d in agg.at[row.id, "curve_dirs"]]
        curves = [c for c in curves if len(c)]
        if curves:
            out[row.id] = curves
    return out


def _mean_curve(curves: list[pd.Series]) -> pd.Series:
    if len(curves) == 1:
        return curves[0]
    return pd.concat(curves, axis=1).sort_index().mean(axis=1, skipna=True)


def measured_settings(spec: TableSpec, agg: pd.DataFrame) -> dict[str, str]:
    """Per row group, the dataset(s) and window length(s) its measured runs used, e.g.
    ``"measured: wikitext2, T=256"`` (a reduced scale may substitute both); groups without runs are left out."""
    out: dict[str, str] = {}
    for group in dict.fromkeys(row.group for row in spec.rows):
        ids = [r.id for r in spec.rows if r.group == group and r.id in agg.index]
        datasets = sorted({d for i in ids for d in (agg.at[i, "datasets"] or [])})
        lengths = sorted({int(agg.at[i, "seq_len"]) for i in ids if pd.notna(agg.at[i, "seq_len"])})
        if datasets or lengths:
            parts = [", ".join(datasets)] if datasets else []
            parts += ["T=" + "/".join(str(t) for t in lengths)] if lengths else []
            out[group] = "measured: " + ", ".join(parts)
    return out


def plot_learning_curves(spec: TableSpec, curves: dict[str, list[pd.Series]], title: str = "",
                         measured: dict[str, str] | None = None) -> Figure:
    """Best-so-far validation PPL vs step; one panel per row group (titled with the paper's group and,
    from ``measured``, what the runs actually used), one line per row."""
    groups: list[str] = []
    for row in spec.rows:
        if row.group not in groups:
            groups.append(row.group)
    ncols = min(3, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, group in enumerate(groups):
        ax = axes[i // ncols][i % ncols]
        drawn = 0
        for row in spec.rows:
            if row.group != group or row.id not in curves:
                continue
            mean = _mean_curve(curves[row.id])
            n = len(curves[row.id])
            ax.plot(mean.index, mean.values, marker="o", markersize=2.5, linewidth=1.3,
                    label=row.display + (f" (n={n})" if n > 1 else ""))
            drawn += 1
        note = (measured or {}).get(group)
        ax.set_title(f"paper rows: {group}" + (f"\n({note})" if note else ""), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("best-so-far validation PPL")
        if drawn:
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            _empty_note(ax, "no learning curves recorded")
    for j in range(len(groups), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    fig.suptitle(title or f"{spec.name}: best-so-far validation PPL (reference protocol)", fontsize=11)
    return fig


def _measured(agg: pd.DataFrame, row_id: str, field: str) -> float | None:
    if row_id not in agg.index or agg.at[row_id, "status"] != "ok":
        return None
    value = agg.at[row_id, field]
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def plot_throughput(spec: TableSpec, agg: pd.DataFrame, pubs: dict[str, pd.DataFrame], title: str = "") -> Figure:
    """Training tokens/s per row: measured (solid) beside published (hatched), log scale."""
    ids = [r.id for r in spec.rows]
    measured = [_measured(agg, i, "tokens_per_sec") for i in ids]
    has_tok = any(c.key == "tok_s" and c.published for c in spec.columns)
    paper = [paper_value(pubs, spec.name, i, "tok_s") if has_tok else None for i in ids]
    fig = Figure(figsize=(max(6.0, 0.45 * len(ids) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    x = list(range(len(ids)))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [v or 0 for v in measured], width, label="measured", color="tab:blue")
    if any(p is not None for p in paper):
        ax.bar([i + width / 2 for i in x], [p or 0 for p in paper], width, label="paper", color="white",
               edgecolor="tab:gray", hatch="//")
    for i, row_id, v in zip(x, ids, measured):
        if v is None:
            state = agg.at[row_id, "status"] if row_id in agg.index else "missing"
            ax.text(i - width / 2, 0.02, "not measured" if state == "ok" else state, rotation=90, ha="center",
                    va="bottom", fontsize=6, color="tab:red", transform=ax.get_xaxis_transform())
    ax.set_xticks(x, [r.display if len(ids) <= 8 else r.id for r in spec.rows], rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel("training tokens / s")
    if any(v for v in measured) or any(p for p in paper):
        ax.set_yscale("log")
    else:
        _empty_note(ax, "no throughput recorded")
    ax.legend(fontsize=8)
    ax.set_title(title or f"{spec.name}: training throughput", fontsize=10)
    return fig


def plot_speed_quality(spec: TableSpec, agg: pd.DataFrame, pubs: dict[str, pd.DataFrame], title: str = "") -> Figure:
    """Tokens/s (x, log) vs best PPL (y, log): measured rows filled and labelled, paper rows hollow."""
    fig = Figure(figsize=(6.4, 4.6), layout="constrained")
    ax = fig.subplots()
    has_tok = any(c.key == "tok_s" and c.published for c in spec.columns)
    drawn = False
    for row in spec.rows:
        tok, ppl = _measured(agg, row.id, "tokens_per_sec"), _measured(agg, row.id, "best_ppl")
        if tok and ppl:
            ax.scatter([tok], [ppl], s=28, color="tab:blue", zorder=3)
            ax.annotate(row.id, (tok, ppl), fontsize=6, xytext=(3, 3), textcoords="offset points")
            drawn = True
        if has_tok:
            ptok = paper_value(pubs, spec.name, row.id, "tok_s")
            pppl = paper_value(pubs, spec.name, row.id, "best_ppl")
            if ptok and pppl:
                ax.scatter([ptok], [pppl], s=28, facecolors="none", edgecolors="tab:gray", zorder=2)
                drawn = True
    ax.scatter([], [], s=28, color="tab:blue", label="measured")
    ax.scatter([], [], s=28, facecolors="none", edgecolors="tab:gray", label="paper")
    if drawn:
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        _empty_note(ax, "no measured rows")
    ax.set_xlabel("training tokens / s")
    ax.set_ylabel("best validation PPL")
    ax.legend(fontsize=8)
    ax.set_title(title or f"{spec.name}: speed vs quality", fontsize=10)
    return fig


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_sweep(df: pd.DataFrame, x: str, y: str = "best_ppl", title: str = "") -> Figure:
    """``y`` (mean ± std over runs) vs the swept value ``x``.

    ``df`` holds one line per completed run with columns ``x`` and ``y`` (e.g. from
    :func:`paper_tables.sweep.load_sweep`); rows where ``y`` is absent are ignored. Numeric sweep values
    are placed on a numeric axis (log base 2 when they span a factor of 8 or more), others as categories.
    """
    if x not in df.columns or y not in df.columns:
        raise KeyError(f"plot_sweep needs columns {x!r} and {y!r}; the frame has {list(df.columns)}")
    data = df[[x, y]].copy()
    data[y] = pd.to_numeric(data[y], errors="coerce")
    data = data.dropna(subset=[y])
    data = data[data[x].map(lambda v: v is not None)]
    fig = Figure(figsize=(5.6, 4.0), layout="constrained")
    ax = fig.subplots()
    if data.empty:
        _empty_note(ax, f"no completed run with {y}")
    else:
        keys = data[x].map(lambda v: v if _is_number(v) else str(v))
        grouped = data.assign(_x=keys).groupby("_x", sort=True)[y]
        stats = grouped.agg(["mean", "std", "count"])
        xs = list(stats.index)
        numeric = all(_is_number(v) for v in xs)
        pos = xs if numeric else list(range(len(xs)))
        ax.errorbar(pos, stats["mean"], yerr=stats["std"].fillna(0.0), marker="o", capsize=3)
        for p, (m, n) in zip(pos, zip(stats["mean"], stats["count"])):
            ax.annotate(f"n={int(n)}", (p, m), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if numeric:
            positive = [v for v in xs if v > 0]
            if len(positive) == len(xs) and max(xs) / min(xs) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
        else:
            ax.set_xticks(pos, [str(v) for v in xs])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title or f"{y} vs {x}", fontsize=10 if "\n" not in title else 7)
    return fig
