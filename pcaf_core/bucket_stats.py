"""Bucket occupancy and recall of the context route on real text (the paper's limitation 4).

The split is cut into non-overlapping windows of T tokens; in each, every position t is a full-AR query
(records ``s < t`` of the window, target ``x_{t+1}``), as in training. For a query t whose bucket holds
``r_t`` earlier records (its rank inside the bucket), the route's K candidates are, under ``recent``, the
records of bucket ranks ``r_t - K .. r_t - 1`` and, under ``first``, ranks ``0 .. K-1``. The target is
recalled when one candidate's value ``x_{s+1}`` equals it, i.e. when an earlier record carries the same
(address, successor) pair as the query's own record. So, with s* the latest and s⁰ the earliest earlier
record of that pair:

* ``recent`` recalls iff ``r_t - rank(s*) <= K``; ``first`` recalls iff ``rank(s⁰) < K``;
* ``bucket`` (any policy, unbounded K) recalls iff s* exists: the address's own ceiling;
* ``window``: the target occurs as a successor anywhere earlier in the window (any address): the
  ceiling of a cache that reads every record;
* ``overflow(K)``: ``r_t > K`` (the bucket holds more earlier records than the route can keep);
* ``mass``: the fraction of the query's candidates whose successor is the target (0 without a candidate):
  the cache probability of the target under uniform weights, i.e. how much of what the route reads is
  useful (recall counts a query once a single candidate matches);
* ``random-K``: K records drawn uniformly from the t earlier records of the window, no address: recalls
  with probability ``1 - C(t - c_t, K) / C(t, K)``, c_t the earlier records carrying the target (exact
  expectation, no sampling).

One sort per window gives every K at once (exact: ``tests/test_bucket_stats.py`` checks them against
:func:`pcaf_core.routing.route_context`). ``topk_score`` ranks by the model's ``q_t·k_s/√d + ρ·r_s`` and
needs a trained model's keys (:func:`topk_gap`). Controls: a random-hash route (every position gets a
uniformly random bucket, so the address carries no context), random-K (the same read budget without an
address) and capacity 1 (``recent`` with K = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import gammaln

from pcaf_core import hashing

NO_HIT = np.iinfo(np.int64).max  # gap / rank of a query whose target no earlier record carries


@dataclass
class QueryStats:
    """Per-query statistics of a batch of windows, flattened ``[N]``.

    occupancy: ``r_t``, earlier records in the query's bucket; recent_gap: ``r_t - rank(s*)`` (NO_HIT when
    no earlier record carries the pair); first_rank: ``rank(s⁰)`` (NO_HIT likewise); in_window: the target
    occurs as an earlier successor in the window; same_value: c_t, earlier records carrying the target;
    position: t (earlier records of the window); bucket_sizes: records per non-empty bucket per window;
    mass_recent / mass_first: K -> mean fraction of the K candidates carrying the target.
    """

    occupancy: np.ndarray
    recent_gap: np.ndarray
    first_rank: np.ndarray
    in_window: np.ndarray
    same_value: np.ndarray
    position: np.ndarray
    bucket_sizes: np.ndarray
    mass_recent: dict[int, float]
    mass_first: dict[int, float]


def windows(tokens: np.ndarray, seq_len: int, max_windows: int = 0) -> np.ndarray:
    """``[W, T+1]`` non-overlapping windows of ``tokens`` with each window's next token (the last target)."""
    x = np.asarray(tokens, dtype=np.int64)
    W = (len(x) - 1) // seq_len
    if max_windows:
        W = min(W, max_windows)
    if W < 1:
        raise ValueError(f"the split has {len(x)} tokens: fewer than one window of T={seq_len} plus a target")
    idx = np.arange(W)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return x[idx]


