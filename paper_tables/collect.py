"""Read run directories into pandas and aggregate them per table row.

:func:`load_runs` finds every ``metrics.json`` under a root (any depth, e.g.
``outputs/<table>/<scale>/<backend>/<row>/<run>/metrics.json``), one frame row per run, filtered by
the records' own ``table``/``scale``/``backend``/``profile`` fields. A record that cannot be read is
kept as a failed run (attributed to a table/row from its path where the path names them), so a
broken file shows up in the report instead of crashing it.

Every record is checked before it is used (:func:`pcaf_core.record_check.check_run`): a record whose
digests or best PPL do not match its files is ``damaged`` (its row says so, naming the file); a record from
before the digests is used and listed as ``unverified``. Each run has a role (:func:`run_role`): ``row`` when
its identity (:mod:`pcaf_core.run_identity`) is one of its row's (the row's composed configs, as the record
carries them, or as the caller composed them: ``expected``), ``extra`` otherwise (a sweep job, a run with
other settings): extra runs are listed, never aggregated into a row. A record that carries no identity (from
before identities) counts for its row, as it always did.

:func:`aggregate` reduces the runs of one table to one line per spec row, in the spec's order:
seeds are averaged (mean, sample standard deviation with ddof=1, count ``n_runs``) over completed
runs only. A row without runs is ``missing``; a row whose runs all failed is ``failed`` with the
reason; nothing is ever filled in for a missing number.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import pandas as pd

from paper_tables.spec_types import BACKENDS, RowSpec, TableSpec
from paper_tables.specs import TABLES
from pcaf_core.contention import describe as describe_sharing
from pcaf_core.contention import shared as was_shared
from pcaf_core.record_check import DAMAGED, UNVERIFIED, check_run
from pcaf_core.results import METRICS_FILE, PAPER_BUDGET_SCALES, SCALES, RunMetrics, SchemaError, read_metrics
from pcaf_core.run_identity import NON_RESULT_FIELDS, identity_digest, is_row_run, read_run_config
from pcaf_core.run_record import THROUGHPUT_TIMED_TO_LOSS

RUN_FIELDS = tuple(f.name for f in fields(RunMetrics))
CHECK_COLUMNS = ("integrity", "integrity_note", "config_identity", "role", "shared_machine")
RUN_COLUMNS = (*RUN_FIELDS, "run_dir", "read_error", *CHECK_COLUMNS)

Expected = dict[tuple[str, str], list[str]]
"""``(table, row) -> identity digests`` a caller composed for a row (``experiments.reproduce``)."""

MEASURED_FIELDS = (
    "params", "final_ppl", "best_ppl", "acc_at_best", "acc_param_at_best", "final_acc", "final_acc_param",
    "full_ppl", "full_acc", "full_acc_param", "unigram_ppl", "tokens_per_sec", "peak_mem_mb", "wall_time_s",
    "train_time_s", "batch_size", "seq_len", "steps_done", "steps_planned", "vocab_size",
)
"""Numeric record fields averaged over seeds by :func:`aggregate` (columns ``<f>`` and ``<f>_std``)."""

LEARNING_BAR_DIVISOR = 3.0
"""A row "meets" the learning bar when its best PPL is at most the validation unigram PPL / 3."""

_STATUS_RANK = {"completed": 0, "running": 1, "damaged": 2, "failed": 3}


def shown_root(root: str | os.PathLike[str]) -> str:
    """How a rendered file names the folder its runs were read from: relative to the working directory when it
    lies below it, else its last component (a rendered table is committed and read on other machines; an
    absolute path would name this one)."""
    path = Path(root)
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return path.name or path.as_posix()


def find_metrics_files(root: str | os.PathLike[str]) -> list[Path]:
    """Every ``metrics.json`` under ``root`` (sorted); ``[]`` when ``root`` does not exist."""
    base = Path(root)
    if not base.exists():
        return []
    if base.is_file():
        return [base] if base.name == METRICS_FILE else []
    return sorted(base.rglob(METRICS_FILE))


def _attribute(path: Path) -> dict[str, str]:
    """Guess table/row/scale/backend of an unreadable record from the names in its path."""
    parts = path.parent.parts
    info = {"table": "", "row": "", "scale": "", "backend": ""}
    for part in parts:
        if part in TABLES and not info["table"]:
            info["table"] = part
        elif part in SCALES and not info["scale"]:
            info["scale"] = part
        elif part in BACKENDS and not info["backend"]:
            info["backend"] = part
    if info["table"]:
        ids = TABLES[info["table"]].row_ids
        for part in parts:
            if part in ids:
                info["row"] = part
    return info


def _unreadable_record(path: Path, exc: Exception) -> dict[str, Any]:
    rec: dict[str, Any] = {name: None for name in RUN_FIELDS}
    rec.update(_attribute(path))
    rec.update(status="failed", deviations=[], error=f"unreadable {METRICS_FILE}: {exc}", updated_at="")
    rec.update(read_error=str(exc), integrity=DAMAGED, integrity_note=f"{path} is unreadable")
    return rec


def _checked(run_dir: Path, rec: dict[str, Any]) -> None:
    """Add the record check's outcome, the config's identity and the sharing flag to a record dict; a damaged
    record's status becomes ``damaged`` with the check's problems as its error."""
    check = check_run(run_dir)
    rec["integrity"], rec["integrity_note"] = check.state, check.text()
    if check.state == DAMAGED:
        rec["status"], rec["error"] = "damaged", f"damaged record: {check.text()}"
    config = read_run_config(run_dir)
    rec["config_identity"] = identity_digest(config) if config is not None else None
    rec["shared_machine"] = describe_sharing(rec["extra"].get("shared_machine")) if was_shared(
        rec["extra"].get("shared_machine")) else ""


def run_role(rec: dict[str, Any] | pd.Series, expected: Expected | None = None) -> str:
    """``row`` when the run counts for its table row, ``extra`` when it is a sweep job or a run with other
    settings (module docstring). ``expected`` wins over the identities the record carries."""
    recorded = rec.get("identity") or {}
    mine = recorded.get("config") or rec.get("config_identity")
    key = (rec.get("table"), rec.get("row"))
    if expected is not None and key in expected:
        return "row" if mine is None or mine in expected[key] else "extra"
    if not recorded:
        return "row"  # a record from before identities, or an unreadable one: counted as it always was
    return "row" if is_row_run(mine, recorded.get("row")) else "extra"


LAUNCH_TIMED_NOTE = ("tokens/s not used: this record timed each step on the accelerator until its launches returned, "
                     "not until its loss was on the host (records written before the loop timed steps to the loss); "
                     "rerun the row to measure it")


def _set_aside_launch_timed_throughput(rec: dict[str, Any]) -> None:
    """An accelerator run's tokens/s from a record whose steps were timed to their launches only (no
    :data:`~pcaf_core.run_record.THROUGHPUT_TIMED_TO_LOSS` in its definition) counted host time alone: it is set to
    ``None`` and the row's deviations say why. CPU steps run synchronously, so their records stand."""
    device = str(rec.get("device") or "")
    if (rec.get("tokens_per_sec") is None or not device or device.lower().startswith("cpu")
            or THROUGHPUT_TIMED_TO_LOSS in str(rec.get("throughput_definition") or "")):
        return
    rec["tokens_per_sec"] = None
    rec["deviations"] = [*(rec.get("deviations") or []), LAUNCH_TIMED_NOTE]


