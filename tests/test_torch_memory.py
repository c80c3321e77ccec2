"""No quadratic tensor on the sparse routes: a full-AR window of T = 8192 through the whole model.

A ``TorchDispatchMode`` sees the output of every ATen op (forward and backward), so the largest
intermediate is measured exactly rather than estimated from process memory (a sparse output by its
indices and values: its logical ``[T·?, T]`` shape holds no memory). A single T×T float32
tensor would be 268 MB (T² = 67M elements); the sparse routes stay linear in T.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from backends.torch import build_model
from backends.torch.ops import CHUNK_ELEMENTS
from benchmarks.torch_memory import dense_parts
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile

T = 8192


class LargestTensor(TorchDispatchMode):
    """Records the largest op output (elements) and the op that produced it."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            for part in dense_parts(t) if isinstance(t, torch.Tensor) else ():
                if part.numel() > self.numel:
                    self.numel, self.op = part.numel(), str(func)
        return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _measure(route: str, policy: str, index: str = "bucketed", *, rho: float = 1.0, backward: bool = False):
    model = ModelConfig(variant="pcaf", vocab_size=64, d_model=16, d_hidden=32, n_layers=1, kernel_size=3)
    memory = MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=64, top_k=16,
                          semantic_buckets=16)
    net = build_model(model, memory, get_profile("corrected"), seed=0)
    with torch.no_grad():
        net.memory.recency_scale.fill_(rho)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (1, T), generator=gen)
    targets = torch.randint(0, 64, (1, T), generator=gen)
    probe = LargestTensor()
    start = time.perf_counter()
    with probe:
        out = net(tokens, targets, "ar", need_log_probs=False, need_predictions=False)
        if backward:
            out.loss.backward()
    seconds = time.perf_counter() - start
    # buckets hold ~T/64 = 128 records each, so K = 16 overflows: the policy really chooses
    assert out.memory.cand.valid.sum(-1).max() == 16
    return probe, out, seconds


@pytest.mark.parametrize("policy", ["recent", "first"])
def test_context_route_is_linear_in_T(policy: str) -> None:
    probe, out, seconds = _measure("context", policy, backward=policy == "recent")
    # the largest tensor is the [T, K, d] gather of candidate keys (2M elements), never [T, T] (67M)
    assert probe.numel <= T * 16 * 16, (probe.numel, probe.op)
    assert torch.isfinite(out.loss)
    print(f"context/{policy}: largest op output {probe.numel} elements ({probe.op}), {seconds:.2f} s")


def test_bucketed_semantic_route_is_linear_in_T() -> None:
    probe, out, seconds = _measure("semantic", "topk_score", "bucketed")
    assert probe.numel <= T * 16 * 16, (probe.numel, probe.op)
    print(f"semantic/bucketed: largest op output {probe.numel} elements ({probe.op}), {seconds:.2f} s")


def test_topk_score_route_stays_below_quadratic() -> None:
    # ρ = 20: the sparse proof covers the overflowing queries; any it missed would be scored densely in
    # chunks of at most CHUNK_ELEMENTS scores, still far below T² (and independent of T).
    probe, out, seconds = _measure("context", "topk_score", rho=20.0)
    dense = out.memory.topk_dense
    assert dense.float().mean() < 0.5
    assert probe.numel <= max(T * 16 * 16, CHUNK_ELEMENTS) < T * T // 8, (probe.numel, probe.op)
    print(f"context/topk_score: {int(dense.sum())} dense queries; largest op output {probe.numel} elements "
          f"({probe.op}), {seconds:.2f} s")
