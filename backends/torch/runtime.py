"""Process-wide oneMKL settings the torch backend runs with (applied when :mod:`backends.torch` is imported).

**oneMKL's conditional numerical reproducibility on AMD CPUs.** PyTorch's CPU wheels multiply float32 matrices
with oneMKL's ``sgemm``. On AMD CPUs its default mode (``MKL_CBWR`` unset) runs the skinny products of a training
step slowly and unevenly; with ``MKL_CBWR=AUTO`` (oneMKL picks the code path for the CPU and keeps it, so results
also repeat run to run at a fixed thread count) the same products run faster. Measured on a 2-core AMD EPYC
(torch 2.13.0, oneMKL 2024.2, 2 threads, interleaved processes): the next-token head's ``[8, 1000] @ [1000, 20000]``
at 25-28 GFLOP/s unset against 45-47 with ``AUTO``, ``[64, 512] @ [512, 8000]`` at 86-133 against 138-161; the
large products of the fraction-of-peak figure (``[1024, 1000] @ [1000, 20000]`` and the block MLP's) within
noise of each other (158-190 either way); whole training steps at the WikiText-2 paper shape: next-token
PCAF-context 126-139 ms unset against 117-128, local conv 60-61 against 51-54, full-AR PCAF-context 2.85-2.89 s
against 2.83 s. Intel CPUs keep oneMKL's default, which is tuned for them and was not measured here against
``AUTO``.

oneMKL reads ``MKL_CBWR`` once, at its first call in the process, so this runs at import, before any product;
importing ``torch`` alone makes no oneMKL call. A value already in the environment (any mode oneMKL accepts,
``OFF`` included) is the user's and is kept. Computed values differ between modes only by float32 rounding.
"""

from __future__ import annotations

import os

from pcaf_core.sysinfo import cpu_vendor

MKL_CBWR_ENV = "MKL_CBWR"
"""oneMKL's own variable; set it (``OFF``, ``AUTO``, ``AVX2``, ...) to override :data:`MKL_CBWR_BY_VENDOR`."""

MKL_CBWR_BY_VENDOR = {"AuthenticAMD": "AUTO"}
"""The ``MKL_CBWR`` mode the backend sets by CPU vendor (``/proc/cpuinfo``'s ``vendor_id``) where the
environment sets none; other vendors keep oneMKL's default."""


def configure_mkl() -> str:
    """Set :data:`MKL_CBWR_ENV` for this CPU's vendor unless the environment sets it; returns the value in force
    (``"unset"`` for oneMKL's default). Child processes inherit it. Call before the process's first oneMKL call."""
    if MKL_CBWR_ENV not in os.environ and (mode := MKL_CBWR_BY_VENDOR.get(cpu_vendor() or "")):
        os.environ[MKL_CBWR_ENV] = mode
    return os.environ.get(MKL_CBWR_ENV, "unset")
