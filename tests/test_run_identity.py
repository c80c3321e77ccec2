"""Run identity, record digests and the record check, on synthetic records (no training): which runs count for a
table row, which records are damaged, unverified or shared the machine (docs/EXPERIMENTS.md, "Run identity and
run records")."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from paper_tables.pipeline import build_report, rows_tag
from paper_tables.render import render_markdown
from pcaf_core.contention import ContentionSampler, other_training_processes
from pcaf_core.record_check import DAMAGED, UNVERIFIED, VERIFIED, check_run
from pcaf_core.results import RunMetrics, append_curve_row, write_metrics
from pcaf_core.run_identity import identity_digest, resume_diff, same_identity

TABLE = "wt2-nt-1024"
CONFIG = {"model": {"d_model": 16}, "memory": {"top_k": 16}, "profile": {"name": "reference_torch"},
          "data": {"name": "wikitext2", "data_dir": None, "cache_dir": None},
          "train": {"lr": 0.001, "steps": 5, "compile": "auto", "checkpoint_every": 0, "log_every": 0},
          "eval": {"every": 2}, "backend": {"name": "torch", "device": "auto", "world_size": 1},
          "scale": {"name": "smoke", "common": {}}, "table": TABLE, "row": "pcaf_context", "seed_runs": [],
          "notes": [], "output_root": "outputs", "run_dir": None, "restart_damaged": False}


def _changed(**dotted) -> dict:
    cfg = copy.deepcopy(CONFIG)
    for key, value in dotted.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


def test_identity_ignores_paths_and_cadence_and_nothing_else():
    same = _changed(train__checkpoint_every=2, train__compile="eager", train__log_every=1, data__data_dir="/d")
    same["output_root"], same["run_dir"] = "elsewhere", "/x/run"
    assert same_identity(CONFIG, same) and identity_digest(CONFIG) == identity_digest(same)
    for key, value in (("memory__top_k", 4), ("train__lr", 0.01), ("backend__name", "jax"), ("eval__every", 3),
                       ("backend__device", "cpu")):
        assert not same_identity(CONFIG, _changed(**{key: value})), key
    # Continuing a run: cadence must be repeated, the device and process count may change.
    assert resume_diff(CONFIG, _changed(train__checkpoint_every=2)) == ["train.checkpoint_every: 0 -> 2"]
    assert resume_diff(CONFIG, _changed(backend__device="cuda", backend__world_size=2)) == []
    assert resume_diff(CONFIG, _changed(train__lr=0.01)) == ["train.lr: 0.001 -> 0.01"]


def _run(root: Path, name: str, config: dict | None, row_config: dict | None = CONFIG, best: float = 300.0,
         curve: tuple[float, ...] = (900.0, 300.0), **kw) -> Path:
    """A completed run as the loop leaves it: config.yaml, curve.csv, then the record (identity and digests)."""
    run_dir = root / TABLE / "smoke" / "torch" / "pcaf_context" / name
    run_dir.mkdir(parents=True)
    if config is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    for step, ppl in enumerate(curve, start=1):
        append_curve_row(run_dir, {"step": step, "eval_ppl_reference": ppl})
    identity = ({"config": identity_digest(config), "row": [identity_digest(row_config)]}
                if config is not None and row_config is not None else {})
    fields = dict(table=TABLE, row="pcaf_context", status="completed", scale="smoke", backend="torch", seed=1,
                  profile="reference_torch", best_ppl=best, tokens_per_sec=1000.0, unigram_ppl=5000.0,
                  identity=identity)
    fields.update(kw)
    write_metrics(run_dir, RunMetrics(**fields))
    return run_dir


def _line(md: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith("| PCAF-context |"))


def test_a_sweep_job_newer_than_the_row_run_is_listed_not_rendered(tmp_path):
    root = tmp_path / "out"
    _run(root, "a-row", CONFIG, best=300.0)
    time.sleep(1.1)  # the sweep job's record is the newer one
    job = _run(root.parent / "out" / "multirun" / "x", "000", _changed(memory__top_k=4), best=280.0,
               deviations=["memory.top_k=4 (command line)"], curve=(900.0, 280.0))
    md = render_markdown(build_report(TABLE, "smoke", "torch", root))
    assert "300.00" in _line(md) and "280.00" not in _line(md)
    assert f"`{job}`: pcaf_context, completed, best PPL 280.00; ran with `memory.top_k=4`" in md
    # A caller that composed the row itself (experiments.reproduce) decides by the digests it passes.
    expected = {(TABLE, "pcaf_context"): [identity_digest(_changed(memory__top_k=4))]}
    assert "280.00" in _line(render_markdown(build_report(TABLE, "smoke", "torch", root, expected=expected)))


def test_a_row_whose_only_runs_are_set_aside_says_what_would_render_them(tmp_path, capsys):
    """The row reads missing with its set-aside runs counted, the CSV names what they ran with, and the command
    line says which overrides would render them; a run whose command line changed nothing gets no such advice."""
    from paper_tables.__main__ import main

    root = tmp_path / "out"
    _run(root, "job", _changed(memory__top_k=4), best=280.0, curve=(900.0, 280.0),
         deviations=["memory.top_k=4 (command line)", "train.compile=eager (command line)"])
    render = ["render", "--table", TABLE, "--scale", "smoke", "--backend", "torch", "--runs", str(root), "--out",
              str(tmp_path / "t"), "--no-figures"]
    assert main(render) == 0
    err = capsys.readouterr().err
    assert ("1 row(s) missing whose runs are there with other settings (pcaf_context): they ran with "
            "memory.top_k=4; give the same overrides to render them as the rows") in err  # compile changes no number
    md = (tmp_path / "t" / f"{TABLE}_smoke_torch.md").read_text()
    assert _line(md).endswith("| missing (1 run(s) with other settings set aside) |")
    _run(root, "edited", _changed(memory__top_k=8), best=290.0, curve=(900.0, 290.0))  # no overrides recorded
    assert main(render) == 0
    assert "they ran with memory.top_k=4; give the same overrides" in capsys.readouterr().err
    csv_text = (tmp_path / "t" / f"{TABLE}_smoke_torch.csv").read_text()
    line = next(ln for ln in csv_text.splitlines() if ln.startswith("pcaf_context,"))
    assert line.endswith(",memory.top_k=4; no command-line overrides recorded") or line.endswith(
        ",no command-line overrides recorded; memory.top_k=4")
    alone = tmp_path / "alone"
    _run(alone, "edited", _changed(memory__top_k=8), best=290.0, curve=(900.0, 290.0))
    assert main([*render[:8], str(alone), *render[9:]]) == 0
    assert "their configs are not the rows' and their command lines changed nothing: rerun the rows" in (
        capsys.readouterr().err)


def test_digests_catch_an_edited_record_curve_or_config_and_old_records_are_unverified(tmp_path):
    root = tmp_path / "out"
    good = _run(root, "good", CONFIG)
    assert check_run(good).state == VERIFIED
    for name, edit in (("metrics.json", lambda d: d.update(best_ppl=12.5)), ("curve.csv", None),
                       ("config.yaml", None)):
        run_dir = _run(tmp_path / name, "r", CONFIG)
        path = run_dir / name
        if edit is not None:
            data = json.loads(path.read_text())
            edit(data)
            path.write_text(json.dumps(data, indent=2))
        else:
            path.write_text(path.read_text().replace("300.0", "250.0").replace("0.001", "0.002"))
        check = check_run(run_dir)
        assert check.state == DAMAGED and check.damaged_files() == [name] and str(path) in check.text(), name
    truncated = _run(tmp_path / "trunc", "r", CONFIG)
    (truncated / "metrics.json").write_text((truncated / "metrics.json").read_text()[:200])
    assert check_run(truncated).state == DAMAGED and "unreadable" in check_run(truncated).text()

    # A record from before digests (schema 1): used, unverified; a best PPL its own curve contradicts: damaged.
    old = _run(tmp_path / "old", "r", CONFIG)
    data = json.loads((old / "metrics.json").read_text())
    for key in ("digests", "identity"):
        del data[key]
    data["schema_version"] = 1
    (old / "metrics.json").write_text(json.dumps(data))
    check = check_run(old)
    assert check.state == UNVERIFIED and "no digest" in check.text() and "checked against curve.csv" in check.text()
    data["best_ppl"] = 12.5
    (old / "metrics.json").write_text(json.dumps(data))
    assert check_run(old).state == DAMAGED and "is not the best eval_ppl_reference" in check_run(old).text()


def test_a_damaged_record_renders_damaged_and_an_old_one_unverified(tmp_path):
    root = tmp_path / "out"
    run_dir = _run(root, "r", CONFIG)
    data = json.loads((run_dir / "metrics.json").read_text())
    data["best_ppl"] = 12.5
    (run_dir / "metrics.json").write_text(json.dumps(data, indent=2))
    md = render_markdown(build_report(TABLE, "smoke", "torch", root))
    assert "12.50" not in _line(md) and "| damaged |" in _line(md)
    assert f"{run_dir / 'metrics.json'} does not match its own digest" in _line(md)
    for key in ("digests", "identity"):
        del data[key]
    data.update(schema_version=1, best_ppl=300.0)
    (run_dir / "metrics.json").write_text(json.dumps(data))
    md = render_markdown(build_report(TABLE, "smoke", "torch", root))
    assert "300.00" in _line(md) and "## Unverified records" in md and str(run_dir) in md


def test_throughput_measured_while_sharing_the_machine_is_marked(tmp_path):
    root = tmp_path / "out"
    tally = {"method": "proc", "samples": 3, "shared_samples": 2, "others": ["pid 7: python -m experiments.run"]}
    _run(root, "r", CONFIG, extra={"shared_machine": tally})
    md = render_markdown(build_report(TABLE, "smoke", "torch", root))
    assert "1,000 (shared)" in _line(md)
    assert "## Tokens/s measured while sharing the machine" in md and "2 of 3 samples" in md
    claim = next(ln for ln in md.splitlines() if "retains most (more than half) of local conv's throughput" in ln)
    assert "measured while sharing the machine" in claim


def test_the_sampler_sees_another_training_process_and_not_its_own_tree():
    method, before = other_training_processes()
    assert method in ("proc", "ps")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "experiments.run"])
    try:
        # Popen returns once the child has passed exec's point of no return, which is before the kernel has
        # laid out its new command line: until then /proc shows an empty one. Wait for it to appear.
        deadline = time.monotonic() + 10
        while not any(o.startswith(f"pid {other.pid}: ") for o in other_training_processes()[1]):
            assert time.monotonic() < deadline, "the child's command line never appeared in the process table"
            time.sleep(0.02)
        tally: dict = {}
        ContentionSampler(tally).sample(force=True)
        assert tally["samples"] == 1 and tally["shared_samples"] == 1
        assert any(o.startswith(f"pid {other.pid}: ") for o in tally["others"])
        assert not any(o.startswith(f"pid {os.getpid()}:") for o in tally["others"])
    finally:
        other.kill()
        other.wait()


def test_a_row_selection_has_its_own_file_name():
    assert rows_tag(None) == rows_tag("*") == ""
    assert rows_tag("pcaf_context") == "pcaf_context"
    assert rows_tag("*_wt103_t1024") == "wt103_t1024"
    assert rows_tag("pcaf_*_wt103_t1024,local_conv_*") == "pcaf_wt103_t1024+local_conv"
