"""``experiments.gpu_paper_rows``: the commands it runs, the path it sets, the rows it accepts and skips (no
subprocess here; ``tests/test_render_from_records.py`` uses its record copy on real runs)."""

from __future__ import annotations

import csv
import json
import tarfile
from pathlib import Path

import pytest

from experiments import gpu_paper_rows as gpr
from pcaf_core.record_check import check_run
from pcaf_core.results import RunMetrics, write_metrics


@pytest.fixture(autouse=True)
def own_compile_cache(tmp_path: Path, monkeypatch) -> None:
    """The default ``--compile-cache`` of every test here is its own folder: never this checkout's .compile_cache/,
    which the runner packs after each step and which holds whatever caches a GPU session unpacked there."""
    monkeypatch.setattr(gpr, "CACHE_DIR", tmp_path / "default_compile_cache")


def test_commands_name_the_device_scale_and_tokens_layout(tmp_path: Path) -> None:
    cmd = gpr.reproduce_command("wt2-nt-2048", "transformer_local", "paper", "cuda", tmp_path, "python3")
    assert cmd[:3] == ["python3", "-m", "experiments.reproduce"]
    assert ["--table", "wt2-nt-2048"] == cmd[3:5] and "--no-render" in cmd
    assert cmd[cmd.index("--rows") + 1] == "transformer_local" and cmd[cmd.index("--scale") + 1] == "paper"
    assert cmd[-2:] == ["backend.device=cuda", "data.layout=tokens"]
    cost = gpr.step_cost_command("wt2-nt-1024", "paper", "cuda", tmp_path / "c.csv", "python3")
    text = " ".join(cost)
    assert "TABLE=wt2-nt-1024" in text or "--table wt2-nt-1024" in text
    assert f"--device cuda --csv {tmp_path / 'c.csv'} data.layout=tokens" in text


def test_overrides_reach_the_step_cost_and_every_row(tmp_path: Path, monkeypatch) -> None:
    """``--override``: the same Hydra overrides after ``data.layout=tokens`` in the step cost and each row."""
    launched = []
    monkeypatch.setattr(gpr.subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 0)
    gpr.main(["--step-cost", "wt2-nt-1024", "--out", str(tmp_path), "--output-root", str(tmp_path / "outputs"),
              "--override", "train.compile=on", "--override", "eval.eval_batches=5",
              "wt2-nt-1024/transformer_local", "wt2-nt-1024/transformer_dense"])
    cost, *runs = (" ".join(c) for c in launched)
    assert "data.layout=tokens train.compile=on eval.eval_batches=5" in cost
    assert "transformer_local,transformer_dense" in cost
    assert len(runs) == 2 and all(r.endswith("data.layout=tokens train.compile=on eval.eval_batches=5") for r in runs)
    for bad in ("train.compile", "train.compile=on eval.eval_batches=5"):
        with pytest.raises(SystemExit, match="is not KEY=VALUE"):
            gpr.main(["--override", bad, "wt2-nt-1024/transformer_local"])


def test_stop_on_failure_starts_no_row_after_a_failed_one(tmp_path: Path, monkeypatch, capsys) -> None:
    """A row whose command fails (here: exit 1, no record) ends the command under ``--stop-on-failure``, with a
    line naming the rows not trained; without it the next rows still run."""
    launched = []
    monkeypatch.setattr(gpr.subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 1)
    rows = ["wt2-nt-1024/transformer_global_local", "wt2-nt-2048/transformer_local",
            "wt2-nt-2048/transformer_global_local"]
    common = ["--step-cost", "", "--out", str(tmp_path), "--output-root", str(tmp_path / "outputs")]
    assert gpr.main([*common, "--stop-on-failure", *rows]) == 1
    assert len(launched) == 1
    assert ("stopped after wt2-nt-1024/transformer_global_local failed (--stop-on-failure); not trained: "
            "wt2-nt-2048/transformer_local wt2-nt-2048/transformer_global_local") in capsys.readouterr().out
    launched.clear()
    assert gpr.main([*common, *rows]) == 1
    assert len(launched) == 3


