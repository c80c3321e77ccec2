"""Hydra's compose API on the suite's config directory, and Hydra's errors as one line.

Everything that composes a config (:mod:`experiments.preflight`, :mod:`experiments.cluster`) starts the compose
API here, once per process. Hydra's and OmegaConf's own errors (unknown key, wrong type, missing option,
unparsable override) are several lines with a hint to set ``HYDRA_FULL_ERROR``; :func:`one_line` turns them into
one line that names the key at fault and what to do.
"""

from __future__ import annotations

import dataclasses
import re

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from experiments import app
from experiments.schema import BackendConfig, ExperimentConfig, register
from pcaf_core.config_io import SECTIONS


def _experiment_options(option: str) -> list[str]:
    """What ``experiment=<option>`` could have named: the rows of its table (``<table>/<row>``) where the table
    exists, else the tables. Hydra lists no options of a nested group."""
    root = app.CONF_DIR / "experiment"
    table = option.split("/", 1)[0]
    if (root / table).is_dir():
        return [f"{table}/{f.stem}" for f in sorted((root / table).glob("*.yaml")) if not f.stem.startswith("_")]
    return [f"{t.name}/<row>" for t in sorted(root.iterdir()) if t.is_dir()]


def ensure_hydra() -> None:
    """Initialise Hydra's compose API on the suite's config directory once per process."""
    register()
    if not GlobalHydra.instance().is_initialized():
        initialize_config_dir(config_dir=str(app.CONF_DIR), version_base="1.3", job_name="pcaf")


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _omegaconf_cause(exc: BaseException) -> OmegaConfBaseException | None:
    node: BaseException | None = exc
    while node is not None:
        if isinstance(node, OmegaConfBaseException) and getattr(node, "full_key", None):
            return node
        node = node.__cause__ or node.__context__
    return None


def schema_keys(full_key: str) -> list[str]:
    section = full_key.split(".")[0]
    cls = SECTIONS.get(section) or {"backend": BackendConfig}.get(section)
    if cls is None:
        return [f.name for f in dataclasses.fields(ExperimentConfig)]
    return [f.name for f in dataclasses.fields(cls)]


def one_line(exc: BaseException, override: str = "") -> str:
    """One line naming the key (or the override) at fault and what to do, for a composition error."""
    cause = _omegaconf_cause(exc)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = cause.full_key
        parent = key.rsplit(".", 1)[0] if "." in key else "the config"
        # Hydra's own settings (hydra.launcher.*) are not in the suite's schema: the node says what it holds.
        node = getattr(cause, "parent_node", None)
        keys = [str(k) for k in node.keys()] if key.startswith("hydra.") and node is not None else schema_keys(key)
        return (f"{key} is not a setting (unknown key); the keys of {parent} are {', '.join(keys)}: "
                "fix the spelling or drop the override")
    if isinstance(cause, ValidationError):
        return f"{cause.full_key}: {_first_line(cause.msg)}; give it a value of that type"
    text = str(exc)
    if isinstance(exc, MissingConfigException):
        lines = [line.strip() for line in text.splitlines()]
        options = []
        if any(line.startswith("Available options") for line in lines):
            start = next(i for i, line in enumerate(lines) if line.startswith("Available options")) + 1
            options = [line for line in lines[start:] if line and not line.startswith(("Config search", "provider="))]
        missing = re.search(r"Could not find '([^']+)'", text)
        if missing and "/" in missing.group(1):
            # The group is what Hydra lists the options of (hydra/launcher); without a list, the first segment
            # (experiment options hold a slash themselves: experiment=<table>/<row>).
            listed = re.search(r"Available options in '([^']+)'", text)
            group = listed.group(1) if listed else missing.group(1).split("/", 1)[0]
            option = missing.group(1).removeprefix(group + "/")
            head = f"{group}={option}: no such option in the config group {group}"
        else:
            head = _first_line(text).replace("In 'config': ", "")
        if not options and missing and missing.group(1).startswith("experiment/"):
            options = _experiment_options(missing.group(1).split("/", 1)[1])
        return head + (f"; available: {', '.join(options)}" if options else "; check the group and option name")
    if isinstance(exc, OverrideParseException):
        return (f"cannot parse the override {override or '(one of them)'} ({_first_line(text)}): write key=value, "
                "see https://hydra.cc/docs/advanced/override_grammar/basic")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("See https")]
    return ("; ".join(lines) or type(exc).__name__) + (f" (override {override})" if override else "")


def failing_override(overrides: list[str]) -> str:
    """The first override Hydra's grammar rejects (its parse error does not say which)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for item in overrides:
        try:
            parser.parse_overrides([item])
        except HydraException:
            return item
    return ""
