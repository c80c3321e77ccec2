"""Claim verdicts: does a paper claim hold on the measured numbers (and on the published ones)?

A :class:`~paper_tables.spec_types.Claim` compares rows on one column. Its verdict is

- ``holds``: every (left, right) pair satisfies ``left op factor * right``;
- ``fails``: some pair does not;
- ``not measured``: some referenced row has no value (missing, failed or still running runs; or,
  for the published verdict, no published number), or, for a quality claim (perplexity or accuracy),
  some referenced measured row is below the learning bar: a model that has not learned enough says
  nothing about which architecture is better; or, for a claim on what the machine sets (tokens/s, peak
  memory, run time), the referenced rows ran on more than one machine (rows finished in different sessions
  on different GPUs, say): their numbers are not comparable. The values are still shown in the detail.

Values are compared in measured units (tokens/s, fractions, PPL); published numbers are converted
back from the printed unit with the column's ``scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from paper_tables.collect import row_machines
from paper_tables.published import published_value
from paper_tables.spec_types import Claim, TableSpec, resolve_ref
from paper_tables.specs import TABLES

HOLDS, FAILS, NOT_MEASURED = "holds", "fails", "not measured"
QUALITY_METRICS = ("best_ppl", "final_ppl", "full_ppl", "acc")
"""Measured fields whose comparison needs every compared row over the learning bar."""
MACHINE_METRICS = ("tokens_per_sec", "peak_mem_mb", "wall_time_s")
"""Measured fields the machine sets: their comparison needs every compared row run on one machine."""


@dataclass(frozen=True)
class Verdict:
    """Verdicts of one claim: ``measured`` and ``published`` (each holds/fails/not measured) and the
    values behind them as text (``measured_detail`` / ``published_detail``)."""

    claim: Claim
    measured: str
    published: str
    measured_detail: str
    published_detail: str


def referenced_tables(spec: TableSpec) -> list[str]:
    """Other tables whose rows ``spec``'s claims reference (in first-use order)."""
    out: list[str] = []
    for claim in spec.claims:
        for ref in (*claim.left, *claim.right):
            table, _ = resolve_ref(ref, spec.name)
            if table != spec.name and table not in out:
                out.append(table)
    return out


def claim_is_on_suite_rows(claim: Claim, spec: TableSpec) -> bool:
    """True when the claim names a row the paper does not print (its paper-side verdict is n/a)."""
    for ref in (*claim.left, *claim.right):
        table, row = resolve_ref(ref, spec.name)
        row_spec = TABLES[table].row(row) if table != spec.name else spec.row(row)
        if TABLES[table].has_published and row_spec.published_key is None:
            return True
    return False


def compare(op: str, left: float, right: float, factor: float = 1.0, tol: float = 0.0) -> bool:
    """``left op factor * right``; ``~=`` is ``|left - right| <= tol * |right|``. NaN never holds."""
    if math.isnan(left) or math.isnan(right):
        return False
    target = factor * right
    if op == "<":
        return left < target
    if op == "<=":
        return left <= target
    if op == ">":
        return left > target
    if op == ">=":
        return left >= target
    if op == "~=":
        return abs(left - target) <= tol * abs(target)
    raise ValueError(f"unknown claim operator {op!r}; expected one of <, <=, >, >=, ~=")


def measured_value(aggs: dict[str, pd.DataFrame], table: str, row: str, key: str) -> float | None:
    """Mean measured value (measured units) of column ``key`` for ``table/row``, or ``None`` when the
    row has no completed run, the value was not recorded or the table was not collected."""
    agg = aggs.get(table)
    if agg is None or row not in agg.index or agg.at[row, "status"] != "ok":
        return None
    column = TABLES[table].column(key)
    field = "acc" if column.metric == "acc" else column.metric
    if field == "n_runs":
        return float(agg.at[row, "n_runs"])
    value = agg.at[row, field] if field in agg.columns else None
    return None if value is None else float(value)


def paper_value(pubs: dict[str, pd.DataFrame], table: str, row: str, key: str) -> float | None:
    """Published value of column ``key`` for ``table/row`` in measured units, or ``None``."""
    pub = pubs.get(table)
    if pub is None:
        return None
    spec = TABLES[table]
    column = spec.column(key)
    value = published_value(pub, spec.row(row).published_key, column.published)
    return None if value is None else value / column.scale


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return f"{value:.5g}" if abs(value) < 1e4 else f"{value:,.0f}"


NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "~=": "!~="}
"""The relation a pair of values has when ``op`` does not hold for it (what the detail prints)."""


def _ratio(left: float, target: float) -> float | None:
    """``left`` over ``target`` or its inverse, whichever is at least 1; None where a value is NaN, zero or of
    another sign."""
    if math.isnan(left) or math.isnan(target) or left * target <= 0:
        return None
    return max(left / target, target / left)


def margin(left: float, target: float) -> str:
    """How far ``left`` is from ``target`` (the claim's ``factor * right``), either way: ``0.32%``, ``14%``, and
    past a factor of 2 the factor (``14.9x``); ``""`` where :func:`_ratio` has none."""
    ratio = _ratio(left, target)
    if ratio is None:
        return ""
    return f"{ratio:.3g}x" if ratio >= 2 else f"{100 * (ratio - 1):.2g}%"


