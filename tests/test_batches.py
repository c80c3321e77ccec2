"""The loop's once-per-batch validation (pcaf_core.batches.check_batch): ids and window length."""

from __future__ import annotations

import numpy as np
import pytest

from pcaf_core.batches import check_batch
from pcaf_core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from pcaf_core.profiles import get_profile


def _cfg(variant: str = "pcaf", profile: str = "reference_jax", V: int = 16, max_seq_len: int = 12) -> RunConfig:
    return RunConfig(model=ModelConfig(variant=variant, vocab_size=V, d_model=8, max_seq_len=max_seq_len),
                     data=DataConfig(), train=TrainConfig(seq_len=8), profile=get_profile(profile))


def test_ids_inside_the_vocabulary_pass() -> None:
    inputs = np.arange(16, dtype=np.int32).reshape(2, 8)
    check_batch(inputs, np.array([0, 15], np.int32), _cfg())
    check_batch(inputs, inputs, _cfg())  # AR targets


@pytest.mark.parametrize(("where", "value", "pattern"), [
    ("inputs", 16, r"token id 16 is outside the model's vocabulary \[0, 16\).*max id in this batch 16"),
    ("inputs", -1, r"token id -1 is outside"),
    ("targets", 99, r"token id 99 .*max id in this batch 99.*model.vocab_size=16"),
    ("targets", -3, r"token id -3 is outside"),
])
def test_an_id_outside_the_vocabulary_is_named_with_its_limit(where, value, pattern) -> None:
    inputs = np.zeros((2, 8), np.int32)
    targets = np.zeros(2, np.int32)
    (inputs if where == "inputs" else targets)[1, ...] = value
    with pytest.raises(ValueError, match=pattern) as err:
        check_batch(inputs, targets, _cfg())
    assert "set model.vocab_size" in str(err.value) and "\n" not in str(err.value)


def test_a_window_longer_than_the_positional_table_is_refused() -> None:
    long = np.zeros((1, 13), np.int32)
    with pytest.raises(ValueError, match="T=13 exceeds model.max_seq_len=12.*lower train.seq_len"):
        check_batch(long, np.zeros(1, np.int32), _cfg("transformer_dense"))
    # Fixed sinusoids (reference_torch) and PCAF without a positional table have no rows to run out of.
    check_batch(long, np.zeros(1, np.int32), _cfg("transformer_dense", profile="reference_torch"))
    check_batch(long, np.zeros(1, np.int32), _cfg("local_conv"))
