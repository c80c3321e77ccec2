"""What every benchmark script shares: CSV writing, the machine/environment labels of a row, timing.

The labels name everything that decides a CPU number: the CPU model and cores, the vector and matrix units
that matter (AVX2, AVX-512, AVX-512 BF16, AMX), the library versions (read from package metadata, so a
torch-only process does not import JAX), the intra-op thread count, the glibc malloc tunables and oneMKL's
``MKL_CBWR`` mode (``backends/torch/runtime.py``: the labels set it as the torch backend does, so worker
processes started afterwards inherit what the label says).
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np

from pcaf_core.sysinfo import cpu_flags, machine_label

FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""CPU flags that decide matmul speed on a CPU: AVX2/FMA (fp32), AVX-512, and the bf16 matrix units."""


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """``rows`` as a CSV file (columns: every key, in first-seen order; missing cells empty), parent
    directories created."""
    if not rows:
        raise ValueError(f"no rows to write to {path}: the benchmark measured nothing")
    fields: dict[str, None] = {}
    for r in rows:
        fields.update(dict.fromkeys(r))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(fields))
        w.writeheader()
        w.writerows(rows)


def read_csv(path: str | Path) -> list[dict]:
    """The rows of a CSV file written by :func:`write_csv` (values as strings)."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def late_curve_gap(curve: list[dict]) -> float:
    """Largest ``abs_diff`` (nats between the fp32 and bf16 eval losses of ``benchmarks.precision_check``) after
    the first third of the run (steps past the last recorded step // 3); NaN when no row lies there."""
    last = max(int(r["step"]) for r in curve)
    late = [float(r["abs_diff"]) for r in curve if int(r["step"]) > last // 3]
    return max(late) if late else float("nan")


def package_version(name: str) -> str:
    """Installed version of ``name`` (package metadata; no import), or ``"absent"``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def environment_labels(threads: int | None = None, quick: bool = False) -> dict[str, object]:
    """The labels every benchmark row carries (module docstring). ``threads``: the intra-op thread count the
    process runs with (default: every core); ``quick``: the row comes from a ``--quick`` stand-in run
    (``bench_set`` quick, else full), which the report renderer never mixes with a full run."""
    from backends.torch.runtime import configure_mkl  # the torch workers' oneMKL mode, set here if not yet

    flags = cpu_flags()
    return {
        "machine": machine_label(),
        "cpu_flags": " ".join(f for f in FLAGS_THAT_MATTER if f in flags) or "none of " + ",".join(FLAGS_THAT_MATTER),
        "torch": package_version("torch"),
        "jax": package_version("jax"),
        "threads": threads if threads is not None else os.cpu_count(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "unset"),
        "mkl_cbwr": configure_mkl(),
        # backends/jax/runtime.py: unset or 0 = synchronous XLA:CPU dispatch, 1 = JAX's asynchronous default
        "jax_cpu_async_dispatch": os.environ.get("PCAF_JAX_CPU_ASYNC_DISPATCH", "unset"),
        "bench_set": "quick" if quick else "full",
    }


def labels_line(labels: dict) -> str:
    """The environment of a report in one line (``benchmarks.common.environment_labels``)."""
    return (f"machine: {labels['machine']} ({labels['cpu_flags']}); torch {labels['torch']}, jax {labels['jax']}; "
            f"{labels['threads']} threads (torch intra-op, XLA CPU pool); GLIBC_TUNABLES {labels['glibc_tunables']}; "
            f"MKL_CBWR {labels.get('mkl_cbwr', 'not recorded')}; "
            f"PCAF_JAX_CPU_ASYNC_DISPATCH {labels.get('jax_cpu_async_dispatch', 'not recorded')}")


def median_seconds(fn: Callable[[], object], warmup: int, repeats: int) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones; also the samples.
    ``fn`` must finish its work before returning (synchronise, or bring a value to the host)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def first_and_warm_steps(backend, state, x, y, warmup: int, lr: float = 1e-4):
    """A backend's first training step (compilation included) and ``warmup`` more, untimed:
    ``(state, first step's loss, first step's seconds)``."""
    t0 = time.perf_counter()
    state, loss = backend.train_step(state, x, y, lr)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        state, _ = backend.train_step(state, x, y, lr)
    return state, loss, first


def pipelined_steps(backend, state, x, y, steps: int, lr: float = 1e-4):
    """``steps`` training steps as a one-process run trains them (``pcaf_core.cadence``): each launched
    (``wait=False``) before the previous one's loss is read, the last one read at the end. Returns ``(state, mean
    seconds a step)``: the wall time of the whole run of steps over their number, from a device with nothing
    queued (the caller synchronises first)."""
    t0 = time.perf_counter()
    pending = None
    for _ in range(steps):
        state, loss = backend.train_step(state, x, y, lr, wait=False)
        if pending is not None:
            float(pending)
        pending = loss
    float(pending)
    return state, (time.perf_counter() - t0) / steps


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float] | None:
    """Distribution-free interval for the median of ``values`` (binomial order statistics: the k-th smallest
    and k-th largest, with k the largest rank whose two-sided miss probability stays within
    ``1 - confidence``); None when there are too few values for that confidence (fewer than 5 at 0.9)."""
    import math

    xs = sorted(values)
    n = len(xs)
    tail = (1.0 - confidence) / 2.0
    k, below = 0, 0.0  # below = P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2.0**n
        if nxt > tail:
            break
        k, below = k + 1, nxt
    return (xs[k - 1], xs[n - k]) if k else None


PAIRED_TIE = 0.03
"""Two steps whose speeds differ by at most this fraction count as equally fast (the spread of repeated side-by-side
measurements of one case)."""


def paired_speedup(base: dict, other: dict, tie: float = PAIRED_TIE) -> tuple[float, str, bool]:
    """(``other``'s speed over ``base``'s, a note on it, whether it is a tie), for two benchmark rows timed in the
    same rounds. From their ``step_times_ms`` (``;``-separated, one step of each per round): the median of the
    per-round base/other time ratios and its 90% distribution-free interval (:func:`median_interval`); without
    step times, the ratio of the rows' ``tokens_per_s``. A tie: within ``tie``, or an interval that holds 1 (the
    rounds do not say which is faster)."""
    def times(row: dict) -> list[float]:
        return [float(t) for t in str(row.get("step_times_ms") or "").split(";") if t]

    tb, to = times(base), times(other)
    n = min(len(tb), len(to))
    ratios = [tb[i] / to[i] for i in range(n)]
    x = statistics.median(ratios) if ratios else float(other["tokens_per_s"]) / float(base["tokens_per_s"])
    interval = median_interval(ratios) if ratios else None
    spread = f"90% interval {interval[0]:.2f}-{interval[1]:.2f} over {n} paired rounds" if interval else ""
    if abs(x - 1.0) <= tie:
        return x, "; ".join(filter(None, [f"a tie: within {tie:.0%}", spread])), True
    if interval and interval[0] <= 1.0 <= interval[1]:
        return x, f"a tie: {spread}", True
    return x, spread, False


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x): the exponent p of y ∝ x^p."""
    import math

    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    if den == 0:
        raise ValueError("a log-log slope needs at least two distinct x values")
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den


TEXT_VOCAB = 20000
"""The vocabulary of the WikiText-2 token cache the benchmarks draw their text from (the cpu scale's)."""


def text_tokens(n: int, batch: int, max_vocab: int = TEXT_VOCAB) -> tuple[np.ndarray, str]:
    """``[batch, n]`` consecutive stretches of WikiText-2 train with a ``max_vocab``-token vocabulary (random ids
    when the corpus is missing)."""
    try:
        from pcaf_core.config import DataConfig
        from pcaf_core.data import load_corpus

        train = np.asarray(load_corpus(DataConfig(name="wikitext2", layout="tokens", max_vocab=max_vocab)).train)
        starts = (np.arange(batch) * (len(train) // batch)) % max(len(train) - n, 1)
        if len(train) >= n:
            return np.stack([train[s:s + n] for s in starts]).astype(np.int64), "WikiText-2 train text"
    except Exception as exc:  # noqa: BLE001 - the benchmark still measures cost on random ids, and says so
        print(f"note: WikiText-2 unavailable ({exc}); using random ids", file=sys.stderr)
    return np.random.default_rng(0).integers(3, max_vocab, (batch, n)), "random ids"
