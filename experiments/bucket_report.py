"""The bucket analysis report (``docs/results/buckets.md`` and its plots) from the JSON files that
``python -m experiments.analyze_buckets`` writes; re-rendered after every job, so a sweep ends complete."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PAPER_B, PAPER_N, PAPER_K = 32768, 1, 16
POLICIES = (("recall_recent", "recent"), ("recall_first", "first"), ("recall_topk_score", "topk_score"),
            ("recall_random_hash", "random-hash"), ("recall_random_k", "random-K"))
DATA_TITLES = {"wikitext2": "WikiText-2", "pg19_mini": "pg19-mini"}


def load_records(out_dir: Path) -> dict[tuple, dict[str, Any]]:
    """``(data, split, T, B, n) -> record`` with the rows of every file of that configuration merged by K (a
    file with the topk_score column wins for its K values)."""
    merged: dict[tuple, dict[str, Any]] = {}
    for path in sorted(Path(out_dir).glob("*.json"), key=lambda p: (p.name.endswith("_topk.json"), p.name)):
        rec = json.loads(path.read_text())
        key = (rec["data"], rec["split"], rec["T"], rec["B"], rec["n"])
        cur = merged.setdefault(key, {**rec, "rows": {}, "seconds": 0.0, "commands": []})
        for row in rec["rows"]:
            cur["rows"][row["K"]] = row
        if rec.get("topk_run"):
            cur["topk_run"] = rec["topk_run"]
        cur["seconds"] += rec["seconds"]
        cur["commands"].append(rec["command"])
    return merged


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _row(rec: dict[str, Any], K: int) -> dict[str, Any] | None:
    return rec["rows"].get(K)


def _answer(records: dict[tuple, dict[str, Any]]) -> list[str]:
    """The paragraph answering limitation 4, with the numbers of the paper's address (B = 32768, n = 1)."""
    out = []
    for (data, split, T, B, n), rec in sorted(records.items()):
        if (B, n) != (PAPER_B, PAPER_N) or T != 1024 or PAPER_K not in rec["rows"]:
            continue
        r, top = rec["rows"][PAPER_K], rec["rows"][max(rec["rows"])]
        name = f"{DATA_TITLES.get(data, data)} ({split}, T = {T}, B = {B}, n = {n})"
        topk = "" if math.isnan(r["recall_topk_score"]) else f", `topk_score` {_pct(r['recall_topk_score'])}%"
        out.append(
            f"On {name}, {_pct(r['empty'])}% of queries find their bucket empty and {_pct(r['overflow'])}% find more "
            f"than K = {PAPER_K} earlier records in it (mean occupancy {rec['occupancy_mean']:.1f}, 99th percentile "
            f"{rec['occupancy_p99']:.0f}, largest {rec['occupancy_max']}). The address alone could recall the next "
            f"token for {_pct(r['recall_bucket'])}% of queries (some earlier record of the bucket carries it; "
            f"{_pct(r['recall_window'])}% for a cache that read the whole window); with K = {PAPER_K}, `recent` keeps "
            f"{_pct(r['recall_recent'])}% ({_pct(r['recall_recent'] / max(r['recall_bucket'], 1e-12))}% of the "
            f"address's ceiling) and `first` {_pct(r['recall_first'])}%{topk}; at K = {top['K']} `recent` "
            f"reaches {_pct(top['recall_recent'])}%. Without the address, a random-hash route with the same B and K "
            f"recalls {_pct(r['recall_random_hash'])}% and K = {PAPER_K} random earlier records "
            f"{_pct(r['recall_random_k'])}%; a capacity-1 bucket (`recent`, K = 1) recalls "
            f"{_pct(r['recall_capacity1'])}%. Recall counts a query once one candidate matches; what the address "
            f"buys shows in the fraction of read candidates that carry the target: {_pct(r['mass_recent'])}% of "
            f"`recent`'s K = {PAPER_K} candidates against {_pct(r['mass_random_k'])}% of K random earlier records "
            f"(the cache probability of the target under uniform weights)." + _sweep_sentence(records, data, T))
    return out


def _sweep_sentence(records: dict[tuple, dict[str, Any]], data: str, T: int) -> str:
    """How B (n = 1) and n (B = 32768) move recall and occupancy at K = 16, for one corpus and T."""
    by_b = sorted((k[3], r["rows"][PAPER_K]) for k, r in records.items()
                  if k[0] == data and k[2] == T and k[4] == PAPER_N and PAPER_K in r["rows"])
    by_n = sorted((k[4], r["rows"][PAPER_K]) for k, r in records.items()
                  if k[0] == data and k[2] == T and k[3] == PAPER_B and PAPER_K in r["rows"])
    out = ""
    if len(by_b) > 1:
        rec = [x["recall_recent"] for _, x in by_b]
        out += (f" From B = {by_b[0][0]} to {by_b[-1][0]} `recent` recall moves by {_pct(max(rec) - min(rec))} points "
                "(a window holds far fewer distinct contexts than buckets).")
    for n, x in by_n:
        if n > 1:
            out += (f" With n = {n}, {_pct(x['empty'])}% of queries find their bucket empty and `recent` recalls "
                    f"{_pct(x['recall_recent'])}%.")
    return out


