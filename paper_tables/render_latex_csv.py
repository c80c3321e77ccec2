"""The :class:`~paper_tables.render.Report` of a reproduced table as a LaTeX fragment and as CSV files: the same
cells, captions, claims and deviations as its Markdown (:mod:`paper_tables.render`)."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from paper_tables.published import published_value
from paper_tables.record_notes import claim_detail
from paper_tables.render import (
    Report,
    caption_lines,
    definition_lines,
    deviation_lines,
    measured_number,
    report_headlines,
    row_dataset,
    row_seq_len,
    show_dataset,
    show_seq_len,
    table_grid,
    verdict_published,
)

# ---------------------------------------------------------------------------------------------
# LaTeX
# ---------------------------------------------------------------------------------------------

_TEX_ESCAPES = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
    "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "—": "--",
    "·": r"$\cdot$", "≤": r"$\le$", "→": r"$\to$", "<": r"\textless{}", ">": r"\textgreater{}",
}


def tex_escape(text: str) -> str:
    """Escape LaTeX special characters; map ±, —, ·, ->, <= and < > to their LaTeX forms; drop backticks."""
    text = str(text).replace("`", "").replace("->", "→").replace("<=", "≤")
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in text)


def _tex_tabular(header: list[str], body: list[list[str]], align: str) -> list[str]:
    lines = [rf"\begin{{tabular}}{{@{{}}{align}@{{}}}}", r"\toprule",
             " & ".join(tex_escape(h) for h in header) + r" \\", r"\midrule"]
    lines += [" & ".join(tex_escape(c) for c in row) + r" \\" for row in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return lines


def render_latex(report: Report) -> str:
    """A LaTeX fragment (booktabs, graphicx): the table, the claims table and the deviations list."""
    spec = report.spec
    header, body = table_grid(report)
    n_text = 1 + int(show_dataset(spec)) + int(show_seq_len(spec))
    align = "l" * n_text + "r" * (len(header) - n_text - 2) + "ll"
    caption = " ".join(caption_lines(report))
    out = [tex_escape(line.replace("**", "")) + r"\par" for line in report_headlines(report)]
    out += [r"\begin{table}[!htbp]", r"\centering", rf"\caption{{{tex_escape(caption)}}}",
            rf"\label{{tab:repro-{spec.name}}}", r"\resizebox{\linewidth}{!}{%"]
    out += _tex_tabular(header, body, align)
    out += ["}", r"\end{table}", "", r"\begin{small}"]
    out += [tex_escape(line) + r"\par" for line in definition_lines(report)]
    out += [r"\end{small}", ""]
    if report.verdicts:
        rows = [[v.claim.text, v.claim.metric, verdict_published(report, v), v.measured]
                for v in report.verdicts]
        out += [r"\begin{table}[!htbp]", r"\centering",
                rf"\caption{{Claims of {tex_escape(spec.label or spec.name)}: verdicts on the paper's and on the "
                r"measured numbers.}", rf"\label{{tab:repro-{spec.name}-claims}}", r"\resizebox{\linewidth}{!}{%"]
        out += _tex_tabular(["Claim", "Metric", "Paper", "Measured"], rows, "llll")
        out += ["}", r"\end{table}", ""]
    out += [r"\paragraph{Deviations from the paper's settings.}", r"\begin{itemize}"]
    out += [rf"\item {tex_escape(line)}" for line in deviation_lines(report)]
    out += [r"\end{itemize}", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------------

def _num(value: float | None) -> str:
    if value is None:
        return ""
    return "nan" if math.isnan(value) else repr(float(value))


def render_csv(report: Report) -> str:
    """One line per row: ids, status, then ``<key>_paper``, ``<key>_paper_std``, ``<key>_ours``,
    ``<key>_ours_std`` per column, all in the paper's unit for that column (see the spec), then the
    learning bar, unigram PPL, profiles, deviations, error, and for a missing row what the runs of it that were set
    aside ran with (``paper_tables.collect.ran_with``, ``;`` between distinct sets)."""
    spec = report.spec
    fields = ["row", "experiment", "model", "dataset", "seq_len", "status", "n_runs"]
    for col in spec.columns:
        fields += [f"{col.key}_paper", f"{col.key}_paper_std", f"{col.key}_ours", f"{col.key}_ours_std"]
    fields += ["learning_bar", "unigram_ppl", "profiles", "deviations", "error", "set_aside"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    pub = report.published
    for row in spec.rows:
        line = report.agg.loc[row.id]
        rec: dict[str, Any] = {
            "row": row.id, "experiment": row.experiment, "model": row.display,
            "dataset": row_dataset(report, row), "seq_len": row_seq_len(report, row),
            "status": line["status"], "n_runs": int(line["n_runs"]),
            "learning_bar": line["learning_bar"], "unigram_ppl": _num(line["unigram_ppl"]),
            "profiles": ";".join(line["profiles"] or []), "deviations": "; ".join(line["deviations"] or []),
            "error": line["error"], "set_aside": "; ".join(line["set_aside"] or []),
        }
        for col in spec.columns:
            p = published_value(pub, row.published_key, col.published) if pub is not None else None
            ps = published_value(pub, row.published_key, col.published_std) if pub is not None else None
            m, ms = measured_number(report, row, col)
            rec.update({f"{col.key}_paper": _num(p), f"{col.key}_paper_std": _num(ps),
                        f"{col.key}_ours": _num(m), f"{col.key}_ours_std": _num(ms)})
        writer.writerow(rec)
    return buf.getvalue()


def render_claims_csv(report: Report) -> str:
    """One line per claim: id, text, metric, operator, rows, verdicts and measured values."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["claim", "text", "metric", "op", "factor", "left", "right", "paper_verdict",
                     "measured_verdict", "measured_values", "paper_values", "source"])
    for v in report.verdicts:
        c = v.claim
        writer.writerow([c.id, c.text, c.metric, c.op, c.factor, " ".join(c.left), " ".join(c.right),
                         verdict_published(report, v), v.measured, claim_detail(report, v), v.published_detail,
                         c.source])
    return buf.getvalue()
