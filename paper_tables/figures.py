"""Figures with matplotlib's object API (no pyplot: no global state, no GUI backend, the Agg and PDF
canvases are picked by file type). Each ``plot_*`` returns a :class:`~matplotlib.figure.Figure`;
:func:`save_figure` writes it as PNG and PDF.

- :func:`plot_learning_curves`: best-so-far validation PPL (reference protocol) against training done
  (next-token windows, i.e. targets, or tokens; steps where a run recorded neither), one line per row
  (mean over seeds at each point), one panel per row group, as the paper's curve figures, the PPL axis from
  10% of training on where the curves have the evaluations for it (:func:`focused_limits`).
- :func:`plot_throughput`: training tokens/s per row, measured beside published (log scale).
- :func:`plot_speed_quality`: tokens/s vs best PPL, measured (filled) and published (hollow), each side's
  machine in the legend.
- :func:`plot_sweep`: a metric vs the swept value of a Hydra multirun (mean ± std over runs).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from paper_tables.claims import paper_value
from paper_tables.collect import hardware_of, measured_devices, row_machines
from paper_tables.spec_types import TableSpec
from pcaf_core.results import read_curve

CURVE_METRIC = "eval_ppl_reference"
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">", "h")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))


def _count_text(v: float) -> str:
    """``3.08k``, ``1.2M``: three significant digits with a k / M suffix."""
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def save_figure(fig: Figure, stem: str | os.PathLike[str]) -> list[Path]:
    """Write ``<stem>.png`` (150 dpi) and ``<stem>.pdf`` (without a creation date); returns both paths. Figures use the
    constrained layout, so labels are kept inside the canvas without a tight bounding box."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    for path in paths:
        # No creation date in the PDF: the same records render the same bytes, so a re-render changes only the
        # files whose figure changed.
        fig.savefig(path, dpi=150, metadata={"CreationDate": None} if path.suffix == ".pdf" else None)
    return paths


def _empty_note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4")


CURVE_AXES = {"step": "step", "tokens": "training tokens seen", "windows": "training windows seen (one target each)"}
"""x axes of the learning curves: ``windows`` for next-token tables (rows train different batches and T, and
a window is a target), ``tokens`` for full-AR and mixed tables, ``step`` when a run recorded no token count."""


def _x_value(r: dict[str, Any], x: str, seq_len: int | None) -> float | None:
    if x == "step":
        return r.get("step")
    tokens = r.get("tokens_seen")
    if tokens is None or isinstance(tokens, str):
        return None
    return float(tokens) / seq_len if x == "windows" and seq_len else float(tokens)


def best_so_far_curve(rows: list[dict[str, Any]], metric: str = CURVE_METRIC, x: str = "step",
                      seq_len: int | None = None) -> pd.Series:
    """Best-so-far (running minimum) of ``metric`` from :func:`read_curve` rows, indexed by ``x`` (a
    :data:`CURVE_AXES` key; ``windows`` divides ``tokens_seen`` by ``seq_len``); rows without the metric
    (steps without an evaluation) or without ``x`` are skipped."""
    points = [(_x_value(r, x, seq_len), float(r[metric])) for r in rows
              if r.get(metric) is not None and not isinstance(r.get(metric), str)]
    points = [(k, v) for k, v in points if k is not None]
    if not points:
        return pd.Series(dtype=float)
    s = pd.Series([v for _, v in points], index=[int(round(k)) for k, _ in points], dtype=float)
    s = s[~s.index.duplicated(keep="last")].sort_index()
    return s.cummin()


def load_curves(spec: TableSpec, agg: pd.DataFrame, x: str = "step") -> dict[str, list[pd.Series]]:
    """Best-so-far curves per row, indexed by ``x`` (:data:`CURVE_AXES`): of its completed runs, or of its
    running runs when none completed (failed attempts are left out)."""
    out: dict[str, list[pd.Series]] = {}
    for row in spec.rows:
        if row.id not in agg.index or agg.at[row.id, "status"] not in ("ok", "running"):
            continue
        seq_len = agg.at[row.id, "seq_len"] if "seq_len" in agg.columns else None
        seq_len = int(seq_len) if seq_len is not None and pd.notna(seq_len) else None
        curves = [best_so_far_curve(read_curve(d), x=x, seq_len=seq_len) for d in agg.at[row.id, "curve_dirs"]]
        curves = [c for c in curves if len(c)]
        if curves:
            out[row.id] = curves
    return out


