"""Published CSVs and table specs: every paper row present with the printed values; specs consistent."""

from __future__ import annotations

import pandas as pd
import pytest

from paper_tables.claims import HOLDS, NOT_MEASURED, claim_is_on_suite_rows, evaluate_claims
from paper_tables.published import load_published, published_value
from paper_tables.specs import TABLES, check_specs, get_table

EXPECTED_ROWS = {
    "wt2-nt-1024": 7, "wt2-nt-2048": 7, "wt103-nt-baselines": 7, "wt103-nt-ablations": 7,
    "sweeps-41m": 29, "main-303m": 24, "semantic-leak-audit": 6,
}
# Rows a paper table carries beside the paper's own (published_key None): the paper does not print them.
SUITE_ROWS = {"main-303m": 4}


def test_specs_are_consistent():
    assert check_specs() == []
    assert set(TABLES) == set(EXPECTED_ROWS)


@pytest.mark.parametrize("name", list(EXPECTED_ROWS))
def test_published_csv_has_every_row_in_printed_order(name):
    spec, pub = get_table(name), load_published(name)
    assert len(spec.rows) == EXPECTED_ROWS[name]
    printed = [r for r in spec.rows if r.published_key is not None or not spec.has_published]
    assert list(pub["row"]) == [r.published_key or r.id for r in printed]
    assert pub["row"].is_unique
    extra = [r for r in spec.rows if r not in printed]
    assert len(extra) == SUITE_ROWS.get(name, 0)
    assert all(r.note.startswith("not in the paper") for r in extra)
    for row in spec.rows:
        assert row.experiment == f"{name}/{row.id}"
        assert row.id == row.id.lower() and " " not in row.id and "-" not in row.id


@pytest.mark.parametrize("name", [n for n in EXPECTED_ROWS if n != "semantic-leak-audit"])
def test_printed_params_match_the_csv(name):
    spec, pub = get_table(name), load_published(name)
    for row in spec.rows:
        if row.published_key is None:
            continue
        assert row.params == f"{pub.at[row.id, 'params_M']:.2f}M"
        assert round(pub.at[row.id, "params_exact"] / 1e6, 2) == pub.at[row.id, "params_M"]


# (table, row, column, printed value) spot checks typed from the paper's tables.
SPOT_CHECKS = [
    ("wt2-nt-1024", "pcaf_context", "best_ppl", 223.95),
    ("wt2-nt-1024", "pcaf_context", "acc", 0.2156),
    ("wt2-nt-1024", "pcaf_context", "tok_s", 442594),
    ("wt2-nt-1024", "pcaf_context", "peak_mb", 2410),
    ("wt2-nt-1024", "transformer_dense", "final_ppl", 392.32),
    ("wt2-nt-1024", "transformer_dense", "best_ppl", 386.14),
    ("wt2-nt-1024", "local_conv", "params_M", 26.43),
    ("wt2-nt-2048", "transformer_dense", "batch", 8),
    ("wt2-nt-2048", "transformer_dense", "best_ppl", 458.20),
    ("wt2-nt-2048", "pcaf_no_cache", "tok_s", 524599),
    ("wt2-nt-2048", "pcaf_context", "peak_mb", 4468),
    ("wt103-nt-baselines", "transformer_dense_t1024", "final_ppl", 214.14),
    ("wt103-nt-baselines", "transformer_dense_t2048", "params_M", 41.71),
    ("wt103-nt-baselines", "transformer_global_local_t2048", "throughput_Mtok_s", 7.15),
    ("wt103-nt-baselines", "local_conv_t2048", "throughput_Mtok_s", 45.82),
    ("wt103-nt-baselines", "local_conv_t2048", "elapsed_min", 4.18),
    ("wt103-nt-ablations", "pcaf_context_t1024", "best_ppl", 96.45),
    ("wt103-nt-ablations", "pcaf_context_t1024", "final_ppl", 99.20),
    ("wt103-nt-ablations", "pcaf_hybrid_t1024", "best_ppl", 100.84),
    ("wt103-nt-ablations", "pcaf_no_gate_t2048", "acc", 0.2591),
    ("sweeps-41m", "pcaf_context_wt103", "seeds", 6),
    ("sweeps-41m", "pcaf_context_wt103", "best_ppl", 89.87),
    ("sweeps-41m", "pcaf_context_wt103", "best_ppl_std", 15.28),
    ("sweeps-41m", "transformer_dense_pg19", "acc_at_best_pct", 19.03),
    ("sweeps-41m", "transformer_dense_pg19", "acc_at_best_pct_std", 0.44),
    ("sweeps-41m", "pcaf_semantic_ar_s1024", "best_ppl", 41.30),
    ("sweeps-41m", "pcaf_semantic_ar_s128", "throughput_Mtok_s", 2.87),
    ("sweeps-41m", "pcaf_semantic_ar_t4096_k64", "best_ppl", 42.70),
    ("sweeps-41m", "pcaf_scale_seq512", "throughput_Mtok_s", 17.31),
    ("main-303m", "pcaf_semantic_wt103_t1024", "best_ppl", 33.30),
    ("main-303m", "pcaf_semantic_wt103_t1024", "final_ppl", 33.43),
    ("main-303m", "pcaf_semantic_wt103_t2048", "best_ppl", 36.31),
    ("main-303m", "pcaf_semantic_pg19_t1024", "best_ppl", 50.94),
    ("main-303m", "pcaf_semantic_pg19_t2048", "best_ppl", 52.45),
    ("main-303m", "transformer_dense_wt103_t2048", "best_ppl", 47.49),
    ("main-303m", "transformer_dense_pg19_t2048", "best_ppl", 53.84),
    ("main-303m", "local_conv_pg19_t1024", "final_ppl", 76.67),
    ("main-303m", "pcaf_context_pg19_t2048", "throughput_Mtok_s", 0.65),
    ("main-303m", "pcaf_context_pg19_t2048", "throughput_alt_Mtok_s", 0.96),
    ("main-303m", "pcaf_context_pg19_t2048", "throughput_alt_batch", 256),
    ("main-303m", "transformer_local_wt103_t2048", "acc_at_best_pct", 33.25),
    ("main-303m", "local_conv_wt103_t1024", "batch", 256),
]


