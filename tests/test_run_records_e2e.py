"""A run record that nothing can silently replace or rewrite, through the real entry points at smoke scale
(docs/EXPERIMENTS.md, "Run identity and run records", names these tests).

One smoke run of wt2-nt-1024/pcaf_context is trained once for the module; each test works on its own copy. Commands
run through ``make`` and side by side are processes; the others run in this process (tests/entry_points.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.allocator import TUNABLES
from experiments.app import hydra_value
from pcaf_core.checkpoints import read_loop_state
from pcaf_core.results import read_metrics, write_metrics
from tests.entry_points import run_app, run_main

REPO = Path(__file__).resolve().parents[1]
ROW = ["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context"]
RUN = ["experiment=wt2-nt-1024/pcaf_context", "scale=smoke"]  # python -m experiments.run RUN ...

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PCAF_NO_PROGRESS": "1", "GLIBC_TUNABLES": TUNABLES, **extra}


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=600, **kw)


def _make(*args: str) -> subprocess.CompletedProcess:
    """``make`` with this interpreter's virtualenv, never reinstalling it or re-preparing data."""
    venv = Path(sys.prefix)
    return _cli(["make", "--no-print-directory", "-o", f"{venv}/.installed", "-o", "data", f"VENV={venv}", *args])


def _at(key: str, path: Path) -> str:
    """A path override for the Hydra app (quoted: these paths hold a space and a non-ASCII character)."""
    return f"{key}={hydra_value(str(path))}"