def curve_axis(spec: TableSpec, agg: pd.DataFrame) -> str:
    """The learning curves' x axis (:data:`CURVE_AXES` key): ``windows`` for a next-token table, ``tokens``
    otherwise, ``step`` when a measured run's curve has no ``tokens_seen`` (or a next-token row no T)."""
    for row in spec.rows:
        if row.id not in agg.index or agg.at[row.id, "status"] not in ("ok", "running"):
            continue
        for d in agg.at[row.id, "curve_dirs"]:
            if any(r.get("tokens_seen") in (None, "") for r in read_curve(d)):
                return "step"
        if spec.mode == "nt" and ("seq_len" not in agg.columns or pd.isna(agg.at[row.id, "seq_len"])):
            return "step"
    return "windows" if spec.mode == "nt" else "tokens"


def _mean_curve(curves: list[pd.Series]) -> pd.Series:
    if len(curves) == 1:
        return curves[0]
    return pd.concat(curves, axis=1).sort_index().mean(axis=1, skipna=True)


def measured_settings(spec: TableSpec, agg: pd.DataFrame) -> dict[str, str]:
    """Per row group, the dataset(s), window length(s) and vocabulary size(s) its measured runs used, e.g.
    ``"measured: wikitext2, T=256, V=8,000"`` (a reduced scale may substitute all three); groups without runs
    are left out."""
    out: dict[str, str] = {}
    for group in dict.fromkeys(row.group for row in spec.rows):
        ids = [r.id for r in spec.rows if r.group == group and r.id in agg.index]
        datasets = sorted({d for i in ids for d in (agg.at[i, "datasets"] or [])})
        lengths = sorted({int(agg.at[i, "seq_len"]) for i in ids if pd.notna(agg.at[i, "seq_len"])})
        vocabs = sorted({int(agg.at[i, "vocab_size"]) for i in ids
                         if "vocab_size" in agg.columns and pd.notna(agg.at[i, "vocab_size"])})
        if datasets or lengths:
            parts = [", ".join(datasets)] if datasets else []
            parts += ["T=" + "/".join(str(t) for t in lengths)] if lengths else []
            parts += ["V=" + "/".join(f"{v:,}" for v in vocabs)] if vocabs else []
            out[group] = "measured: " + ", ".join(parts)
    return out


FOCUS_AFTER = 0.1
"""The learning curves' vertical axis starts at the rows' best-so-far PPL once each row has trained this share of
its x range (the paper's curve figures do the same: the axis "focuses on the competitive perplexity regime after the
initial high-loss transient"), so the late differences between rows are not flattened by a first evaluation that
sits near the vocabulary size."""
FOCUS_MIN_POINTS = 3
"""The focus applies only when every line of the panel has at least this many evaluations from
:data:`FOCUS_AFTER` on; a curve of two or three evaluations keeps the full range (cutting it would leave one
point)."""


def focused_limits(means: list[pd.Series]) -> tuple[float, float, float] | None:
    """``(x_left, y_bottom, y_top)`` of a panel of best-so-far curves ``means`` (each indexed by training done,
    non-increasing) that leaves out their initial transient, or None where the full range should stay: fewer
    than :data:`FOCUS_MIN_POINTS` evaluations from :data:`FOCUS_AFTER` of a line's training on, or nothing above
    the focused top to cut. The top is the highest of the lines' values at their first evaluation from
    :data:`FOCUS_AFTER` of their own training on, the bottom the lowest value, ``x_left`` the earliest of those
    first evaluations; each with a margin for a log axis."""
    tops, bottoms, lefts, highest = [], [], [], 0.0
    for mean in means:
        mean = mean.dropna()
        if mean.empty:
            continue
        after = mean[mean.index >= FOCUS_AFTER * float(mean.index[-1])]  # training done counts from zero
        if len(after) < FOCUS_MIN_POINTS:
            return None
        tops.append(float(after.iloc[0]))
        lefts.append(float(after.index[0]))
        bottoms.append(float(mean.min()))
        highest = max(highest, float(mean.max()))
    if not tops:
        return None
    top = max(tops) * 1.06
    return (min(lefts) / 1.25, min(bottoms) / 1.06, top) if top < highest else None


