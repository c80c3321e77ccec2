"""``key=value`` command lines for the small tools that read a trained run (``generate``, ``stream_eval``).

One parser for both, so their options, ``data.*`` location overrides and error messages stay alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

ArgsT = TypeVar("ArgsT")


def parse_key_values(argv: list[str], args_type: type[ArgsT], usage: str) -> tuple[ArgsT, dict[str, str]]:
    """``key=value`` items -> an ``args_type`` instance and the ``data.*`` overrides (``{"data_dir": …}``).

    Fields annotated ``int`` / ``float`` are converted; every other value is taken verbatim (a prompt may
    hold spaces, ``=`` or ``:``). ``run_dir`` must be given. Raises ``ValueError`` with a one-line message.
    """
    types = {f.name: f.type for f in dataclasses.fields(args_type)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    data: dict[str, str] = {}
    for item in argv:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"cannot parse {item!r}: options look like key=value ({usage})")
        if key.startswith("data."):
            data[key[5:]] = raw
            continue
        if key not in types:
            raise ValueError(f"unknown option {key!r}: expected one of {sorted(types)}, data.data_dir or "
                             "data.cache_dir")
        kind = types[key]
        try:
            values[key] = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
        except ValueError:
            raise ValueError(f"{key} must be {'an integer' if kind == 'int' else 'a number'}, got {raw!r}") from None
    args = args_type(**values)
    if not getattr(args, "run_dir", ""):
        raise ValueError(f"run_dir is required ({usage})")
    return args, data
