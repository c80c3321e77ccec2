"""The backend-neutral loop (pcaf_core.loop) driven by a small NumPy backend (``tests/bigram_backend.py``): the
learning-rate schedule, evaluation cadence, and the bookkeeping of the curve and the record.

Checkpoints, resume and failures are in ``tests/test_loop_resume.py``.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from pcaf_core import loop
from pcaf_core.evaluation import capped_ppl
from pcaf_core.loop import run_training
from pcaf_core.results import CURVE_COLUMNS, read_curve, read_metrics
from pcaf_core.run_record import THROUGHPUT_TIMED_TO_LOSS
from pcaf_core.schedule import lr_at_step
from tests.bigram_backend import BigramBackend, ScriptedEvalBackend, V, markov_corpus, small_cfg

# --------------------------------------------------------------------------- schedule


def test_schedule_warmup_then_cosine_to_min_ratio():
    lr, W, S, rho = 2.0, 4, 12, 0.1
    assert lr_at_step(1, lr, W, S, rho) == pytest.approx(0.5)
    assert lr_at_step(2, lr, W, S, rho) == pytest.approx(1.0)
    assert lr_at_step(4, lr, W, S, rho) == pytest.approx(2.0)  # end of warm-up: the peak
    # Half-way through the cosine: lr * (rho + (1 - rho) / 2).
    assert lr_at_step(8, lr, W, S, rho) == pytest.approx(lr * (rho + (1 - rho) * 0.5))
    assert lr_at_step(S, lr, W, S, rho) == pytest.approx(rho * lr)  # cosine end = min_lr_ratio * lr
    values = [lr_at_step(s, lr, W, S, rho) for s in range(W, S + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_schedule_matches_reference_formula_exactly():
    lr, W, S, rho = 7.5e-5, 1500, 12000, 0.02
    for step in (1, 2, 750, 1500, 1501, 6000, 11999, 12000):
        if step <= W:
            want = lr * step / W
        else:
            want = lr * (rho + (1 - rho) * 0.5 * (1 + math.cos(math.pi * (step - W) / (S - W))))
        assert lr_at_step(step, lr, W, S, rho) == want


def test_schedule_constant_default_and_no_warmup_cosine():
    assert {lr_at_step(s, 3e-4, 0, 100, 1.0) for s in range(1, 101)} == {3e-4}
    assert lr_at_step(100, 1.0, 0, 100, 0.02) == pytest.approx(0.02)
    assert lr_at_step(1, 1.0, 0, 100, 0.0) < 1.0  # step 1 is already past the (empty) warm-up
    assert lr_at_step(5, 1.0, 5, 5, 0.0) == 1.0  # warm-up covering the whole run
    with pytest.raises(ValueError, match="1-based"):
        lr_at_step(0, 1.0, 0, 10, 1.0)


def test_loop_feeds_the_schedule_to_the_backend(tmp_path):
    cfg = small_cfg(steps=10, warmup_steps=3, min_lr_ratio=0.2, eval={"protocol": "reference"})
    backend = BigramBackend()
    run_training(cfg, backend, tmp_path, corpus=markov_corpus(), progress=False)
    assert backend.lrs == [lr_at_step(s, 0.5, 3, 10, 0.2) for s in range(1, 11)]
    assert [r["lr"] for r in read_curve(tmp_path)] == [lr_at_step(s, 0.5, 3, 10, 0.2) for s in (1, 4, 8, 10)]


# --------------------------------------------------------------------------- cadence and bookkeeping


def test_eval_cadence_step1_every_n_and_last(tmp_path):
    cfg = small_cfg(steps=10, eval={"every": 4, "batches": 3, "protocol": "reference"})
    backend = BigramBackend()
    run_training(cfg, backend, tmp_path, corpus=markov_corpus(), progress=False)
    eval_steps = [s for kind, s in backend.calls if kind == "eval"]
    assert eval_steps == [1] * 3 + [4] * 3 + [8] * 3 + [10] * 3
    assert [r["step"] for r in read_curve(tmp_path)] == [1, 4, 8, 10]


def test_eval_windows_are_fresh_at_every_evaluation(tmp_path):
    seen: list[bytes] = []

    class Recording(BigramBackend):
        def eval_batch(self, state, inputs, targets, mode):
            seen.append(inputs.tobytes())
            return super().eval_batch(state, inputs, targets, mode)

    run_training(small_cfg(steps=8, eval={"every": 4, "batches": 2, "protocol": "reference"}), Recording(),
                 tmp_path, corpus=markov_corpus(), progress=False)
    assert len(seen) == 6 and len(set(seen)) == 6  # a continuing stream: no evaluation repeats windows


def test_best_final_and_acc_at_best(tmp_path):
    # Evaluations at steps 1, 4, 8, 10 with scripted losses; a tie keeps the earlier evaluation.
    losses, accs = [5.0, 3.0, 4.0, 3.0], [0.1, 0.4, 0.3, 0.45]
    backend = ScriptedEvalBackend(losses, accs, batches=3)
    m = run_training(small_cfg(steps=10, eval={"every": 4, "batches": 3, "protocol": "reference"}), backend,
                     tmp_path, corpus=markov_corpus(), progress=False)
    assert m.best_step == 4
    assert m.best_ppl == pytest.approx(math.exp(3.0))
    assert m.acc_at_best == pytest.approx(0.5)  # round(0.4 * 4) / 4
    assert m.acc_param_at_best == pytest.approx(0.25)
    assert m.final_ppl == pytest.approx(math.exp(3.0))
    assert m.final_acc == pytest.approx(0.5)  # round(0.45 * 4) = 2
    assert m.full_ppl is None and m.protocol == "reference"


def test_ppl_cap_reference_only(tmp_path):
    backend = ScriptedEvalBackend([25.0, 22.0, 30.0], [0.0, 0.0, 0.0], batches=2)
    m = run_training(small_cfg(steps=8, eval={"every": 4, "batches": 2, "protocol": "both"}), backend,
                     tmp_path, corpus=markov_corpus(), progress=False)
    assert m.final_ppl == math.exp(20.0) and m.best_ppl == math.exp(20.0)
    assert m.best_step == 1  # every evaluation hits the cap: the first stays best
    assert m.extra["final_loss"] == 30.0  # the raw loss is kept
    assert m.full_ppl == pytest.approx(math.exp(25.0))  # the full protocol reports the exact PPL
    assert capped_ppl(math.nan, 20.0) != capped_ppl(math.nan, 20.0)  # NaN is not capped away


def test_curve_csv_rows_and_columns(tmp_path):
    cfg = small_cfg(steps=10, log_every=2, eval={"every": 5, "batches": 2})
    run_training(cfg, BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False)
    header = (tmp_path / "curve.csv").read_text().splitlines()[0].split(",")
    assert header == list(CURVE_COLUMNS)
    rows = read_curve(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 4, 5, 6, 8, 10]
    assert [r["tokens_seen"] for r in rows] == [s * 4 * 8 for s in (1, 2, 4, 5, 6, 8, 10)]
    evals = [r["step"] for r in rows if r["eval_loss_reference"] is not None]
    assert evals == [1, 5, 10]
    for r in rows:
        if r["eval_loss_reference"] is not None:
            assert r["eval_ppl_reference"] == pytest.approx(math.exp(r["eval_loss_reference"]))
        assert math.isfinite(r["train_loss"]) and r["elapsed_s"] >= 0


def test_train_loss_in_curve_is_the_mean_since_the_previous_row(tmp_path):
    losses: list[float] = []

    class Tap(BigramBackend):
        def train_step(self, state, inputs, targets, lr, **kwargs):
            state, loss = super().train_step(state, inputs, targets, lr, **kwargs)
            losses.append(loss)
            return state, loss

    run_training(small_cfg(steps=6, eval={"every": 3, "batches": 1, "protocol": "reference"}), Tap(), tmp_path,
                 corpus=markov_corpus(), progress=False)
    rows = read_curve(tmp_path)
    assert [r["step"] for r in rows] == [1, 3, 6]
    assert rows[0]["train_loss"] == losses[0]
    assert rows[1]["train_loss"] == pytest.approx(np.mean(losses[1:3]))
    assert rows[2]["train_loss"] == pytest.approx(np.mean(losses[3:6]))


def test_a_step_is_timed_until_its_loss_is_on_the_host(tmp_path):
    """An accelerator runs a step after train_step returns; its loss arrives when that work is done. The loss
    stands in here for such a device value: reading it takes 20 ms, and the step's time includes them."""

    class DeviceLoss:
        def __init__(self, value: float) -> None:
            self.value = value

        def __float__(self) -> float:
            time.sleep(0.02)
            return self.value

    class Async(BigramBackend):
        def train_step(self, state, inputs, targets, lr, **kwargs):
            state, loss = super().train_step(state, inputs, targets, lr, **kwargs)
            return state, DeviceLoss(loss)

    steps = loop.THROUGHPUT_WARMUP_STEPS + 4
    rec = run_training(small_cfg(steps=steps, eval={"every": 100, "batches": 1, "protocol": "reference"}), Async(),
                       tmp_path, corpus=markov_corpus(), progress=False)
    assert rec.train_time_s >= 0.02 * steps
    assert rec.tokens_per_sec <= rec.batch_size * rec.seq_len / 0.02
    assert THROUGHPUT_TIMED_TO_LOSS in rec.throughput_definition