def _row_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("wt2-nt-1024/smoke/torch/pcaf_context/*/config.yaml"))


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _pcaf_line(md: Path) -> str:
    return next(ln for ln in md.read_text().splitlines() if ln.startswith("| PCAF-context |"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """An outputs root holding one completed smoke run of the row, made by the table driver."""
    from experiments import reproduce

    root = tmp_path_factory.mktemp("trained") / "outputs"
    assert reproduce.main([*ROW, "--output-root", str(root), "--no-render"]) == 0
    return root


@pytest.fixture()
def outputs(trained, tmp_path) -> Path:
    """This test's copy of ``trained``, under a path with a space and a non-ASCII character."""
    root = tmp_path / "out dir ä"
    shutil.copytree(trained, root)
    return root


# --------------------------------------------------------------------------- defects 1 and 5


def test_a_sweep_into_the_same_outputs_is_never_taken_for_the_row_and_make_quotes_paths(outputs):
    """Defect 1: reproduce, ``make sweep`` into the same OUTPUTS, reproduce again and ``make figures``: the row
    keeps its own run, the sweep job is listed beside it. Defect 5: all of it through ``make`` with an outputs
    path holding a space and a non-ASCII character, and no stray folder."""
    (row_dir,) = _row_dirs(outputs)
    row_best = read_metrics(row_dir).best_ppl
    res = _make("sweep", "SWEEP_ROW=wt2-nt-1024/pcaf_context", "SWEEP=memory.top_k=4", "SCALE=smoke",
                f"OUTPUTS={outputs}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (job,) = [p.parent for p in (outputs / "multirun").glob("*/*/metrics.json")]
    job_best = read_metrics(job).best_ppl
    assert job_best != row_best  # otherwise this test could not tell them apart

    res = _make("reproduce-table", "TABLE=wt2-nt-1024", "ROWS=pcaf_context", "SCALE=smoke", f"OUTPUTS={outputs}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"reusing completed run {row_dir}" in res.stdout
    md = Path(res.stdout.strip().splitlines()[-1])
    assert md == outputs / "tables" / "wt2-nt-1024_smoke_torch_pcaf_context.md"
    assert f"{row_best:.2f}" in _pcaf_line(md) and f"{job_best:.2f}" not in _pcaf_line(md)
    assert f"`{job}`: pcaf_context, completed, best PPL {job_best:.2f}; ran with `memory.top_k=4`" \
        in md.read_text()

    res = _make("figures", "FIGURE_TABLES=wt2-nt-1024", "SCALE=smoke", f"OUTPUTS={outputs}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    md = outputs / "tables" / "wt2-nt-1024_smoke_torch.md"
    assert res.stdout.strip().splitlines()[-1] == str(md)
    assert f"{row_best:.2f}" in _pcaf_line(md) and f"{job_best:.2f}" not in _pcaf_line(md)
    assert str(job) in md.read_text()
    assert sorted(p.name for p in outputs.parent.iterdir()) == ["out dir ä"]  # no "out" folder beside it


# --------------------------------------------------------------------------- defect 2


def test_a_refused_resume_changes_nothing_and_the_original_command_still_resumes(outputs):
    (run_dir,) = _row_dirs(outputs)
    # As SIGKILL after the last checkpoint leaves it.
    write_metrics(run_dir, dataclasses.replace(read_metrics(run_dir), status="running"))
    before = _snapshot(run_dir)
    for override, field in (("train.lr=0.01", "train.lr"), ("memory.top_k=8", "memory.top_k")):
        res = run_app([*RUN, _at("run_dir", run_dir), _at("output_root", outputs), override])
        assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
        line = res.stderr.strip().splitlines()[-1]
        assert line.startswith(f"refused: cannot resume {run_dir} with this command: it changes {field}: ")
        assert f"Nothing in {run_dir} was changed" in line and "restart=true" in line
        assert _snapshot(run_dir) == before, override

    res = run_app([*RUN, _at("run_dir", run_dir), _at("output_root", outputs), "train.lr=0.01", "restart=true"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"{run_dir} is kept as it is" in res.stderr and _snapshot(run_dir) == before
    new = [d for d in outputs.rglob("config.yaml") if d.parent != run_dir]
    assert len(new) == 1 and "lr: 0.01" in new[0].read_text()

    res = run_app([*RUN, _at("run_dir", run_dir)])  # the original command still knows its run
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"resuming {run_dir} from step 5" in res.stderr
    rec = read_metrics(run_dir)
    assert rec.status == "completed" and rec.extra["segments"] == 2
    assert (run_dir / "config.yaml").read_bytes() == before["config.yaml"]


# --------------------------------------------------------------------------- defect 3


def test_resuming_with_the_other_backend_is_refused_by_name_with_the_command_that_works(outputs):
    (torch_dir,) = _row_dirs(outputs)
    ckpt = torch_dir / "checkpoints" / "step_5"
    state = read_loop_state(ckpt)
    assert state.backend == "torch" and state.checkpoint_format.startswith("torch-1: ")
    write_metrics(torch_dir, dataclasses.replace(read_metrics(torch_dir), status="running"))
    before = _snapshot(torch_dir)
    res = run_app([*RUN, "backend=jax", _at("run_dir", torch_dir)])
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"refused: {torch_dir} was trained by the torch backend (its checkpoints are torch-1: ")
    assert "backend=jax cannot resume it. Resume it with: python -m experiments.run" in line
    assert "backend=torch" in line and "optimizer.safetensors" not in line and "no checkpoint" not in line
    assert _snapshot(torch_dir) == before and read_metrics(torch_dir).backend == "torch"

    from experiments import reproduce

    # The JAX run is of the local conv row: JAX compiles it in half the time of PCAF's, and what is refused is the
    # backend, whatever the row (the command below is that row's own, but for the backend).
    assert reproduce.main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "local_conv", "--backend", "jax",
                           "--output-root", str(outputs), "--no-render"]) == 0
    (jax_dir,) = [p.parent for p in outputs.glob("wt2-nt-1024/smoke/jax/local_conv/*/config.yaml")]
    before = _snapshot(jax_dir)
    res = run_app(["experiment=wt2-nt-1024/local_conv", "scale=smoke", "backend=torch", _at("run_dir", jax_dir)])
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"refused: {jax_dir} was trained by the jax backend (its checkpoints are jax-1: ")
    assert "backend=jax" in line and _snapshot(jax_dir) == before


# --------------------------------------------------------------------------- defect 4


def test_failed_rows_make_the_command_fail_and_the_fix_replaces_the_bad_override(tmp_path):
    from experiments.reproduce import main as reproduce

    res = run_main(reproduce, [*ROW, "--output-root", str(tmp_path / "out"), "train.lr=1e30"])
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].endswith("1 failed of 1 runs (their rows show why)")
    failed = next(ln for ln in res.stdout.splitlines() if "FAILED: training diverged" in ln)
    assert "no checkpoint to continue from" in failed and "run_dir=" not in failed
    assert failed.count("train.lr=") == 1 and "train.lr=<below 1e+30>" in failed

    empty = tmp_path / "no-data"
    empty.mkdir()
    res = run_main(reproduce, ["--table", "main-303m", "--scale", "paper", "--rows", "pcaf_context_wt103_t1024",
                               "--yes", "--no-render", "--output-root", str(tmp_path / "paper"),
                               f"data.data_dir={empty}", "backend.device=cpu"])
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "FAILED: DataNotFoundError" in res.stdout
    assert res.stderr.strip().splitlines()[-1].endswith("1 failed of 1 runs (their rows show why)")


# --------------------------------------------------------------------------- defect 6


def test_an_edited_or_truncated_record_is_caught_and_rebuilt_keeping_the_damaged_file(outputs, capsys):
    from experiments import reproduce
    from paper_tables.__main__ import main as tables

    (run_dir,) = _row_dirs(outputs)
    record = run_dir / "metrics.json"
    good = read_metrics(run_dir).best_ppl
    data = json.loads(record.read_text())
    data["best_ppl"] = 12.5
    record.write_text(json.dumps(data, indent=2))
    edited = record.read_bytes()
    res = run_main(tables, ["render", "--table", "wt2-nt-1024", "--scale", "smoke", "--backend", "torch", "--runs",
                            str(outputs), "--out", str(outputs / "tables"), "--no-figures"])
    assert res.returncode == 0, res.stderr[-2000:]
    line = _pcaf_line(outputs / "tables" / "wt2-nt-1024_smoke_torch.md")
    assert "12.50" not in line and "| damaged |" in line and f"{record} does not match its own digest" in line
    assert "1 row(s) rendered as damaged (pcaf_context)" in res.stderr

    kept_at = ""  # the UTC second the damaged copy is named by: the next one gets its own
    for damage in ("edited", "truncated"):
        if damage == "truncated":
            while time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) == kept_at:
                time.sleep(0.05)
            record.write_bytes(record.read_bytes()[:300])
            edited = record.read_bytes()
        capsys.readouterr()
        assert reproduce.main([*ROW, "--output-root", str(outputs), "--no-render"]) == 0
        printed = capsys.readouterr()
        kept = [p for p in run_dir.glob("metrics.json.damaged-*") if p.read_bytes() == edited]
        assert len(kept) == 1, damage
        assert f"kept as {kept[0].name}; the record is rebuilt from checkpoint step_5" in printed.err
        rec = read_metrics(run_dir)
        assert rec.status == "completed" and rec.best_ppl == good
        assert any(kept[0].name in i["kept"] for i in rec.extra["incidents"])
        kept_at = kept[0].name.rsplit("-", 1)[1]


