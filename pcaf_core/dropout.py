"""The training-mode dropout of both backends (the spec's forward, :mod:`pcaf_core.reference`, has none),
except torch's on attention weights: ``scaled_dot_product_attention``'s own (``dropout_p``) on the masked and
blocked paths, float masks from ``torch.rand`` on the FlexAttention one (:mod:`backends.torch.window_attention`).

Inverted dropout whose mask compares uniform 16-bit integers ("levels", one per element) with a threshold:
an element whose level is below ``round(p·2^16)`` is dropped, and kept elements are scaled by the inverse of
the actual keep rate, so the layer stays unbiased. The rate is therefore a multiple of 2^-16 (0.1 drops
0.1000061 of the elements), the same on both backends.

One 32-bit random word gives two levels, and random bits are most of what dropout costs on a CPU. A JAX
next-token step of the semantic route at the cpu scale (batch 32, T=1,024; 42M mask elements, most of them in
the full forward that ranks the candidates) took 301 ms drawing one word an element (``flax.linen.Dropout``),
219 ms drawing two levels a word and 146 ms without dropout (2-core AMD EPYC, median of 12 steps). Where the
words come from is the backend's: torch draws them from its global generator (``randint``, so seeding and
checkpointed generator states apply), JAX from the ``"dropout"`` RNG stream of the step's key.
"""

from __future__ import annotations

import numpy as np

DROPOUT_LEVELS = 1 << 16
"""Levels are uniform integers in ``[0, DROPOUT_LEVELS)``; the dropout rate is a multiple of its inverse."""


def dropout_threshold(p: float) -> int:
    """Levels below it drop their element: ``round(p·2^16)``. ``p`` must lie in ``[0, 1)``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout rate {p} is outside [0, 1): set profile.dropout to a rate below 1")
    return round(p * DROPOUT_LEVELS)


def dropout_scale(p: float) -> float:
    """What kept elements are multiplied by: ``2^16 / (2^16 − threshold)``, the inverse of the keep rate."""
    return DROPOUT_LEVELS / (DROPOUT_LEVELS - dropout_threshold(p))


def dropout(x: np.ndarray, levels: np.ndarray, p: float) -> np.ndarray:
    """Training-mode dropout of ``x`` given its ``levels`` (integers in ``[0, 2^16)``, ``x``'s shape):
    ``x · scale`` where ``levels >= threshold``, else 0."""
    if levels.shape != x.shape:
        raise ValueError(f"levels {levels.shape} must have the shape of x {x.shape}")
    keep = levels.astype(np.int64) >= dropout_threshold(p)
    return np.where(keep, x * np.asarray(dropout_scale(p), dtype=x.dtype), np.zeros((), x.dtype))
