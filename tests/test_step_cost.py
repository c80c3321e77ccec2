"""experiments.step_cost: the per-row step cost a scale's budget is calibrated from."""

from __future__ import annotations

import csv

from experiments.step_cost import eval_batch_counts, main
from experiments.table_plan import compose_row


def test_step_cost_times_each_row_on_its_own_text_and_shapes(tmp_path, capsys):
    out = tmp_path / "cost.csv"
    code = main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context", "--warmup", "0",
                 "--steps", "1", "--csv", str(out), "train.steps=7"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pcaf_context") and "ms/target x 7 steps" in lines[0]
    assert "training time at these costs" in lines[-1] and "first steps and evaluation included" in lines[-1]
    [row] = list(csv.DictReader(open(out)))
    assert (row["mode"], row["unit"], row["steps"], row["profile"]) == ("nt", "target", "7", "reference_torch")
    assert float(row["step_ms"]) > 0
    assert row["device"].startswith("cpu") and "device=cpu" in lines[-1]  # the CPU unless told otherwise
    assert abs(float(row["ms_per_unit"]) * int(row["batch"]) - float(row["step_ms"])) < 0.01
    # The whole run: the first step, 6 more at the step cost, and every batch the run evaluates.
    assert int(row["eval_batches"]) == sum(eval_batch_counts(compose_row("wt2-nt-1024", "pcaf_context", "smoke",
                                                                         "torch", ["train.steps=7"])[0].run))
    assert float(row["eval_batch_ms"]) > 0 and float(row["first_step_s"]) > 0
    assert (row["full_batch_ms"], row["first_full_s"]) == (row["eval_batch_ms"], row["first_eval_s"])  # one size
    want_eval = float(row["first_eval_s"]) + (int(row["eval_batches"]) - 1) * float(row["eval_batch_ms"]) / 1e3
    assert abs(float(row["eval_s"]) - want_eval) <= 0.05 + 1e-6
    want = float(row["first_step_s"]) + 6 * float(row["step_ms"]) / 1e3 + float(row["eval_s"])
    assert abs(float(row["wall_s"]) - want) <= 0.1 + 1e-6


def test_eval_batch_count_follows_the_loops_cadence_and_full_pass() -> None:
    """Reference evaluations at step 1, every ``eval.every`` steps and the last step, ``eval.batches`` each; the
    full protocol adds its deterministic pass, batched as the loop batches it."""
    from pcaf_core.data import load_corpus
    from pcaf_core.evaluation import evaluation_tokens, full_windows

    def cfg(*overrides):
        return compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", list(overrides))[0].run

    ref = cfg("train.steps=10", "eval.every=4", "eval.batches=3", "eval.protocol=reference")
    assert eval_batch_counts(ref) == (4 * 3, 0)  # steps 1, 4, 8, 10
    full = cfg("train.steps=10", "eval.protocol=full", "eval.batch_size=5", "eval.full_max_windows=12")
    n_full = len(full_windows(evaluation_tokens(load_corpus(full.data)), full, 5, capped=True))
    assert n_full == 3 and eval_batch_counts(full) == (0, n_full)  # 12 windows in batches of 5
    both = cfg("train.steps=8", "eval.every=4", "eval.batches=2", "eval.protocol=both", "eval.batch_size=5",
               "eval.full_max_windows=12")
    assert eval_batch_counts(both) == (3 * 2, n_full)  # steps 1, 4, 8
    wide = cfg("train.steps=8", "eval.every=4", "eval.batches=2", "eval.protocol=both", "eval.batch_size=5",
               "eval.full_max_windows=12", "eval.full_batch_size=8")
    assert eval_batch_counts(wide) == (3 * 2, 2)  # the pass in batches of 8 windows, the reference ones of 5


def test_step_cost_times_a_full_pass_batched_otherwise_at_its_own_size(tmp_path):
    """With ``eval.full_batch_size`` set, the pass's batches are timed at that size (their own first call and
    median) and the run's evaluation adds the two kinds of batch, each at its own cost."""
    out = tmp_path / "cost.csv"
    assert main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "local_conv", "--warmup", "0", "--steps",
                 "1", "--csv", str(out), "train.steps=3", "eval.full_batch_size=16"]) == 0
    [row] = list(csv.DictReader(open(out)))
    n_ref, n_full = eval_batch_counts(compose_row("wt2-nt-1024", "local_conv", "smoke", "torch",
                                                  ["train.steps=3", "eval.full_batch_size=16"])[0].run)
    assert (int(row["full_batch"]), int(row["full_batches"]), int(row["eval_batches"])) == (16, n_full, n_ref + n_full)
    assert float(row["full_batch_ms"]) > 0 and float(row["first_full_s"]) > 0
    want = (float(row["first_eval_s"]) + (n_ref - 1) * float(row["eval_batch_ms"]) / 1e3
            + float(row["first_full_s"]) + (n_full - 1) * float(row["full_batch_ms"]) / 1e3)
    assert abs(float(row["eval_s"]) - want) <= 0.05 + 1e-6


def test_step_cost_rejects_rows_that_match_nothing(capsys):
    assert main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "nope*"]) == 2
    assert "matches no row of wt2-nt-1024" in capsys.readouterr().err
