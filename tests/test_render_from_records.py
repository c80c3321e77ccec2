"""A table renders from committed run records alone: ``config.yaml``, ``environment.json``, ``metrics.json`` and
``curve.csv`` per run, no checkpoints, rows finished at different times on different GPUs, trained with a
command-line override that the render command names too (what ``experiments.gpu_paper_rows`` brings back from a
GPU machine and ``docs/results/runs`` holds)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from experiments import gpu_paper_rows
from experiments.reproduce import main as reproduce_main
from paper_tables.__main__ import main as render_main
from pcaf_core.results import read_metrics, write_metrics

TABLE, ROWS = "wt2-nt-2048", ("local_conv", "transformer_global_local")
OVERRIDE = "eval.eval_sample_seed=20002"
GPUS = {"local_conv": ("NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)", "gpu-a"),
        "transformer_global_local": ("NVIDIA H200 (torch 2.11.0+cu130)", "gpu-b")}


@pytest.mark.slow
def test_table_renders_from_records_of_two_gpus(tmp_path: Path, capsys) -> None:
    outputs, records = tmp_path / "outputs", tmp_path / "docs_runs"
    # As the GPU rows run, with a command-line override (there: data.layout=tokens, which smoke scale already sets).
    assert reproduce_main(["--table", TABLE, "--scale", "smoke", "--rows", ",".join(ROWS), "--output-root",
                           str(outputs), "--no-render", OVERRIDE]) == 0
    for row in ROWS:
        (run,) = gpu_paper_rows.copy_records(outputs, TABLE, "smoke", row, records)
        assert sorted(p.name for p in run.iterdir()) == sorted(gpu_paper_rows.RECORD_FILES)
        # As if each row had trained on its own GPU (the record rewritten as its run writes it, so
        # its digests hold).
        device, host = GPUS[row]
        record = read_metrics(run)
        record.device = device
        write_metrics(run, record)
        env = json.loads((run / "environment.json").read_text())
        env.update(host=host)
        (run / "environment.json").write_text(json.dumps(env))
    shutil.rmtree(outputs)  # nothing but the records is left to read

    out = tmp_path / "tables"
    render = ["render", "--table", TABLE, "--scale", "smoke", "--backend", "torch", "--runs", str(records), "--out"]
    # Without the override the runs are not the rows as the table defines them: listed, never rendered as rows,
    # and the command says which override would render them.
    capsys.readouterr()
    assert render_main([*render, str(tmp_path / "as_defined"), "--no-figures"]) == 0
    text = (tmp_path / "as_defined" / f"{TABLE}_smoke_torch.md").read_text()
    assert sum(line.endswith("| missing |") for line in text.splitlines()) == 5
    assert sum(line.endswith("| missing (1 run(s) with other settings set aside) |")
               for line in text.splitlines()) == 2
    assert text.count(f"ran with `{OVERRIDE}`") == 2
    err = capsys.readouterr().err
    assert (f"2 row(s) missing whose runs are there with other settings ({', '.join(ROWS)}): they ran with "
            f"{OVERRIDE}; give the same overrides") in err
    csv_text = (tmp_path / "as_defined" / f"{TABLE}_smoke_torch.csv").read_text()
    assert csv_text.splitlines()[0].endswith(",set_aside") and csv_text.count(f",{OVERRIDE}\n") == 2
    assert render_main([*render, str(out), OVERRIDE]) == 0
    assert "with other settings" not in capsys.readouterr().err
    text = (out / f"{TABLE}_smoke_torch.md").read_text()
    shared = next(line for line in text.splitlines() if line.startswith("- All measured rows: "))
    assert f"; {OVERRIDE} (command line);" in shared
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "ok (n=1)" in line]
    assert [line.split(" | ")[0] for line in table_rows] == ["| Local conv only", "| Global-local attn"]
    # Each row's wall time, in minutes, from its own record.
    header = next(line for line in text.splitlines() if line.startswith("| Model |")).split(" | ")
    minutes = header.index("Run minutes (ours)")
    for line, row in zip(table_rows, ROWS):
        wall = read_metrics(next((records / TABLE / "smoke" / "torch" / row).iterdir())).wall_time_s
        assert wall > 0 and float(line.split(" | ")[minutes]) == pytest.approx(wall / 60, rel=0.01, abs=0.001)
    assert "- Run minutes (ours): each row's whole run" in text
    assert sum(line.endswith("| missing |") for line in text.splitlines()) == 5  # the table's other rows
    device_line = next(line for line in text.splitlines() if line.startswith("- Device(s): "))
    assert (f"{GPUS['local_conv'][0]} (`local_conv`) / {GPUS['transformer_global_local'][0]} "
            f"(`transformer_global_local`)") in device_line
    assert "Runs read: 2 record(s)" in device_line
    # Our column spans two GPUs: the note says only rows of one machine compare, ours included.
    note = next(line for line in text.splitlines() if line.startswith("- 3 machines: "))
    assert f"ours from {GPUS['local_conv'][0]} / {GPUS['transformer_global_local'][0]}" in note
    assert "only between rows that ran on the same machine" in note and "Two machines" not in text
    assert (out / f"{TABLE}_smoke_torch_curves.png").stat().st_size > 0  # the learning curves from curve.csv


def test_backend_scoped_overrides_compose_each_backend_s_rows() -> None:
    """``python -m paper_tables backends ... torch:k=v jax:k=v``: an override prefixed with a backend applies to
    that backend's rows only, the others to both."""
    from experiments.table_plan import expected_identities
    from paper_tables.__main__ import _expected_per_backend

    common, scoped = "eval.eval_sample_seed=20002", "train.lr=0.001"
    got = _expected_per_backend("wt2-nt-1024", "smoke", "local_conv", [common, f"torch:{scoped}"])
    assert got["torch"] == expected_identities("wt2-nt-1024", "smoke", "torch", "local_conv", [common, scoped])
    assert got["jax"] == expected_identities("wt2-nt-1024", "smoke", "jax", "local_conv", [common])
    assert got["torch"] != expected_identities("wt2-nt-1024", "smoke", "torch", "local_conv", [common])
