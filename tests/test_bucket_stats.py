"""Bucket occupancy and recall (:mod:`pcaf_core.bucket_stats`) against brute force with the spec's routes."""

from __future__ import annotations

import itertools

import numpy as np

from pcaf_core import bucket_stats, routing
from pcaf_core.mixture import selection_score


def _brute(addr, win, K, policy, score=None, mass=False):
    """Per query: the route's candidates (spec) hold the target (or: the fraction that do); and the
    bucket's earlier records."""
    W, T = addr.shape
    hits, occ = [], []
    for w in range(W):
        sel = None if score is None else score[w][None]
        cand = routing.route_context(addr[w][None], np.arange(T), K, policy, sel)
        values = win[w, 1:][np.clip(cand.index[0], 0, None)]
        match = (values == win[w, 1:][:, None]) & cand.valid[0]
        n = cand.valid[0].sum(-1)
        hits.append(np.where(n > 0, match.sum(-1) / np.maximum(n, 1), 0.0) if mass else match.any(-1))
        occ.append([np.sum(addr[w, :t] == addr[w, t]) for t in range(T)])
    return np.concatenate(hits), np.concatenate(occ)


def test_recall_and_overflow_equal_the_spec_routes_for_every_k():
    rng = np.random.default_rng(0)
    win = rng.integers(0, 6, (3, 41))
    for order, buckets in ((1, 4), (2, 5)):
        addr = bucket_stats.context_addresses(win, order, buckets)
        stats = bucket_stats.query_stats(addr, win, [1, 2, 5])
        rows = bucket_stats.recall_table(stats, [1, 2, 5])
        for row in rows:
            hit_r, occ = _brute(addr, win, row["K"], "recent")
            hit_f, _ = _brute(addr, win, row["K"], "first")
            assert row["recall_recent"] == np.mean(hit_r) and row["recall_first"] == np.mean(hit_f)
            assert abs(row["mass_recent"] - np.mean(_brute(addr, win, row["K"], "recent", mass=True)[0])) < 1e-12
            assert abs(row["mass_first"] - np.mean(_brute(addr, win, row["K"], "first", mass=True)[0])) < 1e-12
            assert row["overflow"] == np.mean(occ > row["K"])
            assert 0 < row["recall_recent"] < row["recall_bucket"] <= row["recall_window"]
        np.testing.assert_array_equal(stats.occupancy, occ)
        assert rows[0]["recall_capacity1"] == rows[0]["recall_recent"]  # K = 1


def test_topk_score_rank_equals_the_spec_route():
    rng = np.random.default_rng(1)
    W, T, d = 2, 30, 4
    win = rng.integers(0, 5, (W, T + 1))
    addr = bucket_stats.context_addresses(win, 1, 3)
    q = rng.normal(size=(W, T, d))
    k = rng.normal(size=(W, T, d))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    rank = bucket_stats.topk_gap(addr, win, q, k, rho=0.8, denominator=T - 1)
    rec = np.arange(T) / (T - 1)
    score = np.stack([selection_score(q[w][None], k[w][None], rec, 0.8)[0] for w in range(W)])
    for K in (1, 3, 8):
        hit, _ = _brute(addr, win, K, "topk_score", score)
        np.testing.assert_array_equal(rank < K, hit)


def test_random_hash_control_and_histogram():
    win = np.tile(np.arange(8), (2, 9))[:, :65]  # a repeating text: the context route recalls it all
    stats = bucket_stats.query_stats(bucket_stats.context_addresses(win, 1, 16), win)
    rand = bucket_stats.query_stats(bucket_stats.random_addresses((2, 64), 16, seed=0), win)
    row = bucket_stats.recall_table(stats, [2], random_stats=rand)[0]
    assert row["recall_recent"] == row["recall_window"] > row["recall_random_hash"]
    labels, frac = bucket_stats.occupancy_histogram(stats.occupancy)
    assert len(labels) == len(frac) and abs(frac.sum() - 1) < 1e-12 and frac[0] == 16 / 128


def test_random_k_recall_is_the_exact_expectation_of_k_random_earlier_records():
    rng = np.random.default_rng(2)
    win = rng.integers(0, 4, (1, 13))
    stats = bucket_stats.query_stats(bucket_stats.context_addresses(win, 1, 8), win)
    succ = win[0, 1:]
    for K in (1, 3, 20):
        want = []
        for t in range(12):  # enumerate every K-subset of the t earlier records
            subsets = list(itertools.combinations(range(t), min(K, t)))
            want.append(np.mean([any(succ[s] == succ[t] for s in sub) for sub in subsets]) if t else 0.0)
        assert abs(bucket_stats.random_k_recall(stats, K) - np.mean(want)) < 1e-12
