"""The run-record schema (pcaf_core.results): round trip, atomic writes, versioning, curves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from pcaf_core import results
from pcaf_core.results import (
    CURVE_COLUMNS,
    SCHEMA_VERSION,
    RunMetrics,
    SchemaError,
    append_curve_row,
    hash_config,
    read_curve,
    read_metrics,
    write_metrics,
)


def _record(**kw) -> RunMetrics:
    base = dict(
        table="wt2-nt-1024", row="pcaf_context", status="completed", scale="smoke", backend="torch",
        profile="reference_torch", seed=1234, mode="nt", seq_len=64, batch_size=4, steps_done=20,
        steps_planned=20, params=26_592_730, final_ppl=512.5, best_ppl=498.25, best_step=20, acc_at_best=0.1234,
        acc_param_at_best=0.1111, final_acc=0.12, full_ppl=505.0, unigram_ppl=1400.0, tokens_per_sec=12345.6,
        throughput_definition="global_batch*T / train step time, after warm-up, excluding evaluation",
        peak_mem_mb=None, wall_time_s=30.5, train_time_s=25.0, dataset="wikitext2", data_layout="tokens",
        vocab_size=20000, deviations=["steps 5000 -> 20 (scale=smoke)"], git_commit="abc123",
        versions={"numpy": "2.4"}, config_hash="0123456789abcdef", overrides=["train.steps=20"],
        extra={"note": "x", "per_eval": [1.0, 2.0]},
    )
    base.update(kw)
    return RunMetrics(**base)


def test_round_trip_preserves_every_field(tmp_path):
    rec = _record()
    path = write_metrics(tmp_path / "run", rec)
    assert path == tmp_path / "run" / "metrics.json"
    back = read_metrics(tmp_path / "run")
    assert back == rec
    assert back.updated_at
    assert back.schema_version == SCHEMA_VERSION
    assert read_metrics(path) == rec  # the file path itself is accepted too
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["peak_mem_mb"] is None


def test_non_finite_floats_are_standard_json_and_come_back(tmp_path):
    rec = _record(status="completed", best_ppl=math.inf, final_ppl=math.nan, extra={"loss": -math.inf})
    write_metrics(tmp_path, rec)
    text = (tmp_path / "metrics.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = read_metrics(tmp_path)
    assert back.best_ppl == math.inf and math.isnan(back.final_ppl) and back.extra["loss"] == -math.inf


def test_integer_valued_floats_read_back_as_floats(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps({"schema_version": 1, "table": "t", "row": "r",
                                                       "best_ppl": 100, "status": "running"}))
    assert isinstance(read_metrics(tmp_path).best_ppl, float)


def test_failed_write_leaves_previous_file_intact(tmp_path, monkeypatch):
    write_metrics(tmp_path, _record(best_ppl=111.0))
    before = (tmp_path / "metrics.json").read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_metrics(tmp_path, _record(best_ppl=222.0))
    assert (tmp_path / "metrics.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["metrics.json"]  # the temp file was removed


def test_unserialisable_record_raises_before_touching_the_file(tmp_path):
    write_metrics(tmp_path, _record(best_ppl=111.0))
    before = (tmp_path / "metrics.json").read_bytes()
    with pytest.raises(SchemaError, match="not JSON-serialisable"):
        write_metrics(tmp_path, _record(extra={"bad": object()}))
    assert (tmp_path / "metrics.json").read_bytes() == before
    assert read_metrics(tmp_path).best_ppl == 111.0


@pytest.mark.parametrize("version, message", [(99, "newer version"), (0, "re-run the experiment")])
def test_unknown_schema_version_is_a_clear_error(tmp_path, version, message):
    data = _record().to_dict()
    data["schema_version"] = version
    (tmp_path / "metrics.json").write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=rf"unknown metrics schema_version {version}.*{message}"):
        read_metrics(tmp_path)


def test_missing_version_unknown_field_and_bad_json_are_errors(tmp_path):
    data = _record().to_dict()
    del data["schema_version"]
    (tmp_path / "metrics.json").write_text(json.dumps(data))
    with pytest.raises(SchemaError, match="no 'schema_version'"):
        read_metrics(tmp_path)
    data["schema_version"] = 1
    data["surprise"] = 1
    (tmp_path / "metrics.json").write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"unknown fields \['surprise'\].*'extra'"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(SchemaError, match="not valid JSON"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "absent")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(status="done"), "status='done' is invalid"),
        (dict(status="failed", error=None), "needs 'error'"),
        (dict(mode="lm"), "mode='lm' is invalid"),
        (dict(params=1.5), "params must be an int"),
        (dict(best_ppl="low"), "best_ppl must be a number"),
        (dict(deviations="one"), "deviations must be a list of strings"),
        (dict(table=""), "non-empty 'table'"),
    ],
)
def test_invalid_values_name_the_field(kw, message):
    with pytest.raises(SchemaError, match=message):
        _record(**kw)


def test_numpy_scalars_are_accepted_as_plain_numbers(tmp_path):
    import numpy as np

    rec = _record(params=np.int64(41_742_522), best_ppl=np.float32(95.5), seq_len=np.int32(2048))
    assert type(rec.params) is int and type(rec.best_ppl) is float and type(rec.seq_len) is int
    write_metrics(tmp_path, rec)
    assert read_metrics(tmp_path).params == 41_742_522


def test_failed_record_keeps_its_error(tmp_path):
    write_metrics(tmp_path, _record(status="failed", error="CUDA out of memory", best_ppl=None))
    back = read_metrics(tmp_path)
    assert back.status == "failed" and back.error == "CUDA out of memory" and back.best_ppl is None


def test_curve_append_and_read(tmp_path):
    assert read_curve(tmp_path) == []
    append_curve_row(tmp_path, {"step": 1, "tokens_seen": 256, "train_loss": 9.9, "eval_ppl_reference": 20000.0,
                                "lr": 3e-4})
    append_curve_row(tmp_path, {"step": 2, "tokens_seen": 512, "train_loss": 9.5})
    header = (tmp_path / "curve.csv").read_text().splitlines()[0].split(",")
    assert header == list(CURVE_COLUMNS)
    rows = read_curve(tmp_path)
    assert rows[0]["step"] == 1 and rows[0]["eval_ppl_reference"] == 20000.0 and rows[0]["lr"] == 3e-4
    assert rows[1]["eval_ppl_reference"] is None and rows[1]["train_loss"] == 9.5


def test_curve_new_extra_column_widens_the_file(tmp_path):
    append_curve_row(tmp_path, {"step": 1, "train_loss": 5.0})
    append_curve_row(tmp_path, {"step": 2, "train_loss": 4.0, "grad_norm": 0.5})
    append_curve_row(tmp_path, {"step": 3, "grad_norm": 0.25, "eval_ppl_reference": math.nan})
    rows = read_curve(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["grad_norm"] is None and rows[1]["grad_norm"] == 0.5 and rows[2]["grad_norm"] == 0.25
    assert math.isnan(rows[2]["eval_ppl_reference"])
    with pytest.raises(ValueError, match="needs 'step'"):
        append_curve_row(tmp_path, {"train_loss": 1.0})


def test_hash_config_is_order_independent():
    assert hash_config({"a": 1, "b": {"c": 2}}) == hash_config({"b": {"c": 2}, "a": 1})
    assert hash_config({"a": 1}) != hash_config({"a": 2})
    assert len(hash_config({})) == 16


def test_results_module_imports_no_framework():
    code = "import sys, pcaf_core.results; sys.exit(int('torch' in sys.modules or 'jax' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__))).returncode == 0
