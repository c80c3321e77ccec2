"""Environments for the subprocesses tests start."""

from __future__ import annotations

import os
import re


def xla_flags(devices: int) -> str:
    """This process's ``XLA_FLAGS`` with ``devices`` emulated CPU devices instead of whatever count it had (the
    other flags, such as tests/conftest.py's compile level, are kept)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return f"{flags} --xla_force_host_platform_device_count={devices}".strip()