def _table_vs_k(records: dict[tuple, dict[str, Any]]) -> list[str]:
    lines = []
    for (data, split, T, B, n), rec in sorted(records.items()):
        if (B, n) != (PAPER_B, PAPER_N):
            continue
        title = f"{DATA_TITLES.get(data, data)} {split}, T = {T}, B = {B}, n = {n}"
        lines += ["", f"**{title}** ({rec['windows']} windows, {rec['queries']:,} queries)", "",
                  "| K | overflow | recent | first | topk_score | random-hash | random-K | bucket ceiling "
                  "| window ceiling |", "|---|---|---|---|---|---|---|---|---|"]
        for K in sorted(rec["rows"]):
            r = rec["rows"][K]
            lines.append(f"| {K} | {_pct(r['overflow'])} | {_pct(r['recall_recent'])} | {_pct(r['recall_first'])} | "
                         f"{_pct(r['recall_topk_score'])} | {_pct(r.get('recall_random_hash'))} | "
                         f"{_pct(r['recall_random_k'])} | {_pct(r['recall_bucket'])} | {_pct(r['recall_window'])} |")
    return lines


def _table_mass(records: dict[tuple, dict[str, Any]]) -> list[str]:
    lines = ["| data | T | K | recent | first | random-hash | random-K |", "|---|---|---|---|---|---|---|"]
    for (data, _split, T, B, n), rec in sorted(records.items()):
        if (B, n) != (PAPER_B, PAPER_N):
            continue
        for K in sorted(rec["rows"]):
            r = rec["rows"][K]
            lines.append(f"| {DATA_TITLES.get(data, data)} | {T} | {K} | {_pct(r.get('mass_recent'))} | "
                         f"{_pct(r.get('mass_first'))} | {_pct(r.get('mass_random_hash'))} | "
                         f"{_pct(r.get('mass_random_k'))} |")
    return lines


