"""Every paper row's resolved config at every scale, as the text a run writes to ``config.yaml``.

The row files under ``conf/experiment/<table>/`` state each fact once (a table's ``_base.yaml`` holds what
its rows share; a row file only what differs), so a change to one file can change many rows. This module
turns the whole tree into one mapping ``"<table>/<row>@<scale>#<seed entry>" -> resolved YAML`` that a
test compares with the committed copy in ``tests/fixtures/resolved_configs.json.gz``: any change to what a
row trains shows up there, key by key.

    python -m experiments.resolved_configs --check           # exit 1 and list the rows that changed
    python -m experiments.resolved_configs --write           # after an intended change: commit the new copy

The text is what :func:`experiments.app.write_run_files` writes, without ``run_dir`` (where a run lives is
not what it is). ``train.precision=auto`` resolves to what the machine trains fastest in, so the rows are
composed with ``train.precision=fp32`` (:data:`PIN`): the copy is the same on every machine.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from experiments import app
from pcaf_core.results import SCALES

PIN = ["train.precision=fp32"]
SNAPSHOT = app.REPO_ROOT / "tests" / "fixtures" / "resolved_configs.json.gz"


def all_rows() -> list[tuple[str, str]]:
    """``(table, row)`` of every experiment file, in the paper's order per table."""
    from experiments.table_plan import available_tables, table_rows

    return [(t, r) for t in available_tables() for r in table_rows(t)]


def config_text(resolved: app.ResolvedRun) -> str:
    """The resolved config as ``config.yaml`` holds it, less ``run_dir``."""
    cfg = app.config_dict(resolved)
    cfg.pop("run_dir", None)
    return app.config_yaml(cfg)


def resolve_all(rows: Iterable[tuple[str, str]] | None = None, scales: Iterable[str] = SCALES,
                compose=None) -> dict[str, str]:
    """``{"<table>/<row>@<scale>#<i>": text}`` for every seed entry ``i`` of every row at every scale that is
    defined for its table (:func:`experiments.app.scale_covers`).

    ``compose(table, row, scale)`` returns the row's resolved runs (default: the table driver's
    :func:`experiments.table_plan.compose_row` on the torch backend with :data:`PIN`)."""
    if compose is None:
        from experiments.table_plan import compose_row

        def compose(table: str, row: str, scale: str) -> list[app.ResolvedRun]:
            return compose_row(table, row, scale, "torch", PIN)
    out = {}
    for table, row in all_rows() if rows is None else rows:
        for scale in scales:
            if not app.scale_covers(scale, table):
                continue
            for i, resolved in enumerate(compose(table, row, scale)):
                out[f"{table}/{row}@{scale}#{i}"] = config_text(resolved)
    return out


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def write_snapshot(texts: dict[str, str], path: Path = SNAPSHOT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(dict(sorted(texts.items())), indent=0, ensure_ascii=False).encode("utf-8")
    # mtime=0: the same configs give the same bytes, so git sees no change when nothing changed.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(data)


def differences(want: dict[str, str], got: dict[str, str]) -> list[str]:
    """One block per changed, missing or new entry: its key and a unified diff of the text."""
    out = []
    for key in sorted(set(want) | set(got)):
        if key not in got:
            out.append(f"{key}: missing now")
        elif key not in want:
            out.append(f"{key}: new (not in the committed copy)")
        elif want[key] != got[key]:
            diff = difflib.unified_diff(want[key].splitlines(), got[key].splitlines(), "committed", "now",
                                        lineterm="", n=1)
            out.append(f"{key}:\n" + "\n".join(diff))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="compare with the committed copy")
    action.add_argument("--write", action="store_true", help="replace the committed copy")
    parser.add_argument("--path", type=Path, default=SNAPSHOT)
    args = parser.parse_args(argv)
    texts = resolve_all()
    if args.write:
        write_snapshot(texts, args.path)
        print(f"{len(texts)} resolved configs -> {args.path}")
        return 0
    diffs = differences(read_snapshot(args.path), texts)
    for block in diffs:
        print(block)
    print(f"{len(diffs)} of {len(texts)} resolved configs differ from {args.path}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