def plot_learning_curves(spec: TableSpec, curves: dict[str, list[pd.Series]], title: str = "",
                         measured: dict[str, str] | None = None, x: str = "step") -> Figure:
    """Best-so-far validation PPL against ``x`` (the curves' index, a :data:`CURVE_AXES` key; log scale
    for tokens and windows, which differ by orders of magnitude between rows); one panel per row group
    (titled with the paper's group and, from ``measured``, what the runs actually used), one line per row. A
    panel leaves out the first evaluations' transient where :func:`focused_limits` says so, and its PPL axis's
    label says it did."""
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
        drawn, means = 0, []
        for row in spec.rows:
            if row.group != group or row.id not in curves:
                continue
            mean = _mean_curve(curves[row.id])
            means.append(mean)
            n = len(curves[row.id])
            # A marker and dash pattern per line: rows with identical curves (same network, same
            # init) stay visible on top of each other.
            ax.plot(mean.index, mean.values, marker=MARKERS[drawn % len(MARKERS)], markersize=3.5,
                    linestyle=LINESTYLES[drawn % len(LINESTYLES)], linewidth=1.3, markerfacecolor="none",
                    label=row.label + (f" (n={n})" if n > 1 else ""))
            drawn += 1
        note = (measured or {}).get(group)
        ax.set_title(f"paper rows: {group}" + (f"\n({note})" if note else ""), fontsize=10)
        ax.set_xlabel(CURVE_AXES[x])
        ax.set_ylabel("best-so-far validation PPL")
        if drawn:
            ax.set_yscale("log")
            focus = focused_limits(means)
            if focus is not None:  # the lines' first evaluations lie above and left of the axes
                ax.set_ylim(*focus[1:])
                ax.set_ylabel(f"best-so-far validation PPL\n(from {FOCUS_AFTER:.0%} of training on)")
            _log_ticks(ax, "y")
            if x != "step":
                ax.set_xscale("log")
                if focus is not None:
                    ax.set_xlim(left=focus[0])
                _log_ticks(ax, "x", unit="count")
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
    """Training tokens/s per row: measured (solid) beside published (hatched), log scale. The legend names
    the machine of each side (the recorded devices; ``spec.paper_device``): the two are rarely the same."""
    ids = [r.id for r in spec.rows]
    measured = [_measured(agg, i, "tokens_per_sec") for i in ids]
    has_tok = any(c.key == "tok_s" and c.published for c in spec.columns)
    paper = [paper_value(pubs, spec.name, i, "tok_s") if has_tok else None for i in ids]
    names = _point_names(spec, ids)  # the row's group where two rows share a model name (T=1024 / T=2048)
    tags = _machine_tags(agg, ids)
    ticks = [(names[r.id] if len(ids) <= 8 else r.id) + tags[r.id] for r in spec.rows]
    longest = max(map(len, ticks), default=0)  # the rotated tick labels' room below the bars
    fig = Figure(figsize=(max(6.0, 0.45 * len(ids) + 2), 3.4 + 0.045 * longest), layout="constrained")
    ax = fig.subplots()
    x = list(range(len(ids)))
    width = 0.4
    here = measured_devices(agg)
    ax.bar([i - width / 2 for i in x], [v or 0 for v in measured], width, color="tab:blue",
           label=f"measured: {here}" if here else "measured")
    if any(p is not None for p in paper):
        ax.bar([i + width / 2 for i in x], [p or 0 for p in paper], width, color="white", edgecolor="tab:gray",
               hatch="//", label=f"paper: {spec.paper_device}" if spec.paper_device else "paper")
    for i, row_id, v in zip(x, ids, measured):
        if v is None:
            state = agg.at[row_id, "status"] if row_id in agg.index else "missing"
            ax.text(i - width / 2, 0.02, "not measured" if state == "ok" else state, rotation=90, ha="center",
                    va="bottom", fontsize=6, color="tab:red", transform=ax.get_xaxis_transform())
    ax.set_xticks(x, ticks, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("training tokens / s")
    values = [v for v in measured if v] + [p for p in paper if p]
    # A log axis where the values span a decade or more; a linear one from zero otherwise, where a log axis
    # would start just under the smallest bar and make a 10% difference look like a factor.
    log = bool(values) and max(values) / min(values) >= 10
    if values:
        if log:
            ax.set_yscale("log")
        # Headroom above the tallest bar for the legend, which names the machines.
        ax.set_ylim(bottom=None if log else 0, top=max(values) * (8 if log else 1.35))
        if log:
            _log_ticks(ax, "y", unit="count")
        else:
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _count_text(v)))
        for i, v in zip(x, measured):
            if v:
                ax.annotate(_count_text(v), (i - width / 2, v), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6)
    else:
        _empty_note(ax, "no throughput recorded")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or f"{spec.name}: training throughput", fontsize=10 if "\n" not in title else 9)
    return fig


