"""experiments.step_cost: the per-row step cost a scale's budget is calibrated from."""

from __future__ import annotations

import csv

from experiments.step_cost import main


def test_step_cost_times_each_row_on_its_own_text_and_shapes(tmp_path, capsys):
    out = tmp_path / "cost.csv"
    code = main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context", "--warmup", "0",
                 "--steps", "1", "--csv", str(out), "train.steps=7"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pcaf_context") and "ms/target x 7 steps" in lines[0]
    assert "training time at these costs" in lines[-1] and "evaluation and start-up not included" in lines[-1]
    [row] = list(csv.DictReader(open(out)))
    assert (row["mode"], row["unit"], row["steps"], row["profile"]) == ("nt", "target", "7", "reference_torch")
    assert float(row["step_ms"]) > 0
    assert row["device"].startswith("cpu") and "device=cpu" in lines[-1]  # the CPU unless told otherwise
    assert abs(float(row["ms_per_unit"]) * int(row["batch"]) - float(row["step_ms"])) < 0.01


def test_step_cost_rejects_rows_that_match_nothing(capsys):
    assert main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "nope*"]) == 2
    assert "matches no row of wt2-nt-1024" in capsys.readouterr().err
