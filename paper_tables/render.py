"""Render a reproduced table: published and measured values side by side, in Markdown (LaTeX and CSV:
:mod:`paper_tables.render_latex_csv`, from the same cells).

Every renderer takes a :class:`Report` (spec + aggregated runs + published numbers + claim
verdicts + run context) and returns text. A row without completed runs shows ``missing``,
``failed`` (with the reason in the status column) or ``running`` in its measured cells; nothing is
ever invented. Besides the table a report lists the claims with their verdicts (on the paper's numbers
and on the measured ones), each row's deviations from the paper's settings (as recorded by the runs,
plus the differences this module can see in the records: steps, batch, T, parameters, profile,
dataset) and the learning bar (measured best PPL <= validation unigram PPL / 3). A row whose record failed
its check shows ``damaged`` with the file and the mismatch; tokens/s measured while other training processes
ran on the machine carry ``(shared)``, and the report lists those runs, the records it could not verify
(written before record digests) and the runs of the table's rows that are not a row's run (sweep jobs, runs
with other settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from paper_tables.claims import NOT_MEASURED, Verdict, claim_is_on_suite_rows
from paper_tables.collect import LEARNING_BAR_DIVISOR, measured_devices, measured_machines
from paper_tables.headline import headline_lines
from paper_tables.published import published_value
from paper_tables.record_notes import SHARED_MARK, claim_detail, record_lines
from paper_tables.spec_types import ColumnSpec, RowSpec, TableSpec

DATASET_IDS = {"WikiText-2": "wikitext2", "WikiText-103": "wikitext103", "PG-19": "pg19"}
"""Printed dataset name -> dataset id used in run records."""

PROTOCOL_TEXT = {
    "reference": "reference (random validation windows resampled at each evaluation; best = minimum over "
                 "evaluations, as the paper)",
    "full": "full (one deterministic pass over the whole validation split; exact token-weighted PPL)",
}

MISSING_CELL = {"missing": "missing", "failed": "failed", "running": "running", "damaged": "damaged"}

DASH = "—"


@dataclass
class Report:
    """Everything one rendered table needs.

    ``agg``: :func:`paper_tables.collect.aggregate` of the table; ``published``: its published frame
    (``None`` when the table has no published numbers); ``verdicts``: claim verdicts; ``scale``,
    ``backend``, ``profile_filter``: the selection; ``runs_root``: where runs were read;
    ``n_records``: run records read for this table; ``unattributed``: ``"path: reason"`` lines of
    records that belong to no spec row; ``extra_runs``: lines naming the runs of the table's rows that are
    not a row's run (:func:`paper_tables.collect.run_role`).
    """

    spec: TableSpec
    agg: pd.DataFrame
    published: pd.DataFrame | None
    verdicts: list[Verdict]
    scale: str
    backend: str
    runs_root: str = ""
    profile_filter: str | None = None
    n_records: int = 0
    unattributed: list[str] = field(default_factory=list)
    extra_runs: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------

MIN_SIGNIFICANT = 3
"""Measured values keep at least this many significant digits (a reduced-scale throughput of 0.0213M
tok/s would otherwise print as 0.02M)."""


def _decimals(value: float, col: ColumnSpec, significant: int | None) -> int:
    """Decimals for ``value``: the column's, raised (for columns printed with decimals) until
    ``significant`` significant digits show."""
    if significant is None or col.decimals == 0 or value == 0 or not math.isfinite(value):
        return col.decimals
    needed = significant - 1 - math.floor(math.log10(abs(value)))
    return min(max(col.decimals, needed), 8)


def fmt_value(value: float | None, col: ColumnSpec, suffix: bool = True, decimals: int | None = None) -> str:
    """``value`` (already in the paper's unit) with the column's digits (or ``decimals``), thousands
    separators and suffix."""
    if value is None:
        return DASH
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    digits = col.decimals if decimals is None else decimals
    text = f"{value:,.{digits}f}" if col.thousands else f"{value:.{digits}f}"
    return text + (col.suffix if suffix else "")


def _with_std(value: float | None, std: float | None, col: ColumnSpec, significant: int | None = None) -> str:
    if value is None:
        return DASH
    digits = _decimals(value, col, significant) if not (isinstance(value, float) and math.isnan(value)) else 0
    if std is None:
        return fmt_value(value, col, decimals=digits)
    return (f"{fmt_value(value, col, suffix=False, decimals=digits)} ± "
            f"{fmt_value(std, col, suffix=False, decimals=digits)}{col.suffix}")


def _int_text(value: Any) -> str:
    return str(int(round(float(value)))) if value is not None and not _isnan(value) else "?"


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def published_cell(report: Report, row: RowSpec, col: ColumnSpec) -> str:
    """The printed value of ``col`` for ``row`` (``—`` when the paper has none)."""
    pub = report.published
    if pub is None or row.published_key is None:
        return DASH
    value = published_value(pub, row.published_key, col.published)
    std = published_value(pub, row.published_key, col.published_std)
    text = _with_std(value, std, col)
    if value is not None and col.batch:
        batch = published_value(pub, row.published_key, col.batch)
        if batch is not None:
            text += f" ({int(batch)})"
        alt = published_value(pub, row.published_key, col.alt)
        alt_batch = published_value(pub, row.published_key, col.alt_batch)
        if alt is not None:
            text += f" / {fmt_value(alt, col)}" + (f" ({int(alt_batch)})" if alt_batch is not None else "")
    return text


def measured_number(report: Report, row: RowSpec, col: ColumnSpec) -> tuple[float | None, float | None]:
    """Measured mean and std of ``col`` for ``row`` in the paper's unit (``None`` when absent)."""
    line = report.agg.loc[row.id]
    if line["status"] != "ok":
        return None, None
    if col.metric == "n_runs":
        return float(line["n_runs"]), None
    value, std = line.get(col.metric), line.get(f"{col.metric}_std")
    if value is None:
        return None, None
    return float(value) * col.scale, (None if std is None else float(std) * col.scale)


def measured_cell(report: Report, row: RowSpec, col: ColumnSpec) -> str:
    """Measured value of ``col`` (mean ± std over seeds), or the row's state when not measured."""
    line = report.agg.loc[row.id]
    if line["status"] != "ok":
        return MISSING_CELL[line["status"]]
    value, std = measured_number(report, row, col)
    if value is None:
        return "not recorded"
    if col.metric == "n_runs":
        return str(int(value))
    text = _with_std(value, std if line["n_runs"] > 1 and col.spread else None, col, significant=MIN_SIGNIFICANT)
    if col.batch and line.get("batch_size") is not None:
        text += f" ({_int_text(line['batch_size'])})"
    if col.metric == "tokens_per_sec" and line.get("shared_machine"):
        text += SHARED_MARK
    return text


def row_dataset(report: Report, row: RowSpec) -> str:
    if row.dataset:
        return row.dataset
    found = report.agg.loc[row.id, "datasets"]
    return ", ".join(found) if found else DASH


def row_seq_len(report: Report, row: RowSpec) -> str:
    if row.seq_len is not None:
        return str(row.seq_len)
    value = report.agg.loc[row.id, "seq_len"]
    return _int_text(value) if value is not None else DASH


def show_dataset(spec: TableSpec) -> bool:
    return len(spec.datasets) > 1 or any(not r.dataset for r in spec.rows)


def show_seq_len(spec: TableSpec) -> bool:
    return len({r.seq_len for r in spec.rows}) > 1 or any(r.seq_len is None for r in spec.rows)


def _learning_cell(report: Report, row: RowSpec) -> str:
    line = report.agg.loc[row.id]
    if line["status"] != "ok":
        return DASH
    bar = line["learning_bar"]
    if bar == "below bar" and bool(line.get("paper_budget", False)):
        return f"{bar} (unigram {float(line['unigram_ppl']):.1f}; not applied at the paper's budget)"
    if bar in ("meets", "below bar"):
        return f"{bar} (unigram {float(line['unigram_ppl']):.1f})"
    return bar


def table_grid(report: Report) -> tuple[list[str], list[list[str]]]:
    """Header and body cells (plain text) of the side-by-side table."""
    spec = report.spec
    header = ["Model"]
    if show_dataset(spec):
        header.append("Dataset")
    if show_seq_len(spec):
        header.append("T")
    for col in spec.columns:
        if col.published is not None and spec.has_published:
            header.append(f"{col.header} (paper)")
        header.append(f"{col.header} (ours)")
    header += ["Learning bar", "Status"]
    body = []
    for row in spec.rows:
        cells = [row.display]
        if show_dataset(spec):
            cells.append(row_dataset(report, row))
        if show_seq_len(spec):
            cells.append(row_seq_len(report, row))
        for col in spec.columns:
            if col.published is not None and spec.has_published:
                cells.append(published_cell(report, row, col))
            cells.append(measured_cell(report, row, col))
        cells += [_learning_cell(report, row), report.agg.loc[row.id, "status_text"]]
        body.append(cells)
    return header, body


# ---------------------------------------------------------------------------------------------
# Caption, deviations, notes
# ---------------------------------------------------------------------------------------------

def _collected(report: Report, key: str) -> list[str]:
    out: list[str] = []
    for values in report.agg[key]:
        for v in values or []:
            if str(v) not in out:
                out.append(str(v))
    return out


def devices_text(report: Report) -> str:
    """The devices the report's runs recorded, each with its rows where there are several (throughput and memory
    columns depend on it); ``none recorded`` without any."""
    devices = _collected(report, "devices")
    if len(devices) > 1:
        # Rows trained on different machines (or finished at different times on different GPUs): say which ran
        # where, since throughput and memory columns depend on it.
        rows = list(zip(report.agg["row"], report.agg["devices"], strict=True))
        devices = [f"{d} ({', '.join(f'`{r}`' for r, ds in rows if d in (ds or []))})" for d in devices]
    return " / ".join(devices) or "none recorded"


def precision_text(report: Report) -> str:
    """``Precision: fp32 (float32 matmuls: highest) · Seed(s): 1234``: the training precisions, the float32 matrix
    product precision (docs/SPEC.md §9; records before it was recorded leave it out) and the seeds of the report's
    completed runs (every distinct value)."""
    precisions = ", ".join(_collected(report, "precisions")) or "none recorded"
    matmul = [m for m in _collected(report, "matmul_precisions") if m]
    seeds = ", ".join(_collected(report, "seeds")) or "none"
    return (f"Precision: {precisions}" + (f" (float32 matmuls: {', '.join(matmul)})" if matmul else "")
            + f" · Seed(s): {seeds}")


def caption_lines(report: Report) -> list[str]:
    """The report's caption: source table, selection, profiles, protocols, devices, precision and seeds."""
    spec = report.spec
    profiles = _collected(report, "profiles")
    protocols = _collected(report, "protocols")
    paper_profiles = sorted({r.profile for r in spec.rows})
    proto_text = "; ".join(PROTOCOL_TEXT.get(p, p) for p in _expand_protocols(protocols)) or "none recorded"
    source = f"paper table `{spec.label}`" if spec.label else "not a paper table"
    lines = [
        f"Reproduces: {source}: {spec.title}.",
        f"Scale: {report.scale} · Backend: {report.backend} · Profile(s) measured: "
        f"{', '.join(profiles) or 'none'} (paper's rows: {', '.join(paper_profiles)})"
        + (f" · profile filter: {report.profile_filter}" if report.profile_filter else ""),
        f"Evaluation protocol: {proto_text}. Paper values use the reference protocol.",
        f"Device(s): {devices_text(report)} · Runs read: {report.n_records} record(s) under `{report.runs_root}`.",
        f"{precision_text(report)}.",
    ]
    return lines


def definition_lines(report: Report) -> list[str]:
    """The paper's setting for the table and the definitions behind the columns."""
    return [
        f"Paper's setting: {report.spec.setting}.",
        "Accuracy: next-token rows use the argmax of the output (mixture) distribution; full-AR rows use the "
        "argmax of the parametric head (the paper's full-AR definition). Measured values are means over "
        "completed seeds (± sample std when n > 1).",
        f"Learning bar: 'meets' when the measured best PPL <= validation unigram PPL / {LEARNING_BAR_DIVISOR:g}; "
        "'below bar' means the model did not learn enough at this budget for its numbers to say anything about "
        "the paper's claims, so a perplexity or accuracy claim on such a row reads 'not measured' (its values "
        "are still shown); throughput and memory claims do not depend on it. Runs at scale=paper train the "
        "paper's own budget, from which the paper made its claims, so there the bar is shown and not applied"
        + _paper_models_against_the_bar(report) + ".",
    ]


def _paper_models_against_the_bar(report: Report) -> str:
    """Where the report has rows trained at the paper's budget: how many of the paper's own published best PPLs
    the bar would fail (the reason it is not applied there), e.g. ``: the paper's own models would fail it too (5
    of 7 published best PPLs are above 754.8 / 3 = 251.6)``; ``""`` otherwise."""
    agg, pub = report.agg, report.published
    if pub is None or "paper_budget" not in agg.columns:
        return ""
    unigrams = {round(float(u), 1) for u, b in zip(agg["unigram_ppl"], agg["paper_budget"])
                if bool(b) and u is not None and not _isnan(u)}
    if len(unigrams) != 1:  # no paper-budget row, or rows of different validation splits
        return ""
    unigram = unigrams.pop()
    bar = unigram / LEARNING_BAR_DIVISOR
    published = [v for row in report.spec.rows if row.published_key is not None
                 and (v := published_value(pub, row.published_key, "best_ppl")) is not None]
    above = sum(v > bar for v in published)
    if not above:
        return ""
    return (f": the paper's own models would fail it too ({above} of {len(published)} published best PPLs are above "
            f"{unigram:,.1f} / {LEARNING_BAR_DIVISOR:g} = {bar:,.1f})")


def _expand_protocols(protocols: list[str]) -> list[str]:
    out: list[str] = []
    for p in protocols:
        for q in (("reference", "full") if p == "both" else (p,)):
            if q not in out:
                out.append(q)
    return out


def detected_differences(report: Report, row: RowSpec) -> list[str]:
    """Differences from the paper's settings visible in the records of ``row``."""
    line = report.agg.loc[row.id]
    if line["status"] != "ok":
        return []
    out = []

    def num(key: str) -> float | None:
        v = line.get(key)
        return None if v is None or _isnan(v) else float(v)

    steps = num("steps_planned")
    if row.paper_steps is not None and steps is not None and int(steps) != row.paper_steps:
        out.append(f"steps {row.paper_steps} -> {int(steps)}")
    pub = report.published
    batch = num("batch_size")
    paper_batch = published_value(pub, row.published_key, "batch") if pub is not None else None
    if paper_batch is not None and batch is not None and int(batch) != int(paper_batch):
        out.append(f"batch {int(paper_batch)} -> {int(batch)}")
    seq = num("seq_len")
    if row.seq_len is not None and seq is not None and int(seq) != row.seq_len:
        out.append(f"T {row.seq_len} -> {int(seq)}")
    params = num("params")
    exact = published_value(pub, row.published_key, "params_exact") if pub is not None else None
    if exact is not None and params is not None and int(params) != int(exact):
        out.append(f"params {int(exact):,} -> {int(params):,}")
    profiles = line["profiles"] or []
    if profiles and any(p != row.profile for p in profiles):
        out.append(f"profile {row.profile} -> {', '.join(profiles)}")
    want = DATASET_IDS.get(row.dataset)
    datasets = line["datasets"] or []
    if want and datasets and any(d != want for d in datasets):
        out.append(f"dataset {want} -> {', '.join(datasets)}")
    return out


def deviation_lines(report: Report) -> list[str]:
    """One bullet per measured row: recorded deviations, then the detected differences (those not
    already recorded in the same words). Deviations shared by every measured row are listed once first."""
    measured = [r for r in report.spec.rows if report.agg.loc[r.id, "status"] == "ok"]
    if not measured:
        return ["No measured rows."]
    per_row = {r.id: list(report.agg.loc[r.id, "deviations"] or []) for r in measured}
    common = [d for d in per_row[measured[0].id] if all(d in per_row[r.id] for r in measured)]
    lines = []
    if common and len(measured) > 1:
        lines.append("All measured rows: " + "; ".join(common))
    for r in measured:
        own = [d for d in per_row[r.id] if d not in common or len(measured) == 1]
        detected = [d for d in detected_differences(report, r)
                    if not any(rec.startswith(d) for rec in per_row[r.id])]
        parts = []
        if own:
            parts.append("; ".join(own))
        if detected:
            parts.append("detected from the records: " + "; ".join(detected))
        lines.append(f"`{r.id}` ({r.display}): " + (" · ".join(parts) if parts else "none beyond the above"))
    return lines


def note_lines(report: Report) -> list[str]:
    """Two machines, when the measured rows ran elsewhere than the paper's; then row notes from the spec and
    the published CSV."""
    out = []
    here = measured_devices(report.agg)
    peak = ("Peak MB (ours) is the training process's peak: CUDA max_memory_allocated on a GPU, the process's peak "
            "RSS on a CPU.")
    if report.spec.paper_device and here and report.spec.paper_device not in here:
        ours = measured_machines(report.agg)
        if len(ours) == 1:
            out.append(f"Two machines: the paper's Tok/s and Peak MB come from {report.spec.paper_device}, ours from "
                       f"{here}. Compare ratios within a column, as the throughput claims do (one row against "
                       f"another on the same machine), not numbers across the two machines. {peak}")
        else:  # our column spans machines too: within it, only rows of one machine compare
            out.append(f"{len(ours) + 1} machines: the paper's Tok/s and Peak MB come from "
                       f"{report.spec.paper_device}, ours from {here} (the Device(s) line says which row ran on "
                       "which). Compare Tok/s and Peak MB only between rows that ran on the same machine, as the "
                       "throughput claims do (a claim whose rows ran on different machines reads 'not measured'), "
                       f"never across machines, ours included. {peak}")
    wall = next((c for c in report.spec.columns if c.metric == "wall_time_s" and c.published is None), None)
    if wall is not None:
        out.append(f"{wall.header} (ours): each row's whole run (its segments summed where it resumed): "
                   "compiling, the training steps, every evaluation and the full-split pass (the paper gives no "
                   "run times for this table).")
    for r in report.spec.rows:
        notes = [r.note] if r.note else []
        pub = report.published
        if pub is not None and r.published_key in pub.index:
            text = str(pub.at[r.published_key, "note"] or "")
            if text and text not in notes and not text.startswith("not in the paper"):
                notes.append(text)
        if notes:
            out.append(f"`{r.id}` ({r.display}): " + "; ".join(notes))
    return out


def report_headlines(report: Report) -> list[str]:
    """The headline verdict sentences of the report's table (Markdown emphasis included)."""
    return headline_lines(report.spec, {report.spec.name: report.agg}, report.verdicts)


def verdict_published(report: Report, v: Verdict) -> str:
    not_printed = not report.spec.has_published or claim_is_on_suite_rows(v.claim, report.spec)
    if not_printed and v.published == NOT_MEASURED:
        return "n/a (not in the paper)"
    return v.published


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------

def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md_escape(h) for h in header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in body]
    return lines


