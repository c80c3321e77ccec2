"""The results the README and ``docs/results/README.md`` quote in prose come from the committed result files.

Those pages restate, by hand, numbers of the rendered tables and benchmarks beside them (best and full-split
PPL, accuracies). A table rendered again from new run records changes its CSV; a sentence that still quotes the
old figure would then state a result no file holds. Every perplexity-like number of those pages (two decimals,
10 to 999.99) and every four-decimal fraction must therefore be a value of some CSV under ``docs/results`` (to
the page's rounding), or be one of :data:`QUOTED_FROM_RUNS_NOT_COMMITTED`, each with the reason its source is not
there.
"""

from __future__ import annotations

import bisect
import csv
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = ("README.md", "docs/results/README.md")
PPL_LIKE = re.compile(r"(?<![\d.,])(\d{2,3}\.\d{2})(?![\d.])")
FRACTION = re.compile(r"(?<![\d.])(0\.\d{4})(?![\d.])")
QUOTED_FROM_RUNS_NOT_COMMITTED = {
    "114.88": "wt103-nt-baselines cpu local conv's best PPL at ff27a7f, the run before the one its table holds",
    "135.21": "sweeps-41m cpu S=128 full-AR best PPL of the 320-step budget (rerun at bc57dc1), before 640 steps",
    "133.40": "the same row's best PPL at e566763, the same earlier budget",
    "83.56": "best PPL of the stream model's own training run (outputs/stream/pcaf_context_recent), no table row",
}
"""Numbers the pages quote from runs whose records are not committed (earlier runs of a row, a model trained for
the stream protocol): the pages say where each comes from."""


def committed_values() -> list[float]:
    """Every number in every cell of the CSVs under ``docs/results`` (run records aside), sorted; a cell may
    hold several (``;``- or space-separated, ``key=value``)."""
    values = set()
    for path in RESULTS.rglob("*.csv"):
        if "runs" in path.relative_to(RESULTS).parts:
            continue
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.reader(fh):
                for cell in row:
                    for token in re.split(r"[;\s=]+", cell):
                        try:
                            values.add(float(token.replace(",", "")))
                        except ValueError:
                            continue
    return sorted(values)


def _held(value: float, values: list[float], half_unit: float) -> bool:
    """Whether some committed value rounds to ``value`` (within half its last digit, float error included)."""
    i = bisect.bisect_left(values, value - half_unit - 1e-9)
    return i < len(values) and values[i] <= value + half_unit + 1e-9


@pytest.mark.parametrize("page", PAGES)
def test_quoted_results_are_values_of_committed_files(page: str) -> None:
    values = committed_values()
    text = (ROOT / page).read_text(encoding="utf-8")
    quoted = {(n, 0.005) for n in PPL_LIKE.findall(text)} | {(n, 0.00005) for n in FRACTION.findall(text)}
    assert len(quoted) >= 5, f"{page}: the pattern found too few numbers to check anything"
    unheld = sorted(n for n, half in quoted if n not in QUOTED_FROM_RUNS_NOT_COMMITTED
                    and not _held(float(n), values, half))
    assert not unheld, (f"{page} quotes {unheld}, in no CSV under docs/results: bring the sentence up to date with "
                        "the rendered table, or name the run it comes from in QUOTED_FROM_RUNS_NOT_COMMITTED")


def test_every_exception_is_still_quoted() -> None:
    """An exception no page quotes any more is dropped, so the list keeps saying what the pages hold."""
    text = "\n".join((ROOT / page).read_text(encoding="utf-8") for page in PAGES)
    assert [n for n in QUOTED_FROM_RUNS_NOT_COMMITTED if n not in text] == []


def test_a_stale_figure_is_caught() -> None:
    """The check fails on a number that no file holds and passes on one rounded from a held value."""
    values = sorted([97.505, 238.69, 0.2019])
    assert _held(97.51, values, 0.005) and _held(97.50, values, 0.005)
    assert _held(238.69, values, 0.005) and not _held(238.71, values, 0.005)
    assert _held(0.2019, values, 0.00005) and not _held(0.2021, values, 0.00005)
