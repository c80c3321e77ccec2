"""The ``pcaf::`` custom ops: registration (opcheck), fake tensors under ``torch.compile``, autograd
through the gathered keys, and the Triton / pure-torch dispatch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from backends.torch import kernels
from backends.torch.kernels import ops, triton_impl
from pcaf_core.routing import route_context

ADDR = torch.tensor([[1, 2, 1, 1, 3, 1, 2], [0, 0, 2, 0, 0, 5, 0]])


@pytest.mark.slow
@pytest.mark.parametrize(
    "op, args",
    [
        ("bucket_lookup_nt", (ADDR, 3, "recent", None)),
        ("bucket_lookup_nt", (ADDR, 2, "first", 5)),
        ("ar_candidates", (ADDR, 3, "first", None)),
        ("ar_candidates", (ADDR, 2, "recent", 7)),
        ("bucket_table", (ADDR, 6, 2, "first", False)),
        ("bucket_table", (ADDR, 4, 3, "recent", True)),
    ],
)
def test_opcheck(op: str, args: tuple) -> None:
    """Schema, fake-tensor and AOT-dispatch checks of the registration (runs the real kernel too)."""
    torch.library.opcheck(getattr(torch.ops.pcaf, op).default, args)


def test_ops_match_spec_through_dispatch() -> None:
    a = ADDR.numpy()
    T = a.shape[1]
    for policy in ("recent", "first"):
        nt = route_context(a, np.array([T - 1]), 3, policy)
        idx, valid = kernels.candidates_nt(ADDR, 3, policy)
        np.testing.assert_array_equal(idx.numpy(), nt.index)
        np.testing.assert_array_equal(valid.numpy(), nt.valid)
        ar = route_context(a, np.arange(T), 3, policy)
        idx, valid = kernels.candidates_ar(ADDR, 3, policy)
        np.testing.assert_array_equal(idx.numpy(), ar.index)
        np.testing.assert_array_equal(valid.numpy(), ar.valid)
        table = kernels.build_bucket_table(ADDR[:, :-1], 6, 3, policy)
        idx, valid = kernels.lookup_bucket_table(table, ADDR[:, -1])
        np.testing.assert_array_equal(idx.numpy(), nt.index)


def test_triton_enabled_follows_interpreter_mode() -> None:
    assert kernels.triton_enabled(torch.zeros(1)) == triton_impl.INTERPRETED
    assert kernels.triton_enabled(torch.zeros(1, device="meta")) is False


def test_fallback_path_through_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Triton reported unavailable the same ops run the torch implementation and agree."""
    rng = np.random.default_rng(11)
    a = torch.from_numpy(rng.integers(0, 4, size=(3, 50)))
    with_triton = [
        kernels.candidates_nt(a, 4, "recent"),
        kernels.candidates_ar(a, 4, "first"),
        (kernels.build_bucket_table(a, 4, 4, "recent"),),
    ]
    monkeypatch.setattr(ops, "triton_enabled", lambda tensor: False)
    without = [
        kernels.candidates_nt(a, 4, "recent"),
        kernels.candidates_ar(a, 4, "first"),
        (kernels.build_bucket_table(a, 4, 4, "recent"),),
    ]
    for got, want in zip(without, with_triton, strict=True):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_dispatch_rejects_bad_arguments_before_the_op() -> None:
    with pytest.raises(ValueError, match="topk_score"):
        kernels.candidates_ar(ADDR, 2, "topk_score")
    with pytest.raises(ValueError, match="top_k"):
        kernels.candidates_nt(ADDR, 0, "recent")
    with pytest.raises(ValueError, match="num_buckets"):
        kernels.build_bucket_table(ADDR, 0, 2, "recent")


