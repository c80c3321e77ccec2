"""The backend-neutral loop (pcaf_core.loop) driven by a small NumPy backend (``tests/bigram_backend.py``):
checkpoints and their pruning, bit-exact resume, failures (NaN, interrupts, bad configs) and progress output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pcaf_core import loop
from pcaf_core.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, read_loop_state
from pcaf_core.config import (
    ConfigError,
)
from pcaf_core.config_io import config_from_dict, config_to_dict
from pcaf_core.loop import TrainingDiverged, run_training
from pcaf_core.results import read_curve, read_metrics
from tests.bigram_backend import BigramBackend, V, markov_corpus, small_cfg
from tests.resume_helpers import curve_without_time, quality

# --------------------------------------------------------------------------- checkpoints and resume


def test_checkpoint_cadence_layout_and_pruning(tmp_path):
    cfg = small_cfg(steps=10, checkpoint_every=3)
    run_training(cfg, BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False, keep_checkpoints=2)
    names = sorted(p.name for p in list_checkpoints(tmp_path))
    assert names == ["step_10", "step_9"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_10"
    ck = latest_checkpoint(tmp_path)
    assert ck.name == "step_10"
    assert {p.name for p in ck.iterdir()} == {"W.npy", "step.txt", "loop_state.json"}
    ls = read_loop_state(ck)
    assert ls.step == 10 and ls.config_hash == loop.config_hash(cfg) and len(ls.curve) == 4
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())


def test_resume_after_failure_is_bit_exact(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=14, checkpoint_every=4, log_every=1, eval={"every": 5, "batches": 2})
    ref = run_training(cfg, BigramBackend(), tmp_path / "ref", corpus=corpus, progress=False)

    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure at step 11"):
        run_training(cfg, BigramBackend(raise_at_step=11), run, corpus=corpus, progress=False)
    failed = read_metrics(run)
    assert failed.status == "failed" and "injected failure at step 11" in failed.error
    assert failed.steps_done == 10
    assert len(read_curve(run)) == 10  # rows past the last checkpoint (step 8) were written...
    resumed_backend = BigramBackend()
    m = run_training(cfg, resumed_backend, run, corpus=corpus, progress=False)
    assert resumed_backend.calls[0] == ("train", 9)  # ...and the resumed run continued after step 8
    assert m.status == "completed" and m.extra["segments"] == 2
    assert quality(m) == quality(ref)
    assert curve_without_time(run) == curve_without_time(tmp_path / "ref")
    np.testing.assert_array_equal(np.load(run / "checkpoints/step_14/W.npy"),
                                  np.load(tmp_path / "ref/checkpoints/step_14/W.npy"))


def test_resume_of_a_completed_run_reruns_nothing_and_keeps_its_record(tmp_path):
    """A finished run run again (experiments.run run_dir=..., a sweep run again in its directory, a backend's
    train() called twice) returns its record as it is: no step, no evaluation (the full pass of a paper-scale row
    takes minutes, and an interruption there would have marked the finished run failed), not a byte rewritten."""
    corpus = markov_corpus()
    cfg = small_cfg(steps=6, eval={"protocol": "both"})
    first = run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    files = {name: (tmp_path / name).read_bytes() for name in ("metrics.json", "curve.csv")}
    again = BigramBackend()
    second = run_training(cfg, again, tmp_path, corpus=corpus, progress=False)
    assert again.calls == []
    assert second == first and second.extra["segments"] == 1
    assert {name: (tmp_path / name).read_bytes() for name in files} == files
    # A finished run whose record fails its check is rebuilt from its last checkpoint, evaluated again.
    (tmp_path / "metrics.json").write_bytes(files["metrics.json"].replace(b'"best_ppl": ', b'"best_ppl": 1'))
    rebuilt = BigramBackend()
    third = run_training(cfg, rebuilt, tmp_path, corpus=corpus, progress=False)
    assert [c for c in rebuilt.calls if c[0] == "train"] == [] and ("eval", 6) in rebuilt.calls
    assert quality(third) == quality(first) and third.extra["segments"] == 2


def test_resume_with_a_different_config_names_the_fields(tmp_path):
    corpus = markov_corpus()
    run_training(small_cfg(steps=6, checkpoint_every=3), BigramBackend(), tmp_path, corpus=corpus, progress=False)
    changed = small_cfg(steps=6, checkpoint_every=3, lr=0.25)
    with pytest.raises(CheckpointError, match=r"train\.lr: 0\.5 -> 0\.25") as err:
        run_training(changed, BigramBackend(), tmp_path, corpus=corpus, progress=False)
    assert "different config" in str(err.value) and "Nothing in" in str(err.value)
    assert "resume=False" not in str(err.value)  # no option the command line lacks
    assert read_metrics(tmp_path).status == "completed"  # refused before anything changed: the record stands
    # The checkpoint is untouched; resume=False starts over and replaces it.
    assert latest_checkpoint(tmp_path).name == "step_6"
    m = run_training(changed, BigramBackend(), tmp_path, corpus=corpus, progress=False, resume=False)
    assert m.status == "completed" and read_loop_state(latest_checkpoint(tmp_path)).config["train"]["lr"] == 0.25


def test_data_location_does_not_change_the_config_hash():
    a, b = small_cfg(), small_cfg()
    b.data.data_dir = "/elsewhere"
    b.data.cache_dir = "/tmp/cache"
    assert loop.config_hash(a) == loop.config_hash(b)
    b.data.max_vocab = V + 1
    assert loop.config_hash(a) != loop.config_hash(b)


def test_a_run_may_resume_with_its_full_pass_batched_otherwise(tmp_path):
    """``eval.full_batch_size`` is not in a checkpoint's config hash: a run cut off before its full pass finishes
    it in other batches (a checkpoint written before the field existed hashes the same), and scores the same."""
    corpus = markov_corpus()
    cfg = small_cfg(steps=9, checkpoint_every=3, eval={"batch_size": 4})
    ref = run_training(cfg, BigramBackend(), tmp_path / "ref", corpus=corpus, progress=False)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure at step 8"):
        run_training(cfg, BigramBackend(raise_at_step=8), run, corpus=corpus, progress=False)
    wide = small_cfg(steps=9, checkpoint_every=3, eval={"batch_size": 4, "full_batch_size": 64})
    assert loop.config_hash(wide) == loop.config_hash(cfg)
    assert "full_batch_size" not in read_loop_state(latest_checkpoint(run)).config["eval"]
    m = run_training(wide, BigramBackend(), run, corpus=corpus, progress=False)
    assert m.status == "completed" and m.extra["segments"] == 2
    assert m.full_ppl == pytest.approx(ref.full_ppl, rel=1e-12) and m.full_windows == ref.full_windows


def test_incomplete_or_corrupt_checkpoint_falls_back_to_the_previous(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=9, checkpoint_every=3)
    run_training(cfg, BigramBackend(), tmp_path, corpus=corpus, progress=False, keep_checkpoints=3)
    root = tmp_path / "checkpoints"
    (root / "step_9" / "W.npy").write_bytes(b"truncated")
    assert latest_checkpoint(tmp_path).name == "step_6"
    (root / "step_6" / "loop_state.json").unlink()  # never finished
    assert latest_checkpoint(tmp_path).name == "step_3"
    backend = BigramBackend()
    run_training(cfg, backend, tmp_path, corpus=corpus, progress=False)
    assert backend.calls[0] == ("train", 4)


def test_config_round_trip_through_dict():
    cfg = small_cfg(lr=0.125)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    with pytest.raises(ValueError, match="unknown sections"):
        config_from_dict({"bogus": {}})


# --------------------------------------------------------------------------- failures


def test_nan_loss_stops_with_step_and_last_good_checkpoint(tmp_path):
    corpus = markov_corpus()
    cfg = small_cfg(steps=12, checkpoint_every=4)
    with pytest.raises(TrainingDiverged) as err:
        run_training(cfg, BigramBackend(nan_at_step=7), tmp_path, corpus=corpus, progress=False)
    msg = str(err.value)
    good = tmp_path / "checkpoints" / "step_4"
    assert "non-finite loss nan at step 7" in msg and str(good) in msg
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and "step 7" in rec.error and str(good) in rec.error
    assert rec.steps_done == 6
    # The last good checkpoint survives, is complete and loads with finite weights.
    assert latest_checkpoint(tmp_path) == good
    state = BigramBackend().load(good, cfg)
    assert np.isfinite(state["W"]).all() and state["step"] == 4


def test_nan_before_any_checkpoint_says_so(tmp_path):
    with pytest.raises(TrainingDiverged, match="none"):
        run_training(small_cfg(steps=5), BigramBackend(nan_at_step=2), tmp_path, corpus=markov_corpus(),
                     progress=False)
    assert read_metrics(tmp_path).status == "failed" and latest_checkpoint(tmp_path) is None


def test_interrupt_leaves_a_record_that_says_so(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_training(small_cfg(steps=8, checkpoint_every=2), BigramBackend(raise_at_step=5,
                     raise_type=KeyboardInterrupt), tmp_path, corpus=markov_corpus(), progress=False)
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and rec.error.startswith("interrupted by Ctrl-C (SIGINT) after step 4")
    assert "step_4" in rec.error and "resume " in rec.error and rec.extra["resumable"] is True


def test_invalid_config_and_vocab_mismatch_fail_clearly(tmp_path):
    cfg = small_cfg()
    cfg.train.seq_len = 1  # mutated after construction: the loop re-validates
    with pytest.raises(ConfigError, match="train.seq_len=1"):
        run_training(cfg, BigramBackend(), tmp_path, corpus=markov_corpus(), progress=False)
    big = markov_corpus(vocab=V + 10)
    with pytest.raises(ValueError, match=f"corpus vocabulary has {V + 10} ids but model.vocab_size={V}"):
        run_training(small_cfg(), BigramBackend(), tmp_path / "b", corpus=big, progress=False)
    assert read_metrics(tmp_path / "b").status == "failed"
    bad = markov_corpus()
    bad.train[5] = V + 3  # an id the declared vocabulary does not have
    with pytest.raises(Exception, match=str(V + 3)):
        run_training(small_cfg(), BigramBackend(), tmp_path / "c", corpus=bad, progress=False)


def test_batch_must_split_evenly_across_ranks(tmp_path):
    class TwoRanks(BigramBackend):
        world_size = 2

    with pytest.raises(ValueError, match="not divisible by the 2 data-parallel processes"):
        run_training(small_cfg(batch_size=3), TwoRanks(), tmp_path, corpus=markov_corpus(), progress=False)


def test_progress_bar_renders(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PCAF_NO_PROGRESS", raising=False)
    run_training(small_cfg(steps=4), BigramBackend(), tmp_path, corpus=markov_corpus(), progress=True)
    err = capsys.readouterr().err
    assert "numpy-bigram train" in err and "4/4" in err


def test_progress_without_a_terminal_is_one_line_per_evaluation(tmp_path, monkeypatch, capsys):
    """Redirected to a file (a cluster job, nohup), a run prints one line per evaluation with step/total, train
    loss, eval PPL, tokens/s, elapsed and ETA; on a terminal it draws the bar instead; PCAF_NO_PROGRESS=1 and
    progress=False print neither."""
    import io

    from pcaf_core.progress import BAR, LINES, OFF, progress_line, progress_style

    monkeypatch.delenv("PCAF_NO_PROGRESS", raising=False)
    tty, log = io.StringIO(), io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    assert (progress_style(None, tty), progress_style(None, log)) == (BAR, LINES)
    assert (progress_style(True, log), progress_style(False, tty)) == (BAR, OFF)
    monkeypatch.setenv("PCAF_NO_PROGRESS", "1")
    assert progress_style(None, log) == progress_style(True, tty) == OFF
    monkeypatch.delenv("PCAF_NO_PROGRESS")

    line = progress_line("t/r scale=cpu backend=numpy seed=7", 500, 5000, 5.4123, 281.374, 3912.4, 252.0, 2268.0)
    assert line == ("[t/r scale=cpu backend=numpy seed=7] step 500/5000 · train loss 5.412 · eval PPL 281.37 "
                    "(reference) · 3,912 tok/s · elapsed 4m12s · ETA 37m48s")

    cfg = small_cfg()  # stderr under pytest is not a terminal: progress=None gives the lines
    run_training(cfg, BigramBackend(), tmp_path / "run", corpus=markov_corpus(), progress=None)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if " step " in x and "eval PPL" in x]
    evals = [r for r in read_curve(tmp_path / "run") if r.get("eval_ppl_reference") is not None]
    assert len(lines) == len(evals) > 1
    assert lines[-1].startswith(f"[adhoc/run scale=custom backend=numpy-bigram seed={cfg.train.seed}] "
                                f"step {cfg.train.steps}/{cfg.train.steps} · train loss ")
    assert "ETA 0s" in lines[-1] and "elapsed " in lines[0]
    run_training(cfg, BigramBackend(), tmp_path / "quiet", corpus=markov_corpus(), progress=False)
    assert "eval PPL" not in capsys.readouterr().err