def load_runs(
    root: str | os.PathLike[str],
    table: str | None = None,
    scale: str | None = None,
    backend: str | None = None,
    profile: str | None = None,
    expected: Expected | None = None,
) -> pd.DataFrame:
    """One row per run directory under ``root`` with every :class:`RunMetrics` field, ``run_dir``,
    ``read_error`` (empty for readable records) and :data:`CHECK_COLUMNS` (the record check's
    ``integrity`` and note, the config's identity, the run's ``role``, how it shared the machine).
    ``None`` filters match everything.

    Columns have dtype ``object`` so that an unmeasured value stays ``None`` (distinct from a NaN
    that a diverged run reported); use ``pd.to_numeric`` for arithmetic.
    """
    records: list[dict[str, Any]] = []
    for path in find_metrics_files(root):
        try:
            rec = read_metrics(path).to_dict()
            rec["read_error"] = ""
            _checked(path.parent, rec)
        except (SchemaError, OSError, TypeError, ValueError) as exc:
            rec = _unreadable_record(path, exc)
        rec["run_dir"] = str(path.parent)
        rec["role"] = run_role(rec, expected)
        _set_aside_launch_timed_throughput(rec)
        records.append(rec)
    df = pd.DataFrame(records, columns=list(RUN_COLUMNS), dtype=object)
    for key, value in (("table", table), ("scale", scale), ("backend", backend), ("profile", profile)):
        if value is not None:
            keep = df[key] == value
            if key == "profile":
                keep |= df["read_error"] != ""
            df = df[keep]
    return df.reset_index(drop=True)


