"""The CPU training-time estimate of ``experiments.long_run`` counts the FLOPs a step executes: a next-token
step of every model computes from receptive fields, so its estimate is that count, not the full window's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from experiments.long_run import train_seconds
from pcaf_core.config import MemoryConfig, ModelConfig, TrainConfig
from pcaf_core.flops import train_step_flops

T, B, STEPS, RATE = 512, 32, 100, 1e11


@pytest.mark.parametrize("variant", ["pcaf", "local_conv", "transformer_dense", "transformer_local",
                                     "transformer_global_local", "linear_attention"])
def test_next_token_estimate_counts_the_executed_receptive_field(variant: str) -> None:
    model = ModelConfig(variant=variant, vocab_size=8000, d_model=128, d_hidden=512, n_layers=2, n_heads=4)
    memory = MemoryConfig(route="context", top_k=16)
    run = SimpleNamespace(model=model, memory=memory, train=TrainConfig(mode="nt", seq_len=T, batch_size=B,
                                                                        steps=STEPS))
    executed = train_step_flops(model, memory, "nt", T, B, nt_count="receptive_field")
    assert train_seconds(run, RATE) == pytest.approx(STEPS * executed / RATE)
    full = train_step_flops(model, memory, "nt", T, B, nt_count="full_window")
    if variant == "linear_attention":  # its chunked form computes every row: nothing is cut
        assert executed == full
    else:  # dense attention: every row below its top layer, and the top layer's last row
        assert executed < full, variant


def test_full_ar_estimate_counts_every_position() -> None:
    model = ModelConfig(variant="local_conv", vocab_size=8000, d_model=128, d_hidden=512, n_layers=2)
    memory = MemoryConfig()
    run = SimpleNamespace(model=model, memory=memory, train=TrainConfig(mode="ar", seq_len=256, batch_size=2,
                                                                        steps=STEPS))
    assert train_seconds(run, RATE) == pytest.approx(
        STEPS * train_step_flops(model, memory, "ar", 256, 2) / RATE)