def test_metrics_json_content(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=30, lr=20.0, batch_size=16, eval={"every": 10, "batches": 3})
    m = run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    rec = read_metrics(tmp_path)
    assert rec == m
    raw = json.loads((tmp_path / "metrics.json").read_text())
    assert raw["status"] == "completed" and raw["error"] is None
    assert rec.backend == "numpy-bigram" and rec.steps_done == rec.steps_planned == 30
    assert rec.mode == "nt" and rec.seq_len == 8 and rec.batch_size == 16 and rec.seed == 7
    assert rec.params == V * V and rec.vocab_size == V
    assert rec.protocol == "both" and rec.eval_every == 10 and rec.eval_batches == 3
    assert rec.train_tokens == 4000 and rec.eval_tokens == 1200
    assert rec.config_hash == loop.config_hash(cfg)
    # The model learns the chain: far below the unigram floor.
    assert rec.unigram_ppl > 10 and rec.best_ppl < rec.unigram_ppl / 2 and rec.full_ppl < rec.unigram_ppl / 2
    for name in ("final_ppl", "best_ppl", "acc_at_best", "acc_param_at_best", "full_ppl", "full_acc"):
        assert getattr(rec, name) is not None, name
    # NT full protocol, stride 1: one window per position with a full context.
    assert rec.full_windows == 1200 - 8 and rec.extra["full_targets"] == 1200 - 8
    assert rec.extra["full_protocol_label"] == "full"
    assert rec.tokens_per_sec > 0 and rec.extra["timed_steps"] == 30 - loop.THROUGHPUT_WARMUP_STEPS
    assert "global_batch*T" in rec.throughput_definition and "excluded" in rec.throughput_definition
    assert rec.wall_time_s >= rec.train_time_s > 0
    assert (rec.table, rec.row, rec.scale) == ("adhoc", tmp_path.name, "custom")  # no row, no suite scale