def _table_vs(records: dict[tuple, dict[str, Any]], vary: str) -> list[str]:
    """Rows over B (n = 1) or over n (B = 32768), K = 16, every data and T."""
    lines = [f"| data | T | {vary} | empty | overflow (K={PAPER_K}) | recent | first | random-hash | bucket ceiling "
             "| mean occupancy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (data, _split, T, B, n), rec in sorted(records.items()):
        if (vary == "B" and n != PAPER_N) or (vary == "n" and B != PAPER_B):
            continue
        r = _row(rec, PAPER_K)
        if r is None:
            continue
        lines.append(f"| {DATA_TITLES.get(data, data)} | {T} | {B if vary == 'B' else n} | {_pct(r['empty'])} | "
                     f"{_pct(r['overflow'])} | {_pct(r['recall_recent'])} | {_pct(r['recall_first'])} | "
                     f"{_pct(r.get('recall_random_hash'))} | {_pct(r['recall_bucket'])} | "
                     f"{rec['occupancy_mean']:.1f} |")
    return lines


def _histograms(records: dict[tuple, dict[str, Any]]) -> list[str]:
    chosen = [(k, r) for k, r in sorted(records.items()) if (k[3], k[4]) == (PAPER_B, PAPER_N)]
    if not chosen:
        return []
    bins = list(chosen[0][1]["occupancy_hist"])
    lines = ["| data | T | " + " | ".join(bins) + " |", "|---|---|" + "---|" * len(bins)]
    for (data, _, T, _, _), rec in chosen:
        lines.append(f"| {DATA_TITLES.get(data, data)} | {T} | "
                     + " | ".join(_pct(rec["occupancy_hist"][b]) for b in bins) + " |")
    return lines


def _plots(records: dict[tuple, dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    datas = sorted({k[0] for k in records})
    paper = {k: r for k, r in records.items() if (k[3], k[4]) == (PAPER_B, PAPER_N)}
    if paper:
        fig, axes = plt.subplots(1, len(datas), figsize=(5 * len(datas), 3.6), squeeze=False)
        for ax, data in zip(axes[0], datas, strict=True):
            for (d, _, T, _, _), rec in sorted(paper.items()):
                if d != data:
                    continue
                ks = sorted(rec["rows"])
                for (key, label), style in zip(POLICIES, ("-", "--", "-.", ":", (0, (1, 3))), strict=True):
                    ys = [rec["rows"][k].get(key, float("nan")) for k in ks]
                    if all(math.isnan(y) for y in ys):
                        continue
                    ax.plot(ks, [100 * y for y in ys], linestyle=style, marker="o", ms=3, label=f"{label}, T={T}")
                ax.axhline(100 * rec["rows"][ks[0]]["recall_bucket"], color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("K (records per bucket)")
            ax.set_ylabel("recall of the next token (%)")
            ax.set_title(f"{DATA_TITLES.get(data, data)}, B={PAPER_B}, n={PAPER_N} (grey: bucket ceiling)", fontsize=9)
            ax.legend(fontsize=6)
        fig.tight_layout()
        names.append(out.parent / f"{out.stem}_recall_vs_k.png")
        fig.savefig(names[-1], dpi=120)
        plt.close(fig)
    by_b = {k: r for k, r in records.items() if k[4] == PAPER_N and PAPER_K in r["rows"]}
    if len({k[3] for k in by_b}) > 1:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for data in datas:
            for T in sorted({k[2] for k in by_b if k[0] == data}):
                pts = sorted((k[3], r["rows"][PAPER_K]) for k, r in by_b.items() if k[0] == data and k[2] == T)
                bs = [b for b, _ in pts]
                ax.plot(bs, [100 * r["recall_recent"] for _, r in pts], "o-", ms=3,
                        label=f"{DATA_TITLES.get(data, data)} T={T} recent")
                ax.plot(bs, [100 * r["overflow"] for _, r in pts], "x--", ms=3,
                        label=f"{DATA_TITLES.get(data, data)} T={T} overflow")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("B (buckets)")
        ax.set_ylabel(f"% of queries (K={PAPER_K}, n={PAPER_N})")
        ax.legend(fontsize=6)
        fig.tight_layout()
        names.append(out.parent / f"{out.stem}_vs_b.png")
        fig.savefig(names[-1], dpi=120)
        plt.close(fig)
    return [f"![{p.stem}]({p.name})" for p in names]


def render(out_dir: Path, report: Path) -> Path:
    """Write ``report`` (Markdown) and its plots beside it from the JSON files of ``out_dir``."""
    from pcaf_core.fsutil import atomic_write_text

    records = load_records(out_dir)
    report.parent.mkdir(parents=True, exist_ok=True)
    plots = _plots(records, report) if records else []
    seconds = sum(r["seconds"] for r in records.values())
    lines = [
        "# Bucket occupancy and recall of the context route (the paper's limitation 4)", "",
        "The paper's fourth limitation: a bucket keeps at most K records, so repetitive text could crowd a "
        "bucket and lose recall; it asks for occupancy statistics and the effect of K on recall. Here every "
        "evaluation split is cut into windows of T tokens and every position is a full-AR query (records of "
        "the window before it, target the next token). A query *recalls* when one of its K candidates' "
        "successor is the target. Definitions and the exact computation: `pcaf_core/bucket_stats.py`, checked "
        "against the spec's routes in `tests/test_bucket_stats.py`. Numbers are % of queries.", "",
        "- *overflow*: the query's bucket holds more than K earlier records; *empty*: none.",
        "- *mass*: the fraction of the read candidates whose successor is the target (uniform weights).",
        "- *recent* / *first* / *topk_score*: the candidate policies (topk_score ranks by a trained model's "
        "q·k/√d + ρ·r and needs its run; n/a without one).",
        "- *bucket ceiling*: some earlier record of the bucket carries the target (any policy with unbounded K); "
        "*window ceiling*: the target occurs as a successor anywhere earlier in the window (a cache reading "
        "every record).",
        "- Controls: *random-hash* puts every position in a uniformly random bucket (same B, K, `recent`), so "
        "the address carries no context; *random-K* reads K records drawn uniformly from the window's earlier "
        "records (the same read budget without an address; exact expectation); *capacity-1* is `recent` with "
        "K = 1.", "",
        "## Answer", "",
    ] + (_answer(records) or ["(no run at the paper's address B = 32768, n = 1, T = 1024 yet)"]) + [
        "", "## 1. Recall and overflow against K (B = 32768, n = 1)",
    ] + _table_vs_k(records) + [""] + plots[:1] + [
        "", f"### Fraction of the read candidates that carry the target (B = {PAPER_B}, n = {PAPER_N})", "",
        "The mean over queries of (candidates whose successor is the target) / (candidates read), 0 without a "
        "candidate: the cache probability of the target if the K candidates were weighted uniformly.", "",
    ] + _table_mass(records) + [
        "", f"## 2. Against B (n = {PAPER_N}, K = {PAPER_K})", "",
    ] + _table_vs(records, "B") + [""] + plots[1:] + [
        "", f"## 3. Against the context order n (B = {PAPER_B}, K = {PAPER_K})", "",
    ] + _table_vs(records, "n") + [
        "", f"## 4. Occupancy: earlier records in the query's bucket (% of queries, B = {PAPER_B}, n = {PAPER_N})", "",
    ] + _histograms(records) + [
        "", "## How this was made", "",
        f"{len(records)} configurations, {seconds:.0f} s of computation in all (2-core CPU). Commands:", "",
    ] + [f"    {c}" for c in sorted({c for r in records.values() for c in r["commands"]})]
    topk_runs = sorted({r["topk_run"] for r in records.values() if r.get("topk_run")})
    lines += ["", "topk_score keys: " + ("; ".join(topk_runs) if topk_runs else
                                        "no trained run given (the column is n/a)")]
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report
