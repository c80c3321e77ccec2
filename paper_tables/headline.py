"""Headline verdicts: one sentence at the top of a rendered table that judges a paper claim twice.

A :class:`~paper_tables.spec_types.Headline` pairs a claim on the rows run under the paper's profile with the
same claim on a row run under ``corrected``. The sentence says whether each holds and gives the numbers
behind both: the claimed row's measured value against the best row it must beat.
"""

from __future__ import annotations

from paper_tables.claims import HOLDS, NOT_MEASURED, Verdict, measured_value
from paper_tables.spec_types import Claim, Headline, TableSpec, resolve_ref


def _display(spec: TableSpec, ref: str) -> str:
    table, row = resolve_ref(ref, spec.name)
    return spec.row(row).display if table == spec.name else ref


def _numbers(spec: TableSpec, aggs: dict, claim: Claim) -> str:
    """``"<column> <left value> against <value> for <the right-hand row that decides>"``, or what is missing."""
    def value(ref: str) -> float | None:
        return measured_value(aggs, *resolve_ref(ref, spec.name), claim.metric)

    left = claim.left[0]
    lv = value(left)
    rights = [(ref, value(ref)) for ref in claim.right]
    present = [(ref, v) for ref, v in rights if v is not None]
    if lv is None or not present:
        missing = [ref for ref, v in [(left, lv), *rights] if v is None]
        return "no value for " + ", ".join(missing)
    # The right-hand row that decides the claim: the smallest for "<", the largest for ">".
    best_ref, best = (min if claim.op in ("<", "<=") else max)(present, key=lambda rv: rv[1])
    header = spec.column(claim.metric).header
    header = header[:1].lower() + header[1:]  # mid-sentence: "best PPL"
    return f"{header} {lv:,.2f} against {best:,.2f} for {_display(spec, best_ref)}"


def _verdict_word(verdict: Verdict) -> str:
    return {HOLDS: "holds", NOT_MEASURED: "is not measured"}.get(verdict.measured, "fails")


def headline_sentence(spec: TableSpec, aggs: dict, verdicts: list[Verdict], headline: Headline) -> str | None:
    """The sentence of ``headline``, or None when either claim was not judged (rows not selected)."""
    by_id = {v.claim.id: v for v in verdicts}
    ref_v, cor_v = by_id.get(headline.reference_claim), by_id.get(headline.corrected_claim)
    if ref_v is None or cor_v is None:
        return None
    ref_profile = spec.row(resolve_ref(ref_v.claim.left[0], spec.name)[1]).profile
    return (f"**Verdict, {headline.label}:** the paper's claim \"{headline.claim}\" {_verdict_word(ref_v)} under "
            f"`{ref_profile}` ({_numbers(spec, aggs, ref_v.claim)}) and {_verdict_word(cor_v)} under `corrected`, "
            f"{headline.corrected_means} ({_numbers(spec, aggs, cor_v.claim)}).")


def headline_lines(spec: TableSpec, aggs: dict, verdicts: list[Verdict]) -> list[str]:
    """Every headline sentence of ``spec`` that can be judged, in spec order."""
    lines = (headline_sentence(spec, aggs, verdicts, h) for h in spec.headlines)
    return [line for line in lines if line]
