"""Make a copy of a run record portable: the paths it holds under one folder (a checkout on the machine that trained it)
become paths relative to that folder.

A run writes where it ran: ``config.yaml`` names its ``run_dir``, ``environment.json`` the command's arguments,
``metrics.json`` the resume command, the last checkpoint and the data archive, all as absolute paths of that
machine. A record that is taken elsewhere (committed beside the tables, e.g. ``docs/results/runs``) carries
those paths relative to the checkout instead: ``outputs/gpu/...`` and ``data/wikitext-2-v1.tar.xz`` mean the
same thing in every clone, a machine's folder layout means nothing outside it.

Only the checkout's own prefix is rewritten (``<root>/x`` -> ``x``, ``<root>`` itself -> ``.``); every number
and every other string stays as the run wrote it. The record is verified first (:func:`pcaf_core.record_check.
check_run`), so a damaged record is refused rather than given fresh digests; the rewritten ``config.yaml`` and
``curve.csv`` are digested again by :func:`pcaf_core.results.write_metrics`, as the run itself does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pcaf_core import results
from pcaf_core.fsutil import atomic_write_text
from pcaf_core.record_check import DAMAGED, check_run

RELOCATED_FILES = ("config.yaml", "environment.json", "curve.csv")
"""The files beside ``metrics.json`` whose text may hold the root (``metrics.json`` is rewritten as a record)."""


def _pattern(root: str) -> re.Pattern[str]:
    """``root`` as a whole path: followed by ``/`` or by a character that cannot continue a path component."""
    return re.compile(re.escape(root.rstrip("/")) + r"(/|(?=[\s\"',:;=\]\)}]|$))")


def _relative(text: str, pattern: re.Pattern[str]) -> str:
    return pattern.sub(lambda m: "" if m.group(1) == "/" else ".", text)


def _relocate_value(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return _relative(value, pattern)
    if isinstance(value, list):
        return [_relocate_value(v, pattern) for v in value]
    if isinstance(value, dict):
        return {k: _relocate_value(v, pattern) for k, v in value.items()}
    return value


def relocate_record(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Rewrite the paths under ``root`` in the record of ``run_dir`` as paths relative to ``root`` (module
    docstring); returns whether anything changed. Raises ``ValueError`` (one line) for a damaged record.

    Meant for a copy of a record (``experiments.gpu_paper_rows`` relocates the copies it takes home): the files
    are rewritten one after another, ``metrics.json`` last, so a copy interrupted halfway reads as damaged."""
    run_dir, root_text = Path(run_dir), os.fspath(root)
    if not Path(root_text).is_absolute():
        raise ValueError(f"relocate_record needs the absolute folder the record's paths start with, not {root_text!r}")
    check = check_run(run_dir)
    if check.state == DAMAGED:
        raise ValueError(f"{run_dir}: the record is damaged, not relocated ({check.text()})")
    pattern = _pattern(root_text)
    changed = False
    for name in RELOCATED_FILES:
        path = run_dir / name
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            new = _relative(text, pattern)
            if new != text:
                atomic_write_text(path, new)
                changed = True
    data = json.loads((run_dir / results.METRICS_FILE).read_text(encoding="utf-8"))
    relocated = _relocate_value({k: v for k, v in data.items() if k != "digests"}, pattern)
    if changed or relocated != {k: v for k, v in data.items() if k != "digests"}:
        record = results.RunMetrics.from_dict({**relocated, "digests": data.get("digests") or {}})
        results.write_metrics(run_dir, record)
        return True
    return False
