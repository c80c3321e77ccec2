"""How a run ends early: a diverged loss, or a signal asking the process to stop.

:class:`TrainingDiverged` and :class:`RunInterrupted` are what the loop (:mod:`pcaf_core.loop`) raises; the
entry points catch them to print the command that continues the run. :class:`SigtermGuard` turns SIGTERM
(cluster pre-emption, ``kill``) into :class:`RunInterrupted` for the length of a run, so that the record says
the run was interrupted instead of the process vanishing. NumPy/stdlib only.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite. The message names the step, the last good checkpoint
    and the command that continues the run at a lower learning rate; ``details`` = ``{step, loss, lr}``."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = dict(details or {})

    def __reduce__(self):  # picklable across processes with its details
        return (type(self), (str(self), self.details))


class RunInterrupted(BaseException):
    """The process was asked to stop (SIGTERM). Derives from BaseException like KeyboardInterrupt,
    so ``except Exception`` blocks in backends do not swallow it."""

    def __init__(self, message: str = "", signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.signum = signum


class SigtermGuard:
    """``with SigtermGuard():`` SIGTERM raises :class:`RunInterrupted` inside the block. Installed only from
    the main thread (the only one that may install signal handlers) and only where no handler was set (a
    launcher's own handler, e.g. submitit's, is left alone); the previous handler is restored on exit."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            if self._previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, self._handler)
                self._installed = True
        return self

    @staticmethod
    def _handler(signum: int, frame: Any) -> None:
        raise RunInterrupted(f"received signal {signal.Signals(signum).name}", signum)

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
