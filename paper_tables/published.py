"""The paper's published numbers, one CSV per suite table under ``paper_tables/published/``.

Each CSV holds the table's rows in the printed order with the printed values and units (units are in
the column names: ``params_M``, ``throughput_Mtok_s``, ``acc_at_best_pct``...), a ``row`` column with
the suite row id, ``*_std`` columns for printed "± std", a ``batch`` column (printed in
``tab:main1024/2048`` and ``tab:submission_303m_results``; from the paper's logs and scripts for the
TPU tables, empty where unknown), ``params_exact`` (exact counts) and a free-text ``note``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from paper_tables.specs import TABLES, get_table

PUBLISHED_DIR = Path(__file__).resolve().parent / "published"


def published_path(table: str) -> Path:
    """Path of the published CSV of ``table`` (validates the table name)."""
    get_table(table)
    return PUBLISHED_DIR / f"{table}.csv"


def load_published(table: str) -> pd.DataFrame:
    """Published values of ``table`` indexed by row id (empty cells are NaN, ``note`` is text).

    Raises ``FileNotFoundError`` naming the expected path when the CSV is absent.
    """
    path = published_path(table)
    if not path.exists():
        raise FileNotFoundError(f"published numbers for {table!r} not found at {path}")
    df = pd.read_csv(path, dtype={"row": str, "note": str}, keep_default_na=False, na_values=[""])
    if "row" not in df.columns:
        raise ValueError(f"{path} has no 'row' column (the suite row id)")
    df["note"] = df["note"].fillna("") if "note" in df.columns else ""
    return df.set_index("row", drop=False)


def published_value(pub: pd.DataFrame, row_key: str | None, column: str | None) -> float | None:
    """A published number, or ``None`` when the row/column is absent or the cell is empty."""
    if row_key is None or column is None or row_key not in pub.index or column not in pub.columns:
        return None
    value = pub.at[row_key, column]
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if pd.isna(value) else value


def all_published() -> dict[str, pd.DataFrame]:
    """Published frames of every suite table."""
    return {name: load_published(name) for name in TABLES}
