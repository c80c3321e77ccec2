"""Run-record schema shared by the trainers and ``paper_tables``.

Every run owns one directory holding

- ``metrics.json``: one :class:`RunMetrics` record (this module's schema, versioned by
  ``schema_version``), rewritten atomically whenever the run's state changes: ``status="running"``
  at start, ``"completed"`` or ``"failed"`` (with ``error``) at the end;
- ``curve.csv``: the learning curve, one row per logged step (:data:`CURVE_COLUMNS` first, extra
  columns allowed), appended with :func:`append_curve_row`;
- ``config.yaml``: the resolved configuration (written once, when the run is created, by the experiment
  entry point).

Every record written by :func:`write_metrics` carries ``digests``: the sha256 of the record itself and of
the run's ``curve.csv`` and ``config.yaml`` as they were when it was written, so a record edited, truncated
or swapped afterwards is caught before it is used (:mod:`pcaf_core.record_check`). The record's digest is the
sha256 of its canonical JSON (keys sorted, no spaces, non-finite floats as strings) with ``digests.record``
left out; the files' are ``{"bytes": n, "sha256": ...}`` of their first ``n`` bytes (a running run appends
curve rows after its last record, a completed one has none after it).

Conventions: a metric that was not measured is ``None`` (never a placeholder number); perplexities
are ``exp(mean token NLL in nats)``; accuracies are fractions in [0, 1]; times are seconds; memory is
MiB (2**20 bytes). Non-finite floats (a diverged loss) are stored as the JSON strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` so the file stays standard JSON, and are read back as floats.

NumPy/stdlib only: this module never imports torch or jax.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pcaf_core.fsutil import atomic_write_text

SCHEMA_VERSION = 2
"""Version of the ``metrics.json`` layout written by :func:`write_metrics` (2 added ``identity`` and
``digests``)."""

KNOWN_SCHEMA_VERSIONS = (1, 2)
"""Versions :func:`read_metrics` understands (a version-1 record has no identity and no digests)."""

METRICS_FILE = "metrics.json"
CURVE_FILE = "curve.csv"
CONFIG_FILE = "config.yaml"

STATUSES = ("completed", "failed", "running")
MODES = ("nt", "ar")
SCALES = ("paper", "gpu", "cpu", "smoke")
"""The scales a row runs at: the files of ``experiments/conf/scale/`` (a test checks that they agree)."""
PAPER_BUDGET_SCALES = ("paper", "gpu")
"""Scales that train the paper's own models, batches and steps (``gpu`` changes only the dataset)."""
CUSTOM_SCALE = "custom"
"""The scale of a run trained from Python without a record (``pcaf_core.loop.run_training`` called with a config of
the caller's own, e.g. by a backend's ``train``): none of :data:`SCALES`, whose configs the Hydra app composes."""

CURVE_COLUMNS = (
    "step",
    "tokens_seen",
    "train_loss",
    "eval_loss_reference",
    "eval_ppl_reference",
    "eval_acc_reference",
    "eval_acc_param_reference",
    "elapsed_s",
    "lr",
)
"""Standard learning-curve columns, in file order.

- ``step``: optimiser steps completed (1-based; the row describes the state after this step).
- ``tokens_seen``: training input tokens consumed so far (global batch x T x steps).
- ``train_loss``: mean training loss (nats/token) of the step, or of the steps since the last row.
- ``eval_loss_reference``: validation loss (nats/token) under the ``reference`` protocol at this
  step; empty on rows without an evaluation.
- ``eval_ppl_reference``: ``exp(min(cap, eval_loss_reference))``.
- ``eval_acc_reference``: validation top-1 accuracy (fraction) from the argmax of the model's output
  distribution (the mixture for cache models).
- ``eval_acc_param_reference``: validation top-1 accuracy (fraction) from the argmax of the
  parametric head only.
- ``elapsed_s``: wall-clock seconds since the start of training.
- ``lr``: learning rate used by this step.
"""

_NONFINITE_OUT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_NONFINITE_IN = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class SchemaError(ValueError):
    """A run record cannot be read or written under this schema. The message says what to do."""


