"""The ``stream`` evaluation protocol: whole documents read token by token, PPL against the memory horizon.

Every document of the evaluation split (a WikiText article, a PG-19 book: :mod:`pcaf_core.data.documents`)
is read from its first token by a streaming state (:mod:`pcaf_core.streaming`), the local path seeing its
usual receptive field throughout, and every position t predicts ``x_{t+1}``. One backbone step serves
several memory conditions, which differ only in which records the query may read:

* ``none``: no record; the parametric head alone (gate 0).
* ``window``: records of the current training window only, ``s >= T·floor(t/T)`` (the memory is emptied
  every T tokens, as between training windows; the local path is not).
* ``last_<H>``: records of the last H positions, ``s >= t - H`` (H = T, 4T, 16T by default; ``recent``).
* ``document``: every record of the document so far.

In every condition a bucket holds at most K records (the K most recent under ``recent``, the first K
under ``first``), so ``document`` is the stated cap: K records per bucket, at most B·K in all. The
sliding horizons need ``recent`` (the first K records of a sliding horizon are not the first K of the
bucket); under ``first`` only ``none``, ``window`` and ``document`` are defined.

PPL is the exponential of the mean NLL over every predicted token of every document (token-weighted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROTOCOL = "stream"
DEFAULT_MULTIPLES = (1, 4, 16)


@dataclass(frozen=True)
class MemoryCondition:
    """One memory condition: ``kind`` in none | window | last | document; ``horizon`` H for ``last``."""

    kind: str
    horizon: int | None = None

    @property
    def name(self) -> str:
        return f"last_{self.horizon}" if self.kind == "last" else self.kind

    def describe(self, window: int) -> str:
        if self.kind == "none":
            return "no memory (parametric head only)"
        if self.kind == "window":
            return f"current training window (memory emptied every T={window} tokens)"
        if self.kind == "last":
            return f"last {self.horizon} positions ({self.horizon / window:g}T)"
        return "whole document so far"

    def min_pos(self, t: int) -> int | None:
        """The oldest readable record position at t for ``last`` (None: no position bound)."""
        return t - self.horizon if self.kind == "last" else None


def conditions(window: int, policy: str, multiples: tuple[int, ...] = DEFAULT_MULTIPLES) -> list[MemoryCondition]:
    """The conditions of a model trained with window T under ``policy`` (``last_*`` only under ``recent``)."""
    out = [MemoryCondition("none"), MemoryCondition("window")]
    if policy == "recent":
        out += [MemoryCondition("last", m * window) for m in multiples]
    return out + [MemoryCondition("document")]


@dataclass
class ConditionResult:
    """Summed NLL (nats) and predicted tokens of one condition."""

    condition: MemoryCondition
    nll_sum: float = 0.0
    targets: int = 0

    @property
    def nll(self) -> float:
        return self.nll_sum / self.targets if self.targets else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.nll) if self.targets else float("nan")
