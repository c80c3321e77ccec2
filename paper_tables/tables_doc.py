"""The row and claim lists of ``docs/TABLES.md``, written from :data:`paper_tables.specs.TABLES`.

The lists sit between two marker lines in the document; everything outside them is prose written by
hand. ``python -m paper_tables docs`` rewrites the block, ``--check`` exits 1 when the committed block is
stale (a test runs the same check).
"""

from __future__ import annotations

from pathlib import Path

from paper_tables.spec_types import TableSpec
from paper_tables.specs import TABLES

DOC = Path(__file__).resolve().parents[1] / "docs" / "TABLES.md"
BEGIN = "<!-- begin: rows and claims, written by `python -m paper_tables docs`; edit paper_tables/specs.py -->"
END = "<!-- end: rows and claims -->"


def _num(value: float) -> str:
    return f"{value:g}"


def claim_line(claim) -> str:
    factor = "" if claim.factor == 1.0 else f"{_num(claim.factor)} × "
    tol = f" (tol {_num(claim.tol * 100)}%)" if claim.op == "~=" else ""
    return (f"- `{claim.id}`: {claim.text}. `{', '.join(claim.left)} {claim.op} {factor}{', '.join(claim.right)}` "
            f"on `{claim.metric}`{tol}.")


def table_block(spec: TableSpec) -> str:
    label = f"`{spec.label}`" if spec.label else "not in the paper"
    lines = [f"### `{spec.name}` ({label})", "",
             f"| row id (experiment `{spec.name}/<row id>`) | paper row | T | mode | paper steps |",
             "|---|---|---|---|---|"]
    for row in spec.rows:
        seq_len = str(row.seq_len) if row.seq_len is not None else "as run"
        steps = str(row.paper_steps) if row.paper_steps is not None else "—"
        name = row.display
        if spec.label and not row.published_key:
            name += " — not in the paper"
        if len(spec.datasets) > 1 and row.dataset:
            name += f" — {row.dataset}"
        lines.append(f"| `{row.id}` | {name} | {seq_len} | {row.mode.upper()} | {steps} |")
    if spec.claims:
        lines += ["", "Claims:", ""] + [claim_line(c) for c in spec.claims]
    return "\n".join(lines)


def render_block() -> str:
    return "\n\n".join(table_block(spec) for spec in TABLES.values())


def updated(text: str) -> str:
    """``text`` (the document) with the generated block replaced by the current one."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC.name} has lost its marker lines; put {BEGIN!r} and {END!r} back around the lists")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{render_block()}\n\n{END}{tail}"


def main(check: bool = False, path: Path = DOC) -> int:
    text = path.read_text(encoding="utf-8")
    new = updated(text)
    if check:
        if new != text:
            print(f"{path} is stale: run `python -m paper_tables docs` and commit it")
            return 1
        print(f"{path}: the row and claim lists match paper_tables/specs.py")
        return 0
    path.write_text(new, encoding="utf-8")
    print(path)
    return 0
