"""Process facts every backend reports the same way."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (the CPU stand-in for peak accelerator memory)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux and bytes on macOS.
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


BF16_MATMUL_FLAGS = ("amx_bf16",)
"""CPU flags of a bf16 matrix unit that makes bf16 products faster than float32: Intel AMX. Without it they are
slower: a scalar fallback at 2 GFLOP/s against 114 for float32 on a 2-core AMD EPYC (Zen 3); AVX-512 BF16
alone (``avx512_bf16``, a 2-core Xeon with AMX not exposed) gave torch 149 GFLOP/s against 222 in float32 on a
``[2048, 1024] @ [1024, 4096]`` product, and a cpu-scale full-AR PCAF step took 0.11 s under bf16 autocast
against 0.066 s in float32."""


def _cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name`` line of ``/proc/cpuinfo``; None where the file or the field is
    missing (not Linux, or a CPU that does not report it)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where that file does not exist)."""
    return set((_cpuinfo_field("flags") or "").split())


def cpu_vendor() -> str | None:
    """The CPU's vendor string (``/proc/cpuinfo``'s ``vendor_id``: ``AuthenticAMD``, ``GenuineIntel``, ...);
    None where it is not reported."""
    return _cpuinfo_field("vendor_id")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (see :data:`BF16_MATMUL_FLAGS`)."""
    return bool(cpu_flags() & set(BF16_MATMUL_FLAGS))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string elsewhere."""
    model = _cpuinfo_field("model name")
    if model:
        return model
    import platform

    return platform.processor() or platform.machine()


def machine_label() -> str:
    """One line naming the machine for benchmark reports: CPU model, cores, and whether bf16 matrix
    products run in hardware (which decides every bf16 number on a CPU)."""
    import os

    bf16 = "bf16 matrix unit" if cpu_has_bf16_matmul() else "no bf16 matrix unit"
    return f"{cpu_model()}, {os.cpu_count()} cores, {bf16}"
