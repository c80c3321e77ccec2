"""How a training run reports its progress while it runs.

On a terminal a tqdm bar (step, loss, learning rate, last validation PPL). Anywhere else (a log file, a cluster
job, ``nohup``) a bar writes nothing useful, so the run prints one line per evaluation instead::

    [wt2-nt-1024/pcaf_context scale=cpu backend=torch seed=1234] step 500/5000 · train loss 5.412 · eval PPL 281.37
    (reference) · 3,912 tok/s · elapsed 4m12s · ETA 37m48s

``progress=None`` (what the entry points pass) picks the bar on a terminal and the lines elsewhere;
``progress=True`` forces the bar, ``progress=False`` silences both, and so does ``PCAF_NO_PROGRESS=1``. Only the
main process of a data-parallel run reports.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

BAR, LINES, OFF = "bar", "lines", "off"


def progress_style(progress: bool | None, stream: TextIO | None = None) -> str:
    """:data:`BAR`, :data:`LINES` or :data:`OFF` for the ``progress`` argument of a run (see the module doc)."""
    if os.environ.get("PCAF_NO_PROGRESS", "") == "1" or progress is False:
        return OFF
    if progress:
        return BAR
    stream = sys.stderr if stream is None else stream
    return BAR if stream.isatty() else LINES


def duration(seconds: float) -> str:
    """``42s``, ``4m12s``, ``2h05m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(tag: str, step: int, total: int, train_loss: float | None, eval_ppl: float | None,
                  tokens_per_sec: float | None, elapsed: float, eta: float | None) -> str:
    """One evaluation's line: ``[tag] step s/S · train loss · eval PPL (reference) · tok/s · elapsed · ETA``."""
    parts = [f"step {step}/{total}"]
    parts.append(f"train loss {train_loss:.3f}" if train_loss is not None else "train loss n/a")
    parts.append(f"eval PPL {eval_ppl:.2f} (reference)" if eval_ppl is not None else "eval PPL n/a")
    parts.append(f"{tokens_per_sec:,.0f} tok/s" if tokens_per_sec else "tok/s n/a (warm-up)")
    parts.append(f"elapsed {duration(elapsed)}")
    parts.append(f"ETA {duration(eta)}" if eta is not None else "ETA n/a")
    return f"[{tag}] " + " · ".join(parts)


class Progress:
    """The bar or the lines of one training segment (``initial``: the step it resumes from)."""

    def __init__(self, style: str, tag: str, total: int, initial: int, name: str,
                 stream: TextIO | None = None) -> None:
        self.style, self.tag, self.total = style, tag, total
        self.stream = sys.stderr if stream is None else stream
        self.bar: Any = None
        if style == BAR:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=f"{name} train", unit="step", dynamic_ncols=True,
                            file=self.stream)

    def step(self, loss: float, lr: float, last_ppl: float | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}"}
            if last_ppl is not None:
                post["val_ppl"] = f"{last_ppl:.2f}"
            self.bar.set_postfix(post, refresh=False)

    def evaluation(self, step: int, train_loss: float | None, eval_ppl: float | None,
                   tokens_per_sec: float | None, elapsed: float, seconds_per_step: float | None) -> None:
        """``seconds_per_step``: wall seconds a step has cost in this segment, evaluations included (for the ETA)."""
        if self.style != LINES:
            return
        eta = seconds_per_step * (self.total - step) if seconds_per_step is not None else None
        print(progress_line(self.tag, step, self.total, train_loss, eval_ppl, tokens_per_sec, elapsed, eta),
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
