"""The committed paper-scale results, rendered again from their committed run records alone.

``docs/results/runs/<table>/paper/<backend>/<row>/<run>/`` holds the records :mod:`experiments.gpu_paper_rows`
brings back from GPU machines (``config.yaml``, ``environment.json``, ``metrics.json``, ``curve.csv``). For each
table of :data:`~experiments.gpu_paper_rows.PAPER_TABLES` and each backend with records there, this runs
``python -m paper_tables render`` with the overrides the rows were trained with
(:func:`~experiments.gpu_paper_rows.trained_overrides`: the backend's name for the GPU and the tokenized data), and,
where both backends have records, ``python -m paper_tables backends`` over :data:`COMPARED_ROWS` and any other row
JAX ran. What it writes under
``--out`` is what ``docs/results`` commits: ``tests/test_paper_results.py`` renders them again and compares.

    python -m experiments.paper_results [--runs docs/results/runs] [--out docs/results] [--no-figures]

``make paper-results`` runs it. The paths are printed as they are written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.gpu_paper_rows import BACKENDS, PAPER_TABLES, trained_overrides

RUNS = "docs/results/runs"
OUT = "docs/results"
COMPARED_ROWS = ("pcaf_context", "local_conv")
"""The rows set beside each other on the two backends at the paper's scale (the model and its conv backbone), with
"not measured" where one backend has not run them yet; any other row JAX ran joins them."""


def rows_with_records(runs: str | Path, table: str, backend: str) -> list[str]:
    """The rows of ``table`` with a record folder under ``runs/<table>/paper/<backend>/``, sorted."""
    root = Path(runs) / table / "paper" / backend
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def render_commands(runs: str | Path = RUNS, out: str | Path = OUT, figures: bool = True) -> list[list[str]]:
    """The ``paper_tables`` command lines (without ``python -m paper_tables``) that render the committed results:
    one ``render`` per table and backend with records, one ``backends`` per table with records on both (over
    :data:`COMPARED_ROWS` and the rows JAX ran)."""
    commands = []
    for table in PAPER_TABLES:
        ran = {backend: rows_with_records(runs, table, backend) for backend in BACKENDS}
        for backend in BACKENDS:
            if ran[backend]:
                commands.append(["render", "--table", table, "--scale", "paper", "--backend", backend, "--runs",
                                 str(runs), "--out", str(out), *([] if figures else ["--no-figures"]),
                                 *trained_overrides(backend)])
        if all(ran.values()):
            scoped = [f"{backend}:{o}" for backend in BACKENDS for o in trained_overrides(backend)]
            commands.append(["backends", "--table", table, "--scale", "paper", "--runs", str(runs), "--out",
                             str(out), "--rows", ",".join(sorted({*COMPARED_ROWS, *ran["jax"]})), *scoped])
    return commands


def render_committed(runs: str | Path = RUNS, out: str | Path = OUT, figures: bool = True) -> int:
    """Run :func:`render_commands` in this process; 0, or the first command's non-zero exit status."""
    from paper_tables.__main__ import main as paper_tables_main

    for command in render_commands(runs, out, figures):
        code = paper_tables_main(command)
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=RUNS, help=f"the records' root (default {RUNS})")
    parser.add_argument("--out", default=OUT, help=f"where the tables and figures go (default {OUT})")
    parser.add_argument("--no-figures", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    return render_committed(args.runs, args.out, figures=not args.no_figures)


if __name__ == "__main__":
    raise SystemExit(main())
