"""The column sets of the paper's tables: which quantities each table shows as (paper, measured) pairs, in the
paper's units (:class:`paper_tables.spec_types.ColumnSpec`)."""

from __future__ import annotations

from paper_tables.spec_types import ColumnSpec


def params_column(published: str | None = "params_M") -> ColumnSpec:
    return ColumnSpec("params", "Params", "params", published, "M parameters", scale=1e-6, decimals=2,
                      suffix="M", spread=False)


FINAL = ColumnSpec("final_ppl", "Final PPL", "final_ppl", "final_ppl", "perplexity", better="lower")
BEST = ColumnSpec("best_ppl", "Best PPL", "best_ppl", "best_ppl", "perplexity", better="lower")
FULL = ColumnSpec("full_ppl", "Full-split PPL", "full_ppl", None, "perplexity (full protocol)",
                   better="lower")

COLUMNS_WT2 = (
    ColumnSpec("batch", "Batch", "batch_size", "batch", "windows per step", decimals=0, spread=False),
    params_column(),
    FINAL,
    BEST,
    ColumnSpec("acc", "Acc.", "acc", "acc", "fraction", decimals=4, better="higher"),
    ColumnSpec("tok_s", "Tok/s", "tokens_per_sec", "tok_s", "tokens/s", decimals=0, thousands=True,
               better="higher"),
    ColumnSpec("peak_mb", "Peak MB", "peak_mem_mb", "peak_mb", "MiB", decimals=0, thousands=True,
               better="lower"),
    # The paper gives no run times for these tables; ours is each row's whole run (compile, training and every
    # evaluation, the full-split pass included).
    ColumnSpec("wall", "Run minutes", "wall_time_s", None, "minutes", scale=1 / 60, decimals=1, better="lower"),
    FULL,
)

COLUMNS_TPU_NT = (
    ColumnSpec("batch", "Batch", "batch_size", "batch", "windows per step (from the paper's logs)",
               decimals=0, spread=False),
    params_column(),
    FINAL,
    BEST,
    ColumnSpec("acc", "Eval Acc.", "acc", "acc", "fraction", decimals=4, better="higher"),
    ColumnSpec("tok_s", "Throughput", "tokens_per_sec", "throughput_Mtok_s", "M tok/s", scale=1e-6,
               decimals=2, suffix="M", better="higher"),
    ColumnSpec("elapsed", "Elapsed (min)", "wall_time_s", "elapsed_min", "minutes", scale=1 / 60,
               decimals=2, better="lower"),
    FULL,
)

COLUMNS_41M = (
    ColumnSpec("seeds", "Seeds", "n_runs", "seeds", "runs", decimals=0, spread=False),
    ColumnSpec("batch", "Batch", "batch_size", "batch", "windows per step (from the paper's scripts)",
               decimals=0, spread=False),
    params_column(),
    ColumnSpec("best_ppl", "Best PPL", "best_ppl", "best_ppl", "perplexity", published_std="best_ppl_std",
               better="lower"),
    ColumnSpec("acc", "Acc. @ Best", "acc", "acc_at_best_pct", "%", scale=100.0, decimals=2,
               published_std="acc_at_best_pct_std", suffix="%", better="higher"),
    ColumnSpec("tok_s", "Throughput", "tokens_per_sec", "throughput_Mtok_s", "M tok/s", scale=1e-6,
               decimals=2, published_std="throughput_Mtok_s_std", suffix="M", better="higher"),
    FULL,
)

COLUMNS_303M = (
    ColumnSpec("seeds", "Seeds", "n_runs", "seeds", "runs", decimals=0, spread=False),
    params_column(),
    BEST,
    FINAL,
    ColumnSpec("acc", "Acc. @ Best", "acc", "acc_at_best_pct", "%", scale=100.0, decimals=2, suffix="%",
               better="higher"),
    ColumnSpec("tok_s", "Throughput (Batch Size)", "tokens_per_sec", "throughput_Mtok_s", "M tok/s",
               scale=1e-6, decimals=2, suffix="M", batch="batch", alt="throughput_alt_Mtok_s",
               alt_batch="throughput_alt_batch", better="higher"),
    FULL,
)

COLUMNS_AUDIT = (
    params_column(None),
    BEST,
    FINAL,
    ColumnSpec("acc", "Acc. @ Best (mixture)", "acc_at_best", None, "%", scale=100.0, decimals=2, suffix="%",
               better="higher"),
    ColumnSpec("acc_param", "Acc. @ Best (parametric)", "acc_param_at_best", None, "%", scale=100.0,
               decimals=2, suffix="%", better="higher"),
    # No published column to match: plain tokens/s, which a cpu-scale full-AR run (a few thousand) needs.
    ColumnSpec("tok_s", "Tok/s", "tokens_per_sec", None, "tokens/s", decimals=0, thousands=True, better="higher"),
    FULL,
)
