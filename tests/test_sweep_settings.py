"""A sweep's table line pools only runs that differ in their seed alone.

A grid sweep (``memory.top_k=4,16 memory.num_buckets=64,32768``) used to render each key's table by pooling the
other key's runs into one mean ± std with n=2, as if they were seeds. Now every other setting the runs differ in
(read from their config files) gets a column, a line per combination and a line of the plot per combination;
settings that do not change a run's numbers, and the seed, do not split runs.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from paper_tables.figures import plot_sweep
from paper_tables.sweep import load_sweep, other_settings, render_sweep
from pcaf_core.results import RunMetrics, write_metrics


def _job(root: Path, n: int, config: dict, best_ppl: float, seed: int = 1) -> None:
    """One multirun job: the run's resolved config.yaml and its record."""
    run_dir = root / f"{n:03d}-pcaf_context-seed{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    write_metrics(run_dir, RunMetrics(table="wt2-nt-1024", row="pcaf_context", status="completed", scale="smoke",
                                      backend="torch", seed=seed, profile=config["profile"]["name"],
                                      best_ppl=best_ppl, final_ppl=best_ppl, tokens_per_sec=1000.0))


def _config(top_k: int, buckets: int, seed: int, profile: str = "reference_torch", gelu: str = "erf",
            compile_: str = "auto") -> dict:
    return {"table": "wt2-nt-1024", "row": "pcaf_context", "scale": {"name": "smoke"},
            "memory": {"top_k": top_k, "num_buckets": buckets}, "profile": {"name": profile, "gelu": gelu},
            "train": {"seed": seed, "train_sample_seed": 10000 + seed, "compile": compile_},
            "eval": {"eval_sample_seed": 20000 + seed}, "data": {"data_dir": f"/data/{seed}"},
            "backend": {"name": "torch"}, "output_root": "outputs", "run_dir": f"run-{top_k}-{buckets}-{seed}"}


def _grid(root: Path) -> None:
    n = 0
    for buckets in (64, 32768):
        for top_k in (4, 16):
            for seed in (1, 2):  # two seeds of each cell, run with different compile settings and data folders
                ppl = 600.0 - (top_k if buckets > 64 else 0) * 5 + seed
                _job(root, n, _config(top_k, buckets, seed, compile_="auto" if seed == 1 else "off"), ppl, seed)
                n += 1


def test_a_grid_sweep_has_a_line_per_cell_pooling_only_the_seeds(tmp_path):
    _grid(tmp_path / "multirun")
    paths = render_sweep(tmp_path / "multirun", ["memory.top_k", "memory.num_buckets"], tmp_path / "out")
    md = {p.name: p.read_text() for p in paths if p.suffix == ".md"}
    top_k = md["sweep_memory.top_k.md"]
    assert "- The runs also differ in `memory.num_buckets`: one line per combination" in top_k
    assert "| memory.top_k | memory.num_buckets | Best PPL |" in top_k
    lines = [line for line in top_k.splitlines() if line.startswith("| 4 ") or line.startswith("| 16 ")]
    assert lines == [
        "| 4 | 64 | 601.50 ± 0.71 | 601.50 ± 0.71 | — | — | 1,000 ± 0 | ok (n=2) |",
        "| 16 | 64 | 601.50 ± 0.71 | 601.50 ± 0.71 | — | — | 1,000 ± 0 | ok (n=2) |",
        "| 4 | 32768 | 581.50 ± 0.71 | 581.50 ± 0.71 | — | — | 1,000 ± 0 | ok (n=2) |",
        "| 16 | 32768 | 521.50 ± 0.71 | 521.50 ± 0.71 | — | — | 1,000 ± 0 | ok (n=2) |",
    ]
    csv = pd.read_csv(tmp_path / "out" / "sweep_memory.num_buckets.csv")
    assert list(csv.columns[:3]) == ["memory.num_buckets", "memory.top_k", "n_runs"]
    assert csv["n_runs"].tolist() == [2, 2, 2, 2]


def test_the_plot_draws_a_line_per_combination_in_the_order_of_its_values(tmp_path):
    _grid(tmp_path / "multirun")
    df = load_sweep(tmp_path / "multirun", "memory.top_k")
    df = df.assign(**{"memory.num_buckets": [s["memory.num_buckets"] for s in df["settings"]]})
    fig = plot_sweep(df, x="memory.top_k", series=["memory.num_buckets"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["memory.num_buckets=64",
                                                                   "memory.num_buckets=32768"]
    means = [list(bars.lines[0].get_ydata()) for bars in ax.containers]  # each line's points, its caps aside
    assert means == [[601.5, 601.5], [581.5, 521.5]]


def test_only_settings_that_split_runs_are_named(tmp_path):
    profiles = [_config(4, 64, 1, "reference_torch", "erf"), _config(4, 64, 1, "corrected", "tanh"),
                _config(4, 64, 2, "corrected", "tanh", compile_="off")]
    settings = []
    for config in profiles:
        flat = {"table": config["table"], "row": config["row"], "scale.name": "smoke"}
        for section in ("memory", "profile", "train", "eval", "data", "backend"):
            flat.update({f"{section}.{k}": v for k, v in config[section].items()})
        settings.append(flat)
    # The profile's switches come with its name; the seeds, the compile setting and the data folder split nothing.
    assert other_settings(settings, "memory.top_k") == ["profile.name"]
    assert other_settings([settings[1], settings[2]], "memory.top_k") == []
    # A run without a config file is not compared; one run alone has nothing to differ from.
    assert other_settings([settings[0], None, settings[1]], "memory.top_k") == ["profile.name"]
    assert other_settings([settings[0], None], "memory.top_k") == []
