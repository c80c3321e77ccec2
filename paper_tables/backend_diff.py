"""One table measured on both backends, side by side: torch against JAX per row, with the difference.

``python -m paper_tables backends --table main-303m --scale cpu --runs outputs [--rows …] --out DIR`` writes
``<table>_<scale>_torch_vs_jax.{md,csv}``. Both sides come from :func:`paper_tables.pipeline.build_report`, so a
row's numbers are exactly the ones its per-backend table prints (seed means, the same claims).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from paper_tables.collect import hardware_of, row_machines
from paper_tables.pipeline import build_report
from paper_tables.render import Report, devices_text, precision_text

BACKEND_PAIR = ("torch", "jax")


def _value(report: Report, row_id: str, field: str) -> float | None:
    agg = report.agg
    if row_id not in agg.index or agg.at[row_id, "status"] != "ok":
        return None
    value = agg.at[row_id, field]
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(value: float | None, fmt: str) -> str:
    return "not measured" if _missing(value) else format(value, fmt)


def _diff_cell(diff: float | None, pct: float | None) -> str:
    return "not measured" if _missing(diff) else f"{diff:+.2f} ({pct:+.1f}%)"


def _diff(a: float | None, b: float | None) -> tuple[float | None, float | None]:
    """``b - a`` and its percentage of ``a`` (None where either side is missing)."""
    if a is None or b is None:
        return None, None
    return b - a, 100.0 * (b - a) / a


def comparison_frame(torch_report: Report, jax_report: Report) -> pd.DataFrame:
    """One line per row of the table: best and full-split PPL, tokens/s and seeds on each backend, the JAX −
    torch differences (absolute and % of torch) and the JAX / torch throughput ratio."""
    lines: list[dict[str, Any]] = []
    for row in torch_report.spec.rows:
        line: dict[str, Any] = {"row": row.id, "model": row.display, "profile": row.profile}
        for name, report in zip(BACKEND_PAIR, (torch_report, jax_report)):
            for field in ("best_ppl", "full_ppl", "tokens_per_sec", "n_runs"):
                line[f"{field}_{name}"] = _value(report, row.id, field)
            line[f"status_{name}"] = (report.agg.at[row.id, "status_text"] if row.id in report.agg.index
                                      else "missing")
        for field in ("best_ppl", "full_ppl"):
            line[f"{field}_diff"], line[f"{field}_diff_pct"] = _diff(line[f"{field}_torch"], line[f"{field}_jax"])
        # The throughput ratio compares the backends on one device: rows trained on two GPUs get none.
        devices = {name: sorted({hardware_of(m) for m in row_machines(report.agg, row.id)})
                   for name, report in zip(BACKEND_PAIR, (torch_report, jax_report))}
        line["devices_torch"], line["devices_jax"] = (" + ".join(devices[n]) for n in BACKEND_PAIR)
        one_device = len(set(devices["torch"]) | set(devices["jax"])) <= 1
        t, j = line["tokens_per_sec_torch"], line["tokens_per_sec_jax"]
        line["jax_over_torch_tokens_per_s"] = None if t is None or j is None or not one_device else j / t
        lines.append(line)
    return pd.DataFrame(lines, dtype=object)


def render_comparison_markdown(torch_report: Report, jax_report: Report, frame: pd.DataFrame) -> str:
    spec = torch_report.spec
    title = f"# {spec.name} at scale {torch_report.scale}: torch beside JAX"
    lines = [title, "",
             f"- Rows: {len(frame)}; profile per row as in the table; runs read under `{torch_report.runs_root}`",
             *(f"- {name}: Device(s): {devices_text(report)} · {precision_text(report)}"
               for name, report in (("torch", torch_report), ("JAX", jax_report))),
             "- Difference = JAX − torch (and its % of torch); both columns are what each backend's own rendered "
             "table prints (best PPL: reference protocol, minimum over evaluations; full-split: one deterministic "
             "pass). Both backends train on the same windows in the same order (the shared loop's sampler) but "
             "draw their initial weights and dropout masks from their own generators (torch's, `jax.random`), so "
             "a difference is one seed's init-to-init spread plus float-order effects; the backends' equality on "
             "equal weights is what `tests/test_cross_backend*.py` prove.",
             "",
             "| Model | Profile | Best PPL torch | Best PPL JAX | JAX − torch | Full-split torch | Full-split JAX "
             "| JAX − torch | tok/s torch | tok/s JAX | JAX / torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in frame.iterrows():
        best = _diff_cell(r["best_ppl_diff"], r["best_ppl_diff_pct"])
        full = _diff_cell(r["full_ppl_diff"], r["full_ppl_diff_pct"])
        ratio = _cell(r["jax_over_torch_tokens_per_s"], ".2f")
        if _missing(r["jax_over_torch_tokens_per_s"]) and r["devices_torch"] and r["devices_jax"] \
                and r["devices_torch"] != r["devices_jax"]:
            ratio = f"not comparable: {r['devices_torch']} / {r['devices_jax']}"
        lines.append(f"| {r['model']} | {r['profile']} | {_cell(r['best_ppl_torch'], '.2f')} | "
                     f"{_cell(r['best_ppl_jax'], '.2f')} | {best} | {_cell(r['full_ppl_torch'], '.2f')} | "
                     f"{_cell(r['full_ppl_jax'], '.2f')} | {full} | {_cell(r['tokens_per_sec_torch'], ',.0f')} | "
                     f"{_cell(r['tokens_per_sec_jax'], ',.0f')} | {ratio} |")
    lines += ["", "## Claims on each backend", "", "| Claim | torch | JAX |", "|---|---|---|"]
    for vt, vj in zip(torch_report.verdicts, jax_report.verdicts):
        lines.append(f"| {vt.claim.text} | {vt.measured} | {vj.measured} |")
    return "\n".join(lines) + "\n"


def render_backend_comparison(table: str, scale: str, runs: str | os.PathLike[str], out: str | os.PathLike[str],
                              rows: str | None = None, expected: dict | None = None) -> dict[str, Path]:
    """Write ``<table>_<scale>_torch_vs_jax.{md,csv}`` under ``out``; returns ``{"csv": …, "md": …}``.
    ``expected``: per backend, the identities its rows' runs must have (``paper_tables.collect.Expected``;
    default: the ones the records carry)."""
    expected = expected or {}
    torch_report = build_report(table, scale, "torch", runs, rows=rows, expected=expected.get("torch"))
    jax_report = build_report(table, scale, "jax", runs, rows=rows, expected=expected.get("jax"))
    frame = comparison_frame(torch_report, jax_report)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{table}_{scale}_torch_vs_jax"
    paths = {"csv": stem.with_suffix(".csv"), "md": stem.with_suffix(".md")}
    frame.to_csv(paths["csv"], index=False)
    paths["md"].write_text(render_comparison_markdown(torch_report, jax_report, frame), encoding="utf-8")
    return paths
