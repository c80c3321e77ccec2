"""Every experiment file composes at every scale, to the committed resolved configs; paper budgets are the
paper's; row files state only what differs from their table's base; the table specs agree with the configs."""

from __future__ import annotations

import copy
import functools
from unittest import mock

import pytest
import yaml

from experiments import app, preflight, resolved_configs
from experiments.table_plan import EXPERIMENT_DIR, available_tables, compose_row, table_rows
from paper_tables.published import load_published
from paper_tables.specs import TABLES
from pcaf_core.config import ConfigError
from pcaf_core.results import SCALES

TABLE_NAMES = ["wt2-nt-1024", "wt2-nt-2048", "wt103-nt-baselines", "wt103-nt-ablations", "sweeps-41m",
               "main-303m", "semantic-leak-audit"]
ALL_ROWS = [(t, r) for t in TABLE_NAMES for r in table_rows(t)]


@functools.cache
def composed(table: str, row: str, scale: str):
    # PIN: train.precision=auto would resolve to this machine's fastest precision (the committed copy is the
    # same on every machine).
    return compose_row(table, row, scale, "torch", resolved_configs.PIN)


_HYDRA_COMPOSE = preflight.compose_config


@functools.cache
def _at_paper(overrides: tuple[str, ...]):
    return _HYDRA_COMPOSE([*overrides, "scale=paper"])


@functools.cache
def _scale_node(scale: str):
    return _HYDRA_COMPOSE([f"scale={scale}"]).scale


def _compose_scale_apart(overrides: list[str], config_name: str = "config"):
    """Hydra's composition of ``overrides`` from two real compositions: the row at scale=paper, with the scale
    group's node composed on its own put in place of paper's. No row file touches ``scale``, so this is the same
    config (the test comparing it with the committed copy, made by whole compositions, says so for every row);
    a third of the whole composition's cost, which copies the large cpu scale node many times."""
    assert config_name == "config"
    scale = next(o.removeprefix("scale=") for o in overrides if o.startswith("scale="))
    cfg = copy.deepcopy(_at_paper(tuple(o for o in overrides if not o.startswith("scale="))))
    if scale != "paper":
        cfg.scale = copy.deepcopy(_scale_node(scale))
    return cfg


@functools.cache
def composed_apart(table: str, row: str, scale: str):
    """:func:`composed` through :func:`_compose_scale_apart`: every row at every scale for one whole composition
    of each row (the fast tier's test composes the first row of each table whole at every scale)."""
    with mock.patch.object(preflight, "compose_config", _compose_scale_apart):
        return compose_row(table, row, scale, "torch", resolved_configs.PIN)


def test_every_paper_table_has_an_experiment_file_per_row():
    assert available_tables() == sorted(TABLE_NAMES)
    for table in TABLE_NAMES:
        assert sorted(table_rows(table)) == sorted(TABLES[table].row_ids), table


def _check_composed(rows: list[tuple[str, str]], scale: str, compose=composed) -> None:
    """Every run of ``rows`` at ``scale`` is labelled from its file's path, carries the scale's deviations, and
    resolves to the committed config text (``python -m experiments.resolved_configs --write`` after an intended
    change)."""
    rows = [(t, r) for t, r in rows if app.scale_covers(scale, t)]
    want = resolved_configs.read_snapshot()
    got = resolved_configs.resolve_all(rows, [scale], compose=compose)
    assert got, rows
    assert not (diffs := resolved_configs.differences({k: want.get(k, "") for k in got}, got)), "\n".join(diffs)
    for table, row in rows:
        for r in compose(table, row, scale):
            assert (r.table, r.row, r.scale, r.backend) == (table, row, scale, "torch")
            if scale == "paper":
                assert not [d for d in r.deviations if "(scale=" in d], (table, row, r.deviations)
            else:
                assert any(f"(scale={scale})" in d for d in r.deviations)


@pytest.mark.slow
@pytest.mark.parametrize("scale", resolved_configs.SCALES)
def test_every_row_resolves_to_its_committed_config(scale):
    _check_composed(ALL_ROWS, scale, composed_apart)
    if scale == resolved_configs.SCALES[-1]:  # nothing committed is left without a row
        keys = {k.split("@")[0] for k in resolved_configs.read_snapshot()}
        assert keys == {f"{t}/{r}" for t, r in ALL_ROWS}


