"""What a report says about its records: damaged ones, throughput measured while sharing the machine,
records without digests, and runs of a table's rows that are not a row's run (:mod:`paper_tables.render`).

Each reads the aggregate of :func:`paper_tables.collect.aggregate` (columns ``damaged``, ``shared_machine``,
``unverified``) and the report's ``extra_runs``.
"""

from __future__ import annotations

from typing import Any

SHARED_MARK = " (shared)"
"""Appended to a tokens/s cell measured while other training processes shared the machine."""


def record_lines(report: Any) -> list[tuple[str, list[str]]]:
    """``(heading, lines)`` of what the report's records say about themselves: damaged records, runs whose
    tokens/s were measured while sharing the machine, records without digests, and runs of the table's rows
    that are not a row's run."""
    agg = report.agg
    damaged = [f"`{r}`: {d}" for r in agg.index for d in agg.at[r, "damaged"] or []] if "damaged" in agg else []
    shared = [f"`{r}`: {d}" for r in agg.index for d in agg.at[r, "shared_machine"] or []] \
        if "shared_machine" in agg else []
    unverified = [f"`{r}`: {d}" for r in agg.index for d in agg.at[r, "unverified"] or []] \
        if "unverified" in agg else []
    return [
        ("Damaged records (not used; move or delete the file named, or rerun the row)", damaged),
        ("Tokens/s measured while sharing the machine (marked \"(shared)\": other training processes ran "
         "during the timed steps, so these are not this machine's speed)", shared),
        ("Unverified records (written before record digests; used, with best PPL checked against curve.csv "
         "where there is one)", unverified),
        ("Sweep and extra runs (not rendered as rows: their config is not the row's composed config)",
         report.extra_runs),
    ]


def _shared_rows(report: Any, claim) -> list[str]:
    if claim.metric != "tok_s" or "shared_machine" not in report.agg:
        return []
    return [ref for ref in (*claim.left, *claim.right)
            if ref in report.agg.index and report.agg.at[ref, "shared_machine"]]


def claim_detail(report: Any, v: Any) -> str:
    """A verdict's measured values, with a warning when they include tokens/s measured while sharing the
    machine."""
    shared = _shared_rows(report, v.claim)
    return v.measured_detail + (f" (tokens/s of {', '.join(shared)} measured while sharing the machine)"
                                if shared else "")