@dataclass
class RunMetrics:
    """One run's record (``metrics.json``).

    Identity
        ``table``: suite table name (e.g. ``"wt2-nt-1024"``); ``row``: row id within the table
        (the experiment file is ``experiment=<table>/<row>``); ``scale``: one of :data:`SCALES`, or
        :data:`CUSTOM_SCALE` (table ``adhoc``) for a run trained from Python without a record;
        ``backend``: ``"torch"`` or ``"jax"``; ``profile``: compat profile name (``"reference_jax"``,
        ``"reference_torch"``, ``"corrected"``); ``seed``: model-init seed.

    State
        ``status``: ``"running"`` (written at start and on progress), ``"completed"`` or
        ``"failed"``; ``error``: the failure message (required when failed, else ``None``);
        ``steps_done`` / ``steps_planned``: optimiser steps completed / configured;
        ``updated_at``: ISO-8601 UTC time of the last write (set by :func:`write_metrics`).

    Setting
        ``mode``: ``"nt"`` (next token: one prediction per window) or ``"ar"`` (full autoregressive:
        every position); ``seq_len``: window length T in tokens; ``batch_size``: global batch in
        windows per optimiser step; ``params``: trainable parameter count (as the paper counts it);
        ``precision``: ``"fp32"`` or ``"bf16"``; ``matmul_precision``: what a float32 matrix product
        computed (``"highest"``, ``"high"`` or ``"default"``, docs/SPEC.md §9; empty in records written
        before the setting existed); ``device``: accelerator description.

    Evaluation protocol
        ``protocol``: ``"reference"``, ``"full"`` or ``"both"`` (the protocols that were run);
        ``eval_every``: steps between evaluations; ``eval_batches``: random validation batches per
        ``reference`` evaluation; ``full_windows``: windows scored by the ``full`` protocol.

    Quality (``reference`` protocol: random validation windows resampled at each evaluation)
        ``final_ppl``: PPL at the last evaluation; ``best_ppl``: minimum PPL over all evaluations
        (the paper's model-selection metric); ``best_step``: step of that evaluation;
        ``acc_at_best``: top-1 accuracy (fraction) at the best evaluation, argmax of the model's
        output (mixture) distribution; ``acc_param_at_best``: same, argmax of the parametric head
        only (the paper's full-AR PCAF definition); ``final_acc`` / ``final_acc_param``: the same two
        accuracies at the last evaluation.

    Quality (``full`` protocol: one deterministic pass over the whole validation split)
        ``full_ppl``: exact token-weighted PPL; ``full_acc`` / ``full_acc_param``: accuracies as
        above; ``None`` when the protocol was not run.

    Learning bar
        ``unigram_ppl``: PPL of the validation split under the training split's unigram
        distribution over the run's vocabulary (a model that learned anything beats it by far).

    Cost
        ``tokens_per_sec``: training tokens per second (see ``throughput_definition``, the exact
        definition used, e.g. "global_batch*T / train step time, after warm-up, excluding
        evaluation"); ``peak_mem_mb``: peak accelerator memory in MiB (``None`` where the device
        does not report it); ``wall_time_s``: wall-clock seconds of the whole run;
        ``train_time_s``: seconds spent in training steps (evaluation excluded).

    Data
        ``dataset``: corpus actually used (``"wikitext2"``, ``"wikitext103"``, ``"pg19"``,
        ``"pg19_mini"``); ``data_layout``: ``"tokens"``, ``"raw"`` or ``"hf"``; ``vocab_size``: V;
        ``train_tokens`` / ``eval_tokens``: tokens in the (truncated) train / validation streams.

    Provenance
        ``deviations``: every difference from the paper's settings for this row, one sentence each
        (e.g. ``"steps 5000 -> 300 (scale=cpu)"``, ``"WikiText-103 substituted by WikiText-2"``);
        ``git_commit``; ``versions``: package name -> version; ``config_hash``: hash of the
        resolved config (see :func:`hash_config`); ``overrides``: the command-line overrides of the
        run (Hydra syntax ``key=value``); ``extra``: further measurements, free-form JSON values.

    Identity and integrity
        ``identity``: ``{"config": digest, "row": [digests]}``, the identity of the run's ``config.yaml``
        and of its table row's composed configs (:mod:`pcaf_core.run_identity`; empty when the run was
        not made by the experiment app); ``digests``: set by :func:`write_metrics` (module docstring).
    """

    table: str
    row: str
    status: str = "running"
    error: str | None = None
    scale: str = "paper"
    backend: str = ""
    profile: str = ""
    seed: int | None = None
    mode: str = "nt"
    seq_len: int | None = None
    batch_size: int | None = None
    steps_done: int = 0
    steps_planned: int | None = None
    params: int | None = None
    precision: str = "fp32"
    matmul_precision: str = ""
    device: str = ""
    protocol: str = "reference"
    eval_every: int | None = None
    eval_batches: int | None = None
    full_windows: int | None = None
    final_ppl: float | None = None
    best_ppl: float | None = None
    best_step: int | None = None
    acc_at_best: float | None = None
    acc_param_at_best: float | None = None
    final_acc: float | None = None
    final_acc_param: float | None = None
    full_ppl: float | None = None
    full_acc: float | None = None
    full_acc_param: float | None = None
    unigram_ppl: float | None = None
    tokens_per_sec: float | None = None
    throughput_definition: str = ""
    peak_mem_mb: float | None = None
    wall_time_s: float | None = None
    train_time_s: float | None = None
    dataset: str = ""
    data_layout: str = ""
    vocab_size: int | None = None
    train_tokens: int | None = None
    eval_tokens: int | None = None
    deviations: list[str] = field(default_factory=list)
    git_commit: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    config_hash: str = ""
    overrides: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)
    digests: dict[str, Any] = field(default_factory=dict)
    updated_at: str = ""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self._coerce_numbers()
        self.validate()

    def _coerce_numbers(self) -> None:
        """Turn NumPy (or other ``numbers``) scalars into plain ``int``/``float`` so they serialise."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, float)):
                setattr(self, name, float(value))

    def validate(self) -> None:
        """Check values; raise :class:`SchemaError` naming the field and what to do."""
        if not self.table or not self.row:
            raise SchemaError("RunMetrics needs a non-empty 'table' and 'row' (the experiment's table/row ids)")
        if self.status not in STATUSES:
            raise SchemaError(f"RunMetrics.status={self.status!r} is invalid: expected one of {list(STATUSES)}")
        if self.status == "failed" and not self.error:
            raise SchemaError("RunMetrics.status='failed' needs 'error' (the failure message)")
        if self.mode not in MODES:
            raise SchemaError(f"RunMetrics.mode={self.mode!r} is invalid: expected one of {list(MODES)}")
        if self.schema_version not in KNOWN_SCHEMA_VERSIONS:
            raise SchemaError(
                f"RunMetrics.schema_version={self.schema_version!r}: this code reads versions "
                f"{list(KNOWN_SCHEMA_VERSIONS)} and writes {SCHEMA_VERSION}"
            )
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SchemaError(f"RunMetrics.{name} must be a list of strings, got {value!r}")
        for name in _DICT_FIELDS:
            if not isinstance(getattr(self, name), dict):
                raise SchemaError(f"RunMetrics.{name} must be a dict, got {getattr(self, name)!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SchemaError(f"RunMetrics.{name} must be an int or None, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise SchemaError(f"RunMetrics.{name} must be a number or None, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON-compatible dict (non-finite floats still as floats)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunMetrics:
        """Build a record from a parsed ``metrics.json`` dict; checks the schema version first."""
        if not isinstance(data, dict):
            raise SchemaError(f"a run record must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version is None:
            raise SchemaError("run record has no 'schema_version'; it was not written by pcaf_core.results")
        if version not in KNOWN_SCHEMA_VERSIONS:
            newer = isinstance(version, int) and version > SCHEMA_VERSION
            hint = (
                "it was written by a newer version of the suite: update this checkout"
                if newer
                else "re-run the experiment to rewrite it"
            )
            raise SchemaError(
                f"unknown metrics schema_version {version!r} (this reader knows {list(KNOWN_SCHEMA_VERSIONS)}); "
                f"{hint}"
            )
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SchemaError(
                f"run record has unknown fields {unknown}; put extra measurements under 'extra'"
            )
        values = {k: _decode_nonfinite(v) for k, v in data.items()}
        for name in _FLOAT_FIELDS:
            if isinstance(values.get(name), int) and not isinstance(values.get(name), bool):
                values[name] = float(values[name])
        return cls(**values)


_INT_FIELDS = tuple(
    f.name for f in fields(RunMetrics) if f.type in ("int | None", "int")
)
_FLOAT_FIELDS = tuple(f.name for f in fields(RunMetrics) if f.type == "float | None")
_LIST_FIELDS = ("deviations", "overrides")
_DICT_FIELDS = ("versions", "extra", "identity", "digests")


def _encode_nonfinite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE_OUT["nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]
    if isinstance(value, dict):
        return {k: _encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_nonfinite(v) for v in value]
    return value


def _decode_nonfinite(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE_IN:
        return _NONFINITE_IN[value]
    if isinstance(value, dict):
        return {k: _decode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_nonfinite(v) for v in value]
    return value


def metrics_path(run_dir: str | os.PathLike[str]) -> Path:
    """Path of a run directory's ``metrics.json``."""
    return Path(run_dir) / METRICS_FILE