@pytest.mark.parametrize("scale", resolved_configs.SCALES)
def test_one_row_per_table_resolves_to_its_committed_config(scale):
    """The fast tier's share of the test above: the first row of every table."""
    _check_composed([(t, table_rows(t)[0]) for t in TABLE_NAMES], scale)


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and key in ("model", "memory", "data", "train", "eval") and not prefix:
            out.update(_flat(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@functools.cache
def _group_defaults(choices: tuple[tuple[str, str], ...]) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(preflight.compose_config([f"{g}={o}" for g, o in choices]), resolve=True)
    return _flat({k: cfg[k] for k in ("model", "memory", "data", "train", "eval", "notes", "seed_runs")})


def _choices(defaults: list) -> dict[str, str]:
    out = {}
    for entry in defaults:
        if isinstance(entry, dict):
            ((key, value),) = entry.items()
            out[key.removeprefix("override /")] = value
    return out


@pytest.mark.parametrize("table", TABLE_NAMES)
def test_row_files_state_only_what_differs_from_their_base(table):
    """A row file names its table's ``_base`` first, has no ``table``/``row`` keys (the path gives them), and every
    value it sets differs from the one it would get without it (its base's, else its config groups' default)."""
    base = yaml.safe_load((EXPERIMENT_DIR / table / "_base.yaml").read_text(encoding="utf-8"))
    base_values = _flat({k: v for k, v in base.items() if k != "defaults"})
    base_choices = _choices(base["defaults"])
    for row in table_rows(table):
        data = yaml.safe_load((EXPERIMENT_DIR / table / f"{row}.yaml").read_text(encoding="utf-8"))
        assert data["defaults"][0] == f"{table}/_base", (row, data["defaults"])
        assert "table" not in data and "row" not in data, row
        choices = {**base_choices, **_choices(data["defaults"][1:])}
        assert all(base_choices.get(g) != o for g, o in _choices(data["defaults"][1:]).items()), row
        under = {**_group_defaults(tuple(sorted(choices.items()))), **base_values}
        own = _flat({k: v for k, v in data.items() if k != "defaults"})
        same = [k for k, v in own.items() if k in under and under[k] == v]
        assert not same, f"{table}/{row} restates {same}: drop them"


@pytest.mark.slow
def test_params_report_matches_the_paper_for_every_paper_scale_row():
    """``make params``: every paper-scale row's instantiated model has the spec's count and the paper's (the rows
    composed as the committed-config test above composes them; the precision pin changes no parameter)."""
    from experiments.params_report import report

    df = report(compose=lambda table, row: composed_apart(table, row, "paper"))
    assert df["match"].all(), df[~df["match"]].to_string()
    with_paper = df[df["paper"].notna()]
    assert len(with_paper) >= 70
    assert (with_paper["instantiated"] == with_paper["paper"].astype(int)).all()


@pytest.mark.slow
@pytest.mark.parametrize("table", TABLE_NAMES)
def test_table_specs_agree_with_the_paper_scale_configs(table):
    """What ``paper_tables/specs.py`` says of each row (the paper's T, mode, steps, profile; the published batch)
    is what the row's config trains at paper scale."""
    spec = TABLES[table]
    published = load_published(table)
    for row in spec.rows:
        run = composed_apart(table, row.id, "paper")[0].run
        assert run.train.mode == row.mode, row.id
        assert run.profile.name == row.profile, row.id
        if row.seq_len is not None:
            assert run.train.seq_len == row.seq_len, row.id
        if row.paper_steps is not None:
            assert run.train.steps == row.paper_steps, row.id
        if row.published_key and "batch" in published.columns:
            line = published.loc[published["row"] == row.published_key].iloc[0]
            batches = {int(line[c]) for c in ("batch", "throughput_alt_batch") if c in published.columns
                       and line[c] == line[c] and line[c] is not None}  # NaN: the paper prints no batch
            assert not batches or run.train.batch_size in batches, row.id


def test_multi_seed_rows_expand_to_their_seeds():
    runs = composed("sweeps-41m", "pcaf_context_wt103", "paper")
    assert [(r.run.train.seed, r.run.train.train_sample_seed, r.run.eval.eval_sample_seed) for r in runs] == [
        (1234, 11001, 21001), (2345, 12001, 22001), (3456, 13001, 23001)]


PAPER_BUDGETS = [
    # (table, row, {dotted key: value}) spot checks against docs/REFERENCE_CODE.md §5.5
    ("wt2-nt-1024", "pcaf_context", {"train.steps": 5000, "train.batch_size": 64, "train.lr": 3e-4,
                                     "train.weight_decay": 0.01, "eval.every": 500, "eval.batches": 50,
                                     "profile.dropout": 0.1, "profile.grad_clip_norm": 1.0,
                                     "memory.num_buckets": 32768, "memory.top_k": 16, "memory.context_order": 1,
                                     "data.max_train_tokens": 2_000_000, "data.max_eval_tokens": 200_000}),
    ("wt2-nt-2048", "transformer_dense", {"train.batch_size": 8, "train.seq_len": 2048}),
    ("wt2-nt-1024", "transformer_local", {"train.batch_size": 32, "model.window": 128}),
    ("wt103-nt-baselines", "transformer_dense_t1024", {"train.batch_size": 128, "train.steps": 20000,
                                                       "eval.every": 1000, "eval.batches": 100}),
    ("wt103-nt-ablations", "pcaf_semantic_t2048", {"train.batch_size": 256, "memory.semantic_score_scale": 0.5,
                                                   "memory.candidate_policy": "topk_score",
                                                   "profile.name": "reference_jax", "profile.dropout": 0.0}),
    ("sweeps-41m", "pcaf_semantic_ar_s1024", {"train.mode": "ar", "train.steps": 25000, "train.lr": 7.5e-5,
                                              "memory.top_k": 32, "memory.semantic_buckets": 1024,
                                              "memory.semantic_score_scale": 1.0, "eval.batches": 20}),
    ("sweeps-41m", "pcaf_scale_seq4096", {"train.batch_size": 128, "train.seq_len": 4096, "train.steps": 20000}),
    ("main-303m", "pcaf_context_wt103_t1024", {"train.steps": 12000, "train.batch_size": 256,
                                               "train.warmup_steps": 1500, "train.min_lr_ratio": 0.02,
                                               "train.weight_decay": 0.05, "data.max_train_tokens": 100_000_000}),
    ("main-303m", "transformer_dense_pg19_t2048", {"train.steps": 30000, "train.batch_size": 32,
                                                   "train.warmup_steps": 3000, "train.weight_decay": 0.03,
                                                   "eval.every": 2500, "data.max_train_tokens": 200_000_000}),
]


@pytest.mark.parametrize("table,row,expected", PAPER_BUDGETS, ids=[f"{t}/{r}" for t, r, _ in PAPER_BUDGETS])
def test_paper_scale_rows_carry_the_paper_budget(table, row, expected):
    run = composed(table, row, "paper")[0].run
    for key, value in expected.items():
        section, name = key.split(".")
        assert getattr(getattr(run, section), name) == value, key


def test_the_scales_are_the_scale_files():
    assert sorted(SCALES) == sorted(p.stem for p in (app.CONF_DIR / "scale").glob("*.yaml"))
    assert resolved_configs.SCALES == SCALES


def test_the_gpu_scale_changes_only_the_dataset_and_refuses_other_tables():
    """scale=gpu: the TPU tables' next-token rows at the paper's models and budgets, on WikiText-2."""
    assert app.scale_tables("gpu") == ("wt103-nt-baselines", "wt103-nt-ablations")
    assert not app.scale_covers("gpu", "wt2-nt-1024") and app.scale_covers("cpu", "wt2-nt-1024")
    for table in app.scale_tables("gpu"):
        row = table_rows(table)[0]
        paper, gpu = composed(table, row, "paper")[0], composed(table, row, "gpu")[0]
        flat_paper, flat_gpu = _flat(app.config_dict(paper)), _flat(app.config_dict(gpu))
        changed = {k for k in flat_paper if flat_paper[k] != flat_gpu.get(k)} - {"scale"}
        assert changed == {"data.name", "data.layout", "data.max_train_tokens", "data.max_eval_tokens"}, changed
        assert (gpu.run.data.name, gpu.run.data.layout, gpu.run.data.max_vocab) == ("wikitext2", "tokens", 32000)
        assert (gpu.run.train.steps, gpu.run.model.d_model) == (paper.run.train.steps, paper.run.model.d_model)
        assert any("(scale=gpu)" in d and "WikiText-2" in d for d in gpu.deviations)
    with pytest.raises(ConfigError, match="scale=gpu is defined only for the tables"):
        compose_row("wt2-nt-1024", "pcaf_context", "gpu", "torch", [])


def test_command_line_overrides_are_recorded_as_deviations():
    r = compose_row("wt2-nt-1024", "pcaf_context", "paper", "torch", ["memory.top_k=4"])[0]
    assert r.run.memory.top_k == 4
    assert "memory.top_k=4 (command line)" in r.deviations


def test_a_jax_run_on_cuda_is_recorded_on_jaxs_gpu_and_a_device_neither_backend_has_is_refused():
    """backend.device=cuda, the torch backend's name for the GPU, is JAX's gpu: one name in a run's identity."""
    (jax_run,) = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "jax", ["backend.device=cuda"])
    (same,) = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "jax", ["backend.device=gpu"])
    assert jax_run.cfg.backend.device == "gpu" and app.config_dict(jax_run) == app.config_dict(same)
    (torch_run,) = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", ["backend.device=cuda:1"])
    assert torch_run.cfg.backend.device == "cuda:1"
    with pytest.raises(ConfigError, match="backend.device='cuda:1' is invalid for backend=jax: use auto, cpu, gpu"):
        compose_row("wt2-nt-1024", "pcaf_context", "smoke", "jax", ["backend.device=cuda:1"])


