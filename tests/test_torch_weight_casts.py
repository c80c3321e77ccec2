"""The eager bf16 step's weight casts in one pass each way (backends.torch.weight_casts): bitwise autocast's step."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.torch import weight_casts
from backends.torch.layers import ConvBlock
from backends.torch.train import TorchBackend
from pcaf_core.config import DataConfig, EvalConfig, MemoryConfig, ModelConfig, RunConfig, TrainConfig
from pcaf_core.profiles import get_profile

V = 64


def bf16_cfg(variant: str, mode: str, profile: str = "corrected", **train) -> RunConfig:
    return RunConfig(
        model=ModelConfig(variant=variant, vocab_size=V, d_model=16, d_hidden=32, n_layers=2, n_heads=2, window=8,
                          n_global=2, max_seq_len=32),
        memory=MemoryConfig(route="context", num_buckets=64, top_k=4, semantic_buckets=8),
        profile=get_profile(profile),
        data=DataConfig(name="wikitext2", max_vocab=V),
        train=TrainConfig(mode=mode, seq_len=16, batch_size=3, steps=3, lr=3e-3, seed=5, precision="bf16",
                          **train),
        eval=EvalConfig(),
    )


def batch(mode: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, (3, 16))
    return x, rng.integers(0, V, (3, 16) if mode == "ar" else (3,))


def states(cfg: RunConfig, conv_form: str):
    """Two identical states of ``cfg``: one with the step's weight copies (the default), one without."""
    backend = TorchBackend("cpu")
    merged = backend.init(cfg)
    alone = backend.init(cfg)
    alone = dataclasses.replace(alone, weight_casts=())
    for state in (merged, alone):
        for m in state.module.modules():
            if isinstance(m, ConvBlock):
                m.conv_form = conv_form
    return backend, merged, alone


@pytest.mark.parametrize(("variant", "mode", "profile", "conv_form"), [
    ("pcaf", "ar", "corrected", "conv1d"),
    ("pcaf", "nt", "reference_torch", "auto"),
    ("transformer_local", "nt", "corrected", "auto"),
])
def test_the_step_is_bitwise_autocasts_own(variant, mode, profile, conv_form):
    cfg = bf16_cfg(variant, mode, profile)
    backend, merged, alone = states(cfg, conv_form)
    assert merged.weight_casts and len(merged.weight_casts) > 4  # every linear's weight and bias, the convs'
    for step in range(2):
        x, y = batch(mode, step)
        losses = []
        for state in (merged, alone):
            torch.manual_seed(100 + step)  # the same dropout draws
            losses.append(backend.train_step(state, x, y, 3e-3)[1])
        assert losses[0] == losses[1]
        for (name, a), b in zip(merged.module.named_parameters(), alone.module.parameters()):
            assert a.grad is not None and b.grad is not None, name
            assert a.grad.dtype == torch.float32, name
            assert torch.equal(a.grad, b.grad), name
            assert torch.equal(a, b), name
    x, y = batch(mode, 9)
    ea, eb = backend.eval_batch(merged, x, y, mode), backend.eval_batch(alone, x, y, mode)
    assert np.array_equal(ea.target_log_prob, eb.target_log_prob)
    assert np.array_equal(ea.prediction, eb.prediction)


class _Ops(TorchDispatchMode):
    """Counts dispatched ops by name, and which of them cast one of ``params`` itself."""

    def __init__(self, params) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}  # the mode sees the parameters' data, not the objects
        self.count: collections.Counter[str] = collections.Counter()
        self.param_casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.count[name] += 1
        if name == "aten::_to_copy" and args and args[0].data_ptr() in self.ptrs:
            self.param_casts += 1
        return func(*args, **(kwargs or {}))


def test_one_copy_each_way_replaces_the_casts_of_each_parameter():
    cfg = bf16_cfg("pcaf", "ar")
    backend, merged, alone = states(cfg, "conv1d")
    x, y = batch("ar", 0)
    counts = {}
    for label, state in (("merged", merged), ("alone", alone)):
        backend.train_step(state, x, y, 3e-3)  # the optimiser's state exists before the counted step
        with _Ops(weight_casts.castable(state.module)) as ops:
            backend.train_step(state, x, y, 3e-3)
        counts[label] = ops
    n = len(merged.weight_casts)
    assert counts["merged"].count["aten::_foreach_copy_"] == 2  # forward and backward
    assert counts["merged"].param_casts == 0
    assert counts["alone"].param_casts == n  # autocast casts each parameter once a forward...
    # ...and each gradient back in the backward pass: 2n casts become two multi-tensor copies.
    saved = counts["alone"].count["aten::_to_copy"] - counts["merged"].count["aten::_to_copy"]
    assert saved == 2 * n


def test_weight_is_the_parameter_outside_the_context_and_where_autocast_is_off():
    lin = torch.nn.Linear(4, 3)
    assert weight_casts.weight(lin.weight) is lin.weight
    with weight_casts.autocast("cpu", torch.bfloat16, weight_casts.castable(lin)):
        copy = weight_casts.weight(lin.weight)
        assert copy.dtype == torch.bfloat16 and torch.equal(copy, lin.weight.detach().bfloat16())
        assert weight_casts.weight(None) is None
        with torch.autocast("cpu", enabled=False):
            assert weight_casts.weight(lin.weight) is lin.weight
    assert weight_casts.weight(lin.weight) is lin.weight


def test_compiled_and_float32_steps_make_no_copies():
    backend = TorchBackend("cpu")
    assert backend.init(bf16_cfg("pcaf", "nt")).weight_casts
    fp32 = bf16_cfg("pcaf", "nt")
    fp32 = dataclasses.replace(fp32, train=dataclasses.replace(fp32.train, precision="fp32"))
    assert backend.init(fp32).weight_casts == ()
    compiled = bf16_cfg("pcaf", "nt", compile="on")
    assert backend.init(compiled).weight_casts == ()


def test_a_compiled_product_under_autocast_traces_weight_without_a_graph_break():
    """A compiled step's layers still call :func:`weight_casts.weight`; Dynamo must trace it as ``p`` (a graph
    break would split a step that CUDA graphs replay as one graph)."""
    lin = torch.nn.Linear(4, 3)

    def product(x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0  # an op before the call: a break there leaves two graphs, not an empty first one
        return torch.nn.functional.linear(x, weight_casts.weight(lin.weight), weight_casts.weight(lin.bias))

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(product)(torch.ones(2, 4))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