def curve_path(run_dir: str | os.PathLike[str]) -> Path:
    """Path of a run directory's ``curve.csv``."""
    return Path(run_dir) / CURVE_FILE


DIGESTED_FILES = (CURVE_FILE, CONFIG_FILE)
"""Files of a run directory whose digest each record carries (when they exist as it is written)."""


def file_digest(path: str | os.PathLike[str], size: int | None = None) -> dict[str, Any]:
    """``{"bytes": n, "sha256": ...}`` of the first ``size`` bytes of ``path`` (all of it by default)."""
    h = hashlib.sha256()
    remaining = Path(path).stat().st_size if size is None else int(size)
    n = 0
    with open(path, "rb") as fh:
        while remaining > 0:
            chunk = fh.read(min(1 << 20, remaining))
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
            remaining -= len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def record_digest(data: dict[str, Any]) -> str:
    """sha256 of a record dict's canonical JSON, ``digests.record`` left out (see the module docstring)."""
    body = dict(data)
    digests = dict(body.get("digests") or {})
    digests.pop("record", None)
    body["digests"] = digests
    text = json.dumps(_encode_nonfinite(body), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_metrics(run_dir: str | os.PathLike[str], metrics: RunMetrics) -> Path:
    """Validate ``metrics``, stamp ``updated_at``, the schema version and the digests, and write
    ``<run_dir>/metrics.json`` atomically.

    The record is serialised completely before the file system is touched, so an invalid record
    (e.g. a non-JSON value under ``extra``) raises without changing the previous file. Creates
    ``run_dir`` when missing. Returns the file path.
    """
    metrics.validate()
    metrics.updated_at = datetime.now(UTC).isoformat(timespec="seconds")
    metrics.schema_version = SCHEMA_VERSION
    files = {name: file_digest(Path(run_dir) / name) for name in DIGESTED_FILES if (Path(run_dir) / name).is_file()}
    metrics.digests = {"algorithm": "sha256", "files": files}
    try:
        data = metrics.to_dict()
        metrics.digests["record"] = data["digests"]["record"] = record_digest(data)
        text = json.dumps(_encode_nonfinite(data), indent=2, sort_keys=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"run record for {metrics.table}/{metrics.row} is not JSON-serialisable: {exc}") from exc
    path = metrics_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text + "\n")
    return path