def machine_of(device: Any) -> str:
    """The machine of a recorded device text: the text up to its first ';' ("NVIDIA H100 80GB HBM3 (torch
    2.11.0+cu130)", "cpu (torch 2.13.0+cpu, 2 threads)"), without how the step was computed that follows."""
    head = str(device or "").split(";")[0].strip()
    return head + ")" if head.count("(") > head.count(")") else head


def hardware_of(machine: str) -> str:
    """The device of a :func:`machine_of` text without the software after it ("NVIDIA H100 80GB HBM3")."""
    return machine.split(" (")[0].strip()


def row_machines(agg: pd.DataFrame, row: str) -> list[str]:
    """The machines (:func:`machine_of`) of ``row``'s runs in an aggregated frame, first-seen order."""
    if "devices" not in agg.columns or row not in agg.index:
        return []
    return _unique([m for m in map(machine_of, agg.at[row, "devices"] or []) if m])


def measured_machines(agg: pd.DataFrame) -> list[str]:
    """The distinct devices the measured rows ran on, shortened for a legend (:func:`machine_of`), in row
    order; [] when none."""
    return _unique([m for row in agg.index for m in row_machines(agg, row)])


def measured_devices(agg: pd.DataFrame) -> str:
    """:func:`measured_machines` joined with ' / '; "" when none."""
    return " / ".join(measured_machines(agg))


def _number(value: Any) -> float | None:
    """``value`` as a float; ``None`` for absent or non-numeric values (NaN stays NaN: a diverged
    run's NaN is reported, not hidden)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _stats(values: list[Any]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof=1; ``None`` for fewer than two values)."""
    nums = [v for v in (_number(x) for x in values) if v is not None]
    if not nums:
        return None, None
    mean = sum(nums) / len(nums)
    if len(nums) < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in nums) / (len(nums) - 1)
    return mean, math.sqrt(var)


def learning_bar(best_ppl: float | None, unigram_ppl: float | None) -> str:
    """``"meets"`` when ``best_ppl <= unigram_ppl / 3``, ``"below bar"`` otherwise; ``"not measured"``
    without a best PPL and ``"no unigram PPL"`` when the record lacks the unigram baseline."""
    if best_ppl is None or (isinstance(best_ppl, float) and math.isnan(best_ppl)):
        return "not measured"
    if unigram_ppl is None or (isinstance(unigram_ppl, float) and math.isnan(unigram_ppl)):
        return "no unigram PPL"
    return "meets" if best_ppl <= unigram_ppl / LEARNING_BAR_DIVISOR else "below bar"


