"""Process-wide XLA:CPU settings the JAX backend runs with (applied when :mod:`backends.jax` is imported).

**Synchronous CPU dispatch.** By default XLA:CPU runs a jitted call on a worker thread of its own and returns at
once. Every buffer a step allocates is then allocated on that thread, which glibc serves from a non-main malloc
arena; such an arena hands blocks larger than its 64 MB heap to ``mmap`` whatever ``glibc.malloc.mmap_threshold``
says (:mod:`experiments.allocator` keeps freed memory only in the main arena), so every step page-faults its
largest buffers in afresh and the kernel zeroes them. Run on the calling thread (main arena), the 41M full-AR
step (``[2048, 32000]`` logits and their gradient) went from 4.2-4.6 s with 1.5-1.9 s of kernel time to 3.5-4.2 s
with 0.3-0.6 s on a 2-core AMD EPYC, and from 3.2-3.9 s with 1.1-1.7 s to 2.6-3.1 s with under 0.35 s on a
2-core Xeon with AVX-512 (interleaved processes, steps 4-9 of each). Short steps lose nothing: a cpu-scale
next-token step took 0.14-0.19 s against 0.15-0.29 s, and JAX's full-AR routing at T=8,192 was unchanged.
What synchronous dispatch gives up is overlapping Python with a running step; sharded (multi-device)
computations stay asynchronous whatever the setting. Computed values never depend on it. It only takes effect
if set before JAX creates its CPU client (the first device query), hence at import;
``PCAF_JAX_CPU_ASYNC_DISPATCH=1`` in the environment keeps JAX's default (JAX reads no variable for it).
"""

from __future__ import annotations

import os

import jax

ASYNC_DISPATCH_ENV = "PCAF_JAX_CPU_ASYNC_DISPATCH"
"""``1`` keeps XLA:CPU's asynchronous dispatch (JAX's default), ``0`` or unset turns it off."""

_CHOICES = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}


def configure_cpu_dispatch() -> bool:
    """Set ``jax_cpu_enable_async_dispatch`` from :data:`ASYNC_DISPATCH_ENV` (off unless it says ``1``); returns
    the value. JAX reads it when it creates its CPU client, so call this before any device query."""
    raw = os.environ.get(ASYNC_DISPATCH_ENV, "").strip().lower()
    if raw not in _CHOICES:
        raise ValueError(f"{ASYNC_DISPATCH_ENV}={os.environ[ASYNC_DISPATCH_ENV]!r}: set it to 1 (asynchronous "
                         "XLA:CPU dispatch) or 0 (synchronous, the default)")
    jax.config.update("jax_cpu_enable_async_dispatch", _CHOICES[raw])
    return _CHOICES[raw]
