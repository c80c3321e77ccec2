"""A run's identity: which runs are the same run, and what a command must repeat to continue one.

A run directory's ``config.yaml`` is the resolved Hydra config, written once when the run is created
(``experiments.app``). Every decision that asks "is this the same run?" compares two views of such a config
through this module, and only this module:

* **identity** (:func:`identity_view`): what a run's numbers depend on. The spec's sections (``model``,
  ``memory``, ``profile``, ``data``, ``train``, ``eval``), the ``backend`` section and the labels ``table``,
  ``row`` and ``scale.name``, without the fields that cannot change a number: where files live
  (:data:`LOCATION_FIELDS`) and how often the run writes checkpoints and curve rows, whether its step is
  compiled and how its full pass is batched (:data:`NON_RESULT_FIELDS`). The scale's override tables, the row's
  seed list and notes are not compared either: what they change is already in the sections. A table row uses a
  run only when the run's identity equals the identity of the row's composed config at that scale and backend
  (one per seed entry): ``experiments.reproduce`` reuses and resumes by it, ``paper_tables.collect`` renders by
  it. A sweep job differs from its row in the swept key, so it is never taken for the row, wherever its
  directory is.
* **resume view** (:func:`resume_view`): what a command must repeat to continue a run in its own directory:
  the identity plus :data:`NON_RESULT_FIELDS`, less :data:`RESUMABLE_CHANGES` (a checkpoint holds the global
  state, so a run may go on on another device or with another number of data-parallel processes). A
  checkpoint's own config hash checks the spec's sections again.

:func:`identity_digest` is a short stable digest of the identity view. Each run record carries
``identity = {"config": <digest of its config.yaml>, "row": [<digests of the row's composed configs>]}``
(``row`` is empty for a run that is no paper row), so a renderer that cannot compose configs can still tell
a row's run from a sweep job, and can check the digest against ``config.yaml``.

NumPy/stdlib only (PyYAML, loaded lazily, reads ``config.yaml``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"

IDENTITY_SECTIONS = ("model", "memory", "profile", "data", "train", "eval", "backend")
"""Config sections compared, whole but for the fields below."""

IDENTITY_LABELS = ("table", "row")
"""Top-level labels compared (with ``scale.name``)."""

LOCATION_FIELDS = ("data.data_dir", "data.cache_dir")
"""Where the corpus and its cache live: never compared (a run may resume after its data moved), but for
:data:`FOLDER_CORPORA`."""

FOLDER_CORPORA = ("text",)
"""``data.name`` values whose ``data.data_dir`` is the corpus itself (a corpus of your own,
``pcaf_core.data.own_corpus``): another folder is another corpus, so there ``data.data_dir`` is compared."""


def location_fields(data_name: object) -> tuple[str, ...]:
    """The :data:`LOCATION_FIELDS` left out of the views of a run whose ``data.name`` is ``data_name``."""
    if data_name in FOLDER_CORPORA:
        return tuple(f for f in LOCATION_FIELDS if f != "data.data_dir")
    return LOCATION_FIELDS

BATCHING_FIELDS = ("eval.full_batch_size",)
"""Fields that set only how a pass's windows are batched (:func:`pcaf_core.evaluation.full_batch_size`): left out
of the identity, of the resume view and of a checkpoint's config hash (``pcaf_core.config_io.hashable_config``),
so a run may continue, and a record count for its row, whatever batching its full pass used. Batching may
change float rounding, never what is scored."""

NON_RESULT_FIELDS = ("train.compile", "train.checkpoint_every", "train.log_every", *BATCHING_FIELDS)
"""Fields that change how a run is executed or recorded, not its numbers: left out of the identity, kept
in the resume view (a checkpoint's config hash includes them) except :data:`BATCHING_FIELDS`."""

RESUMABLE_CHANGES = ("backend.device", "backend.world_size", *BATCHING_FIELDS)
"""Fields a command may change when it continues a run (left out of the resume view; the first two are part of
the identity)."""


def _drop(view: dict[str, Any], dotted: tuple[str, ...]) -> None:
    for key in dotted:
        section, _, name = key.partition(".")
        node = view.get(section)
        if isinstance(node, dict):
            node.pop(name, None)


def _view(cfg: Mapping[str, Any]) -> dict[str, Any]:
    view: dict[str, Any] = {s: copy.deepcopy(dict(cfg[s])) for s in IDENTITY_SECTIONS
                            if isinstance(cfg.get(s), Mapping)}
    for label in IDENTITY_LABELS:
        view[label] = cfg.get(label)
    scale = cfg.get("scale")
    view["scale"] = scale.get("name") if isinstance(scale, Mapping) else scale
    _drop(view, location_fields((view.get("data") or {}).get("name")))
    return view


def resume_view(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a resolved config a command must repeat to continue the run (module docstring)."""
    view = _view(cfg)
    _drop(view, RESUMABLE_CHANGES)
    return view


def identity_view(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a resolved config a run's numbers depend on (module docstring)."""
    view = _view(cfg)
    _drop(view, NON_RESULT_FIELDS)
    return view


def _canonical(view: Mapping[str, Any]) -> str:
    return json.dumps(view, sort_keys=True, separators=(",", ":"), default=str)


def identity_digest(cfg: Mapping[str, Any]) -> str:
    """16 hex digits of the sha256 of the identity view's canonical JSON."""
    return hashlib.sha256(_canonical(identity_view(cfg)).encode("utf-8")).hexdigest()[:16]


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"section.key": value}`` (lists and scalars are leaves)."""
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def view_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for every differing field of two views (sorted; ``<absent>`` for a missing one)."""
    a, b = flatten(old), flatten(new)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]


def same_identity(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """True when two resolved configs are the same run for a table (:func:`identity_view` equal)."""
    return identity_view(a) == identity_view(b)


def resume_diff(run_config: Mapping[str, Any], command_config: Mapping[str, Any]) -> list[str]:
    """What a command would change in the run it continues (:func:`resume_view`); ``[]`` when nothing."""
    return view_diff(resume_view(run_config), resume_view(command_config))


def read_run_config(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The resolved config in ``<run_dir>/config.yaml`` as plain data; None when the file is absent or is not
    a mapping (a run created outside the app)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    import yaml

    # libyaml's parser when PyYAML has it: the same data as yaml.safe_load, parsed in C (a run reads its config
    # when it is chosen, created and resumed; the pure-Python parser took ~15 ms a read).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def is_row_run(config_digest: str | None, row_digests: list[str] | None) -> bool:
    """True when a run whose config has identity ``config_digest`` is a run of the row whose composed configs
    have the identities ``row_digests``."""
    return bool(config_digest) and config_digest in (row_digests or [])
