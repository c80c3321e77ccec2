"""Hydra multirun sweeps: one table and one plot of a metric over the swept values.

For each run record under a multirun directory the swept value of ``param`` (a dotted config key,
e.g. ``memory.top_k``) is read from, in order: the resolved ``config.yaml`` (or
``.hydra/config.yaml``) in the run directory or one of its parents up to the sweep root; the
record's ``overrides``; ``.hydra/overrides.yaml`` in the same places; the record's ``extra``.
Runs whose value cannot be found are listed, never guessed.

A line of the table pools only runs that differ in their seed alone. Where runs also differ in another setting (a
grid sweep of two keys, a sweep over rows or profiles), read from the same config files, the table has one line per
combination of the settings that tell the runs apart (:func:`other_settings`), and the plot one line per
combination.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from paper_tables.collect import load_runs, machine_of, shown_root
from paper_tables.figures import plot_sweep, save_figure
from pcaf_core.config_io import RUN_SECTIONS
from pcaf_core.run_identity import NON_RESULT_FIELDS, location_fields

CONFIG_NAMES = ("config.yaml", os.path.join(".hydra", "config.yaml"))
OVERRIDES_NAME = os.path.join(".hydra", "overrides.yaml")
SWEEP_METRICS = ("best_ppl", "final_ppl", "acc_at_best", "acc_param_at_best", "full_ppl", "tokens_per_sec",
                 "peak_mem_mb", "params")
METRIC_LABELS = {
    "best_ppl": "best validation PPL (reference protocol)", "final_ppl": "final validation PPL (reference protocol)",
    "acc_at_best": "accuracy at the best evaluation", "acc_param_at_best": "head's accuracy at the best evaluation",
    "full_ppl": "full-split validation PPL", "tokens_per_sec": "training tokens / s",
    "peak_mem_mb": "peak memory (MB)", "params": "parameters"}
"""The plot's axis label of each :data:`SWEEP_METRICS` field."""

SEED_KEYS = ("train.seed", "train.train_sample_seed", "eval.eval_sample_seed")
"""The seeds (of the weights and dropout, of the training windows, of the evaluation windows): runs that differ in
them alone repeat one setting, and a table line pools them into its mean ± std."""
SETTING_SECTIONS = (*RUN_SECTIONS, "backend")
LEADING_SETTINGS = ("table", "row", "scale.name", "backend.name", "profile.name", "model.variant")
"""Settings that name a group of runs before any other (:func:`other_settings`): a sweep over profiles reads
``profile.name``, not the dozen switches that come with it."""

_MISSING = object()


