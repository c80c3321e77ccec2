"""``experiments.gpu_paper_rows``: the commands it runs, the path it sets, the rows it accepts and skips (no
subprocess here; ``tests/test_render_from_records.py`` uses its record copy on real runs)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from experiments import gpu_paper_rows as gpr


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
    assert "skipped wt2-nt-2048/transformer_local: predicted 536 s of training" in capsys.readouterr().out