def test_command_line_overrides_win_over_the_scale():
    r = compose_row("main-303m", "pcaf_context_wt103_t1024", "cpu", "torch", ["train.steps=77", "eval.every=3"])[0]
    assert (r.run.train.steps, r.run.eval.every) == (77, 3)
    assert "train.steps=77 (command line)" in r.deviations
    assert not any(d.startswith("train.steps:") for d in r.deviations)


@pytest.mark.parametrize("scale", ["smoke", "cpu"])
@pytest.mark.parametrize("choice", ["data=pg19_mini", "data.name=pg19_mini"])
def test_a_corpus_named_on_the_command_line_replaces_the_scales_stand_in(scale, choice):
    """The reduced scales train every table on WikiText-2 in place of its own corpus. A corpus the user names,
    as the config group or as data.name, is trained as named, in its own layout (pg19's is raw, not the
    scale's tokens), and the scale's note about its stand-in is not written: it would be false."""
    table, row = "wt103-nt-baselines", table_rows("wt103-nt-baselines")[0]
    default = compose_row(table, row, scale, "torch", [])[0]
    assert (default.run.data.name, default.run.data.layout) == ("wikitext2", "tokens")
    note = [d for d in default.deviations if d.startswith(f"{scale} scale: WikiText-2")]
    assert len(note) == 1
    named = compose_row(table, row, scale, "torch", [choice])[0]
    assert (named.run.data.name, named.run.data.layout) == ("pg19_mini", "raw")
    assert f"{choice} (command line)" in named.deviations
    assert note[0] not in named.deviations
    # The scale's other data settings still apply: the vocabulary it shrinks to for its model widths.
    assert named.run.data.max_vocab == default.run.data.max_vocab
    # Changing one key of the stand-in keeps the rest of it, and drops the note that no longer describes it.
    raw = compose_row(table, row, scale, "torch", ["data.layout=raw"])[0]
    assert (raw.run.data.name, raw.run.data.layout) == ("wikitext2", "raw")
    assert note[0] not in raw.deviations