def test_site_goes_first_on_the_path(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpr, "SITE", tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert gpr.child_env()["PYTHONPATH"].split(":") == [str(gpr.REPO), "/elsewhere"]
    (tmp_path / "site").mkdir()
    assert gpr.child_env()["PYTHONPATH"].split(":") == [str(tmp_path / "site"), str(gpr.REPO), "/elsewhere"]


def test_rows_are_table_slash_row() -> None:
    assert gpr.parse_rows(["wt2-nt-1024/local_conv"]) == [("wt2-nt-1024", "local_conv")]
    for bad in ("local_conv", "wt2-nt-1024/", "a/b/c"):
        with pytest.raises(SystemExit, match="is not TABLE/ROW"):
            gpr.parse_rows([bad])


def test_a_row_predicted_past_the_budget_is_skipped(tmp_path: Path, monkeypatch, capsys) -> None:
    """With step costs on hand and no time left for a row, nothing is launched for it."""
    (tmp_path / "step_cost").mkdir()
    with open(tmp_path / "step_cost" / "wt2-nt-2048.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["table", "row", "train_s"])
        writer.writeheader()
        writer.writerow({"table": "wt2-nt-2048", "row": "transformer_local", "train_s": 536.0})
    launched = []
    monkeypatch.setattr(gpr.subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 0)
    args = ["--step-cost", "", "--budget-s", "300", "--out", str(tmp_path), "wt2-nt-2048/transformer_local"]
    assert gpr.main(args) == 0
    assert launched == []
    assert "skipped wt2-nt-2048/transformer_local: predicted 536 s for its run" in capsys.readouterr().out


def test_the_budget_counts_the_whole_run_where_the_step_cost_predicts_it(tmp_path: Path) -> None:
    """``wall_s`` (first step, training, evaluation) when the CSV has it; ``train_s`` in an older CSV."""
    (tmp_path / "step_cost").mkdir()
    for name, fields, row in (("a.csv", ["table", "row", "train_s", "wall_s"], ["t", "new", "120.0", "341.5"]),
                              ("b.csv", ["table", "row", "train_s"], ["t", "old", "118.0"])):
        with open(tmp_path / "step_cost" / name, "w", newline="") as fh:
            csv.writer(fh).writerows([fields, row])
    assert gpr.predicted_seconds(tmp_path) == {("t", "new"): 341.5, ("t", "old"): 118.0}


def _completed_run(root: Path, table: str, row: str, run: str, status: str = "completed") -> Path:
    """A run folder as a run leaves it, its paths absolute under this checkout."""
    folder = root / table / "paper" / "torch" / row / run
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"row: {row}\nrun_dir: {gpr.REPO / 'outputs' / run}\n")
    (folder / "environment.json").write_text(json.dumps({"argv": [str(gpr.REPO / "experiments/reproduce.py")]}))
    (folder / "curve.csv").write_text("step,eval_ppl_reference\n1,100.0\n")
    write_metrics(folder, RunMetrics(table=table, row=row, status=status, best_ppl=100.0,
                                     extra={"data": {"source": str(gpr.REPO / "data" / "wikitext-2-v1.tar.xz")},
                                            "elsewhere": "/srv/data/other.tar.xz"}))
    (folder / "checkpoint_000100.pt").write_bytes(b"weights")  # never travels
    return folder


def test_each_finished_row_is_packed_into_one_archive(tmp_path: Path, monkeypatch) -> None:
    """After every row the archive holds every completed record so far, and nothing but record files."""
    output_root, out = tmp_path / "outputs", tmp_path / "out"
    rows = {"pcaf_context": "completed", "local_conv": "running"}  # local_conv: cut off

    def fake_reproduce(cmd, **kwargs):
        row = cmd[cmd.index("--rows") + 1]
        _completed_run(output_root, "wt2-nt-1024", row, "seed1234-x", rows[row])
        return 0

    monkeypatch.setattr(gpr.subprocess, "call", fake_reproduce)
    args = ["--step-cost", "", "--out", str(out), "--output-root", str(output_root),
            "wt2-nt-1024/pcaf_context", "wt2-nt-1024/local_conv"]
    assert gpr.main(args) == 1  # the stopped row has no completed record
    with tarfile.open(out / gpr.ARCHIVE_NAME) as tar:
        names = sorted(tar.getnames())
    assert names == sorted(f"wt2-nt-1024/paper/torch/pcaf_context/seed1234-x/{n}" for n in gpr.RECORD_FILES)

    into = tmp_path / "docs_runs"
    (run,) = gpr.unpack_records(out / gpr.ARCHIVE_NAME, into)
    assert run == into / "wt2-nt-1024/paper/torch/pcaf_context/seed1234-x"
    record = json.loads((run / "metrics.json").read_text())
    assert record["status"] == "completed" and check_run(run).state == "verified"
    # The copies name paths relative to the checkout, and nothing outside it is touched.
    assert record["extra"]["data"]["source"] == "data/wikitext-2-v1.tar.xz"
    assert record["extra"]["elsewhere"] == "/srv/data/other.tar.xz"
    assert "run_dir: outputs/seed1234-x" in (run / "config.yaml").read_text()
    assert json.loads((run / "environment.json").read_text())["argv"] == ["experiments/reproduce.py"]
    assert str(gpr.REPO) in (output_root / "wt2-nt-1024/paper/torch/pcaf_context/seed1234-x/config.yaml").read_text()
    assert gpr.unpack_records(out / gpr.ARCHIVE_NAME, into) == [run]  # the same records again: nothing changes


def test_unpack_refuses_what_is_not_a_record_and_what_would_be_overwritten(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _completed_run(runs, "wt2-nt-2048", "local_conv", "seed1234-y")
    archive = tmp_path / "records.tar.gz"
    assert gpr.pack_records(runs, archive) == len(gpr.RECORD_FILES)
    into = tmp_path / "docs_runs"
    clash = into / "wt2-nt-2048/paper/torch/local_conv/seed1234-y/curve.csv"
    clash.parent.mkdir(parents=True)
    clash.write_text("another run's curve\n")
    with pytest.raises(SystemExit, match="exists with other contents: move it away"):
        gpr.unpack_records(archive, into)
    assert sorted(p.name for p in clash.parent.iterdir()) == ["curve.csv"]  # nothing else was written

    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(runs / "wt2-nt-2048/paper/torch/local_conv/seed1234-y/metrics.json", arcname="../metrics.json")
    with pytest.raises(SystemExit, match="is not a run record file"):
        gpr.unpack_records(bad, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(SystemExit, match="no archive at"):
        gpr.unpack_records(tmp_path / "missing.tar.gz", into)


def test_jax_rows_name_jax_and_its_gpu_device(tmp_path: Path, monkeypatch) -> None:
    """``--backend jax``: the commands, the step-cost file and the records all say jax; the device is JAX's ``gpu``."""
    launched = []
    monkeypatch.setattr(gpr.subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 0)
    assert gpr.main(["--backend", "jax", "--step-cost", "wt2-nt-1024", "--out", str(tmp_path),
                     "--output-root", str(tmp_path / "outputs"), "wt2-nt-1024/pcaf_context"]) == 1  # no record
    cost, run = (" ".join(c) for c in launched)
    assert "BACKEND=jax" in cost or "--backend jax" in cost
    assert f"--csv {tmp_path / 'step_cost' / 'wt2-nt-1024_jax.csv'} data.layout=tokens" in cost
    assert "--backend jax" in run and run.endswith("backend.device=gpu data.layout=tokens")
    _completed_run(tmp_path / "outputs2", "wt2-nt-1024", "pcaf_context", "seed1234-j")
    jax_dir = tmp_path / "jax_outputs" / "wt2-nt-1024" / "paper" / "jax"
    jax_dir.mkdir(parents=True)
    (tmp_path / "outputs2" / "wt2-nt-1024" / "paper" / "torch" / "pcaf_context").rename(jax_dir / "pcaf_context")
    (copied,) = gpr.copy_records(tmp_path / "jax_outputs", "wt2-nt-1024", "paper", "pcaf_context",
                                 tmp_path / "runs", "jax")
    assert copied == tmp_path / "runs" / "wt2-nt-1024" / "paper" / "jax" / "pcaf_context" / "seed1234-j"
    gpr.pack_records(tmp_path / "runs", tmp_path / "r.tar.gz")
    (unpacked,) = gpr.unpack_records(tmp_path / "r.tar.gz", tmp_path / "docs_runs")
    assert unpacked.parts[-4:] == ("paper", "jax", "pcaf_context", "seed1234-j")


def test_step_costs_default_to_the_tables_of_the_rows_given(tmp_path: Path, monkeypatch) -> None:
    """``--scale gpu`` rows of the TPU tables: only their tables are timed (the gpu scale refuses the others)."""
    launched = []
    monkeypatch.setattr(gpr.subprocess, "call", lambda cmd, **kw: launched.append(" ".join(cmd)) or 0)
    rows = ["wt103-nt-ablations/pcaf_context_t1024", "wt103-nt-baselines/local_conv_t2048",
            "wt103-nt-ablations/pcaf_context_t2048"]
    gpr.main(["--scale", "gpu", "--out", str(tmp_path), "--output-root", str(tmp_path / "outputs"), *rows])
    costs = [c for c in launched if "step" in c and "experiments.reproduce" not in c]
    assert len(costs) == 2 and "wt103-nt-ablations" in costs[0] and "wt103-nt-baselines" in costs[1]
    assert all("SCALE=gpu" in c or "--scale gpu" in c for c in costs)
    # Only the rows it will train: each row timed costs a build and a compile of GPU time.
    assert "ROWS=pcaf_context_t1024,pcaf_context_t2048 " in costs[0] or \
        "--rows pcaf_context_t1024,pcaf_context_t2048 " in costs[0]
    assert "ROWS=local_conv_t2048 " in costs[1] or "--rows local_conv_t2048 " in costs[1]
    assert sum("experiments.reproduce" in c for c in launched) == 3
    launched.clear()
    gpr.main(["--out", str(tmp_path), "--output-root", str(tmp_path / "outputs")])
    assert len(launched) == 2 and [t in c for t, c in zip(gpr.PAPER_TABLES, launched, strict=True)] == [True, True]
    assert all("ROWS=* " in c or "--rows * " in c for c in launched)  # no rows given: every row of each


def test_the_compilers_caches_are_kept_packed_after_each_row_and_unpacked(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    """``--compile-cache``: every step runs with the compilers' cache variables pointing into the folder (one the
    caller set is kept), the folder is packed into ``<out>/compile_cache.tar.gz`` after the step costs and each row,
    and ``--unpack-cache`` puts it back for the next run; ``''`` leaves the variables alone."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    envs = []

    def fake_call(cmd, env, **kwargs):
        envs.append(env)
        if "TORCHINDUCTOR_CACHE_DIR" in env:  # what inductor would write there
            (Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph").mkdir(parents=True, exist_ok=True)
            (Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph" / f"entry{len(envs)}").write_text("graph")
        return 0

    monkeypatch.setattr(gpr.subprocess, "call", fake_call)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    gpr.main(["--step-cost", "wt2-nt-1024", "--compile-cache", str(cache), "--out", str(out), "--output-root",
              str(tmp_path / "outputs"), "wt2-nt-1024/pcaf_context"])
    assert len(envs) == 2
    for env in envs:
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
        assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
        assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "mine")
    assert f"{out / gpr.CACHE_ARCHIVE}: 2 file(s)" in capsys.readouterr().out
    with tarfile.open(out / gpr.CACHE_ARCHIVE) as tar:
        assert sorted(tar.getnames()) == ["inductor/fxgraph/entry1", "inductor/fxgraph/entry2"]

    fresh = tmp_path / "fresh"
    assert gpr.main(["--unpack-cache", str(out / gpr.CACHE_ARCHIVE), "--compile-cache", str(fresh)]) == 0
    assert (fresh / "inductor/fxgraph/entry2").read_text() == "graph"

    envs.clear()
    gpr.main(["--step-cost", "", "--compile-cache", "", "--out", str(tmp_path / "out2"), "--output-root",
              str(tmp_path / "outputs"), "wt2-nt-1024/pcaf_context"])
    assert "TORCHINDUCTOR_CACHE_DIR" not in envs[0] and not (tmp_path / "out2" / gpr.CACHE_ARCHIVE).exists()

    unsafe = tmp_path / "unsafe.tar.gz"
    with tarfile.open(unsafe, "w:gz") as tar:
        tar.add(out / gpr.CACHE_ARCHIVE, arcname="../outside")
    with pytest.raises(tarfile.FilterError):
        gpr.unpack_cache(unsafe, tmp_path / "third")
    assert not (tmp_path / "outside").exists()


def _reproduce_that_fails_with(bad: str, output_root: Path, launched: list[list[str]]):
    """A stand-in for ``experiments.reproduce``: a command carrying the override ``bad`` fails (exit 1, no record),
    any other leaves a completed run of its row."""
    def fake(cmd, **kwargs):
        launched.append(cmd)
        if bad in cmd:
            return 1
        table, row = cmd[cmd.index("--table") + 1], cmd[cmd.index("--rows") + 1]
        _completed_run(output_root, table, row, f"seed1234-{len(list(output_root.rglob('metrics.json')))}")
        return 0
    return fake


def test_a_tried_setting_is_dropped_for_a_row_whose_run_fails_with_it(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--try-override``: each row runs with it first; where that fails, again without it as a new run
    (``--fresh``), and the row counts as trained. A row that succeeds with it is not run twice."""
    output_root, launched = tmp_path / "outputs", []
    monkeypatch.setattr(gpr.subprocess, "call", _reproduce_that_fails_with("train.compile=cudagraphs", output_root,
                                                                           launched))
    common = ["--step-cost", "", "--scale", "paper", "--out", str(tmp_path / "out"), "--output-root",
              str(output_root), "--override", "eval.full_batch_size=256"]
    assert gpr.main([*common, "--try-override", "train.compile=cudagraphs", "wt2-nt-1024/transformer_local"]) == 0
    first, second = launched
    assert first[-2:] == ["eval.full_batch_size=256", "train.compile=cudagraphs"] and "--fresh" not in first
    assert second[-1] == "eval.full_batch_size=256" and "--fresh" in second
    assert ("wt2-nt-1024/transformer_local failed with train.compile=cudagraphs: running it again without "
            "(--try-override)") in capsys.readouterr().out
    assert len(list((tmp_path / "out" / "runs").rglob("metrics.json"))) == 1
    launched.clear()
    assert gpr.main([*common, "--try-override", "train.compile=on", "wt2-nt-2048/transformer_local"]) == 0
    assert len(launched) == 1 and launched[0][-1] == "train.compile=on"


def test_the_tried_setting_waits_for_its_gpu_tests(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--try-if-passed``: a row gets the tried setting only where every gpu test matching the name passed;
    ``{row}`` in the name makes each model's test case gate that model's rows. The gpu tests run first, and their
    failure does not stop the rows."""
    output_root, launched = tmp_path / "outputs", []
    monkeypatch.setattr(gpr.subprocess, "call", _reproduce_that_fails_with("never", output_root, launched))
    ran = []
    name = "tests.test_torch_cuda_graphs::test_windowed_flex_cudagraph_step_trains_like_eager_on_cuda"
    rows = ["wt2-nt-1024/transformer_local", "wt2-nt-2048/transformer_global_local", "wt2-nt-2048/pcaf_no_cache"]

    def run(gate_name: str, global_local: str) -> dict[str, bool]:
        outcomes = {f"{name}[transformer_local]": "passed", f"{name}[transformer_global_local]": global_local,
                    "tests.test_torch_cuda_graphs::test_losses_read_one_step_late_are_the_steps_own_on_cuda": "failed"}
        monkeypatch.setattr(gpr.gate, "run_gpu_tests", lambda *a, **k: ran.append(a[0]) or (1, outcomes))
        launched.clear()
        assert gpr.main(["--step-cost", "", "--out", str(tmp_path / "out"), "--output-root", str(output_root),
                         "--gpu-tests", "windowed_flex_cudagraph or losses_read_one_step_late", "--try-override",
                         "train.compile=cudagraphs", "--try-if-passed", gate_name, *rows]) == 0
        assert ran[-1] == "windowed_flex_cudagraph or losses_read_one_step_late" and len(launched) == len(rows)
        return {cmd[cmd.index("--rows") + 1]: "train.compile=cudagraphs" in cmd for cmd in launched}

    # One name for every row: all or nothing.
    assert run("windowed_flex_cudagraph", "passed") == {
        "transformer_local": True, "transformer_global_local": True, "pcaf_no_cache": True}
    for outcome in ("skipped", "failed"):
        assert set(run("windowed_flex_cudagraph", outcome).values()) == {False}
    text = capsys.readouterr().out
    assert "gpu tests: exit 1; " in text
    assert ("1 of 2 test(s) matching 'windowed_flex_cudagraph' did not pass: "
            f"{name}[transformer_global_local] failed: wt2-nt-1024/transformer_local runs without "
            "train.compile=cudagraphs") in text
    # Per row: the local case passed, so local attention's rows are tried as graphs; a row with no case of its own
    # is not.
    per_row = "windowed_flex_cudagraph_step_trains_like_eager_on_cuda[{row}]"
    assert run(per_row, "skipped") == {
        "transformer_local": True, "transformer_global_local": False, "pcaf_no_cache": False}
    text = capsys.readouterr().out
    assert ("1 test(s) matching 'windowed_flex_cudagraph_step_trains_like_eager_on_cuda[transformer_local]' passed: "
            "wt2-nt-1024/transformer_local runs with train.compile=cudagraphs") in text
    assert ("no test matching 'windowed_flex_cudagraph_step_trains_like_eager_on_cuda[pcaf_no_cache]' ran: "
            "wt2-nt-2048/pcaf_no_cache runs without train.compile=cudagraphs") in text


def test_only_a_setting_that_keeps_the_numbers_can_be_tried(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="only a setting that cannot change a row's numbers"):
        gpr.main(["--try-override", "train.lr=1e-3", "wt2-nt-1024/transformer_local"])
    with pytest.raises(SystemExit, match="--try-if-passed needs --gpu-tests"):
        gpr.main(["--try-override", "train.compile=cudagraphs", "--try-if-passed", "x", "wt2-nt-1024/local_conv"])
    with pytest.raises(SystemExit, match="is not KEY=VALUE"):
        gpr.main(["--try-override", "train.compile", "wt2-nt-1024/local_conv"])


def test_a_machine_without_the_step_packages_is_told_before_anything_runs(tmp_path: Path, monkeypatch) -> None:
    """Hydra, OmegaConf and PyYAML importable by the steps' interpreter, or one line saying to bring .gpu_site,
    before the gpu tests or any row start."""
    import os
    import sys

    assert gpr.missing_packages(sys.executable, dict(os.environ)) == []  # this project's environment has them
    for name, script, missing in (("no_yaml", "echo yaml", ["yaml"]),  # the probe's answer: PyYAML not found
                                  ("broken", "exit 1", list(gpr.STEP_PACKAGES))):  # no answer: none counts as found
        python = tmp_path / name
        python.write_text(f"#!/bin/sh\n{script}\n")
        python.chmod(0o755)
        assert gpr.missing_packages(str(python), dict(os.environ)) == missing
    launched = []
    monkeypatch.setattr(gpr.subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 0)
    monkeypatch.setattr(gpr.gate, "run_gpu_tests", lambda *a, **k: launched.append(a) or (0, {}))
    monkeypatch.setattr(gpr, "missing_packages", lambda python, env: ["hydra", "omegaconf"])
    with pytest.raises(SystemExit, match=r"cannot import hydra, omegaconf with PYTHONPATH=.*--make-site"):
        gpr.main(["--step-cost", "", "--out", str(tmp_path / "out"), "--gpu-tests", "x", "wt2-nt-1024/local_conv"])
    assert launched == []