def _by(pairs: list[tuple[float, float]], closest: bool) -> str:
    """`` (by 1.4%)`` for one pair, `` (closest by 0.32%)`` for the nearest of several, so that a verdict resting
    on a fraction of a percent (from one seed a row, say) reads as the close call it is."""
    measurable = [(lv, t) for lv, t in pairs if _ratio(lv, t) is not None]
    if not measurable:
        return ""
    nearest = min(measurable, key=lambda pair: _ratio(*pair))
    return f" ({'closest ' if closest and len(pairs) > 1 else ''}by {margin(*nearest)})"


def _judge(claim: Claim, spec: TableSpec, lookup) -> tuple[str, str]:
    """Verdict and detail. The detail states the relation the values have: ``a=1 < b=2`` when every pair
    satisfies the claim, ``a=3 >= b=2`` when none does, and one ``;``-separated pair per right-hand row
    otherwise, so a reader never sees the claim's operator between numbers that contradict it. An order claim's
    detail adds how far the values are from the claim's boundary (:func:`margin`): the closest pair's margin in
    the first two forms, each pair's in the third."""
    left = [(ref, lookup(*resolve_ref(ref, spec.name), claim.metric)) for ref in claim.left]
    right = [(ref, lookup(*resolve_ref(ref, spec.name), claim.metric)) for ref in claim.right]
    absent = [ref for ref, v in (*left, *right) if v is None]
    if absent:
        return NOT_MEASURED, "no value for " + ", ".join(absent)
    held = {(lr, rr): compare(claim.op, lv, rv, claim.factor, claim.tol) for lr, lv in left for rr, rv in right}
    factor = f"{claim.factor:g} x " if claim.factor != 1.0 else ""
    tol = f" (tol {claim.tol:.0%})" if claim.op == "~=" else ""
    ok = all(held.values())
    order = claim.op != "~="  # a tolerance claim states its tolerance instead

    def by(pairs, closest=True):
        return _by([(lv, claim.factor * rv) for lv, rv in pairs], closest) if order else ""

    if ok or not any(held.values()):
        op = claim.op if ok else NEGATED[claim.op]
        detail = (", ".join(f"{ref}={_fmt(v)}" for ref, v in left) + f" {op} {factor}"
                  + ", ".join(f"{ref}={_fmt(v)}" for ref, v in right) + tol
                  + by([(lv, rv) for _, lv in left for _, rv in right]))
    else:
        detail = "; ".join(
            f"{lr}={_fmt(lv)} {claim.op if held[lr, rr] else NEGATED[claim.op]} {factor}{rr}={_fmt(rv)}"
            + by([(lv, rv)], closest=False) for lr, lv in left for rr, rv in right) + tol
    return (HOLDS if ok else FAILS), detail


def below_bar_rows(claim: Claim, spec: TableSpec, aggs: dict[str, pd.DataFrame]) -> list[str]:
    """References of ``claim`` whose measured row is below the learning bar, when the claim compares
    quality (:data:`QUALITY_METRICS`); empty for throughput and memory claims. A row trained at the paper's own
    budget (``paper_budget``: scale=paper or gpu) is judged whatever its bar."""
    out = []
    for ref in (*claim.left, *claim.right):
        table, row = resolve_ref(ref, spec.name)
        agg = aggs.get(table)
        if TABLES[table].column(claim.metric).metric not in QUALITY_METRICS or agg is None:
            continue
        if (row in agg.index and "learning_bar" in agg.columns and agg.at[row, "learning_bar"] == "below bar"
                and not ("paper_budget" in agg.columns and bool(agg.at[row, "paper_budget"]))):
            out.append(ref)
    return out


def machines_of_rows(claim: Claim, spec: TableSpec, aggs: dict[str, pd.DataFrame]) -> dict[str, list[str]]:
    """``{reference: its runs' machines}`` of ``claim``'s measured rows where they ran on more than one machine
    (:func:`paper_tables.collect.machine_of`) and the claim compares :data:`MACHINE_METRICS`; empty otherwise."""
    machines: dict[str, list[str]] = {}
    for ref in (*claim.left, *claim.right):
        table, row = resolve_ref(ref, spec.name)
        if TABLES[table].column(claim.metric).metric not in MACHINE_METRICS:
            return {}
        if table in aggs:
            machines[ref] = row_machines(aggs[table], row)
    return machines if len({m for ms in machines.values() for m in ms}) > 1 else {}


def evaluate_claims(
    spec: TableSpec, aggs: dict[str, pd.DataFrame], pubs: dict[str, pd.DataFrame]
) -> list[Verdict]:
    """Verdicts of every claim of ``spec``. ``aggs`` maps table name -> aggregated frame
    (:func:`paper_tables.collect.aggregate`) and must include the referenced tables to judge
    cross-table claims; ``pubs`` maps table name -> published frame."""
    out = []
    for claim in spec.claims:
        m, m_detail = _judge(claim, spec, lambda t, r, k: measured_value(aggs, t, r, k))
        below = below_bar_rows(claim, spec, aggs)
        if below and m != NOT_MEASURED:
            m, m_detail = NOT_MEASURED, f"below the learning bar: {', '.join(below)} (measured {m_detail})"
        machines = machines_of_rows(claim, spec, aggs)
        if machines and m != NOT_MEASURED:
            ran = "; ".join(f"{ref} on {' and '.join(ms) or 'an unrecorded machine'}" for ref, ms in machines.items())
            m, m_detail = NOT_MEASURED, f"rows from different machines, not comparable: {ran} (measured {m_detail})"
        p, p_detail = _judge(claim, spec, lambda t, r, k: paper_value(pubs, t, r, k))
        out.append(Verdict(claim, m, p, m_detail, p_detail))
    return out