# What a row measures: a scale may shrink widths, budgets and data, but two rows that differ in one of these
# at paper scale must still differ in it, in the same direction, at every reduced scale.
MEASURED_KEYS = ("model.variant", "train.mode", "train.seq_len", "memory.route", "memory.top_k",
                 "memory.num_buckets", "memory.semantic_buckets", "memory.candidate_policy", "profile.name")


def _measured(table: str, row: str, scale: str) -> dict:
    cfg = composed_apart(table, row, scale)[0].run
    out = {}
    for key in MEASURED_KEYS:
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = obj
    return out


@pytest.mark.slow
@pytest.mark.parametrize("table", TABLE_NAMES)
def test_the_cpu_scale_keeps_what_each_row_sweeps(table):
    rows = table_rows(table)
    paper = {r: _measured(table, r, "paper") for r in rows}
    cpu = {r: _measured(table, r, "cpu") for r in rows}
    for key in MEASURED_KEYS:
        for a in rows:
            for b in rows:
                pa, pb, ca, cb = paper[a][key], paper[b][key], cpu[a][key], cpu[b][key]
                if pa == pb:
                    continue
                assert ca != cb, f"{table}: {a} and {b} differ in {key} ({pa} vs {pb}) but not at cpu scale ({ca})"
                if isinstance(pa, int | float) and not isinstance(pa, bool):
                    assert (ca < cb) == (pa < pb), f"{table}: cpu scale reverses {key} of {a} and {b}"


@pytest.mark.parametrize(("table", "row", "profile", "expected"), [
    ("main-303m", "pcaf_semantic_wt103_t1024", "reference_jax", "default"),
    ("main-303m", "pcaf_semantic_corrected_wt103_t1024", "corrected", "highest"),
    ("wt2-nt-1024", "pcaf_context", "reference_torch", "highest"),
])
def test_matmul_precision_resolves_to_the_profiles_in_the_saved_config(table, row, profile, expected):
    """``train.matmul_precision=profile`` is resolved when a row composes, so config.yaml (and the record)
    name the precision that runs, without a deviation line; a command-line value wins and is a deviation."""
    r = composed(table, row, "cpu")[0]
    assert r.run.profile.name == profile
    assert r.run.train.matmul_precision == r.cfg.train.matmul_precision == expected
    assert r.run.train.head_loss == "auto"
    assert not [d for d in r.deviations if "matmul_precision" in d]
    mine = compose_row(table, row, "cpu", "torch", ["train.matmul_precision=high"])[0]
    assert mine.run.train.matmul_precision == "high"
    assert "train.matmul_precision=high (command line)" in mine.deviations
