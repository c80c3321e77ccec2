"""Test-wide settings.

Triton kernels run under the interpreter when no CUDA device is present; the variable must be set
before ``triton`` is first imported, hence here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Several tests start subprocesses that must import the project from this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