def _machine_tags(agg: pd.DataFrame, row_ids: list[str]) -> dict[str, str]:
    """``{row id: " [its machine]"}`` where the measured rows ran on more than one machine (rows finished on
    different GPUs, whose tokens/s do not compare), the machine's name without its software; "" for every row
    otherwise."""
    machines = {i: row_machines(agg, i) for i in row_ids}
    if len({m for ms in machines.values() for m in ms}) <= 1:
        return dict.fromkeys(row_ids, "")
    return {i: f" [{' + '.join(map(hardware_of, ms))}]" if ms else "" for i, ms in machines.items()}


def _point_names(spec: TableSpec, row_ids: list[str]) -> dict[str, str]:
    """Model name per row, with the row's group added where two plotted rows share a name."""
    rows = [spec.row(i) for i in row_ids]
    shared = {r.label for r in rows if sum(o.label == r.label for o in rows) > 1}
    return {r.id: f"{r.label} ({r.group})" if r.label in shared else r.label for r in rows}


def _log_ticks(ax: Any, axis: str, unit: str = "") -> None:
    """Plain numbers on a log axis (``200``, ``3k``, ``1.2M``), at 1-2-5 steps (decades past a factor of 1,000);
    at finer steps (30, 40, 60 …) when the axis spans less than a factor of 20 (x: 5), and finer again (250, 350)
    below a factor of 4, so a reader can read values between the labels. Call it after the axis limits are set."""
    from matplotlib.ticker import LogLocator, NullFormatter

    def fmt(v: float, _pos: Any = None) -> str:
        return _count_text(v) if unit == "count" else f"{v:g}"

    target = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    span = hi / max(lo, 1e-300)
    # Decades only past a factor of 1,000: 1-2-5 labels over four or more decades run into each other. The
    # finer steps only where the labels fit: on the y axis, and on the wider x labels below a factor of 5.
    if span >= 1e3:
        subs: tuple[float, ...] = (1.0,)
    elif span >= (5 if axis == "x" else 20):
        subs = (1.0, 2.0, 5.0)
    elif span >= 4:
        subs = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
    else:
        subs = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
    target.set_major_locator(LogLocator(base=10, subs=subs))
    target.set_major_formatter(FuncFormatter(fmt))
    target.set_minor_formatter(NullFormatter())


SPEED_QUALITY_PANEL_ROWS = 10
"""A table with more plotted rows than this gets one speed-vs-quality panel per row group (sweeps-41m's 29
rows on one axis bury their labels in each other)."""


