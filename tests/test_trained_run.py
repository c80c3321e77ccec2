"""``pcaf_core.trained_run.locate_run`` on a run trained from Python: a backend's ``train(cfg, run_dir)`` writes
no ``config.yaml`` (the Hydra app does), so the run's config is the one its checkpoints record; such a run is
labelled ``adhoc`` at the ``custom`` scale, not as a suite row. Runs written by ``experiments.run`` are covered
by tests/test_generate.py and tests/test_stream_eval.py.
"""

from __future__ import annotations

import shutil

import pytest

from backends.torch.train import train
from experiments.table_plan import row_config
from pcaf_core.results import CUSTOM_SCALE, read_metrics
from pcaf_core.trained_run import WEIGHTS_FILE, RunNotFoundError, locate_run


@pytest.fixture(scope="module")
def python_run(tmp_path_factory):
    cfg = row_config("wt2-nt-1024/pcaf_context", scale="smoke", overrides=["memory.top_k=4"])
    run_dir = tmp_path_factory.mktemp("runs") / "mine"
    assert train(cfg, run_dir, progress=False).status == "completed"
    return cfg, run_dir


def test_a_run_trained_from_python_is_found_with_the_config_it_was_trained_with(python_run):
    cfg, run_dir = python_run
    assert not (run_dir / "config.yaml").exists()
    step_dir = run_dir / "checkpoints" / f"step_{cfg.train.steps}"
    for path in (run_dir, step_dir, step_dir / WEIGHTS_FILE):
        run = locate_run(path)
        assert run.run_dir == run_dir and run.config == cfg and run.step == cfg.train.steps
        assert run.weights == step_dir / WEIGHTS_FILE
    assert run.describe().startswith(f"adhoc/mine scale={CUSTOM_SCALE} trained-backend=torch")


def test_a_run_trained_from_python_is_not_labelled_with_a_suite_scale(python_run):
    _, run_dir = python_run
    record = read_metrics(run_dir)
    assert (record.table, record.row, record.scale) == ("adhoc", "mine", CUSTOM_SCALE)


def test_a_folder_that_is_no_run_and_weights_without_their_checkpoint_say_what_to_pass(python_run, tmp_path):
    cfg, run_dir = python_run
    with pytest.raises(RunNotFoundError, match=r"no config.yaml or checkpoints/ found above it\): pass run_dir="):
        locate_run(tmp_path)
    # Weights copied into a run folder of their own, away from the loop state that records their config.
    (tmp_path / "checkpoints").mkdir()
    loose = tmp_path / WEIGHTS_FILE
    shutil.copy(run_dir / "checkpoints" / f"step_{cfg.train.steps}" / WEIGHTS_FILE, loose)
    with pytest.raises(RunNotFoundError, match=r"has no config.yaml, and .* records no config \(no loop_state.json\)"):
        locate_run(loose)
