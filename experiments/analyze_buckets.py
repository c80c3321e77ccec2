"""Bucket occupancy and recall on real corpora (the paper's limitation 4): ``python -m experiments.analyze_buckets``.

Hydra app (``experiments/conf_tools/analyze_buckets.yaml``; ``-m`` sweeps): for one (data, T, B, n) it cuts
the evaluation split into windows of T, computes every query's bucket occupancy and recall statistics
(:mod:`pcaf_core.bucket_stats`) for the context route, a random-hash route and, with ``run_dir``, the
``topk_score`` policy of a trained run's keys, writes them as JSON under ``out_dir`` and re-renders the
report (``report``, default ``docs/results/buckets.md``, with its plots beside it) from every JSON there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from pcaf_core import bucket_stats
from pcaf_core.config import DataConfig

CORPORA = {  # the caches `make data` builds
    "wikitext2": DataConfig(name="wikitext2", layout="tokens", max_vocab=20000),
    "pg19_mini": DataConfig(name="pg19_mini", layout="raw", max_vocab=32000),
}


def _portable(arg: str) -> str:
    """A command-line argument as a committed report may show it: an absolute path in ``key=/path`` relative to the
    working directory, or its last five components when it lies elsewhere (never this machine's layout)."""
    key, sep, value = arg.partition("=")
    path = Path(value)
    if not sep or not path.is_absolute():
        return arg
    try:
        return f"{key}={path.relative_to(Path.cwd()).as_posix()}"
    except ValueError:
        return f"{key}=.../{Path(*path.parts[-5:]).as_posix()}"


def _k_values(k: Any) -> list[int]:
    values = [int(v) for v in (k if isinstance(k, (list, tuple)) or OmegaConf.is_list(k) else [k])]
    if not values or min(values) < 1:
        raise ValueError(f"K must be integers >= 1, got {k!r}")
    return sorted(set(values))


def run_ids(analysis_vocab: Any, run_vocab: Any) -> np.ndarray:
    """``[V_analysis] int64``: the run's id of every analysis token (``<unk>`` where the run's vocabulary
    lacks it), so a run trained on a smaller vocabulary of the same corpus reads the text as it was trained
    to, while addresses and recall stay on the analysis tokenization."""
    unk = run_vocab.stoi["<unk>"]
    return np.array([run_vocab.stoi.get(t, unk) for t in analysis_vocab.itos], dtype=np.int64)


def _topk_ranks(run_dir: str, data: str, win: np.ndarray, addr: np.ndarray, T: int,
                analysis_vocab: Any) -> tuple[np.ndarray, str]:
    """The topk_score statistic from a trained run's keys and queries (the spec's forward, its profile)."""
    from pcaf_core.reference import hidden_states, l2_normalize
    from pcaf_core.trained_run import load_params, load_vocabulary, locate_run

    run = locate_run(run_dir)
    cfg = run.config
    if cfg.data.name != data:
        raise ValueError(f"run {run.run_dir} was trained on data={cfg.data.name}; its keys cannot rank {data} "
                         "(give run_dir only with its own corpus)")
    run_vocab, _ = load_vocabulary(run)
    model_win = run_ids(analysis_vocab, run_vocab)[win]
    params = {k: v.astype(np.float64) for k, v in load_params(run).items()}
    W = win.shape[0]
    q = np.empty((W, T, cfg.model.d_model))
    k = np.empty_like(q)
    for w0 in range(0, W, 8):
        h = hidden_states(params, model_win[w0:w0 + 8, :T], cfg.model, cfg.profile)
        k[w0:w0 + 8] = l2_normalize(h @ params["memory.key.weight"], cfg.profile.l2norm)
        q[w0:w0 + 8] = l2_normalize(h @ params["memory.query.weight"], cfg.profile.l2norm)
    rho = float(params["memory.recency_scale"])
    described = run.describe()
    if len(run_vocab) != len(analysis_vocab):
        described += (f"; its vocabulary of {len(run_vocab):,} reads the words outside it (of the analysis's "
                      f"{len(analysis_vocab):,}) as <unk>")
    return bucket_stats.topk_gap(addr, win, q, k, rho, max(T - 1, 1)), described


def analyze(cfg: DictConfig) -> Path:
    """Compute one configuration's statistics, write its JSON, re-render the report; returns the JSON path."""
    from pcaf_core.data import load_corpus

    if cfg.data not in CORPORA:
        raise ValueError(f"data={cfg.data!r} is unknown: expected one of {sorted(CORPORA)}")
    T, B, n, ks = int(cfg.T), int(cfg.B), int(cfg.n), _k_values(cfg.K)
    start = time.perf_counter()
    data = CORPORA[cfg.data]
    corpus = load_corpus(data)
    tokens = corpus.split(cfg.split)
    win = bucket_stats.windows(tokens, T, int(cfg.max_windows))
    addr = bucket_stats.context_addresses(win, n, B)
    stats = bucket_stats.query_stats(addr, win, ks)
    rand = bucket_stats.query_stats(bucket_stats.random_addresses(addr.shape, B, int(cfg.seed)), win, ks)
    topk, topk_run = (None, None)
    if cfg.run_dir:
        topk, topk_run = _topk_ranks(str(cfg.run_dir), cfg.data, win, addr, T, corpus.vocab)
    rows = bucket_stats.recall_table(stats, ks, topk, rand)
    labels, frac = bucket_stats.occupancy_histogram(stats.occupancy)
    size_labels, size_frac = bucket_stats.occupancy_histogram(stats.bucket_sizes)
    record = {
        "data": cfg.data, "split": cfg.split, "T": T, "B": B, "n": n, "windows": int(win.shape[0]),
        "queries": int(stats.occupancy.size), "vocab": len(corpus.vocab), "seed": int(cfg.seed),
        "topk_run": topk_run, "rows": rows,
        "occupancy_hist": dict(zip(labels, map(float, frac), strict=True)),
        "bucket_size_hist": dict(zip(size_labels, map(float, size_frac), strict=True)),
        "occupancy_mean": float(stats.occupancy.mean()), "occupancy_p99": float(np.percentile(stats.occupancy, 99)),
        "occupancy_max": int(stats.occupancy.max()),
        "buckets_per_window": float(len(stats.bucket_sizes) / win.shape[0]),
        "seconds": time.perf_counter() - start,
        "command": "python -m experiments.analyze_buckets " + " ".join(map(_portable, sys.argv[1:])),
    }
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "_topk" if topk is not None else ""
    path = out_dir / f"{cfg.data}_T{T}_B{B}_n{n}_K{'-'.join(map(str, ks))}{tag}.json"
    from pcaf_core.fsutil import atomic_write_text

    atomic_write_text(path, json.dumps(record, indent=1))
    for r in rows:
        # topk_score ranks a trained run's keys: not measured without run_dir (NaN in the record).
        ranked = "n/a (run_dir=<a trained run> measures it)" if topk is None else f"{r['recall_topk_score']:.3f}"
        print(f"[buckets data={cfg.data} split={cfg.split} T={T} B={B} n={n} K={r['K']}] overflow {r['overflow']:.3f} "
              f"recall recent {r['recall_recent']:.3f} first {r['recall_first']:.3f} "
              f"topk_score {ranked} random-hash {r['recall_random_hash']:.3f} "
              f"(bucket ceiling {r['recall_bucket']:.3f}, window ceiling {r['recall_window']:.3f})")
    if cfg.report:
        from experiments.bucket_report import render

        print(f"report: {render(out_dir, Path(cfg.report))}")
    return path


@hydra.main(version_base="1.3", config_path="conf_tools", config_name="analyze_buckets")
def main(cfg: DictConfig) -> None:
    try:
        analyze(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