def _speed_quality_points(spec: TableSpec, rows: list, agg: pd.DataFrame, pubs: dict[str, pd.DataFrame]):
    """``(row id, measured (tok/s, PPL) or None, paper (tok/s, PPL) or None)`` of the rows with any point."""
    has_tok = any(c.key == "tok_s" and c.published for c in spec.columns)
    points: list[tuple[str, tuple[float, float] | None, tuple[float, float] | None]] = []
    for row in rows:
        tok, ppl = _measured(agg, row.id, "tokens_per_sec"), _measured(agg, row.id, "best_ppl")
        mine = (tok, ppl) if tok and ppl else None
        paper = None
        if has_tok:
            ptok, pppl = paper_value(pubs, spec.name, row.id, "tok_s"), paper_value(pubs, spec.name, row.id, "best_ppl")
            paper = (ptok, pppl) if ptok and pppl else None
        if mine or paper:
            points.append((row.id, mine, paper))
    return points


def _speed_quality_panel(ax: Any, spec: TableSpec, points: list, legend: bool, agg: pd.DataFrame) -> list:
    """Draw one panel; returns its point labels (placed once the figure's layout is final)."""
    from matplotlib import colormaps

    from paper_tables.labels import PointLabel

    names = _point_names(spec, [p[0] for p in points])
    tags = _machine_tags(agg, [p[0] for p in points])
    colors = colormaps["tab10"].colors
    labels: list[PointLabel] = []
    for k, (row_id, mine, paper) in enumerate(points):
        color, marker = colors[k % len(colors)], MARKERS[k % len(MARKERS)]
        if mine:
            ax.scatter(*mine, s=36, color=color, marker=marker, zorder=3)
            labels.append(PointLabel(*mine, names[row_id] + tags[row_id], color))
        if paper:
            ax.scatter(*paper, s=36, facecolors="white", edgecolors=color, marker=marker, linewidths=1.2, zorder=3)
            labels.append(PointLabel(*paper, f"{names[row_id]} (paper)", color))
        if mine and paper:
            ax.plot([mine[0], paper[0]], [mine[1], paper[1]], linestyle=(0, (3, 3)), linewidth=0.7, color=color,
                    alpha=0.6, zorder=1)
    ax.set_xlabel("training tokens / s")
    ax.set_ylabel("best validation PPL")
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [p[0] for _, m, q in points for p in (m, q) if p]
    ys = [p[1] for _, m, q in points for p in (m, q) if p]
    # Room for labels: a factor of 3 on each side of x, 15% below and 35% above in y (a cluster of
    # near-coincident points stacks its labels upwards).
    ax.set_xlim(min(xs) / 3.0, max(xs) * 3.0)
    ax.set_ylim(min(ys) / 1.15, max(ys) * 1.35)
    _log_ticks(ax, "x", unit="count")
    _log_ticks(ax, "y")
    if legend:  # each side's machine, as the throughput figure's legend names them: the x axis is tokens/s
        here = measured_devices(agg)
        ax.scatter([], [], s=36, color="0.35", label=f"measured (filled): {here}" if here else "measured (filled)")
        ax.scatter([], [], s=36, facecolors="white", edgecolors="0.35",
                   label=f"paper (hollow): {spec.paper_device}" if spec.paper_device else "paper (hollow)")
        ax.legend(fontsize=8, loc="best")
    return labels


