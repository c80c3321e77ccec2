"""Data-layer timings: cold cache build and warm load, per corpus, written as CSV.

    python benchmarks/bench_data.py [--out bench/data.csv] [--loads 5]

Each corpus is built into a fresh temporary cache directory, so ``build_s`` is the cold
path a new checkout pays once: archive sha256, unpacking, source checks, tokenizing, the
vocabulary, writing the arrays. ``load_s`` is the median in-process reload of the built cache (settings, source
fingerprint, manifest, vocabulary, memory-mapped arrays, id range check); ``load_new_process_s``
is the same in a fresh interpreter, including ``import pcaf_core.data`` but not interpreter
start-up. Corpora that are not present (pg19-mini without ../shared/data or $PCAF_DATA_DIR)
are reported and skipped.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pcaf_core.config import DataConfig  # noqa: E402
from pcaf_core.data import DataNotFoundError, load_corpus  # noqa: E402

CORPORA = [("wikitext2", 20000), ("pg19_mini", 32000)]

_LOAD_IN_NEW_PROCESS = """
import time
t0 = time.perf_counter()
from pcaf_core.config import DataConfig
from pcaf_core.data import load_corpus
load_corpus(DataConfig(name={name!r}, max_vocab={vocab}, cache_dir={cache!r}))
print(time.perf_counter() - t0)
"""


def bench(name: str, max_vocab: int, loads: int) -> dict[str, object] | None:
    with tempfile.TemporaryDirectory(prefix="pcaf-bench-") as cache:
        cfg = DataConfig(name=name, max_vocab=max_vocab, cache_dir=cache)
        t0 = time.perf_counter()
        try:
            corpus = load_corpus(cfg)
        except DataNotFoundError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            return None
        build_s = time.perf_counter() - t0
        times = []
        for _ in range(loads):
            t0 = time.perf_counter()
            again = load_corpus(cfg)
            times.append(time.perf_counter() - t0)
            assert again.manifest["build"]["created_utc"] == corpus.manifest["build"]["created_utc"]
        code = _LOAD_IN_NEW_PROCESS.format(name=name, vocab=max_vocab, cache=cache)
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        splits = corpus.manifest["splits"]
        return {
            "corpus": name, "layout": corpus.settings.layout, "tokenizer": corpus.settings.tokenizer,
            "rows": corpus.settings.rows, "max_vocab": max_vocab, "vocab_size": corpus.vocab_size,
            "train_documents": splits["train"]["documents"], "train_tokens": splits["train"]["total_tokens"],
            "validation_tokens": splits["validation"]["total_tokens"], "test_tokens": splits["test"]["total_tokens"],
            "build_s": round(build_s, 3),
            "load_s": round(statistics.median(times), 4), "load_new_process_s": round(float(r.stdout.strip()), 4),
            "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "data.csv"))
    ap.add_argument("--loads", type=int, default=5, help="in-process reloads to take the median of")
    args = ap.parse_args()
    rows = [r for r in (bench(n, v, args.loads) for n, v in CORPORA) if r is not None]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'corpus':<11}{'vocab':>7}{'train tokens':>14}{'build s':>9}{'load s':>8}{'new proc s':>11}")
    for r in rows:
        print(f"{r['corpus']:<11}{r['vocab_size']:>7,}{r['train_tokens']:>14,}{r['build_s']:>9.2f}"
              f"{r['load_s']:>8.3f}{r['load_new_process_s']:>11.3f}")
    print(f"written to {out} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
