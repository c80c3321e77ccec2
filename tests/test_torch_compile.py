"""The compiled training step (``train.compile``) gives the eager step's losses and gradients.

Every PCAF variant and route × {nt, ar} runs through ``torch.compile`` with ``aot_eager`` (Dynamo's graph
capture and AOT autograd, the compiled path's own layer forms and dropout, without C++ code generation);
one case runs through inductor itself, next-token PCAF-context with dropout on, the configuration the
speed targets are about. A cold inductor compile costs about a minute on this CPU, hence one case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch.backend import TorchBackend, TrainingLoss
from backends.torch.compile import (
    COMPILE_MIN_STEPS,
    COMPILE_MIN_STEPS_AR,
    COMPILED_LABEL,
    compile_min_steps,
    compile_training,
    use_compile,
)
from backends.torch.layers import ConvBlock, causal_depthwise_conv
from pcaf_core.config import MemoryConfig, ModelConfig, RunConfig, TrainConfig
from pcaf_core.profiles import get_profile

CASES = [  # (variant, route, semantic index, policy)
    ("pcaf", "context", "dense", "recent"),
    ("pcaf", "context", "dense", "first"),
    ("pcaf", "context", "dense", "topk_score"),
    ("pcaf", "semantic", "dense", "topk_score"),
    ("pcaf", "semantic", "bucketed", "recent"),
    ("pcaf", "hybrid", "bucketed", "first"),
    ("pcaf_no_gate", "context", "dense", "first"),
    ("pcaf_no_cache", "context", "dense", "first"),
    ("local_conv", "context", "dense", "first"),
]
STEPS = 3


def _cfg(case, mode: str, compile_mode: str = "off") -> RunConfig:
    variant, route, index, policy = case
    return RunConfig(
        model=ModelConfig(variant=variant, vocab_size=64, d_model=16, d_hidden=24, n_layers=2, max_seq_len=32),
        memory=MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=8, top_k=4,
                            semantic_buckets=4),
        profile=get_profile("reference_torch"),  # dropout 0.1 and clipping on
        train=TrainConfig(mode=mode, seq_len=24, batch_size=3, steps=STEPS, compile=compile_mode))


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _compare_steps(cfg: RunConfig, compiler: str):
    """STEPS training steps in which the eager and the compiled training loss both run on the same weights
    and the same dropout masks (the generator state is replayed), then the optimiser steps once.

    Comparing two separately trained copies would also compare float drift through routes that select
    discretely (a top-K or argmax near a tie flips after a few updates); this compares the step itself.
    Returns the model (for inspection).
    """
    backend = TorchBackend("cpu")
    state = backend.init(cfg)
    eager = TrainingLoss(state.module)
    compiled = compile_training(state.module, TrainingLoss(state.module), backend=compiler)
    rng = np.random.default_rng(0)
    state.module.train()
    for step in range(STEPS):
        x = torch.as_tensor(rng.integers(3, 64, (3, 24)))
        y = torch.as_tensor(rng.integers(3, 64, (3,) if cfg.train.mode == "nt" else (3, 24)))
        generator = torch.get_rng_state()
        state.optimizer.zero_grad(set_to_none=True)
        loss_e = eager(x, y, cfg.train.mode)
        loss_e.backward()
        grads_e = _grads(state.module)
        torch.set_rng_state(generator)
        state.optimizer.zero_grad(set_to_none=True)
        loss_c = compiled(x, y, cfg.train.mode)
        loss_c.backward()
        grads_c = _grads(state.module)
        np.testing.assert_allclose(loss_c.item(), loss_e.item(), rtol=1e-5, err_msg=f"step {step + 1}")
        assert grads_e.keys() == grads_c.keys()
        # Relative to the largest gradient: a parameter whose gradient is rounding noise around 0 (ρ in
        # some routes) differs by more than rtol of itself.
        scale = max(float(g.abs().max()) for g in grads_e.values())
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6 * scale,
                                       msg=f"step {step + 1}: {name}")
        state.optimizer.step()
    return state.module


@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_compiled_graph_capture_trains_like_eager(case, mode: str) -> None:
    _compare_steps(_cfg(case, mode), "aot_eager")


@pytest.mark.slow
def test_inductor_compiled_step_trains_like_eager_with_dropout() -> None:
    module = _compare_steps(_cfg(("pcaf", "context", "dense", "first"), "nt"), "inductor")
    blocks = [m for m in module.modules() if isinstance(m, ConvBlock)]
    assert blocks and all(b.conv_form == "shifted" for b in blocks)


def test_shifted_conv_equals_the_convolution() -> None:
    torch.manual_seed(0)
    block = ConvBlock(6, 8, 5, "tanh", 0.0).double()
    y = torch.randn(2, 11, 6, dtype=torch.float64)
    conv = block.conv(torch.nn.functional.pad(y.transpose(1, 2), (4, 0))).transpose(1, 2)
    torch.testing.assert_close(causal_depthwise_conv(y, block.conv.weight, block.conv.bias), conv, rtol=1e-14,
                               atol=1e-14)


def test_auto_compiles_long_runs_only_and_the_record_says_so() -> None:
    case = ("pcaf", "context", "dense", "first")
    short, long_ = _cfg(case, "nt", "auto"), _cfg(case, "nt", "auto")
    long_.train.steps = COMPILE_MIN_STEPS
    assert not use_compile(short) and use_compile(long_)
    # Full AR gains less a step, so only longer runs repay the compile.
    ar = _cfg(case, "ar", "auto")
    ar.train.steps = COMPILE_MIN_STEPS
    assert not use_compile(ar) and compile_min_steps(ar) == COMPILE_MIN_STEPS_AR > COMPILE_MIN_STEPS
    ar.train.steps = COMPILE_MIN_STEPS_AR
    assert use_compile(ar)
    # Where compiling measured slower: routes that rank with a host-side ρ, and the Transformers.
    for other, mode in ((("pcaf", "context", "dense", "topk_score"), "nt"), (("pcaf", "context", "dense", "topk_score"),
                        "ar"), (("pcaf", "semantic", "dense", "recent"), "nt"),
                        (("transformer_dense", "context", "dense", "first"), "nt"),
                        (("transformer_dense", "context", "dense", "first"), "ar")):
        cfg = _cfg(other, mode, "auto")
        cfg.train.steps = COMPILE_MIN_STEPS_AR
        assert not use_compile(cfg), (other, mode)
    topk_no_cache = _cfg(("pcaf_no_cache", "context", "dense", "topk_score"), "nt", "auto")
    topk_no_cache.train.steps = COMPILE_MIN_STEPS
    assert use_compile(topk_no_cache)  # no cache: its policy ranks nothing
    assert use_compile(_cfg(case, "nt", "on")) and not use_compile(_cfg(case, "nt", "off"))
    backend = TorchBackend("cpu")
    backend.init(_cfg(case, "nt", "on"))  # torch.compile is lazy: building compiles nothing yet
    assert COMPILED_LABEL in backend.device
    plain = TorchBackend("cpu")
    plain.init(short)
    assert COMPILED_LABEL not in plain.device
