"""Parameter count of every paper-scale row, from the instantiated model, beside the paper's.

The model is built on PyTorch's ``meta`` device, so no weight is allocated (a 303M model costs
nothing). Three numbers per row: the instantiated module's count, the spec's count from the
canonical shapes, and the paper's exact count (from ``paper_tables/published``).

    python -m experiments.params_report            # exit status 1 if any row disagrees
"""

from __future__ import annotations

import sys

import pandas as pd

from experiments.table_plan import available_tables, compose_row, table_rows
from pcaf_core.params import count_params


def instantiated_count(resolved) -> int:
    import torch

    from backends.torch import build_model

    with torch.device("meta"):
        module = build_model(resolved.run.model, resolved.run.memory, resolved.run.profile)
    return sum(p.numel() for p in module.parameters())


def published_counts(table: str) -> dict[str, int]:
    from paper_tables.published import load_published

    try:
        pub = load_published(table)
    except (FileNotFoundError, KeyError, ValueError):
        return {}
    if "params_exact" not in pub.columns:
        return {}
    return {str(r): int(v) for r, v in zip(pub["row"], pub["params_exact"]) if pd.notna(v)}


def report(compose=None) -> pd.DataFrame:
    """One line per paper-scale row. ``compose(table, row)`` returns the row's resolved runs at paper scale
    (default: :func:`experiments.table_plan.compose_row` on the torch backend)."""
    if compose is None:
        def compose(table: str, row: str):
            return compose_row(table, row, "paper", "torch", [])
    rows = []
    for table in available_tables():
        paper = published_counts(table)
        for row in table_rows(table):
            resolved = compose(table, row)[0]
            rows.append({
                "table": table,
                "row": row,
                "profile": resolved.run.profile.name,
                "instantiated": instantiated_count(resolved),
                "spec": count_params(resolved.run.model, resolved.run.memory, resolved.run.profile),
                "paper": paper.get(row),
            })
    df = pd.DataFrame(rows)
    df["match"] = [
        (r.instantiated == r.spec) and (r.paper is None or pd.isna(r.paper) or r.instantiated == r.paper)
        for r in df.itertuples()
    ]
    return df


def main() -> int:
    df = report()
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(df.to_string(index=False, formatters={c: "{:,.0f}".format for c in ("instantiated", "spec")}))
    bad = df[~df["match"]]
    with_paper = df["paper"].notna().sum()
    print(f"\n{len(df)} paper-scale rows; {with_paper} with a published count; "
          f"{len(bad)} disagree{'' if bad.empty else ': ' + ', '.join(bad['table'] + '/' + bad['row'])}")
    return 0 if bad.empty else 1


if __name__ == "__main__":
    sys.exit(main())