def _dedupe_seeds(sub: pd.DataFrame) -> pd.DataFrame:
    """Keep one run per seed: completed before running before failed, then the latest write."""
    if sub.empty:
        return sub
    sub = sub.assign(
        _rank=sub["status"].map(lambda s: _STATUS_RANK.get(s, 3)),
        _key=[f"seed:{s}" if s is not None and not (isinstance(s, float) and math.isnan(s)) else f"dir:{d}"
              for s, d in zip(sub["seed"], sub["run_dir"])],
        _time=sub["updated_at"].fillna(""),
    )
    sub = sub.sort_values(["_key", "_rank", "_time"], ascending=[True, True, False], kind="stable")
    return sub.drop_duplicates("_key", keep="first").drop(columns=["_rank", "_key", "_time"])


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _unique(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if v is not None and v != "" and v not in out:
            out.append(v)
    return out


NO_OVERRIDES = "no command-line overrides recorded"
"""The ``set_aside`` entry of a run that is not its row's run although its command line changed nothing (a record
from another code revision, or one edited by hand)."""
COMMAND_LINE = " (command line)"
"""The suffix of a record's deviation that its command line set (``pcaf_core`` writes ``key=value (command line)``)."""


def ran_with(deviations: list[str] | None) -> str:
    """The overrides a run's command line gave that can change its numbers (``backend.device=gpu
    data.layout=tokens``; :data:`~pcaf_core.run_identity.NON_RESULT_FIELDS` left out), from its record's
    deviations; ``""`` when it recorded none."""
    out = []
    for d in deviations or []:
        if d.endswith(COMMAND_LINE):
            override = d.removesuffix(COMMAND_LINE)
            if override.partition("=")[0] not in NON_RESULT_FIELDS:
                out.append(override)
    return " ".join(out)


def _aggregate_row(sub: pd.DataFrame, row: RowSpec) -> dict[str, Any]:
    set_aside = sub.iloc[0:0]
    if len(sub) and "role" in sub.columns:
        set_aside = sub[(sub["role"] == "extra") & (sub["status"] != "damaged")]
        sub = sub[sub["role"] != "extra"]
    all_damaged = sub[sub["status"] == "damaged"] if len(sub) else sub
    sub = _dedupe_seeds(sub)
    done = sub[sub["status"] == "completed"]
    failed = sub[sub["status"] == "failed"]
    running = sub[sub["status"] == "running"]
    damaged = sub[sub["status"] == "damaged"]
    out: dict[str, Any] = {
        "row": row.id,
        "n_runs": len(done),
        "n_failed": len(failed),
        "n_running": len(running),
        "seeds": _unique(list(done["seed"])),
        "run_dirs": list(sub["run_dir"]),
        "curve_dirs": list(done["run_dir"]) if len(done) else list(running["run_dir"]),
        "error": _one_line(failed["error"].iloc[0]) if len(failed) else "",
        "damaged": [f"{d}: {n}" for d, n in zip(all_damaged["run_dir"], all_damaged["integrity_note"])],
        "unverified": [d for d, i in zip(done["run_dir"], done.get("integrity", [None] * len(done)))
                       if i == UNVERIFIED],
        "shared_machine": [f"{d}: {t}" for d, t in zip(done["run_dir"], done.get("shared_machine", [""] * len(done)))
                           if t],
    }
    basis = done if len(done) else sub
    for key, col in (("profiles", "profile"), ("protocols", "protocol"), ("devices", "device"),
                     ("datasets", "dataset"), ("precisions", "precision"), ("matmul_precisions", "matmul_precision")):
        out[key] = _unique(list(basis[col])) if len(basis) else []
    deviations: list[str] = []
    for devs in basis["deviations"] if len(basis) else []:
        for d in devs or []:
            if d not in deviations:
                deviations.append(d)
    out["deviations"] = deviations
    for f in MEASURED_FIELDS:
        out[f], out[f"{f}_std"] = _stats(list(done[f])) if len(done) else (None, None)
    out["acc"], out["acc_std"] = out[row.acc_field], out[f"{row.acc_field}_std"]
    out["acc_param"], out["acc_param_std"] = out["acc_param_at_best"], out["acc_param_at_best_std"]
    out["learning_bar"] = learning_bar(out["best_ppl"], out["unigram_ppl"]) if len(done) else "not measured"
    # The bar guards the cut budgets of the stand-in scales. Runs at scale=paper (or gpu, which changes only the
    # dataset) train the paper's own budget: the paper made its claims from models trained exactly so (five of
    # tab:main2048's seven published best PPLs are above a third of the unigram PPL of the tokenized WikiText-2
    # validation split, 754.8), so there the bar is shown and not applied.
    out["paper_budget"] = bool(len(done)) and all(s in PAPER_BUDGET_SCALES for s in done["scale"])

    if len(done):
        status, text = "ok", f"ok (n={len(done)})"
        if len(failed):
            text += f"; {len(failed)} failed: {out['error']}"
        if len(running):
            text += f"; {len(running)} running"
        if len(all_damaged):
            text += f"; {len(all_damaged)} damaged record(s) not used: {_one_line(all_damaged['error'].iloc[0])}"
        if len(out["profiles"]) > 1:
            text += f"; mixed profiles: {', '.join(out['profiles'])}"
    elif len(damaged):
        status, text = "damaged", _one_line(damaged["error"].iloc[0], 400)
    elif len(running):
        r = running.iloc[0]
        planned = r["steps_planned"] if r["steps_planned"] is not None else "?"
        status, text = "running", f"running (step {r['steps_done']}/{planned})"
    elif len(failed):
        status, text = "failed", f"failed: {out['error']}"
    elif len(set_aside):
        status, text = "missing", f"missing ({len(set_aside)} run(s) with other settings set aside)"
    else:
        status, text = "missing", "missing"
    out["status"], out["status_text"] = status, text
    # What the runs of this row that are not its runs ran with (sweep jobs, other overrides): what a renderer
    # would have to be given to take them for the row, when the row has no run of its own.
    out["set_aside"] = (_unique([ran_with(d) or NO_OVERRIDES for d in set_aside["deviations"]])
                        if status == "missing" and len(set_aside) else [])
    return out


def aggregate(runs: pd.DataFrame, spec: TableSpec) -> pd.DataFrame:
    """One line per row of ``spec`` (spec order, indexed by row id) from the runs of ``spec.name``."""
    mine = runs[runs["table"] == spec.name] if len(runs) else runs
    lines = [_aggregate_row(mine[mine["row"] == r.id] if len(mine) else mine, r) for r in spec.rows]
    return pd.DataFrame(lines, dtype=object).set_index("row", drop=False)


def extra_runs(runs: pd.DataFrame, table: str) -> pd.DataFrame:
    """Runs of ``table``'s rows that are not the rows' runs (sweep jobs, runs with other settings)."""
    if runs.empty or "role" not in runs.columns:
        return runs.iloc[0:0]
    return runs[(runs["table"] == table) & (runs["role"] == "extra")]


def unattributed_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs whose table/row is not a spec row (unknown names, unreadable files without a clue)."""
    if runs.empty:
        return runs
    known = [
        bool(t in TABLES and r in TABLES[t].row_ids) for t, r in zip(runs["table"], runs["row"])
    ]
    return runs[[not k for k in known]]


def collect_tables(
    root: str | os.PathLike[str], names: list[str], scale: str | None, backend: str | None,
    profile: str | None = None, expected: Expected | None = None,
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Load the runs under ``root`` once and aggregate each table in ``names`` (``expected``: see
    :func:`run_role`).

    Returns ``(runs, {table: aggregated frame})``; ``runs`` holds every run of the selected
    scale/backend/profile (all tables).
    """
    runs = load_runs(root, scale=scale, backend=backend, profile=profile, expected=expected)
    return runs, {name: aggregate(runs, TABLES[name]) for name in names}