# --------------------------------------------------------------------------- defect 7


def test_rows_reproduced_side_by_side_keep_their_own_tables_and_shared_throughput_is_labelled(tmp_path):
    out = tmp_path / "out"
    # A training process that is no part of either command (started through a shell that exits, so it is not
    # this test's child either).
    pid = int(subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'import time; time.sleep(300)' "
                              "experiments.run >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout)
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "experiments.reproduce", "--table", "wt2-nt-1024", "--scale",
                                   "smoke", "--rows", row, "--output-root", str(out)], cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
                 for row in ("pcaf_context", "local_conv")]
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        os.kill(pid, 9)
    for proc, (stdout, stderr) in zip(procs, results):
        assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    for row, display in (("pcaf_context", "PCAF-context"), ("local_conv", "Local conv only")):
        md = out / "tables" / f"wt2-nt-1024_smoke_torch_{row}.md"
        line = next(ln for ln in md.read_text().splitlines() if ln.startswith(f"| {display} |"))
        assert "ok (n=1)" in line and " (shared) |" in line, line
        (rec_dir,) = [p.parent for p in out.glob(f"wt2-nt-1024/smoke/torch/{row}/*/metrics.json")]
        tally = read_metrics(rec_dir).extra["shared_machine"]
        assert tally["shared_samples"] >= 1 and any(o.startswith(f"pid {pid}: ") for o in tally["others"])
        assert "## Tokens/s measured while sharing the machine" in md.read_text()
