"""Process facts every backend reports the same way."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (the CPU stand-in for peak accelerator memory)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux and bytes on macOS.
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