def _dotted(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def _search_dirs(run_dir: Path, root: Path) -> list[Path]:
    dirs = [run_dir]
    try:
        run_dir.resolve().relative_to(root.resolve())
    except ValueError:
        return dirs
    node = run_dir
    while node.resolve() != root.resolve() and node.parent != node:
        node = node.parent
        dirs.append(node)
    return dirs


def _from_overrides(overrides: list[str], param: str) -> Any:
    for item in overrides or []:
        key, sep, value = str(item).partition("=")
        if sep and key.lstrip("+~") == param:
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError:
                return value
    return _MISSING


def swept_value(run_dir: str | os.PathLike[str], root: str | os.PathLike[str], param: str,
                overrides: list[str] | None = None, extra: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(value, source)`` of ``param`` for a run; ``(None, "")`` when no source has it."""
    dirs = _search_dirs(Path(run_dir), Path(root))
    for d in dirs:
        for name in CONFIG_NAMES:
            path = d / name
            if path.exists():
                value = _dotted(_load_yaml(path), param)
                if value is not _MISSING:
                    return value, str(path)
    value = _from_overrides(overrides or [], param)
    if value is not _MISSING:
        return value, "metrics.json overrides"
    for d in dirs:
        path = d / OVERRIDES_NAME
        if path.exists():
            loaded = _load_yaml(path)
            value = _from_overrides(loaded if isinstance(loaded, list) else [], param)
            if value is not _MISSING:
                return value, str(path)
    if extra and param in extra:
        return extra[param], "metrics.json extra"
    return None, ""


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", out)
        else:
            out[f"{prefix}{key}"] = _hashable(value)


def run_settings(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The dotted settings of a run (``memory.top_k``, ``profile.name``, ``table``, ``row``, ``scale.name``, ...)
    from the first config file found where :func:`swept_value` looks: the run's sections, its backend, its table,
    row and scale; None where no config file is found."""
    for d in _search_dirs(Path(run_dir), Path(root)):
        for name in CONFIG_NAMES:
            config = _load_yaml(d / name) if (d / name).exists() else None
            if isinstance(config, dict):
                out: dict[str, Any] = {}
                for section in SETTING_SECTIONS:
                    if isinstance(config.get(section), dict):
                        _flatten(config[section], f"{section}.", out)
                for key in ("table", "row"):
                    if key in config:
                        out[key] = config[key]
                if isinstance(config.get("scale"), dict) and "name" in config["scale"]:
                    out["scale.name"] = config["scale"]["name"]
                return out
    return None


def other_settings(settings: Sequence[dict[str, Any] | None], param: str) -> list[str]:
    """The settings besides ``param`` and the seed (:data:`SEED_KEYS`) that tell runs apart, from their
    :func:`run_settings` (runs without a config file are not compared). Each is named only where it splits runs
    that the ones before it keep together, :data:`LEADING_SETTINGS` first, then the others in name order: a grid
    of two keys gives the other key, a sweep over profiles ``profile.name`` alone."""
    known = [s for s in settings if s is not None]
    if len(known) < 2:
        return []
    # How a run was compiled, checkpointed or batched for evaluation, and where its files live, do not change its
    # numbers: runs differing in them alone are repeats. Unless the folder is the corpus (location_fields).
    ignored = set(NON_RESULT_FIELDS) | set.intersection(*(set(location_fields(s.get("data.name"))) for s in known))
    shared = set.intersection(*(set(s) for s in known)) - {param, *SEED_KEYS, *ignored}
    differing = [k for k in shared if len({str(s[k]) for s in known}) > 1]
    ordered = [k for k in LEADING_SETTINGS if k in differing] + sorted(k for k in differing
                                                                        if k not in LEADING_SETTINGS)
    chosen: list[str] = []
    for key in ordered:
        groups: dict[tuple, set[str]] = {}
        for s in known:
            groups.setdefault(tuple(str(s[k]) for k in chosen), set()).add(str(s[key]))
        if any(len(values) > 1 for values in groups.values()):
            chosen.append(key)
    return chosen


def load_sweep(root: str | os.PathLike[str], param: str) -> pd.DataFrame:
    """One line per run record under ``root``: column ``param`` (the swept value, ``None`` when not
    found), ``value_source``, ``status``, ``error``, ``seed``, ``table``, ``row``, ``scale``, ``backend``,
    ``profile``, ``precision``, ``matmul_precision``, ``machine`` (``paper_tables.collect.machine_of`` of the
    recorded device), ``run_dir``, the :data:`SWEEP_METRICS` and ``settings`` (:func:`run_settings`)."""
    runs = load_runs(root)
    lines = []
    for _, run in runs.iterrows():
        value, source = swept_value(run["run_dir"], root, param, run["overrides"], run["extra"])
        line = {param: value, "value_source": source, "settings": run_settings(run["run_dir"], root)}
        for key in ("status", "error", "seed", "table", "row", "scale", "backend", "profile", "precision",
                    "matmul_precision", "run_dir", "shared_machine", *SWEEP_METRICS):
            line[key] = run[key]
        line["machine"] = machine_of(run["device"]) if run["device"] else None
        lines.append(line)
    columns = [param, "value_source", "status", "error", "seed", "table", "row", "scale", "backend", "profile",
               "precision", "matmul_precision", "machine", "run_dir", "shared_machine", *SWEEP_METRICS, "settings"]
    return pd.DataFrame(lines, columns=columns, dtype=object)


def _sort_key(value: Any) -> tuple[int, Any]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


def with_settings(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """``df`` (:func:`load_sweep`) with a column per setting of ``keys`` (None where a run's config is unknown)."""
    return df.assign(**{k: pd.Series([_hashable(s.get(k)) if isinstance(s, dict) else None for s in df["settings"]],
                                     index=df.index, dtype=object) for k in keys})


def aggregate_sweep(df: pd.DataFrame, param: str, by: Sequence[str] = ()) -> pd.DataFrame:
    """Per swept value (sorted), and per combination of the settings ``by`` (columns of ``df``, e.g. from
    :func:`with_settings` of :func:`other_settings`) before it: completed/failed/running counts and mean/std of
    the metrics over completed runs. Runs without a swept value are left out (see :func:`unresolved_runs`)."""
    known = df[df[param].map(lambda v: v is not None)] if len(df) else df
    cell_of = pd.Series([tuple(_hashable(line[k]) for k in (*by, param)) for _, line in known.iterrows()],
                        index=known.index, dtype=object)
    lines = []
    for cell in sorted(set(cell_of), key=lambda c: tuple(_sort_key(v) for v in c)):
        sub = known[[c == cell for c in cell_of]]  # not ==: pandas reads a tuple as a sequence
        done = sub[sub["status"] == "completed"]
        failed = sub[sub["status"].isin(["failed", "damaged"])]  # a damaged record is not a result
        line: dict[str, Any] = {param: cell[-1], **dict(zip(by, cell)), "n_runs": len(done), "n_failed": len(failed),
                                "n_running": int((sub["status"] == "running").sum())}
        line["error"] = " ".join(str(failed["error"].iloc[0]).split())[:200] if len(failed) else ""
        # Jobs run at once (a local launcher with JOBS > 1) time each other: their tokens/s is labelled so.
        line["n_shared"] = int(sum(bool(v) for v in done["shared_machine"])) if "shared_machine" in done else 0
        for metric in SWEEP_METRICS:
            nums = [float(v) for v in done[metric] if v is not None]
            mean = sum(nums) / len(nums) if nums else None
            std = (math.sqrt(sum((v - mean) ** 2 for v in nums) / (len(nums) - 1)) if len(nums) > 1 else None)
            line[metric], line[f"{metric}_std"] = mean, std
        lines.append(line)
    return pd.DataFrame(lines, dtype=object)


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return str(value)
    return value


def unresolved_runs(df: pd.DataFrame, param: str) -> list[str]:
    """Run directories whose swept value was not found."""
    if df.empty:
        return []
    return [str(d) for d, v in zip(df["run_dir"], df[param]) if v is None]


def _cell(mean: Any, std: Any, digits: int = 2) -> str:
    if mean is None:
        return "—"
    text = f"{float(mean):,.{digits}f}"
    return text + (f" ± {float(std):,.{digits}f}" if std is not None else "")


def _status(line: pd.Series) -> str:
    parts = [f"ok (n={line['n_runs']})"] if line["n_runs"] else []
    if line["n_failed"]:
        parts.append(f"{line['n_failed']} failed: {line['error']}")
    if line["n_running"]:
        parts.append(f"{line['n_running']} running")
    return "; ".join(parts) or "missing"


def sweep_labels(df: pd.DataFrame) -> str:
    """``Row: … · Scale: … · Backend: … · Profile: … · Seeds: … · Precision: … · Device: …`` over the runs
    read (every distinct value; the precision with its float32 matmul precision where recorded, e.g.
    ``fp32 (matmul highest)``)."""
    if df.empty:
        return "no runs"

    def values(col: str) -> str:
        found = sorted({str(v) for v in df[col] if v is not None and str(v) not in ("nan", "")})
        return ", ".join(found) or "unknown"

    rows = sorted({f"{t}/{r}" for t, r in zip(df["table"], df["row"])})
    df = df.assign(precision=[f"{p} (matmul {m})" if m and str(m) != "nan" else p
                              for p, m in zip(df["precision"], df["matmul_precision"])])
    return (f"Row: {', '.join(rows)} · Scale: {values('scale')} · Backend: {values('backend')} · "
            f"Profile: {values('profile')} · Seeds: {values('seed')} · Precision: {values('precision')} · "
            f"Device: {values('machine')}")


def render_sweep_markdown(agg: pd.DataFrame, param: str, y: str, root: str, unresolved: list[str],
                          labels: str = "", by: Sequence[str] = ()) -> str:
    """Markdown table of the sweep: one line per swept value, and per combination of the settings ``by`` (the
    columns after it) where runs differ in more than the swept value and their seed; ``labels``
    (:func:`sweep_labels`) heads it."""
    out = [f"# Sweep over `{param}`", ""] + ([f"- {labels}"] if labels else []) + [
        f"- Runs read under `{root}`; metric plotted: `{y}` (mean ± sample std "
        "over completed runs that differ in their seed alone; PPL from the reference protocol unless the column "
        "says full)."]
    if by:
        out.append(f"- The runs also differ in {', '.join(f'`{k}`' for k in by)}: one line per combination, and "
                   "one line of the plot per combination.")
    out.append("")
    header = [param, *by, "Best PPL", "Final PPL", "Acc. @ best", "Full-split PPL", "Tok/s", "Status"]
    out += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for _, line in agg.iterrows():
        cells = [str(line[param]), *(str(line[k]) for k in by), _cell(line["best_ppl"], line["best_ppl_std"]),
                 _cell(line["final_ppl"], line["final_ppl_std"]),
                 _cell(line["acc_at_best"], line["acc_at_best_std"], 4), _cell(line["full_ppl"], line["full_ppl_std"]),
                 _cell(line["tokens_per_sec"], line["tokens_per_sec_std"], 0)
                 + (" (shared)" if line.get("n_shared") else ""), _status(line)]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if len(agg) and agg["n_shared"].astype(int).sum():
        out += ["", "(shared): tokens/s measured while sharing the machine with other training processes (e.g. "
                "sweep jobs run at once); compare such throughputs with care."]
    if agg.empty:
        out.append("")
        out.append(f"No run with a value for `{param}` was found.")
    if unresolved:
        out += ["", f"## Runs without a value for `{param}`", ""] + [f"- {d}" for d in unresolved]
    out.append("")
    return "\n".join(out)


def render_sweep_csv(agg: pd.DataFrame) -> str:
    """The aggregated sweep as CSV (metric units as in the run records)."""
    buf = io.StringIO()
    agg.to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue()


def render_sweep(runs: str | os.PathLike[str], params: str | Sequence[str], out: str | os.PathLike[str],
                 y: str = "best_ppl", name: str | None = None) -> list[Path]:
    """For each swept key in ``params`` write ``sweep_<key>.csv``, ``.png``, ``.pdf`` and ``.md``
    under ``out`` (``name`` replaces the key in the file stem when a single key is given).

    Returns the written paths, the Markdown file last for each key. Raises ``KeyError`` for a metric
    outside :data:`SWEEP_METRICS`.
    """
    if y not in SWEEP_METRICS:
        raise KeyError(f"unknown sweep metric {y!r}; choose one of {list(SWEEP_METRICS)}")
    keys = [params] if isinstance(params, str) else list(params)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for key in keys:
        df = load_sweep(runs, key)
        by = other_settings(list(df["settings"]), key)
        df = with_settings(df, by)
        agg = aggregate_sweep(df, key, by)
        label = name if name and len(keys) == 1 else key
        stem = out_dir / f"sweep_{label.replace('/', '_')}"
        csv_path = stem.with_name(stem.name + ".csv")
        csv_path.write_text(render_sweep_csv(agg), encoding="utf-8")
        labels = sweep_labels(df)
        lines = labels.replace(" · Profile", "\nProfile").replace(" · Device", "\nDevice")
        title = f"{METRIC_LABELS[y]} vs {key}\n{lines}"
        png, pdf = save_figure(plot_sweep(df[df["status"] == "completed"], x=key, y=y, title=title,
                                          ylabel=METRIC_LABELS[y], series=by), stem)
        md = stem.with_name(stem.name + ".md")
        md.write_text(render_sweep_markdown(agg, key, y, shown_root(runs), unresolved_runs(df, key), labels, by),
                      encoding="utf-8")
        written += [csv_path, png, pdf, md]
    return written