def _ranks(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ``[W, T]`` int64 group keys: each position's rank within its group (in position order), the
    position of the previous member (-1 if first) and of the group's first member."""
    W, T = keys.shape
    pos = np.broadcast_to(np.arange(T), (W, T))
    order = np.lexsort((pos, keys), axis=-1)
    sk = np.take_along_axis(keys, order, -1)
    start = np.ones((W, T), dtype=bool)
    start[:, 1:] = sk[:, 1:] != sk[:, :-1]
    slot = np.broadcast_to(np.arange(T), (W, T))
    seg = np.maximum.accumulate(np.where(start, slot, 0), axis=-1)
    rank_sorted = slot - seg
    prev_sorted = np.where(start, -1, np.take_along_axis(order, np.maximum(slot - 1, 0), -1))
    first_sorted = np.take_along_axis(order, seg, -1)
    rank, prev, first = (np.empty((W, T), dtype=np.int64) for _ in range(3))
    rows = np.arange(W)[:, None]
    rank[rows, order] = rank_sorted
    prev[rows, order] = prev_sorted
    first[rows, order] = first_sorted
    return rank, prev, first


def _candidate_matches(rank: np.ndarray, pair: np.ndarray, ks: list[int]) -> tuple[dict, dict]:
    """Mean fraction of matching candidates under ``recent`` and ``first`` for each K.

    Records of one (address, successor) pair have increasing bucket ranks, so with every pair's members
    laid out in one sorted array of ``group·(T+1) + bucket rank``, the matching candidates of query t are a
    contiguous run before t's own entry: those with bucket rank ``>= r_t - K`` (recent) or ``< K`` (first).
    """
    W, T = rank.shape
    groups = np.unique((np.arange(W)[:, None] * (int(pair.max()) + 1) + pair).ravel(), return_inverse=True)[1]
    comp = groups.astype(np.int64) * (T + 1) + rank.ravel()
    order = np.argsort(comp, kind="stable")
    comp_sorted = comp[order]
    own = np.empty_like(order)
    own[order] = np.arange(order.size)  # t's index in the sorted array; its earlier pair members precede it
    base = groups.astype(np.int64) * (T + 1)
    start = np.searchsorted(comp_sorted, base, "left")
    r = rank.ravel()
    recent, first = {}, {}
    for K in ks:
        n_cand = np.minimum(r, K)
        lo = np.maximum(np.searchsorted(comp_sorted, base + np.maximum(r - K, 0), "left"), start)
        hi = np.searchsorted(comp_sorted, base + n_cand, "left")
        with np.errstate(invalid="ignore", divide="ignore"):
            recent[K] = float(np.mean(np.where(n_cand > 0, (own - lo) / n_cand, 0.0)))
            first[K] = float(np.mean(np.where(n_cand > 0, (hi - start) / n_cand, 0.0)))
    return recent, first


def query_stats(addresses: np.ndarray, win: np.ndarray, ks: list[int] = ()) -> QueryStats:
    """Statistics of every query of windows ``win`` ``[W, T+1]`` under bucket ``addresses`` ``[W, T]``;
    ``ks``: the capacities whose candidate mass is computed."""
    addr = np.asarray(addresses, dtype=np.int64)
    W, T = addr.shape
    succ = win[:, 1:]  # x_{t+1}: the value of record t and the target of query t
    rank, _, _ = _ranks(addr)
    pair = addr * (int(succ.max()) + 1) + succ
    _, prev, first = _ranks(pair)
    rows = np.arange(W)[:, None]
    seen = prev >= 0
    gap = np.where(seen, rank - rank[rows, np.maximum(prev, 0)], NO_HIT)
    first_rank = np.where(seen, rank[rows, first], NO_HIT)
    value_rank, prev_value, _ = _ranks(succ)
    sizes = np.concatenate([np.bincount(np.unique(a, return_inverse=True)[1]) for a in addr])
    position = np.broadcast_to(np.arange(T), (W, T)).ravel()
    mass_recent, mass_first = _candidate_matches(rank, pair, list(ks))
    return QueryStats(rank.ravel(), gap.ravel(), first_rank.ravel(), (prev_value >= 0).ravel(), value_rank.ravel(),
                      position, sizes, mass_recent, mass_first)


def random_k_mass(stats: QueryStats) -> float:
    """Mean fraction of K uniformly drawn earlier records carrying the target: ``c_t / t`` for any K."""
    t = stats.position.astype(np.float64)
    return float(np.mean(np.where(t > 0, stats.same_value / np.maximum(t, 1), 0.0)))


def random_k_recall(stats: QueryStats, K: int) -> float:
    """Mean recall of K records drawn uniformly without replacement from each query's t earlier records:
    ``1 - C(t - c, K) / C(t, K)`` (all t records when t <= K)."""
    t, c = stats.position.astype(np.float64), stats.same_value.astype(np.float64)
    k = np.minimum(K, t)
    miss_possible = t - c >= k
    # log C(t - c, k) - log C(t, k), where both exist.
    log_miss = (gammaln(t - c + 1) - gammaln(t - c - k + 1) - gammaln(t + 1) + gammaln(t - k + 1))
    miss = np.where(miss_possible, np.exp(np.where(miss_possible, log_miss, 0.0)), 0.0)
    return float(np.mean(np.where(c > 0, 1.0 - miss, 0.0)))


def random_addresses(shape: tuple[int, ...], num_buckets: int, seed: int) -> np.ndarray:
    """The random-hash control: every position in a uniformly random bucket (no context in the address)."""
    return np.random.default_rng(seed).integers(0, num_buckets, shape)


def context_addresses(win: np.ndarray, order: int, num_buckets: int) -> np.ndarray:
    """The context route's addresses of windows ``[W, T+1]`` (zeros left of each window, as in training)."""
    return hashing.addresses(win[:, :-1], order, num_buckets)


def topk_gap(addresses: np.ndarray, win: np.ndarray, query: np.ndarray, keys: np.ndarray, rho: float,
             denominator: int) -> np.ndarray:
    """``topk_score`` recall statistic of every query, ``[W·T]``: the rank (0-based, descending
    ``q_t·k_s/√d + ρ·s/D``, ties to the lower index) of the best-ranked earlier same-bucket record whose
    value is the target, NO_HIT when there is none; the route recalls iff it is below K.

    query / keys: ``[W, T, d]`` unit vectors of the windows; dense ``[T, T]`` scores per window.
    """
    W, T = addresses.shape
    succ = win[:, 1:]
    out = np.full((W, T), NO_HIT, dtype=np.int64)
    pos = np.arange(T)
    earlier = pos[None, :] < pos[:, None]  # [t, s]: s < t
    for w in range(W):
        score = query[w] @ keys[w].T / np.sqrt(query.shape[-1]) + rho * pos[None, :] / denominator
        ok = earlier & (addresses[w][None, :] == addresses[w][:, None])
        match = ok & (succ[w][None, :] == succ[w][:, None])
        # The best matching record: highest score, ties to the lower index (the first argmax).
        masked = np.where(match, score, -np.inf)
        best = np.argmax(masked, axis=1)
        best_score = masked[pos, best]
        above = ok & ((score > best_score[:, None]) | ((score == best_score[:, None]) & (pos[None, :] < best[:, None])))
        hit = match.any(axis=1)
        out[w] = np.where(hit, above.sum(axis=1), NO_HIT)
    return out.ravel()


def recall_table(stats: QueryStats, k_values: list[int], topk: np.ndarray | None = None,
                 random_stats: QueryStats | None = None) -> list[dict[str, float]]:
    """One row per K: overflow and recall of each policy, the ceilings and the controls (fractions)."""
    rows = []
    for K in k_values:
        row = {
            "K": K,
            "overflow": float(np.mean(stats.occupancy > K)),
            "recall_recent": float(np.mean(stats.recent_gap <= K)),
            "recall_first": float(np.mean(stats.first_rank < K)),
            "recall_topk_score": float(np.mean(topk < K)) if topk is not None else float("nan"),
            "recall_bucket": float(np.mean(stats.recent_gap != NO_HIT)),
            "recall_window": float(np.mean(stats.in_window)),
            "recall_capacity1": float(np.mean(stats.recent_gap <= 1)),
            "recall_random_k": random_k_recall(stats, K),
            "mass_recent": stats.mass_recent.get(K, float("nan")),
            "mass_first": stats.mass_first.get(K, float("nan")),
            "mass_random_k": random_k_mass(stats),
            "empty": float(np.mean(stats.occupancy == 0)),
        }
        if random_stats is not None:
            row["recall_random_hash"] = float(np.mean(random_stats.recent_gap <= K))
            row["mass_random_hash"] = random_stats.mass_recent.get(K, float("nan"))
        rows.append(row)
    return rows


def occupancy_histogram(values: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Fractions of ``values`` in bins 0, 1, 2-3, 4-7, …, 1024+ (labels, fractions)."""
    edges = [0, 1, 2] + [2 ** i for i in range(2, 11)] + [np.iinfo(np.int64).max]
    labels = ["0", "1"] + [f"{2 ** i}-{2 ** (i + 1) - 1}" for i in range(1, 10)] + ["1024+"]
    counts = np.histogram(values, bins=edges)[0]
    return labels, counts / max(len(values), 1)