def read_metrics(run_dir: str | os.PathLike[str]) -> RunMetrics:
    """Read ``<run_dir>/metrics.json`` (``run_dir`` may also be the file itself).

    Raises :class:`FileNotFoundError` when absent and :class:`SchemaError` when the file is not
    valid JSON or not a record of a known schema version.
    """
    path = Path(run_dir)
    if path.is_dir() or path.name != METRICS_FILE:
        path = metrics_path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path} is not valid JSON ({exc}); re-run the experiment to rewrite it") from exc
    try:
        return RunMetrics.from_dict(data)
    except SchemaError as exc:
        raise SchemaError(f"{path}: {exc}") from exc
    except TypeError as exc:
        raise SchemaError(f"{path}: {exc}") from exc


def hash_config(config: Any) -> str:
    """Short stable hash (16 hex digits of SHA-256) of a JSON-compatible config mapping.

    Keys are sorted so that the hash does not depend on insertion order.
    """
    text = json.dumps(_encode_nonfinite(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else _encode_nonfinite(value)
    return str(value)


def _read_header(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8") as fh:
        return next(csv.reader(fh), [])


def append_curve_row(run_dir: str | os.PathLike[str], row: dict[str, Any]) -> Path:
    """Append one learning-curve row to ``<run_dir>/curve.csv``.

    ``row`` must contain ``step``; any :data:`CURVE_COLUMNS` key that is absent (or ``None``) is
    written empty. Keys outside :data:`CURVE_COLUMNS` become extra columns; when a row brings a
    column the file does not have yet, the file is rewritten atomically with the wider header
    (earlier rows get empty cells). Returns the file path.
    """
    if "step" not in row or row["step"] is None:
        raise ValueError("a curve row needs 'step' (optimiser steps completed)")
    path = curve_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    new_extra = [k for k in row if k not in CURVE_COLUMNS]
    if path.exists() and path.stat().st_size > 0:
        header = _read_header(path)
        missing = [k for k in new_extra if k not in header]
        if missing:
            old_rows = _read_raw_rows(path)
            header = header + missing
            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=header, restval="", lineterminator="\n")
            writer.writeheader()
            writer.writerows(old_rows)
            writer.writerow({k: _cell(row.get(k)) for k in header})
            atomic_write_text(path, buf.getvalue())
            return path
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow([_cell(row.get(k)) for k in header])
        with path.open("a", encoding="utf-8", newline="") as fh:
            fh.write(buf.getvalue())
        return path
    header = list(CURVE_COLUMNS) + new_extra
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerow([_cell(row.get(k)) for k in header])
    atomic_write_text(path, buf.getvalue())
    return path


def _read_raw_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _parse_cell(text: str) -> Any:
    if text == "":
        return None
    if text in _NONFINITE_IN:
        return _NONFINITE_IN[text]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def read_curve(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of ``<run_dir>/curve.csv`` as dicts: numbers parsed (int where integral text), empty
    cells as ``None``, other text kept. An absent file gives ``[]``."""
    path = curve_path(run_dir)
    if not path.exists():
        return []
    return [{k: _parse_cell(v or "") for k, v in raw.items()} for raw in _read_raw_rows(path)]