def render_markdown(report: Report) -> str:
    """The full report as Markdown: caption, table, claims, deviations, notes, unattributed runs."""
    spec = report.spec
    out = [f"# {spec.name}: {spec.title}", ""]
    out += [line + "\n" for line in report_headlines(report)]
    out += [f"- {line}" for line in caption_lines(report) + definition_lines(report)]
    out.append("")
    header, body = table_grid(report)
    out += _md_table(header, body)
    out += ["", "## Claims", ""]
    if report.verdicts:
        rows = [[v.claim.text, v.claim.metric, verdict_published(report, v), v.measured,
                 claim_detail(report, v)] for v in report.verdicts]
        out += _md_table(["Claim", "Metric", "Paper", "Measured", "Measured values"], rows)
    else:
        out.append("This table states no claims.")
    out += ["", "## Deviations from the paper's settings", ""]
    out += [f"- {line}" for line in deviation_lines(report)]
    notes = note_lines(report)
    if notes:
        out += ["", "## Notes", ""] + [f"- {line}" for line in notes]
    for heading, lines in record_lines(report):
        if lines:
            out += ["", f"## {heading}", ""] + [f"- {line}" for line in lines]
    if report.unattributed:
        out += ["", "## Run records not matched to a row", ""] + [f"- {line}" for line in report.unattributed]
    out.append("")
    return "\n".join(out)