def _read_context(addresses: torch.Tensor, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A miniature context read: AR candidates, gathered keys, masked softmax over q·k."""
    idx, valid = kernels.candidates_ar(addresses, 3, "recent")
    rows = torch.arange(addresses.shape[0], device=addresses.device)[:, None, None]
    cand = keys[rows, idx.clamp(min=0)]  # [B, T, K, D]
    scores = torch.einsum("btd,btkd->btk", query, cand).masked_fill(~valid, -1e9)
    weights = torch.softmax(scores, dim=-1) * valid
    return (weights[..., None] * cand).sum(dim=(-2, -1))


@pytest.mark.slow
def test_compile_and_autograd_through_gathered_keys() -> None:
    """``torch.compile`` (aot_eager: Dynamo plus AOTAutograd over the fake registrations) gives eager's
    values and gradients; gradients reach exactly the keys that were selected."""
    torch.manual_seed(0)
    keys = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)
    query = torch.randn(2, 7, 4, dtype=torch.float64)
    eager = _read_context(ADDR, keys, query)
    (g_eager,) = torch.autograd.grad(eager.sum(), keys)
    compiled_fn = torch.compile(_read_context, backend="aot_eager", fullgraph=True)
    compiled = compiled_fn(ADDR, keys, query)
    (g_compiled,) = torch.autograd.grad(compiled.sum(), keys)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_compiled, g_eager)
    idx, valid = kernels.candidates_ar(ADDR, 3, "recent")
    selected = torch.zeros(2, 7, dtype=torch.bool)
    for b in range(2):
        selected[b, idx[b][valid[b]]] = True
    touched = g_eager.abs().sum(-1) > 0
    assert torch.equal(touched, selected)


@pytest.mark.slow
def test_compile_with_dynamic_sequence_length() -> None:
    """The fake registrations take their shapes from the inputs, so one graph serves several T."""
    fn = torch.compile(
        lambda a: kernels.candidates_nt(a, 2, "first")[0] + kernels.candidates_ar(a, 2, "first")[0][:, -1:],
        backend="aot_eager",
        dynamic=True,
        fullgraph=True,
    )
    for T in (5, 9):
        a = torch.arange(T).remainder(3)[None, :]
        want = kernels.candidates_nt(a, 2, "first")[0] + kernels.candidates_ar(a, 2, "first")[0][:, -1:]
        assert torch.equal(fn(a), want)


@pytest.mark.slow
def test_cpu_without_interpreter_uses_the_torch_path() -> None:
    """In a process without ``TRITON_INTERPRET`` the kernels are compiled-mode and cannot take CPU
    tensors, so the ops must route CPU inputs to the torch implementation."""
    script = textwrap.dedent(
        """
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import numpy as np, torch
        from backends.torch import kernels
        from backends.torch.kernels import triton_impl
        from pcaf_core.routing import route_context
        assert not triton_impl.INTERPRETED
        a = torch.tensor([[1, 2, 1, 1, 3, 1]])
        assert not kernels.triton_enabled(a)
        idx, valid = kernels.candidates_ar(a, 2, "recent")
        want = route_context(a.numpy(), np.arange(6), 2, "recent")
        assert np.array_equal(idx.numpy(), want.index) and np.array_equal(valid.numpy(), want.valid)
        print("ok")
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("policy", ["recent", "first"])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_route_context_with_kernels_equals_the_spec(policy, mode):
    """The models' routing entry point gives the spec's candidates when it dispatches to the kernels."""
    from backends.torch.routing import route_context
    from pcaf_core import records
    from pcaf_core import routing as spec_routing
    from pcaf_core.hashing import addresses as spec_addresses

    tokens = np.random.default_rng(4).integers(3, 9, (2, 40))
    addr = spec_addresses(tokens, 1, 5)
    qpos = records.query_positions(40, mode)
    want = spec_routing.route_context(addr, qpos, 4, policy)
    # With the layout read back from query_pos, and with it stated as the models state it (no read-back).
    for layout in (None, mode):
        got = route_context(torch.from_numpy(addr), torch.from_numpy(qpos), 4, policy, kernels=True,
                            query_layout=layout)
        np.testing.assert_array_equal(got.index.numpy(), want.index)
        np.testing.assert_array_equal(got.valid.numpy(), want.valid)


def test_route_context_rejects_an_unknown_query_layout():
    from backends.torch.routing import route_context

    addr = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="query_layout 'full' is unknown"):
        route_context(addr, torch.arange(8), 2, "recent", kernels=True, query_layout="full")