def plot_speed_quality(spec: TableSpec, agg: pd.DataFrame, pubs: dict[str, pd.DataFrame], title: str = "") -> Figure:
    """Tokens/s (x, log) vs best PPL (y, log), one colour and marker per model: the measured point filled,
    the paper's hollow, joined by a dashed line; every point labelled with the model's name. Past
    :data:`SPEED_QUALITY_PANEL_ROWS` plotted rows, one panel per row group."""
    from paper_tables.labels import place_labels

    points = _speed_quality_points(spec, list(spec.rows), agg, pubs)
    if len(points) > SPEED_QUALITY_PANEL_ROWS:
        groups: dict[str, list] = {}
        for row in spec.rows:
            groups.setdefault(row.group, []).append(row)
        panels = [(g, p) for g, rows in groups.items() if (p := _speed_quality_points(spec, rows, agg, pubs))]
    else:
        panels = [("", points)]
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols) if panels else 1
    fig = Figure(figsize=(7.2 * ncols, 5.0 * nrows), layout="constrained")
    axes = fig.subplots(nrows, max(ncols, 1), squeeze=False).ravel()
    if not points:
        axes[0].set_title(title or f"{spec.name}: speed vs quality", fontsize=10)
        _empty_note(axes[0], "no measured rows")
        return fig
    placed = []
    for k, (group, pts) in enumerate(panels):
        placed.append((axes[k], _speed_quality_panel(axes[k], spec, pts, legend=k == 0, agg=agg)))
        if group:
            axes[k].set_title(f"paper rows: {group}", fontsize=10)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if len(panels) > 1:
        fig.suptitle(title or f"{spec.name}: speed vs quality", fontsize=11)
    else:
        axes[0].set_title(title or f"{spec.name}: speed vs quality", fontsize=10)
    fig.get_layout_engine().execute(fig)  # final axes positions before labels are placed in pixels
    for ax, labels in placed:
        for text in place_labels(fig, ax, labels):
            text.set_in_layout(False)
    return fig


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def plot_sweep(df: pd.DataFrame, x: str, y: str = "best_ppl", title: str = "", ylabel: str = "",
               series: Sequence[str] = ()) -> Figure:
    """``y`` (mean ± std over runs; its axis labelled ``ylabel``, default ``y``) vs the swept value ``x``, one line
    per combination of the columns ``series`` (the other settings the runs differ in; a legend names each).

    ``df`` holds one line per completed run with columns ``x`` and ``y`` (e.g. from
    :func:`paper_tables.sweep.load_sweep`); rows where ``y`` is absent are ignored. Numeric sweep values
    are placed on a numeric axis (log base 2 when they span a factor of 8 or more) and joined by lines, others as
    categories, as points.
    """
    if x not in df.columns or y not in df.columns or not set(series) <= set(df.columns):
        raise KeyError(f"plot_sweep needs columns {x!r}, {y!r} and {list(series)}; the frame has {list(df.columns)}")
    data = df[[x, y, *series]].copy()
    data[y] = pd.to_numeric(data[y], errors="coerce")
    data = data.dropna(subset=[y])
    data = data[data[x].map(lambda v: v is not None)]
    fig = Figure(figsize=(5.6, 4.0), layout="constrained")
    ax = fig.subplots()
    if data.empty:
        _empty_note(ax, f"no completed run with {y}")
    else:
        data = data.assign(_x=data[x].map(lambda v: v if _is_number(v) else str(v)),
                           _series=[", ".join(f"{k}={v}" for k, v in zip(series, vals))
                                    for vals in zip(*(data[k] for k in series))] if series else "")
        xs = sorted(set(data["_x"]), key=lambda v: (0, v) if _is_number(v) else (1, str(v)))
        numeric = all(_is_number(v) for v in xs)
        where = {v: (v if numeric else i) for i, v in enumerate(xs)}
        # The lines in the order of their settings' values (numbers as numbers: 64 before 32768).
        order = {name: tuple((0, v) if _is_number(v) else (1, str(v)) for v in (part[k].iloc[0] for k in series))
                 for name, part in data.groupby("_series")}
        for line, name in enumerate(sorted(order, key=order.get)):
            part = data[data["_series"] == name]
            stats = part.groupby("_x", sort=True)[y].agg(["mean", "std", "count"])
            pos = [where[v] for v in stats.index]
            # Categories (profiles, corpora) have no order between them: points, not a line through them.
            ax.errorbar(pos, stats["mean"], yerr=stats["std"].fillna(0.0), marker="o", capsize=3,
                        linestyle="-" if numeric else "none", label=name or None)
            for p, (m, n) in zip(pos, zip(stats["mean"], stats["count"])):  # stacked where lines meet
                ax.annotate(f"n={int(n)}", (p, m), fontsize=6, xytext=(3, 3 + 7 * line), textcoords="offset points")
        if series:
            ax.legend(fontsize=7)
        ax.margins(x=0.08)  # room for the last point's run count
        if numeric:
            positive = [v for v in xs if v > 0]
            if len(positive) == len(xs) and max(xs) / min(xs) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
        else:
            ax.set_xticks(list(range(len(xs))), [str(v) for v in xs])
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title or f"{y} vs {x}", fontsize=10 if "\n" not in title else 7)
    return fig
