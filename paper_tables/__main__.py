"""Command line: ``python -m paper_tables {render,backends,sweep,list} ...``.

- ``render --table T --scale S --backend B --runs DIR --out DIR [--profile P] [--no-figures] [--rows GLOBS]``:
  writes ``<T>_<S>_<B>.{md,tex,csv}``, ``<T>_<S>_<B>_claims.csv`` and the figures (``<T>_<S>_<B>_<rows>.*`` for
  a row selection); prints every path, the Markdown path last. A row's runs are chosen by their identity
  (:func:`paper_tables.collect.run_role`): a sweep job under the same root is listed, never rendered as the
  row; a damaged record is rendered as damaged, with a line on stderr naming it; a row whose only runs were
  trained with other overrides reads missing, with a line on stderr naming the overrides that would render them.
- ``backends --table T --scale S --runs DIR --out DIR [--rows GLOBS]``: the table's rows measured on torch
  and on JAX side by side, with the JAX − torch differences: ``<T>_<S>_torch_vs_jax.{md,csv}``.
- ``sweep --runs DIR --param KEY [--param KEY2] --out DIR [--y METRIC] [--name NAME]``: one table and
  one plot of ``METRIC`` over the values of each ``KEY`` found in a Hydra multirun; prints the paths,
  a Markdown path last.
- ``list [--table T]``: the tables, or one table's rows with their experiment names.
- ``docs [--check]``: rewrite the row and claim lists of ``docs/TABLES.md`` from the specs (``--check``: exit 1
  when the committed lists are stale).

``render``, ``backends`` and ``sweep`` exit 1 with one line when ``--runs`` holds no run record at all (a mistyped
root), instead of rendering a table of missing rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paper_tables.spec_types import BACKENDS
from paper_tables.specs import TABLES, get_table
from paper_tables.sweep import SWEEP_METRICS
from pcaf_core.results import SCALES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paper_tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("render", help="render one table from run directories")
    r.add_argument("--table", required=True, help=f"suite table: {', '.join(TABLES)}")
    r.add_argument("--scale", required=True, choices=SCALES)
    r.add_argument("--backend", required=True, choices=BACKENDS)
    r.add_argument("--runs", default="outputs", help="root searched for run directories (metrics.json)")
    r.add_argument("--out", default="outputs/tables", help="output directory")
    r.add_argument("--profile", default=None, help="only runs of this compat profile (default: all)")
    r.add_argument("--no-figures", action="store_true", help="skip the figures")
    r.add_argument("--rows", default=None, help="comma-separated globs over row ids (default: every row)")
    r.add_argument("overrides", nargs="*", help="Hydra overrides the rows' runs were trained with (key=value, as "
                   "given to experiments.reproduce): their runs count as the rows' runs, each override listed as "
                   "a deviation (default: the rows as the table defines them)")

    s = sub.add_parser("sweep", help="table + plot of a metric over a Hydra multirun's swept values")
    s.add_argument("--runs", required=True, help="multirun directory")
    s.add_argument("--param", required=True, action="append",
                   help="dotted config key that was swept, e.g. memory.top_k (repeat for several keys)")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--y", default="best_ppl", choices=SWEEP_METRICS, help="metric to plot")
    s.add_argument("--name", default=None, help="file stem suffix (default: the param)")

    b = sub.add_parser("backends", help="one table measured on torch and on JAX, side by side with the difference")
    b.add_argument("--table", required=True, help=f"suite table: {', '.join(TABLES)}")
    b.add_argument("--scale", required=True, choices=SCALES)
    b.add_argument("--runs", default="outputs", help="root searched for run directories (metrics.json)")
    b.add_argument("--out", default="outputs/tables", help="output directory")
    b.add_argument("overrides", nargs="*", help="Hydra overrides the rows' runs were trained with, as for render; "
                   "one prefixed with 'torch:' or 'jax:' applies to that backend's runs only (e.g. "
                   "torch:backend.device=cuda jax:backend.device=gpu)")
    b.add_argument("--rows", default=None, help="comma-separated globs over row ids (default: every row)")

    ls = sub.add_parser("list", help="list tables, or the rows and experiment names of one table")
    ls.add_argument("--table", default=None)

    d = sub.add_parser("docs", help="rewrite the row and claim lists of docs/TABLES.md from the specs")
    d.add_argument("--check", action="store_true", help="only check that the committed lists are current")
    return p


def _check_table(parser: argparse.ArgumentParser, name: str) -> None:
    try:
        get_table(name)
    except KeyError as exc:
        parser.error(str(exc.args[0]))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        if args.table is None:
            for t in TABLES.values():
                print(f"{t.name}\t{t.label or '(not in the paper)'}\t{len(t.rows)} rows\t{t.title}")
            return 0
        _check_table(parser, args.table)
        for row in get_table(args.table).rows:
            print(f"{row.id}\texperiment={row.experiment}\t{row.display}")
        return 0
    if args.command == "docs":
        from paper_tables.tables_doc import main as docs_main

        return docs_main(check=args.check)

    from paper_tables.collect import find_metrics_files
    from paper_tables.sweep import render_sweep


    if args.command in ("render", "backends"):
        _check_table(parser, args.table)
    if not find_metrics_files(args.runs):
        # A mistyped root would otherwise render a table of "missing" rows and look like a result.
        state = "does not exist" if not Path(args.runs).exists() else "holds no run record (metrics.json)"
        print(f"no run found: --runs {args.runs} {state}; point --runs at the output root the runs were written "
              "to (python -m experiments.reproduce --output-root, default outputs)", file=sys.stderr)
        return 1
    if args.command == "render":
        expected = None
        if args.overrides:
            expected = _expected_per_backend(args.table, args.scale, args.rows, args.overrides, (args.backend,))
            if expected is None:
                return 2
            expected = expected[args.backend]
        return render_and_print(args.table, args.scale, args.backend, args.runs, args.out, profile=args.profile,
                                figures=not args.no_figures, rows=args.rows, expected=expected)
    if args.command == "backends":
        from paper_tables.backend_diff import render_backend_comparison

        expected = None
        if args.overrides:
            expected = _expected_per_backend(args.table, args.scale, args.rows, args.overrides)
            if expected is None:
                return 2
        paths = render_backend_comparison(args.table, args.scale, args.runs, args.out, rows=args.rows,
                                          expected=expected)
        print(paths["csv"])
        print(paths["md"])
        return 0
    for path in render_sweep(args.runs, args.param, args.out, y=args.y, name=args.name):
        print(path)
    return 0


def _expected_per_backend(table: str, scale: str, rows: str | None, overrides: list[str],
                          backends: tuple[str, ...] = ("torch", "jax")) -> dict | None:
    """Per backend, the identities of the rows composed with ``overrides`` (those prefixed ``<backend>:`` for that
    backend only; :func:`experiments.table_plan.expected_identities`); None after printing a config error."""
    from experiments.table_plan import expected_identities  # Hydra composition, only when asked for
    from pcaf_core.config import ConfigError

    out = {}
    for backend in backends:
        mine = []
        for o in overrides:
            scope, sep, rest = o.partition(":")
            if sep and scope in ("torch", "jax") and "=" not in scope:
                if scope == backend:
                    mine.append(rest)
            else:
                mine.append(o)
        try:
            out[backend] = expected_identities(table, scale, backend, rows or "*", mine)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return None
    return out


def render_and_print(table: str, scale: str, backend: str, runs, out, *, profile: str | None = None,
                     figures: bool = True, rows: str | None = None, expected=None) -> int:
    """Render one table (:func:`paper_tables.pipeline.render_table`), print every path with the Markdown path
    last, and say on stderr which rows are damaged and which missing rows have runs set aside (with the
    overrides that would render them). Returns 0."""
    from paper_tables.collect import NO_OVERRIDES
    from paper_tables.pipeline import render_table

    paths = render_table(table, scale, backend, runs, out, profile=profile, figures=figures, rows=rows,
                         expected=expected)
    for key, path in paths.items():
        if key != "md":
            print(path)
    lines = _csv_rows(paths["csv"])
    damaged = [line["row"] for line in lines if line["status"] == "damaged"]
    if damaged:
        print(f"{len(damaged)} row(s) rendered as damaged ({', '.join(damaged)}): see {paths['md']}", file=sys.stderr)
    set_aside = {line["row"]: line["set_aside"] for line in lines if line["status"] == "missing" and line["set_aside"]}
    if set_aside:
        sets = sorted({s for v in set_aside.values() for s in v.split("; ") if s != NO_OVERRIDES})
        hint = (f"they ran with {' | '.join(sets)}; give the same overrides to render them as the rows" if sets else
                "their configs are not the rows' and their command lines changed nothing: rerun the rows")
        print(f"{len(set_aside)} row(s) missing whose runs are there with other settings ({', '.join(set_aside)}): "
              f"{hint} (notes of {paths['md']})", file=sys.stderr)
    print(paths["md"], flush=True)
    return 0


def _csv_rows(csv_path: Path) -> list[dict[str, str]]:
    import csv

    with open(csv_path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


if __name__ == "__main__":
    sys.exit(main())
