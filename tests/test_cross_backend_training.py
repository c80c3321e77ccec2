"""Torch and JAX train alike: the same canonical initial weights (the spec's
``pcaf_core.params.init_params`` in float32), the same windows, fp32, no dropout, the same learning-rate
schedule, weight decay and clipping: 20 AdamW steps give per-step losses within 1e-3, and the final
weights of one backend, saved, load into the other. The shared loop gives both backends the same errors.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.jax import weights as jax_weights
from backends.jax.backend import JaxBackend
from backends.torch import weights as torch_weights
from backends.torch.backend import TorchBackend
from pcaf_core.data import DataError, WindowSampler
from pcaf_core.loop import run_training
from pcaf_core.params import init_params, param_shapes
from pcaf_core.results import read_metrics
from pcaf_core.schedule import lr_for
from tests.test_jax_train import CORPUS, V, tiny_cfg

STEPS = 20
TOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "variant,mode",
    [("pcaf", "nt"), ("pcaf", "ar"), ("local_conv", "nt")],
)
@pytest.mark.slow
def test_twenty_steps_agree(tmp_path, variant, mode):
    cfg = tiny_cfg(variant=variant, grad_clip_norm=0.5,
                   train={"mode": mode, "steps": STEPS, "lr": 1e-2, "warmup_steps": 4, "min_lr_ratio": 0.1,
                          "weight_decay": 0.05})
    assert cfg.profile.dropout == 0 and cfg.train.precision == "fp32"
    spec = init_params(cfg.model, cfg.memory, cfg.profile, seed=3, dtype=np.float32)

    tb = TorchBackend("cpu")
    ts = tb.init(cfg)
    torch_weights.load_canonical(ts.module, spec)  # in place: the new AdamW has no moments yet
    jb = JaxBackend("cpu")
    js = jb.from_canonical(cfg, spec)

    sampler = WindowSampler(CORPUS.train, cfg.train.seq_len, cfg.train.batch_size, mode, seed=5, split="train")
    torch_losses, jax_losses = [], []
    for step in range(1, STEPS + 1):
        x, y = next(sampler)
        lr = lr_for(cfg.train, step)
        ts, lt = tb.train_step(ts, x, y, lr)
        js, lj = jb.train_step(js, x, y, lr)
        torch_losses.append(lt)
        jax_losses.append(lj)
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=0, atol=TOL)

    # The final weights agree loosely (Adam amplifies float noise in near-zero gradient entries), and
    # a checkpoint of one backend loads into the other.
    wt, wj = torch_weights.to_canonical(ts.module), jax_weights.to_canonical(js.params)
    assert max(float(np.abs(wt[k] - spec[k]).max()) for k in wt) > 0.05  # the steps moved the weights
    for k in wt:
        np.testing.assert_allclose(wj[k], wt[k], rtol=0, atol=2e-2, err_msg=k)
    jb.save(js, tmp_path)
    torch_weights.load_safetensors(tmp_path / "model.safetensors", ts.module)
    x, y = next(sampler)
    et, ej = tb.eval_batch(ts, x, y, mode), jb.eval_batch(js, x, y, mode)
    np.testing.assert_allclose(ej.target_log_prob, et.target_log_prob, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_both_backends_report_bad_data_identically(tmp_path):
    bad = np.array(CORPUS.train)
    bad[77] = V + 3
    fake = SimpleNamespace(train=bad, valid=CORPUS.valid, vocab_size=V)
    cfg = tiny_cfg()
    errors = {}
    for name, backend in (("torch", TorchBackend("cpu")), ("jax", JaxBackend("cpu"))):
        with pytest.raises(DataError) as err:
            run_training(cfg, backend, tmp_path / name, corpus=fake, progress=False)
        errors[name] = str(err.value)
        assert read_metrics(tmp_path / name).status == "failed"
    assert errors["torch"] == errors["jax"] and str(V + 3) in errors["jax"]
    shapes = param_shapes(cfg.model, cfg.memory, cfg.profile)
    assert set(jax_weights.to_canonical(JaxBackend("cpu").init(cfg).params)) == set(shapes)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize(("variant", "impl", "kernel"), [
    ("transformer_local", "auto", {"torch": "masked SDPA", "jax": "banded GEMMs"}),
    ("transformer_global_local", "masked", {"torch": "masked SDPA", "jax": "masked softmax"}),
    ("transformer_local", "blocked", {"torch": "blocked SDPA", "jax": "banded GEMMs"}),
    ("transformer_dense", "auto", None),
])
def test_the_record_says_how_windowed_attention_ran(backend, variant, impl, kernel):
    """``model.attention_impl=auto`` runs a different kernel per device (torch: FlexAttention on CUDA, masked SDPA on
    a CPU), so a windowed run's record names the one that ran, beside the head loss's form; other models carry no
    such label."""
    cfg = tiny_cfg(variant=variant, model={"attention_impl": impl})
    b = TorchBackend("cpu") if backend == "torch" else JaxBackend("cpu")
    b.init(cfg)
    labels = b.device.split("; ")
    assert "head loss in one tile" in labels
    if kernel is None:
        assert not [x for x in labels if "attention" in x]
    else:
        assert f"windowed attention by {kernel[backend]}" in labels

