"""The types a table spec is made of (:mod:`paper_tables.specs` holds the paper's tables as data): columns, rows,
claims, headline verdicts and the table itself, and the functions that work on one spec.

Units: a :class:`ColumnSpec` converts a measured value (in :class:`pcaf_core.results.RunMetrics`
units: tokens/s, parameters, fractions, seconds) into the unit the paper prints by multiplying with
``scale`` (e.g. ``1e-6`` for "M tok/s", ``100`` for a percentage).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field

OPS = ("<", "<=", ">", ">=", "~=")
"""Claim operators; ``~=`` means equal within the claim's relative tolerance ``tol``."""

CLAIM_METRICS = ("best_ppl", "final_ppl", "full_ppl", "acc", "acc_param", "tok_s", "peak_mb")
"""Column keys a claim may compare."""

BACKENDS = ("torch", "jax")


@dataclass(frozen=True)
class ColumnSpec:
    """One quantity shown as a (paper, measured) pair of columns.

    ``key``: short id (``best_ppl``, ``tok_s``...); ``header``: heading as the paper prints it;
    ``metric``: the measured field (a :class:`pcaf_core.results.RunMetrics` field, ``"acc"`` for the row's accuracy
    definition, or ``"n_runs"`` for the number of completed runs); ``published`` /
    ``published_std``: columns of the published CSV (``None``: the paper has no such number);
    ``scale``: paper unit = measured value x scale; ``decimals``: digits printed; ``thousands``:
    thousands separators; ``suffix``: unit suffix printed after the number (``"M"``, ``"%"``);
    ``batch`` / ``alt`` / ``alt_batch``: published CSV columns for a batch size printed in
    parentheses and a second printed throughput; ``better``: ``"lower"``/``"higher"`` or ``None``;
    ``spread``: show "± std" over seeds for the measured value (off for settings such as batch).
    """

    key: str
    header: str
    metric: str
    published: str | None
    unit: str
    scale: float = 1.0
    decimals: int = 2
    published_std: str | None = None
    thousands: bool = False
    suffix: str = ""
    batch: str | None = None
    alt: str | None = None
    alt_batch: str | None = None
    better: str | None = None
    spread: bool = True


@dataclass(frozen=True)
class RowSpec:
    """One paper row = one experiment file.

    ``id``: snake-case row id; ``display``: model name as the paper prints it; ``experiment``:
    Hydra experiment name ``<table>/<id>`` (file ``experiments/conf/experiment/<table>/<id>.yaml``);
    ``published_key``: value of the ``row`` column in the published CSV (``None``: not in the
    paper); ``params``: parameter count as printed (``"26.59M"``); ``dataset``: corpus as printed
    (``""``: not fixed by the paper, the measured one is shown); ``seq_len``: T (``None``: not fixed
    by the paper); ``mode``: ``"nt"`` or ``"ar"``; ``group``: panel/group label used by figures;
    ``paper_steps``: the paper's step budget (``None`` when unknown); ``profile``: compat profile
    that reproduces the paper's row; ``acc_field``: the measured accuracy field comparable with the
    paper's accuracy (``acc_at_best`` = argmax of the mixture, NT; ``acc_param_at_best`` = argmax of
    the parametric head, the paper's full-AR definition); ``note``: remark shown in the report;
    ``figure_label``: the model's name in figures where ``display`` is the paper's code identifier plus a
    description (``"pcaf_semantic (Semantic Hash Routing)"``); empty: ``display``.
    """

    id: str
    display: str
    experiment: str
    published_key: str | None
    params: str
    dataset: str
    seq_len: int | None
    mode: str
    group: str
    paper_steps: int | None
    profile: str
    acc_field: str
    note: str = ""
    figure_label: str = ""

    @property
    def label(self) -> str:
        """The model's name as figures print it."""
        return self.figure_label or self.display


