"""docs/LIBRARY.md runs as written: every ``python`` block of the page, in order, in one namespace, from a fresh
folder (the page's runs go to ``runs/`` under it), with the page's own assertions; plus the one-line errors of
``experiments.table_plan.row_config`` that the page promises.
"""

from __future__ import annotations

import re

import pytest

from pcaf_core.config import ConfigError
from tests.conftest import REPO

GUIDE = REPO / "docs" / "LIBRARY.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def guide_blocks() -> list[str]:
    return BLOCK.findall(GUIDE.read_text(encoding="utf-8"))


def test_the_guide_has_a_block_for_each_of_its_steps():
    text = "\n".join(guide_blocks())
    for used in ("row_config(", "load_corpus(", "backends.torch.train import", "backends.jax.train import",
                 "load_model(", "generate(", ".backward()", "jax.value_and_grad", "load_safetensors("):
        assert used in text, used


@pytest.mark.slow
def test_every_block_of_the_guide_runs_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PCAF_NO_PROGRESS", "1")
    namespace: dict = {"__name__": "library_guide"}
    for number, block in enumerate(guide_blocks(), 1):
        try:
            exec(compile(block, f"{GUIDE.name} block {number}", "exec"), namespace)
        except Exception as exc:  # name the block that failed, with its code
            raise AssertionError(f"docs/LIBRARY.md block {number} failed: {exc!r}\n{block}") from exc
    printed = capsys.readouterr().out
    # The two trainers completed their runs, each in its own folder, and torch generated from JAX's run.
    assert namespace["record"].status == namespace["record_jax"].status == "completed"
    assert (tmp_path / "runs" / "pcaf-torch" / "metrics.json").is_file()
    assert namespace["run"].run_dir.resolve() == (tmp_path / "runs" / "pcaf-jax").resolve()
    assert namespace["out"].log_probs.shape == (namespace["cfg"].train.batch_size, 1, namespace["cfg"].model.vocab_size)
    assert "completed 5" in printed


@pytest.mark.parametrize("experiment, message", [
    ("wt2-nt-1024", "expected <table>/<row>, e.g. wt2-nt-1024/pcaf_context"),
    ("wt2-nt-1024/no_such_row", "available: wt2-nt-1024/local_conv"),
])
def test_row_config_names_what_exists(experiment, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from experiments.table_plan import row_config

        row_config(experiment, scale="smoke")


def test_row_config_is_the_row_with_its_overrides():
    from experiments.table_plan import compose_row, row_config

    cfg = row_config("wt2-nt-1024/pcaf_context", scale="smoke", overrides=["memory.top_k=8"])
    assert cfg == compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", ["memory.top_k=8"])[0].run
    assert cfg.memory.top_k == 8
    with pytest.raises(ConfigError, match="K must be >= 1"):
        row_config("wt2-nt-1024/pcaf_context", scale="smoke", overrides=["memory.top_k=0"])
