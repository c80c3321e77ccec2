"""Check a run's record before anything uses it: its digests, and its best PPL against its own curve.

A record written by :func:`pcaf_core.results.write_metrics` carries the sha256 of itself and of the run's
``curve.csv`` and ``config.yaml`` as they were when it was written (see :mod:`pcaf_core.results`).
:func:`check_run` verifies them and that the record's ``best_ppl`` is the lowest ``eval_ppl_reference`` of
``curve.csv`` (the ``reference`` protocol's evaluations; the loop keeps the first of equal values, and a NaN
only while no other evaluation exists), where the record's digest covers a curve or the record has no digest.
The outcome:

* ``verified``: the digests match (and, for a completed run, the curve holds its best PPL);
* ``unverified``: a record from before the digests (schema version 1): only the curve check could be made,
  and ``notes`` says so; such records are still used, labelled unverified;
* ``damaged``: something does not match; ``problems`` names the file and what is wrong, one line each.

For a run that has not completed, ``curve.csv`` may hold rows written after the record (a process stopped
between its last two writes), so only the rows the record covers are checked, and the best PPL is not.

NumPy/stdlib only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcaf_core import results
from pcaf_core.results import CURVE_FILE, METRICS_FILE

VERIFIED, UNVERIFIED, DAMAGED = "verified", "unverified", "damaged"


@dataclass
class RecordCheck:
    """What :func:`check_run` found. ``problems``: ``(file name, one line)`` per mismatch."""

    state: str
    problems: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def damaged_files(self) -> list[str]:
        """Names of the files found damaged (``metrics.json``, ``curve.csv``, ``config.yaml``)."""
        return list(dict.fromkeys(name for name, _ in self.problems))

    def text(self) -> str:
        """One line: the problems (or notes) joined."""
        return "; ".join(why for _, why in self.problems) or "; ".join(self.notes)


def curve_best(rows: list[dict[str, Any]]) -> float | None:
    """The best ``eval_ppl_reference`` of curve rows as the loop chooses it: the minimum over evaluations that
    are not NaN; NaN when every evaluation was NaN; None when there was none."""
    values = [r.get("eval_ppl_reference") for r in rows]
    values = [float(v) for v in values if isinstance(v, (int, float))]
    numbers = [v for v in values if not math.isnan(v)]
    if numbers:
        return min(numbers)
    return math.nan if values else None


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b


def _check_files(run_dir: Path, data: dict[str, Any], completed: bool) -> list[tuple[str, str]]:
    problems = []
    files = (data.get("digests") or {}).get("files") or {}
    for name, want in files.items():
        path = run_dir / name
        if not path.is_file():
            problems.append((name, f"{path} is missing (metrics.json recorded its digest)"))
            continue
        size = path.stat().st_size
        # A completed run wrote its record after its last curve row; any other run may have appended rows
        # after its last record, so only the prefix the record covers must match.
        strict = completed or name != CURVE_FILE
        if (strict and size != want.get("bytes")) or size < int(want.get("bytes", 0)):
            problems.append((name, f"{path} has {size} bytes, its digest in metrics.json covers {want.get('bytes')}"))
        elif results.file_digest(path, want.get("bytes"))["sha256"] != want.get("sha256"):
            problems.append((name, f"{path} does not match its sha256 in metrics.json (changed after the run wrote "
                                   "it)"))
    return problems


def check_run(run_dir: str | os.PathLike[str]) -> RecordCheck:
    """Verify the record of ``run_dir`` (module docstring). An unreadable ``metrics.json`` is ``damaged``."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = results.RunMetrics.from_dict(data)
    except FileNotFoundError:
        return RecordCheck(DAMAGED, [(METRICS_FILE, f"{path} is missing")])
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:  # SchemaError is a ValueError
        return RecordCheck(DAMAGED, [(METRICS_FILE, f"{path} is unreadable ({' '.join(str(exc).split())[:200]})")])
    completed = record.status == "completed"
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    digest = (data.get("digests") or {}).get("record")
    if digest:
        if results.record_digest(data) != digest:
            problems.append((METRICS_FILE, f"{path} does not match its own digest (edited or damaged after the run "
                                           "wrote it)"))
        problems += _check_files(run_dir, data, completed)
    else:
        notes.append(f"{path} has no digest (written before record digests)")
    curve = run_dir / CURVE_FILE
    # A record with digests vouches only for the curve it covered; one without (written before digests)
    # is checked against whatever curve it has.
    covers_curve = not digest or CURVE_FILE in ((data.get("digests") or {}).get("files") or {})
    if (completed and record.best_ppl is not None and covers_curve
            and not any(n == CURVE_FILE for n, _ in problems)):
        if curve.is_file():
            best = curve_best(results.read_curve(run_dir))
            if not _same(best, record.best_ppl):
                problems.append((METRICS_FILE, f"best_ppl {record.best_ppl!r} in {path} is not the best "
                                               f"eval_ppl_reference of {curve} ({best!r})"))
            elif not digest:
                notes.append(f"its best PPL was checked against {CURVE_FILE}")
        elif not digest:
            notes.append(f"no {CURVE_FILE} to check its best PPL against")
    if problems:
        return RecordCheck(DAMAGED, problems, notes)
    return RecordCheck(VERIFIED if digest else UNVERIFIED, [], notes)

