"""The torch trainer (backends.torch.train) on a slice of the real WikiText-2 cache.

Small shapes (V = 200, d = 16, T = 16, batch 4, tens of steps) so every test runs in seconds on a CPU.
The helpers :func:`tiny_cfg` and the ``wt2_cache`` fixture are shared with the DDP and resume tests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch

from backends.torch import checkpoint as ckpt
from backends.torch.optim import build_optimizer, param_groups
from backends.torch.train import TorchBackend, train
from backends.torch.weights import to_canonical
from pcaf_core.batches import check_batch
from pcaf_core.checkpoints import latest_checkpoint
from pcaf_core.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    MemoryConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from pcaf_core.data import DataError, load_corpus
from pcaf_core.evaluation import score_batch
from pcaf_core.loop import TrainingDiverged, run_training
from pcaf_core.params import count_params
from pcaf_core.profiles import get_profile
from pcaf_core.results import read_curve, read_metrics

V = 200


@pytest.fixture(scope="session")
def wt2_cache(tmp_path_factory) -> str:
    """A token cache of WikiText-2 at V = 200 in a private directory (built once per session)."""
    cache = tmp_path_factory.mktemp("pcaf_cache")
    load_corpus(DataConfig(name="wikitext2", max_vocab=V, cache_dir=str(cache)))
    return str(cache)


def tiny_cfg(cache_dir: str, *, variant: str = "pcaf", profile: str = "corrected", route: str = "context",
             train: dict[str, Any] | None = None, eval: dict[str, Any] | None = None,
             model: dict[str, Any] | None = None, **profile_over: Any) -> RunConfig:
    """A run small enough for a unit test: V=200, d=16, T=16, batch 4, 20 steps."""
    tr = dict(mode="nt", seq_len=16, batch_size=4, steps=20, lr=3e-3, seed=11, checkpoint_every=0)
    tr.update(train or {})
    ev = dict(protocol="both", every=10, batches=3, full_max_windows=64)
    ev.update(eval or {})
    mo = dict(variant=variant, vocab_size=V, d_model=16, d_hidden=32, n_layers=2, n_heads=2, window=8,
              n_global=2, max_seq_len=32)
    mo.update(model or {})
    return RunConfig(
        model=ModelConfig(**mo),
        memory=MemoryConfig(route=route, num_buckets=256, top_k=4, semantic_buckets=8),
        profile=get_profile(profile, **profile_over),
        data=DataConfig(name="wikitext2", max_vocab=V, max_train_tokens=40_000, max_eval_tokens=4_000,
                        cache_dir=cache_dir),
        train=TrainConfig(**tr),
        eval=EvalConfig(**ev),
    )


def weights_of(run_dir: Path, step: int | None = None) -> dict[str, np.ndarray]:
    path = latest_checkpoint(run_dir) if step is None else Path(run_dir) / "checkpoints" / f"step_{step}"
    return safetensors.numpy.load_file(str(path / ckpt.WEIGHTS_FILE))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_train_end_to_end_writes_a_complete_record(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache, train={"steps": 20, "checkpoint_every": 10, "log_every": 5})
    m = train(cfg, tmp_path, progress=False)
    assert read_metrics(tmp_path) == m
    assert m.status == "completed" and m.backend == "torch" and m.steps_done == 20
    assert m.params == count_params(cfg.model, cfg.memory, cfg.profile)
    assert m.dataset == "wikitext2" and m.vocab_size == V and m.train_tokens == 40_000 and m.eval_tokens == 4_000
    for name in ("final_ppl", "best_ppl", "acc_at_best", "acc_param_at_best", "full_ppl", "full_acc",
                 "full_acc_param", "tokens_per_sec", "peak_mem_mb", "unigram_ppl"):
        value = getattr(m, name)
        assert value is not None and math.isfinite(value), name
    assert m.full_windows == 64 and "capped: first 64 of" in m.extra["full_protocol_label"]
    assert m.device.startswith("cpu") and m.versions["torch"] == torch.__version__
    rows = read_curve(tmp_path)
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]  # it learns
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_*"))] == ["step_10", "step_20"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,profile,mode",
    [
        ("pcaf", "reference_jax", "ar"),
        ("pcaf_no_gate", "reference_torch", "nt"),
        ("local_conv", "reference_torch", "ar"),
        ("transformer_local", "corrected", "nt"),
        ("linear_attention", "reference_jax", "ar"),
    ],
)
def test_variants_profiles_modes_train(tmp_path, wt2_cache, variant, profile, mode):
    cfg = tiny_cfg(wt2_cache, variant=variant, profile=profile,
                   train={"steps": 6, "mode": mode}, eval={"every": 3, "batches": 2, "full_max_windows": 8})
    m = run_training(cfg, TorchBackend("cpu"), tmp_path, progress=False)
    assert m.status == "completed"
    assert m.params == count_params(cfg.model, cfg.memory, cfg.profile)
    assert math.isfinite(m.best_ppl) and math.isfinite(m.full_ppl)
    assert m.extra["full_targets"] == (8 if mode == "nt" else 8 * 16)


def test_same_seed_same_run_bitwise(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache, profile="reference_torch", train={"steps": 8})  # dropout and clipping on
    a = train(cfg, tmp_path / "a", progress=False)
    b = train(cfg, tmp_path / "b", progress=False)
    for name in ("final_ppl", "best_ppl", "acc_at_best", "full_ppl", "full_acc"):
        assert getattr(a, name) == getattr(b, name)
    wa, wb = weights_of(tmp_path / "a"), weights_of(tmp_path / "b")
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    c = train(tiny_cfg(wt2_cache, profile="reference_torch", train={"steps": 8, "seed": 12}), tmp_path / "c",
              progress=False)
    assert c.final_ppl != a.final_ppl


# --------------------------------------------------------------------------- optimiser


def test_weight_decay_groups(wt2_cache):
    cfg = tiny_cfg(wt2_cache, variant="transformer_dense")
    module = TorchBackend("cpu").init(cfg).module
    (only,) = param_groups(module, 0.01, decay_all=True)
    assert len(only["params"]) == len(list(module.parameters())) and only["weight_decay"] == 0.01
    decay, no_decay = param_groups(module, 0.01, decay_all=False)
    assert no_decay["weight_decay"] == 0.0
    assert "pos.table" in no_decay["names"] and "embed.weight" in decay["names"]
    assert all(n.endswith(".bias") or "norm" in n or n == "pos.table" for n in no_decay["names"])
    assert {"blocks.0.attn.qkv.weight", "head.out.weight"} <= set(decay["names"])
    pcaf = TorchBackend("cpu").init(tiny_cfg(wt2_cache)).module
    _, nd = param_groups(pcaf, 0.01, decay_all=False)
    assert "memory.recency_scale" in nd["names"]
    opt = build_optimizer(module, cfg.train, cfg.profile)
    assert opt.defaults["betas"] == (cfg.train.beta1, cfg.train.beta2) and opt.defaults["eps"] == cfg.train.eps


def test_unused_parameters_are_decayed_like_the_reference(wt2_cache):
    # reference_jax carries an unused semantic router in context-route models (docs/REFERENCE_CODE.md §7.16): the
    # reference's AdamW sees a zero gradient and still applies p <- p - lr*wd*p.
    cfg = tiny_cfg(wt2_cache, profile="reference_jax", train={"weight_decay": 0.1})
    backend = TorchBackend("cpu")
    state = backend.init(cfg)
    before = state.module.memory.router.weight.detach().clone()
    rng = np.random.default_rng(0)
    x = rng.integers(3, V, (4, 16)).astype(np.int32)
    y = rng.integers(3, V, (4,)).astype(np.int32)
    backend.train_step(state, x, y, lr=0.5)
    after = state.module.memory.router.weight.detach()
    torch.testing.assert_close(after, before * (1 - 0.5 * 0.1), rtol=0, atol=1e-7)


def test_weight_decay_switch_excludes_norms(wt2_cache):
    cfg = tiny_cfg(wt2_cache, weight_decay_all_params=False, train={"weight_decay": 0.5})
    backend = TorchBackend("cpu")
    state = backend.init(cfg)
    ln = state.module.head.norm.bias  # zero-initialised, and its gradient is what moves it
    state.module.head.norm.bias.data.fill_(1.0)
    x = np.full((4, 16), 5, dtype=np.int32)
    y = np.full((4,), 6, dtype=np.int32)
    state.optimizer.zero_grad()
    backend.train_step(state, x, y, lr=1e-9)  # a negligible Adam step: only decay could move it
    assert torch.allclose(ln.detach(), torch.ones_like(ln), atol=1e-6)


def test_grad_clipping(wt2_cache):
    rng = np.random.default_rng(1)
    x = rng.integers(3, V, (4, 16)).astype(np.int32)
    y = rng.integers(3, V, (4,)).astype(np.int32)

    def grad_norm(clip: float) -> float:
        backend = TorchBackend("cpu")
        state = backend.init(tiny_cfg(wt2_cache, grad_clip_norm=clip))
        backend.train_step(state, x, y, lr=1e-3)
        return float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in state.module.parameters()])))

    assert grad_norm(0.0) > 0.05
    assert grad_norm(0.05) == pytest.approx(0.05, rel=1e-4)


def test_dropout_on_in_training_off_in_evaluation(wt2_cache):
    cfg = tiny_cfg(wt2_cache, variant="local_conv", profile="reference_torch")
    assert cfg.profile.dropout == 0.1
    backend = TorchBackend("cpu")
    state = backend.init(cfg)
    rng = np.random.default_rng(2)
    x = rng.integers(3, V, (4, 16)).astype(np.int32)
    y = rng.integers(3, V, (4,)).astype(np.int32)
    e1 = backend.eval_batch(state, x, y, "nt")
    e2 = backend.eval_batch(state, x, y, "nt")
    for field in ("target_log_prob", "prediction", "prediction_param"):
        np.testing.assert_array_equal(getattr(e1, field), getattr(e2, field))
    assert not state.module.training
    xt, yt = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
    state.module.train()
    with torch.no_grad():
        l1 = state.module(xt, yt, "nt").loss
        l2 = state.module(xt, yt, "nt").loss
    assert l1 != l2  # dropout draws differ between training forwards
    backend.train_step(state, x, y, lr=1e-3)
    assert state.module.training


def test_bf16_autocast_runs_with_finite_loss(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache, train={"steps": 4, "precision": "bf16"}, eval={"every": 2, "batches": 2,
                                                                           "full_max_windows": 8})
    dtypes: list[torch.dtype] = []

    class Hooked(TorchBackend):
        def init(self, c):
            state = super().init(c)
            state.module.head.hidden.register_forward_hook(lambda mod, i, o: dtypes.append(o.dtype))
            return state

    backend = Hooked("cpu")
    m = run_training(cfg, backend, tmp_path, progress=False)
    assert m.status == "completed" and m.precision == "bf16"
    assert math.isfinite(m.final_ppl) and math.isfinite(m.full_ppl)
    assert all(math.isfinite(r["train_loss"]) for r in read_curve(tmp_path))
    assert dtypes and set(dtypes) == {torch.bfloat16}  # the matmuls ran in bf16...
    w = weights_of(tmp_path)
    assert all(v.dtype == np.float32 for v in w.values())  # ...the master weights stay fp32


@pytest.mark.parametrize(("profile", "setting", "matmul", "cudnn_tf32"), [
    ("corrected", "profile", "highest", False),
    ("reference_torch", "profile", "highest", False),
    ("reference_jax", "profile", "high", True),  # JAX's default precision: TF32 on a GPU
    ("reference_jax", "highest", "highest", False),
    ("corrected", "high", "high", True),
])
def test_matmul_precision_sets_what_fp32_means(wt2_cache, monkeypatch: pytest.MonkeyPatch, profile, setting,
                                               matmul, cudnn_tf32):
    """Building a backend applies ``train.matmul_precision`` (the profile's by default) to matmuls and to cuDNN's
    convolutions (whose own default is TF32): under ``highest`` fp32 means fp32 on a GPU too."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", not cudnn_tf32)
    previous = torch.get_float32_matmul_precision()
    try:
        TorchBackend("cpu").init(tiny_cfg(wt2_cache, profile=profile, train={"matmul_precision": setting}))
        assert torch.get_float32_matmul_precision() == matmul
        assert torch.backends.cudnn.allow_tf32 is cudnn_tf32
    finally:
        torch.set_float32_matmul_precision(previous)