def test_full_protocol_ar_and_cap_is_labelled(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(mode="ar", steps=4, eval={"protocol": "full", "full_max_windows": 10, "batch_size": 4})
    m = run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    assert m.best_ppl is None and m.final_ppl is None  # no reference evaluation was run
    assert m.full_windows == 10 and m.extra["full_targets"] == 10 * 8
    assert m.extra["full_protocol_label"] == "full (capped: first 10 of 150 validation windows)"
    assert any("capped at 10 of 150" in d for d in m.deviations)
    # Uncapped AR: every position 1..N-1 scored once, the last window's overlap masked out.
    m2 = run_training(small_cfg(mode="ar", steps=4, eval={"protocol": "full"}), BigramBackend(), tmp_path / "u",
                      corpus=corpus, progress=False)
    assert m2.extra["full_targets"] == 1200 - 1 and m2.extra["full_protocol_label"] == "full"


def test_full_pass_batches_by_full_batch_size_and_scores_the_same(tmp_path):
    """``eval.full_batch_size`` sets how many windows a batch of the full pass holds, and nothing else: the same
    targets to the same loss and accuracy, the reference batches at the eval batch size, and a config hash and
    run identity that ignore it (so a record counts for its row whatever batching its pass used)."""
    from pcaf_core.config_io import config_to_dict
    from pcaf_core.run_identity import identity_digest, resume_diff

    class Sizes(BigramBackend):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def eval_batch(self, state, inputs, targets, mode):
            self.sizes.append(len(inputs))
            return super().eval_batch(state, inputs, targets, mode)

    corpus = markov_corpus()
    runs = {}
    for full in (0, 48):
        cfg = small_cfg(steps=4, eval={"batch_size": 8, "batches": 2, "full_batch_size": full})
        backend = Sizes()
        m = run_training(cfg, backend, tmp_path / str(full), corpus=corpus, progress=False)
        runs[full] = (cfg, m, backend.sizes)
    (cfg0, m0, sizes0), (cfg48, m48, sizes48) = runs[0], runs[48]
    reference = 2 * 2  # steps 1 and 4, two batches each
    assert set(sizes0) == {8} and set(sizes48[:reference]) == {8}
    assert sizes48[reference:] == [48] * (len(sizes48) - reference)
    assert len(sizes0) - reference == -(-m0.full_windows // 8) and len(sizes48) - reference == -(-m0.full_windows // 48)
    assert m48.full_windows == m0.full_windows and m48.extra["full_targets"] == m0.extra["full_targets"]
    assert m48.full_ppl == pytest.approx(m0.full_ppl, rel=1e-12) and m48.full_acc == m0.full_acc
    assert m48.best_ppl == m0.best_ppl
    assert loop.config_hash(cfg48) == loop.config_hash(cfg0) == m0.config_hash == m48.config_hash
    d0, d48 = config_to_dict(cfg0), config_to_dict(cfg48)
    assert identity_digest(d48) == identity_digest(d0) and resume_diff(d0, d48) == []


def test_record_template_identity_is_kept(tmp_path):
    from pcaf_core.results import RunMetrics

    tmpl = RunMetrics(table="wt2-nt-1024", row="pcaf_context", scale="smoke", deviations=["steps 5000 -> 12"])
    m = run_training(small_cfg(), BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False, record=tmpl)
    assert (m.table, m.row, m.scale) == ("wt2-nt-1024", "pcaf_context", "smoke")
    assert m.deviations[0] == "steps 5000 -> 12"


def test_record_names_the_matmul_precision_that_ran(tmp_path):
    """``train.matmul_precision=profile`` reaches the record as the profile's precision (config and hash keep
    what the caller built); a set value is recorded as set."""
    from pcaf_core.profiles import get_profile

    expected = {("corrected", "profile"): "highest", ("reference_jax", "profile"): "default",
                ("reference_jax", "high"): "high"}
    for (profile, setting), want in expected.items():
        cfg = small_cfg(steps=2, matmul_precision=setting)
        cfg.profile = get_profile(profile)
        run_dir = tmp_path / f"{profile}-{setting}"
        m = run_training(cfg, BigramBackend(), run_dir, corpus=markov_corpus(), progress=False)
        assert m.matmul_precision == read_metrics(run_dir).matmul_precision == want, (profile, setting)
        assert m.config_hash == loop.config_hash(cfg)


def test_a_failure_whose_record_cannot_be_built_still_leaves_a_failed_record(tmp_path, monkeypatch, caplog):
    """When the loop's own ``failed`` record cannot be built, the run still ends with a minimal ``failed`` record
    naming the original error, the error itself is raised, and what went wrong while recording is logged; when
    even that record cannot be written, nothing hides the original error."""
    import pcaf_core.run_record as run_record

    build = loop.build_record

    def build_all_but_failed(*args, **kwargs):
        if kwargs["status"] == "failed":
            raise OSError("no memory stats")
        return build(*args, **kwargs)

    monkeypatch.setattr(loop, "build_record", build_all_but_failed)
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        run_training(small_cfg(), BigramBackend(raise_at_step=5), tmp_path / "a", progress=False)
    rec = read_metrics(tmp_path / "a")
    assert rec.status == "failed" and "injected failure at step 5" in rec.error and rec.steps_done == 4
    assert "could not write the failed run record: no memory stats" in caplog.text

    monkeypatch.setattr(run_record, "write_record", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        run_training(small_cfg(), BigramBackend(raise_at_step=5), tmp_path / "b", progress=False)
    assert "could not write a minimal failed record either: disk gone" in caplog.text
