"""Invalid configuration values raise a clear error naming the field."""

from __future__ import annotations

import pytest

from pcaf_core.config import (
    HEAD_LOSS_AUTO_LOGITS,
    MATMUL_PRECISIONS,
    ConfigError,
    DataConfig,
    EvalConfig,
    MemoryConfig,
    ModelConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    head_loss_chunks,
    head_loss_label,
    validate,
)
from pcaf_core.profiles import PROFILE_MATMUL_PRECISION, PROFILES, get_profile, matmul_precision

BAD_VALUES = [
    (MemoryConfig, {"top_k": 0}, "memory.top_k"),
    (MemoryConfig, {"top_k": -3}, "memory.top_k"),
    (MemoryConfig, {"num_buckets": 0}, "memory.num_buckets"),
    (MemoryConfig, {"context_order": 0}, "memory.context_order"),
    (MemoryConfig, {"route": "telepathy"}, "memory.route"),
    (MemoryConfig, {"candidate_policy": "random"}, "memory.candidate_policy"),
    (MemoryConfig, {"semantic_index": "trie"}, "memory.semantic_index"),
    (MemoryConfig, {"semantic_temperature": 0.0}, "memory.semantic_temperature"),
    (MemoryConfig, {"fixed_gate": 1.5}, "memory.fixed_gate"),
    (ModelConfig, {"variant": "mamba"}, "model.variant"),
    (ModelConfig, {"d_model": 0}, "model.d_model"),
    (ModelConfig, {"variant": "transformer_dense", "d_model": 10, "n_heads": 4}, "model.n_heads"),
    (TrainConfig, {"seq_len": 1}, "train.seq_len"),
    (TrainConfig, {"mode": "bidirectional"}, "train.mode"),
    (TrainConfig, {"warmup_steps": 10, "steps": 5}, "train.warmup_steps"),
    (TrainConfig, {"precision": "fp8"}, "train.precision"),
    (TrainConfig, {"head_loss": "fused"}, "train.head_loss"),
    (TrainConfig, {"head_position_chunk": 0}, "train.head_position_chunk"),
    (TrainConfig, {"head_vocab_chunk": -8}, "train.head_vocab_chunk"),
    (TrainConfig, {"matmul_precision": "tf32"}, "train.matmul_precision"),
    (DataConfig, {"name": "c4"}, "data.name"),
    (DataConfig, {"max_vocab": 2}, "data.max_vocab"),
    (EvalConfig, {"protocol": "vibes"}, "eval.protocol"),
    (ProfileConfig, {"positional_scale": -0.5}, "profile.positional_scale"),
    (ProfileConfig, {"positional_scale": float("nan")}, "profile.positional_scale"),
]


@pytest.mark.parametrize("cls,kwargs,field_name", BAD_VALUES, ids=[b[2] + str(b[1]) for b in BAD_VALUES])
def test_invalid_value_names_the_field(cls, kwargs, field_name):
    with pytest.raises(ConfigError, match=field_name.replace(".", r"\.")):
        cls(**kwargs)


def test_validate_rechecks_mutated_fields():
    cfg = RunConfig()
    cfg.memory.top_k = 0
    with pytest.raises(ConfigError, match=r"memory\.top_k=0"):
        validate(cfg)


def test_sequence_longer_than_positional_table_is_rejected():
    with pytest.raises(ConfigError, match=r"train\.seq_len"):
        RunConfig(model=ModelConfig(variant="transformer_dense", d_model=8, n_heads=2, max_seq_len=16),
                  profile=get_profile("reference_jax"), train=TrainConfig(seq_len=32))


def test_profiles_are_named_switch_sets():
    assert set(PROFILES) == {"reference_jax", "reference_torch", "corrected"}
    c = get_profile("corrected")
    assert not c.semantic_ar_target_leak and not c.nt_mixture_floor and c.hybrid_dedup
    for name in ("reference_jax", "reference_torch"):
        p = get_profile(name)
        assert p.semantic_ar_target_leak and p.nt_mixture_floor and p.ar_accuracy_parametric_only
    assert get_profile("reference_jax", hybrid_dedup=True).hybrid_dedup
    with pytest.raises(ConfigError, match="unknown"):
        get_profile("reference_tpu")
    with pytest.raises(ConfigError, match="override"):
        get_profile("corrected", no_such_switch=True)


@pytest.mark.parametrize(("head_loss", "mode", "batch", "parts", "expected"), [
    ("auto", "ar", 64, 1, None),  # 64 x 1,024 x 4,096 = 2^28 logits: one tile
    ("auto", "ar", 65, 1, (512, 4096)),  # past 2^28: tiles
    ("auto", "ar", 128, 2, None),  # 64 windows on each of two devices
    ("auto", "ar", 130, 2, (512, 4096)),
    ("auto", "nt", 1000, 1, None),  # one query per window
    ("full", "ar", 10**3, 1, None),
    ("chunked", "nt", 1, 1, (512, 4096)),
])
def test_head_loss_tiles_where_one_tile_would_be_large(head_loss, mode, batch, parts, expected):
    cfg = RunConfig(model=ModelConfig(vocab_size=4096), train=TrainConfig(
        mode=mode, seq_len=1024, batch_size=batch, head_loss=head_loss, head_position_chunk=512,
        head_vocab_chunk=4096))
    assert 64 * 1024 * 4096 == HEAD_LOSS_AUTO_LOGITS
    assert head_loss_chunks(cfg, parts) == expected
    assert head_loss_label(expected) == ("head loss in one tile" if expected is None
                                         else "head loss in 512x4096 tiles")


def test_matmul_precision_defaults_to_the_profiles():
    """``profile``: JAX's default precision under reference_jax (the paper's TPU runs), float32 under
    reference_torch (the paper's PyTorch code ran with TF32 off) and corrected; a set value wins."""
    assert set(PROFILE_MATMUL_PRECISION) == set(PROFILES)
    assert TrainConfig().matmul_precision == "profile"
    resolved = {name: matmul_precision(RunConfig(profile=get_profile(name))) for name in PROFILES}
    assert resolved == {"reference_jax": "default", "reference_torch": "highest", "corrected": "highest"}
    for value in MATMUL_PRECISIONS:
        cfg = RunConfig(profile=get_profile("reference_jax"), train=TrainConfig(matmul_precision=value))
        assert matmul_precision(cfg) == value


def test_matmul_precision_of_an_unnamed_profile_must_be_set():
    with pytest.raises(ConfigError, match=r"train\.matmul_precision=.* has no default matmul precision"):
        RunConfig(profile=ProfileConfig(name="mine"))
    cfg = RunConfig(profile=ProfileConfig(name="mine"), train=TrainConfig(matmul_precision="high"))
    assert matmul_precision(cfg) == "high"