def test_matmul_precision_context_restores_the_settings():
    from backends.torch.precision import matmul_precision

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with matmul_precision("default"):
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(ValueError, match="expected one of"):
        with matmul_precision("tf32"):
            pass


@pytest.mark.parametrize(("head_loss", "label"), [("auto", "head loss in one tile"),
                                                  ("chunked", "head loss in 7x50 tiles")])
def test_head_loss_form_reaches_the_model_and_the_record(tmp_path, wt2_cache, head_loss, label):
    """``train.head_loss``: ``auto`` keeps one tile on a CPU, ``chunked`` trains through tiles; the record's
    device field says which."""
    cfg = tiny_cfg(wt2_cache, train={"mode": "ar", "steps": 2, "head_loss": head_loss, "head_position_chunk": 7,
                                     "head_vocab_chunk": 50})
    backend = TorchBackend("cpu")
    state = backend.init(cfg)
    assert state.module.head.chunks == (None if head_loss == "auto" else (7, 50))
    m = run_training(cfg, backend, tmp_path, progress=False)
    assert m.status == "completed" and label in m.device.split("; ") and m.matmul_precision == "highest"


# --------------------------------------------------------------------------- checkpoint files


def test_checkpoint_files_are_safetensors_and_plain_tensors(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache, train={"steps": 3})
    backend = TorchBackend("cpu")
    run_training(cfg, backend, tmp_path, progress=False)
    ck = latest_checkpoint(tmp_path)
    assert sorted(p.name for p in ck.iterdir()) == ["loop_state.json", "model.safetensors", "optimizer.pt",
                                                     "rng_rank0.pt"]
    weights = safetensors.numpy.load_file(str(ck / "model.safetensors"))
    state = backend.load(ck, cfg)
    canon = to_canonical(state.module)
    assert set(weights) == set(canon) and all(np.array_equal(weights[k], canon[k]) for k in canon)
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    assert opt["optimizer"]["state"][0]["step"].item() == 3
    rng = torch.load(ck / "rng_rank0.pt", weights_only=True)
    assert rng["cpu"].dtype == torch.uint8
    for a, b in zip(state.optimizer.state_dict()["state"].values(), opt["optimizer"]["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_param_count_and_peak_memory(wt2_cache):
    backend = TorchBackend("cpu")
    for variant in ("pcaf", "transformer_global_local"):
        cfg = tiny_cfg(wt2_cache, variant=variant)
        assert backend.param_count(backend.init(cfg)) == count_params(cfg.model, cfg.memory, cfg.profile)
    assert backend.peak_memory_mb() > 10


# --------------------------------------------------------------------------- bad inputs


def test_token_id_out_of_range_is_named(wt2_cache):
    """The shared layer validates each batch once (the loop's training path calls check_batch, its
    evaluation path score_batch); the model itself does not scan ids."""
    cfg = tiny_cfg(wt2_cache)
    backend = TorchBackend("cpu")
    state = backend.init(cfg)
    x = np.full((4, 16), 5, dtype=np.int32)
    x[2, 3] = V + 7
    y = np.full((4,), 6, dtype=np.int32)
    with pytest.raises(ValueError, match=rf"token id {V + 7} is outside the model's vocabulary \[0, {V}\)"):
        check_batch(x, y, cfg)
    y[0] = V
    with pytest.raises(ValueError, match=rf"max id in this batch {V}.*model.vocab_size={V}"):
        score_batch(backend, state, cfg, np.full((4, 16), 5, dtype=np.int32), y)


def test_corpus_larger_than_the_model_vocabulary_fails_before_training(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache, model={"vocab_size": 150})
    with pytest.raises(ValueError, match="corpus vocabulary has 200 ids but model.vocab_size=150"):
        train(cfg, tmp_path, progress=False)
    assert read_metrics(tmp_path).status == "failed"


def test_window_longer_than_the_positional_table(tmp_path, wt2_cache):
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len=32"):
        tiny_cfg(wt2_cache, variant="transformer_dense", train={"seq_len": 48})
    cfg = tiny_cfg(wt2_cache, variant="transformer_dense")
    cfg.train.seq_len = 48  # mutated after validation: the loop validates again
    with pytest.raises(ConfigError, match="train.seq_len=48 is invalid: exceeds model.max_seq_len=32"):
        train(cfg, tmp_path, progress=False)
    assert "max_seq_len" in read_metrics(tmp_path).error
    good = tiny_cfg(wt2_cache, variant="transformer_dense")
    with pytest.raises(ValueError, match="T=48 exceeds model.max_seq_len=32"):
        check_batch(np.zeros((2, 48), np.int32), np.zeros(2, np.int32), good)
    # Fixed sinusoids have no table: long windows are fine there.
    check_batch(np.zeros((2, 48), np.int32), np.zeros(2, np.int32),
                tiny_cfg(wt2_cache, variant="transformer_dense", profile="reference_torch"))


def test_corrupt_ids_in_the_corpus_are_named(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache)
    corpus = load_corpus(cfg.data)
    from types import SimpleNamespace

    bad = np.array(corpus.train)
    bad[1234] = V + 1
    fake = SimpleNamespace(train=bad, valid=np.asarray(corpus.valid), vocab_size=V)
    with pytest.raises(DataError, match=str(V + 1)):
        train(cfg, tmp_path, progress=False, corpus=fake)


def test_huge_lr_diverges_and_the_last_good_checkpoint_loads(tmp_path, wt2_cache):
    cfg = tiny_cfg(wt2_cache, train={"steps": 10, "lr": 1e30, "checkpoint_every": 1})
    with pytest.raises(TrainingDiverged) as err:
        train(cfg, tmp_path, progress=False)
    msg = str(err.value)
    good = latest_checkpoint(tmp_path)
    assert good is not None and f"Last good checkpoint: {good}" in msg
    step = int(good.name.split("_")[1])
    assert "non-finite loss" in msg and f"at step {step + 1}" in msg
    rec = read_metrics(tmp_path)
    assert rec.status == "failed" and f"at step {step + 1}" in rec.error and rec.steps_done == step
    state = TorchBackend("cpu").load(good, cfg)
    assert all(torch.isfinite(p).all() for p in state.module.parameters())


def test_poisoned_weight_stops_at_that_step(tmp_path, wt2_cache):
    class Poisoned(TorchBackend):
        def train_step(self, state, inputs, targets, lr, **kwargs):
            if state.optimizer.state_dict()["state"] and \
                    state.optimizer.state_dict()["state"][0]["step"].item() == 4:
                with torch.no_grad():
                    state.module.head.out.weight[0, 0] = float("nan")
            return super().train_step(state, inputs, targets, lr, **kwargs)

    cfg = tiny_cfg(wt2_cache, train={"steps": 10, "checkpoint_every": 2})
    with pytest.raises(TrainingDiverged, match=r"at step 5 .*Last good checkpoint: .*step_4"):
        run_training(cfg, Poisoned("cpu"), tmp_path, progress=False)
    assert read_metrics(tmp_path).status == "failed"
    good = latest_checkpoint(tmp_path)
    assert good.name == "step_4"
    w = weights_of(tmp_path, 4)
    assert all(np.isfinite(v).all() for v in w.values())
    # Resuming after the failure continues from the good checkpoint (here with a healthy backend).
    m = run_training(cfg, TorchBackend("cpu"), tmp_path, progress=False)
    assert m.status == "completed" and m.extra["segments"] == 2