@dataclass(frozen=True)
class Claim:
    """A claim of the paper as a comparison of measured numbers.

    Holds iff ``left_value op factor * right_value`` for every (left, right) row pair, on the
    column ``metric`` (mean over seeds). A row reference is a row id of the same table or
    ``"<table>/<row>"`` for another table (measured at the same scale and backend). ``~=`` holds
    when ``|left - right| <= tol * |right|``. ``source`` says where the paper makes the claim.
    """

    id: str
    text: str
    left: tuple[str, ...]
    op: str
    right: tuple[str, ...]
    metric: str
    factor: float = 1.0
    tol: float = 0.0
    source: str = ""


@dataclass(frozen=True)
class Headline:
    """A one-sentence verdict at the top of a rendered table: one claim of the paper judged under the
    profile that produced the paper's number (``reference_claim``) and again on rows run under
    ``corrected`` (``corrected_claim``), with the numbers behind both verdicts.

    ``label``: what the sentence is about (``"WikiText-103 T=1024"``); ``claim``: the claim in the
    paper's words; ``corrected_means``: what changes under ``corrected``, said after its verdict.
    """

    label: str
    claim: str
    reference_claim: str
    corrected_claim: str
    corrected_means: str


@dataclass(frozen=True)
class TableSpec:
    """A suite table: paper label, rows, columns, claims, headline verdicts and the paper's setting in words."""

    name: str
    title: str
    label: str | None
    mode: str
    datasets: tuple[str, ...]
    profile: str
    setting: str
    columns: tuple[ColumnSpec, ...]
    rows: tuple[RowSpec, ...]
    claims: tuple[Claim, ...] = field(default_factory=tuple)
    headlines: tuple[Headline, ...] = field(default_factory=tuple)
    # Where the paper measured its throughput column ("" when the table has none): figures that put the
    # paper's tokens/s beside ours name both machines.
    paper_device: str = ""

    def row(self, row_id: str) -> RowSpec:
        """The row with id ``row_id``; raises ``KeyError`` listing the valid ids."""
        for r in self.rows:
            if r.id == row_id:
                return r
        raise KeyError(f"table {self.name!r} has no row {row_id!r}; rows: {[r.id for r in self.rows]}")

    @property
    def row_ids(self) -> tuple[str, ...]:
        return tuple(r.id for r in self.rows)

    def column(self, key: str) -> ColumnSpec:
        for c in self.columns:
            if c.key == key:
                return c
        raise KeyError(f"table {self.name!r} has no column {key!r}; columns: {[c.key for c in self.columns]}")

    @property
    def has_published(self) -> bool:
        return any(r.published_key for r in self.rows)


def resolve_ref(ref: str, default_table: str) -> tuple[str, str]:
    """Split a claim row reference into ``(table, row)``; a bare row id belongs to ``default_table``."""
    if "/" in ref:
        table, row = ref.split("/", 1)
        return table, row
    return default_table, ref


def select_rows(spec: TableSpec, patterns: str | None) -> TableSpec:
    """``spec`` restricted to the rows whose id matches one of the comma-separated globs.

    Claims survive only when every same-table row they name is selected (a claim about rows that
    were not run would read "not measured" for a reason the reader did not choose). The title says
    which rows were selected.
    """
    if not patterns or patterns == "*":
        return spec
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    rows = tuple(r for r in spec.rows if any(fnmatch.fnmatch(r.id, g) for g in globs))
    if not rows:
        raise KeyError(f"rows {patterns!r} match no row of {spec.name!r}; rows: {list(spec.row_ids)}")
    kept = {r.id for r in rows}

    def local_ok(refs: tuple[str, ...]) -> bool:
        return all("/" in ref or ref in kept for ref in refs)

    claims = tuple(c for c in spec.claims if local_ok(c.left) and local_ok(c.right))
    kept_claims = {c.id for c in claims}
    headlines = tuple(h for h in spec.headlines if {h.reference_claim, h.corrected_claim} <= kept_claims)
    return dataclasses.replace(spec, rows=rows, claims=claims, headlines=headlines,
                               title=f"{spec.title} [rows: {patterns}]")