@pytest.mark.parametrize("table, row, column, value", SPOT_CHECKS)
def test_printed_values(table, row, column, value):
    assert published_value(load_published(table), row, column) == pytest.approx(value, abs=1e-9)


def test_empty_cells_are_missing_not_zero():
    pub = load_published("sweeps-41m")
    assert published_value(pub, "pcaf_topk4", "best_ppl_std") is None
    assert published_value(pub, "pcaf_semantic_ar_t4096_k32", "batch") is None
    assert "no script" in pub.at["pcaf_semantic_ar_t4096_k32", "note"]
    audit = load_published("semantic-leak-audit")
    assert set(audit.columns) == {"row", "model", "profile", "note"}
    assert not get_table("semantic-leak-audit").has_published


def test_every_paper_claim_holds_on_the_published_numbers():
    pubs = {n: load_published(n) for n in TABLES if get_table(n).has_published}
    for name, spec in TABLES.items():
        if not spec.has_published:
            continue
        for verdict in evaluate_claims(spec, {}, pubs):
            if claim_is_on_suite_rows(verdict.claim, spec):
                assert verdict.published == NOT_MEASURED, (name, verdict.claim.id)
            else:
                assert verdict.published == HOLDS, (name, verdict.claim.id, verdict.published_detail)


def test_unknown_table_lists_the_valid_names():
    with pytest.raises(KeyError, match="valid tables: wt2-nt-1024, wt2-nt-2048"):
        get_table("wt2-nt-4096")
    with pytest.raises(KeyError, match="rows:"):
        get_table("wt2-nt-1024").row("mamba")


def test_csv_numbers_are_numeric_columns():
    for name in EXPECTED_ROWS:
        pub = load_published(name)
        for col in ("best_ppl", "final_ppl", "params_M"):
            if col in pub.columns:
                assert pd.api.types.is_float_dtype(pub[col]), (name, col)


def test_docs_list_every_row_and_claim():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "TABLES.md").read_text()
    sections = text.split("\n### `")[1:]
    by_name = {s.split("`", 1)[0]: s for s in sections}
    assert set(by_name) == set(TABLES)
    for name, spec in TABLES.items():
        for row in spec.rows:
            assert f"| `{row.id}` |" in by_name[name], (name, row.id)
        for claim in spec.claims:
            assert f"- `{claim.id}`:" in by_name[name], (name, claim.id)
