"""The tiny training steps the compiled-step tests compare with eager (tests/test_torch_compile.py,
tests/test_torch_cuda_graphs.py): the cases, their config, and the step-by-step comparison."""

from __future__ import annotations

import numpy as np
import torch

from backends.torch.backend import TorchBackend, TrainingLoss
from backends.torch.compile import compile_training
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
COMPILED_CASES = [c for c in CASES if c[0] != "local_conv"]
"""The cases compiled: local_conv is pcaf_no_cache's network with the cache path off (backends/torch/models.py),
and only parameters the step never reads differ, so Dynamo and AOT autograd make the same forward and backward
graphs of the two (their generated code is identical in both modes): one of them compiles for both. The eager
checks (the device reads) still run every case."""
B, T = 2, 16
"""Batch and window of every step: 16 tokens over 8 buckets repeat enough to fill the K=4 candidate slots, and
on the CUDA code paths the Triton interpreter's time grows with the programs a kernel launches (B·T rows)."""
STEPS = 2
"""Steps compared: the second runs the compiled step on the weights the first step's update changed (and, on the
routes that rank with ρ read back, on a new ρ, which Dynamo recompiles for)."""


def step_config(case, mode: str, compile_mode: str = "off") -> RunConfig:
    variant, route, index, policy = case
    return RunConfig(
        # One conv block with a 2-tap conv: compile time grows with the ops traced, and each kind of op of the
        # step (the conv's shifted multiply-adds, the block, the head, the memory read) is traced all the same.
        model=ModelConfig(variant=variant, vocab_size=64, d_model=16, d_hidden=24, n_layers=1, kernel_size=2,
                          max_seq_len=32),
        memory=MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=8, top_k=4,
                            semantic_buckets=4),
        profile=get_profile("reference_torch"),  # dropout 0.1 and clipping on
        train=TrainConfig(mode=mode, seq_len=T, batch_size=B, steps=STEPS, compile=compile_mode))


def attention_step_config(variant: str, mode: str) -> RunConfig:
    """A one-block windowed Transformer (head dimension 16, window 4, 2 global keys) with the reference profile's
    dropout, on the same batch and window as :func:`step_config`: on CUDA its attention is FlexAttention."""
    return RunConfig(
        model=ModelConfig(variant=variant, vocab_size=64, d_model=32, d_hidden=24, n_layers=1, n_heads=2, window=4,
                          n_global=2, max_seq_len=32),
        memory=MemoryConfig(num_buckets=8, top_k=4, semantic_buckets=4),
        profile=get_profile("reference_torch"),
        train=TrainConfig(mode=mode, seq_len=T, batch_size=B, steps=STEPS))


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def compare_steps(cfg: RunConfig, compiler: str, device: str = "cpu"):
    """STEPS training steps in which the eager and the compiled training loss both run on the same weights
    and the same dropout masks (the generator state is replayed), then the optimiser steps once.

    Comparing two separately trained copies would also compare float drift through routes that select
    discretely (a top-K or argmax near a tie flips after a few updates); this compares the step itself.
    Returns the model (for inspection). ``device``: where the step runs (``cuda``: its generator is replayed too).
    """
    backend = TorchBackend(device)
    state = backend.init(cfg)
    eager = TrainingLoss(state.module)
    compiled = compile_training(state.module, TrainingLoss(state.module), backend=compiler)
    rng = np.random.default_rng(0)
    on_cuda = torch.device(device).type == "cuda"
    state.module.train()
    for step in range(STEPS):
        x = torch.as_tensor(rng.integers(3, 64, (B, T)), device=device)
        y = torch.as_tensor(rng.integers(3, 64, (B,) if cfg.train.mode == "nt" else (B, T)), device=device)
        generator = torch.get_rng_state()
        cuda_generator = torch.cuda.get_rng_state() if on_cuda else None
        state.optimizer.zero_grad(set_to_none=True)
        loss_e = eager(x, y, cfg.train.mode)
        loss_e.backward()
        grads_e = grads(state.module)
        torch.set_rng_state(generator)
        if on_cuda:
            torch.cuda.set_rng_state(cuda_generator)
        state.optimizer.zero_grad(set_to_none=True)
        loss_c = compiled(x, y, cfg.train.mode)
        loss_c.backward()
        grads_c = grads(state.module)
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



def recording_backend():
    """A ``torch.compile`` backend that runs AOT autograd's forward and backward graphs as they are (``aot_eager``'s
    capture) and keeps them: ``(backend, graphs, mutated)``, the graphs in the order AOT makes them (what inductor
    compiles, before its own passes) and the indices of the graph inputs the step mutates (AOT's metadata:
    functionalised, a mutation is an extra output copied back after the graph)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []
    mutated: list[int] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
        if not graphs and meta is not None:
            mutated.extend(i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata)
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record), graphs, mutated


def aot_graphs(fn, *args) -> tuple[list[torch.fx.GraphModule], list[int]]:
    """The forward and backward graphs of ``fn(*args).backward()`` under bf16 autocast and the inputs they mutate
    (:func:`recording_backend`)."""
    backend, graphs, mutated = recording_backend()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=False)
    with torch.autocast(args[0].device.type, dtype=torch.bfloat16):
        loss = compiled(*args)
    loss.backward()
    return graphs, mutated


def cudagraph_unsafe(graphs: list[torch.fx.GraphModule], mutated: list[int]) -> list[str]:
    """Nodes inductor would not capture in a CUDA graph (its own test, ``is_cudagraph_unsafe_fx_node``: host
    syncs, boolean-mask ``index_put``, sparse outputs...), and the mutated inputs (CUDA graph trees accept
    mutated parameters and buffers, not mutated step inputs; the training step should mutate nothing)."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    found = [str(node.target) for gm in graphs for node in gm.graph.nodes
             if node.op == "call_function" and is_cudagraph_unsafe_fx_node(node)]
    return found + [f"mutated input {i}" for i in mutated]
