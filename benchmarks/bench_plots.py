"""The figures of ``docs/results/bench.md``: routing cost against T, and training tokens/s per measured case.

Each figure is titled with the machine it was measured on and written to every path given (the page's copy and
the bench folder's).
"""

from __future__ import annotations

from pathlib import Path


def plot_routing(rows: list[dict], paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    backends = sorted({r["backend"] for r in ok})
    fig, axes = plt.subplots(2, len(backends), figsize=(5 * len(backends), 7), squeeze=False)
    for j, b in enumerate(backends):
        for route in sorted({r["route"] for r in ok if r["backend"] == b}):
            pts = sorted((int(r["T"]), r) for r in ok if r["backend"] == b and r["route"] == route)
            xs = [t for t, _ in pts]
            axes[0][j].plot(xs, [float(r["fwd_bwd_ms"]) for _, r in pts], "o-", label=route)
            mem = [(t, float(r["peak_mb"])) for t, r in pts if r.get("peak_mb") not in ("", None)]
            if mem:
                axes[1][j].plot([m[0] for m in mem], [m[1] for m in mem], "o-", label=route)
        for i, ylabel in enumerate(("forward + backward ms", "peak MB (intermediates)")):
            log_panel(axes[i][j], "T (tokens, batch 1)", ylabel, f"{b}: full-AR routing, d=224, K=32")
    fig.suptitle(_machine_title(rows), fontsize=9)
    _save(fig, paths)


def _machine_title(rows: list[dict]) -> str:
    machines = sorted({r.get("machine", "") for r in rows} - {""})
    return "; ".join(machines) if machines else "machine not recorded"


def plot_models(rows: list[dict], paths: list[Path]) -> None:
    """One horizontal bar per measured case, a panel per mode, grouped by T then model; each bar carries its
    tokens/s and one colour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    modes = [m for m in ("nt", "ar") if any(r["mode"] == m for r in rows)]
    per_mode = {m: sorted((r for r in rows if r["mode"] == m),
                          key=lambda r: (int(r["T"]), r["model"], r["dtype"], r["compile"], str(r["dropout"])))
                for m in modes}
    models = sorted({r["model"] for r in rows})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    heights = [0.32 * len(per_mode[m]) + 1.2 for m in modes]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for j, mode in enumerate(modes):
        sel = per_mode[mode]
        ax = axes[j][0]
        tps = [float(r["tokens_per_s"]) for r in sel]
        ax.barh(range(len(sel)), tps, color=[colours[r["model"]] for r in sel])
        labels = [f"{r['model']}, T={r['T']}, batch {r['batch']}, dropout {r['dropout']}, {r['compile']}, "
                  f"{r['dtype']}" for r in sel]
        ax.set_yticks(range(len(sel)), labels, fontsize=8)
        ax.invert_yaxis()
        for i, v in enumerate(tps):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(min(tps) / 2, max(tps) * 4)
        # matplotlib labels every minor tick of a short log range, and those labels overlap: label 1-2-5 instead
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if max(tps) / min(tps) < 100:
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_xlabel("training tokens/s (batch x T per step; log scale)")
        ax.set_title({"nt": "next-token", "ar": "full AR"}[mode] + " training step, WikiText-2 paper shapes (torch)",
                     fontsize=10)
    fig.suptitle(_machine_title(rows), fontsize=9)
    _save(fig, paths)


def log_panel(ax, xlabel: str, ylabel: str, title: str) -> None:
    """A cost-against-length panel: base-2 log x (lengths double), log y, labels, a small title and legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _save(fig, paths: list[Path]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)
    plt.close(fig)
