"""CUDA graphs (``train.compile=cudagraphs``, and ``auto`` on one GPU): what a step must be to be captured, checked
on CPU tensors with the code paths a CUDA tensor takes (no device reads, one graph inductor can capture; that
inductor's code equals eager's is tests/test_torch_compile.py's), the refusals, and on a GPU the replayed step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch.backend import TorchBackend, TrainingLoss
from backends.torch.compile import (
    COMPILE_MIN_STEPS,
    COMPILED_LABEL,
    CUDA_GRAPHS_LABEL,
    check_compile_device,
    compile_training,
    compiled_label,
    cuda_graph_errors,
    prepare_for_compile,
    ranks_with_host_rho,
    use_compile,
    use_cuda_graphs,
)
from pcaf_core.config import ModelConfig, RunConfig, TrainConfig
from pcaf_core.profiles import get_profile
from tests.compiled_steps import CASES, COMPILED_CASES, B, T, aot_graphs, cudagraph_unsafe, step_config

CUDA = torch.cuda.is_available()
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive",
                         "unique_dim", "masked_select", "equal", "is_nonzero", "allclose", "bincount"})
"""ATen ops that wait for the device to read a value back (``.item()``/``int()``/``bool()`` reach
``_local_scalar_dense``; the rest have data-dependent output shapes or a host result)."""


def _syncs(name: str, args, kwargs) -> bool:
    """Whether an op waits on the device: one of :data:`SYNCING_OPS`, ``repeat_interleave`` without its output
    size, or indexing (``x[mask]``, ``x[mask] = v``) with a boolean mask, which runs ``nonzero`` inside the op."""
    if name in SYNCING_OPS:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that waits on the device (:func:`_syncs`), and any copy of a device tensor to the CPU.
    A ``torch.library`` custom op dispatches as one op, so what runs inside one is checked separately
    (:func:`test_cuda_custom_ops_read_nothing_back`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if _syncs(name, args, kwargs):
            self.reads.append(name)
        out = func(*args, **kwargs)
        if name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor) and out.device.type == "cpu" and any(
                isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args):
            self.reads.append(f"{name} to cpu")
        return out


def test_device_read_check_sees_reads() -> None:
    """The check finds what it looks for (on any device: the ops are the same)."""
    x = torch.arange(6.0)
    reads = _DeviceReads()
    with reads:
        float(x.sum())
        _ = x[x > 2]
        x[x > 4] = 0.0
        torch.bincount(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # told its size: no read
        _ = x[torch.tensor([0, 1])]  # integer indices: no read
    assert reads.reads == ["_local_scalar_dense", "index", "index_put_", "bincount", "repeat_interleave"]


def _device_reads(case, mode: str, precision: str, device: torch.device) -> list[str]:
    cfg = step_config(case, mode)
    cfg.train.precision = precision
    backend = TorchBackend(device)
    state = backend.init(cfg)
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.integers(3, 64, (B, T)), device=device)
    y = torch.as_tensor(rng.integers(3, 64, (B,) if mode == "nt" else (B, T)), device=device)
    loss_module = TrainingLoss(state.module)
    state.module.train()
    reads = _DeviceReads()
    # On a CUDA device the driver-level check runs too: a synchronising call raises (the host-ρ routes, which
    # read ρ back on purpose, are left to the op check).
    strict = device.type == "cuda" and not ranks_with_host_rho(cfg)
    if strict:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with reads:
            with backend._autocast(cfg):
                loss = loss_module(x, y, mode)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(state.module.parameters(), 1.0, foreach=CUDA)
            if device.type == "cuda":
                state.optimizer.step()  # fused AdamW: no read on a GPU (its CPU form reads the step count)
    finally:
        if strict:
            torch.cuda.set_sync_debug_mode("default")
    return reads.reads


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_cuda_step_reads_nothing_back_from_the_device(cuda_code_paths: torch.device, mode: str,
                                                      precision: str) -> None:
    """What CUDA graphs need of a step: its forward, backward and clipping (and on a GPU the optimiser step,
    under CUDA's own synchronisation check as well) wait on the device nowhere, for every case that
    ``cudagraphs`` accepts; the two ρ-ranking routes it refuses do read ρ back (which also shows that the check
    sees a read)."""
    for case in CASES:
        reads = _device_reads(case, mode, precision, cuda_code_paths)
        if ranks_with_host_rho(step_config(case, mode)):
            assert "_local_scalar_dense" in reads, case
        else:
            assert reads == [], (case, reads)


def test_cuda_custom_ops_read_nothing_back(cuda_code_paths: torch.device) -> None:
    """Inside the step's custom ops (``pcaf::ar_candidates``, ``pcaf::bucket_lookup_nt``,
    ``pcaf::gather_dot_grad_y``: the Triton wrappers, interpreted on a CPU) nothing waits on the device either."""
    from backends.torch.kernels import gather_grad, triton_impl

    g = torch.Generator().manual_seed(0)
    addresses = torch.randint(0, 5, (2, 40), generator=g).to(cuda_code_paths)
    x = torch.randn(2, 40, 8, generator=g).to(cuda_code_paths)
    grad = torch.randn(2, 40, 4, generator=g).to(cuda_code_paths)
    index = torch.randint(0, 40, (2, 40, 4), generator=g).to(cuda_code_paths)
    reads = _DeviceReads()
    with reads:
        for policy in ("recent", "first"):
            triton_impl.candidates_ar_triton(addresses, 4, policy)
            triton_impl.candidates_nt_triton(addresses, 4, policy)
        gather_grad.gather_dot_grad_y_triton(x, grad, index, 40)
    assert reads.reads == []


@pytest.mark.parametrize("mode", ["ar", "nt"])
@pytest.mark.parametrize("case", [c for c in COMPILED_CASES if not ranks_with_host_rho(step_config(c, "ar"))],
                         ids=lambda c: "-".join(c))
@pytest.mark.slow
def test_cuda_step_is_one_cudagraph_safe_graph(cuda_code_paths: torch.device, case, mode: str) -> None:
    """CUDA graph trees capture what Dynamo and AOT autograd compile: the step must be one graph (a graph break
    would leave eager launches between graphs), and its forward and backward graphs must hold nothing inductor
    refuses to capture and mutate none of their inputs (either makes inductor skip CUDA graphs, silently)."""
    cfg = step_config(case, mode)
    state = TorchBackend(cuda_code_paths).init(cfg)
    prepare_for_compile(state.module)
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.integers(3, 64, (B, T)), device=cuda_code_paths)
    y = torch.as_tensor(rng.integers(3, 64, (B,) if mode == "nt" else (B, T)), device=cuda_code_paths)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(TrainingLoss(state.module))(x, y, mode)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    graphs, mutated = aot_graphs(TrainingLoss(state.module), x, y, mode)
    assert len(graphs) == 2 and cudagraph_unsafe(graphs, mutated) == []


def windowed_flex_config(variant: str, mode: str, compile_mode: str = "off") -> RunConfig:
    """A three-block windowed Transformer (w=128, 2 global keys) at T=450 with the reference profile's dropout:
    past a block of 128 query rows in each layer (full AR) and in the two lower layers of a next-token step (its
    receptive field), so its steps run FlexAttention's dropout form, as the paper's rows do on a GPU."""
    return RunConfig(model=ModelConfig(variant=variant, vocab_size=64, d_model=32, d_hidden=24, n_layers=3, n_heads=2,
                                       window=128, n_global=2, max_seq_len=450, attention_impl="banded"),
                     profile=get_profile("reference_torch"),
                     train=TrainConfig(mode=mode, seq_len=450, batch_size=2, compile=compile_mode))


@pytest.mark.slow
def test_windowed_flex_step_is_one_cudagraph_safe_graph(flex_backward_on_cpu) -> None:
    """``train.compile=cudagraphs`` accepts the windowed Transformers with FlexAttention: their full-AR training step
    with dropout, FlexAttention traced into every layer, is one graph (a forward and a backward: a graph break would
    make more) that holds nothing inductor refuses to capture and mutates none of its inputs (traced on a CPU through
    FlexAttention's eager backward). The next-token step is checked the same way where its trace is compared with
    eager (tests/test_torch_window_attention.py, ``_compiled_next_token_step_cold``). The global-local model stands
    for both: the local one is the same code with g = 0 (a tensor the masks read, not a traced constant:
    ``backends.torch.window_attention.window_scalars``)."""
    cfg = windowed_flex_config("transformer_global_local", "ar")
    state = TorchBackend("cpu").init(cfg)
    state.module.train()
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.integers(3, 64, (2, 450)))
    y = torch.as_tensor(rng.integers(3, 64, (2, 450)))
    graphs, mutated = aot_graphs(TrainingLoss(state.module), x, y, "ar")
    assert len(graphs) == 2 and cudagraph_unsafe(graphs, mutated) == []
    assert any("flex_attention" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    torch._dynamo.reset()


def test_cudagraph_safety_check_sees_unsafe_nodes() -> None:
    """The check above finds what it looks for: a boolean-mask assignment (a host sync inside ``index_put``)
    and an in-place update of a buffer."""

    class Unsafe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))
            self.register_buffer("count", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count.add_(1.0)
            y = x * self.w
            y[y > 1] = 0.0
            return y.sum()

    found = cudagraph_unsafe(*aot_graphs(Unsafe(), torch.arange(4.0)))
    assert any("index_put" in f for f in found) and any("mutated input" in f for f in found), found


def test_cudagraphs_refuses_what_it_cannot_replay() -> None:
    case = ("pcaf", "context", "dense", "first")
    cfg = step_config(case, "ar", "cudagraphs")
    assert use_compile(cfg) and use_cuda_graphs(cfg) and compiled_label(True) == CUDA_GRAPHS_LABEL
    on = step_config(case, "ar", "on")
    assert compiled_label(False) == COMPILED_LABEL and not use_cuda_graphs(on, torch.device("cuda"))
    with pytest.raises(ValueError, match="needs a CUDA device, and this run trains on cpu: use train.compile=on"):
        TorchBackend("cpu").init(cfg)
    with pytest.raises(ValueError, match="runs in one process, and this run has 2"):
        check_compile_device(cfg, torch.device("cuda"), 2)
    check_compile_device(cfg, torch.device("cuda"), 1)
    for other in (("pcaf", "context", "dense", "topk_score"), ("pcaf", "semantic", "dense", "topk_score")):
        with pytest.raises(ValueError, match="ranks with rho read back from the device every step"):
            check_compile_device(step_config(other, "ar", "cudagraphs"), torch.device("cuda"), 1)
    # No cache ranks nothing, whatever its policy says.
    check_compile_device(step_config(("pcaf_no_cache", "context", "dense", "topk_score"), "ar", "cudagraphs"),
                         torch.device("cuda"), 1)
    with pytest.raises(ValueError, match=r"covers the PCAF variants, local conv and the windowed Transformers with "
                                         r"FlexAttention \(model.attention_impl=banded or auto\), not "
                                         r"'transformer_dense': use train.compile=on or off$"):
        check_compile_device(step_config(("transformer_dense", "context", "dense", "first"), "ar", "cudagraphs"),
                             torch.device("cuda"), 1)
    for variant in ("transformer_local", "transformer_global_local"):
        windowed = windowed_flex_config(variant, "nt", "cudagraphs")
        for impl in ("banded", "auto"):
            windowed.model.attention_impl = impl
            check_compile_device(windowed, torch.device("cuda"), 1)
        windowed.model.attention_impl = "masked"
        with pytest.raises(ValueError, match=f"not '{variant}' with model.attention_impl=masked: use"):
            check_compile_device(windowed, torch.device("cuda"), 1)
    with pytest.raises(ValueError, match="compile with backend='inductor'"):
        compile_training(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), backend="aot_eager", cuda_graphs=True)


def test_auto_replays_compiled_steps_as_cuda_graphs_on_one_gpu() -> None:
    """``auto`` compiles what pays off (:func:`use_compile`) and, on one CUDA device in one process, replays it as
    CUDA graphs (faster than inductor alone in every ``make bench-cuda`` case); not on a CPU, not under DDP, and
    never a step it does not compile. A CPU backend builds the inductor step and labels it so."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    long_ = step_config(("pcaf", "context", "dense", "first"), "ar", "auto")
    long_.train.steps = COMPILE_MIN_STEPS
    assert use_cuda_graphs(long_, cuda, 1)
    assert not use_cuda_graphs(long_, cpu, 1) and not use_cuda_graphs(long_, cuda, 2) and not use_cuda_graphs(long_)
    short = step_config(("pcaf", "context", "dense", "first"), "ar", "auto")
    short.train.steps = COMPILE_MIN_STEPS - 1
    assert not use_cuda_graphs(short, cuda, 1)
    for case in (("transformer_dense", "context", "dense", "first"), ("pcaf", "context", "dense", "topk_score")):
        cfg = step_config(case, "nt", "auto")
        cfg.train.steps = COMPILE_MIN_STEPS
        assert not use_cuda_graphs(cfg, cuda, 1), case
    assert not use_cuda_graphs(step_config(("pcaf", "context", "dense", "first"), "ar", "off"), cuda, 1)
    # (full AR on a CPU stays eager where its head runs on oneDNN: compile.compile_pays_off)
    long_nt = step_config(("pcaf", "context", "dense", "first"), "nt", "auto")
    long_nt.train.steps = COMPILE_MIN_STEPS
    backend = TorchBackend("cpu")
    state = backend.init(long_nt)
    assert not state.cuda_graphs and backend.device.endswith(f"; {COMPILED_LABEL}")


def test_a_step_that_cannot_be_captured_says_so_in_one_line() -> None:
    """Inductor's refusal (``triton.cudagraph_or_error``) becomes one line naming its reason and the alternative;
    other errors, and the same error outside a ``cudagraphs`` run, pass unchanged."""
    case = ("pcaf", "context", "dense", "first")
    refusal = RuntimeError("skipping cudagraphs due to cpu device (primals_1)\nFound from:\n  File ...")
    with pytest.raises(RuntimeError, match=r"^train.compile=cudagraphs could not capture this step as a CUDA graph "
                                           r"\(cpu device \(primals_1\)\): use train.compile=on$") as caught:
        with cuda_graph_errors(step_config(case, "ar", "cudagraphs"), True):
            raise refusal
    assert caught.value.__cause__ is refusal
    with pytest.raises(RuntimeError, match=r"^train.compile=auto \(auto replays compiled steps as CUDA graphs on a "
                                           r"GPU\) could not capture this step as a CUDA graph \(cpu device"):
        with cuda_graph_errors(step_config(case, "ar", "auto"), True):
            raise refusal
    wrapped = RuntimeError("backend='inductor' raised:\nRuntimeError: skipping cudagraphs due to mutated inputs (1 "
                           "instances)")  # as Dynamo wraps the forward's compile error
    with pytest.raises(RuntimeError, match=r"CUDA graph \(mutated inputs \(1 instances\)\): use train.compile=on$"):
        with cuda_graph_errors(step_config(case, "ar", "cudagraphs"), True):
            raise wrapped
    with pytest.raises(RuntimeError, match="^skipping cudagraphs due to"):
        with cuda_graph_errors(step_config(case, "ar", "on"), False):
            raise refusal
    with pytest.raises(RuntimeError, match="^out of memory$"):
        with cuda_graph_errors(step_config(case, "ar", "cudagraphs"), True):
            raise RuntimeError("out of memory")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device; the step's CPU-side conditions (no device "
                    "reads, one safe graph) are tested above on CPU tensors with the CUDA code paths chosen")
def test_cudagraph_step_trains_like_eager_on_cuda() -> None:
    """``cudagraphs``, and ``auto`` for a long run, replay the step as CUDA graphs: six steps (the first compiles,
    the second captures, four replay) give the eager steps' losses (dropout 0: the same arithmetic up to
    inductor's fusions) with every graph captured (a skip would raise; the counter and the graph tree say so
    too), and with dropout on, replays at learning rate 0 draw fresh masks (different losses)."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    case = ("pcaf", "context", "dense", "first")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(3, 64, (B, T)).astype(np.int32), rng.integers(3, 64, (B, T)).astype(np.int32))
               for _ in range(6)]
    losses = {}
    for compile_mode in ("off", "cudagraphs", "auto"):  # fp32 all: the backend turns cuDNN's TF32 off
        cfg = step_config(case, "ar", compile_mode)
        cfg.profile.dropout = 0.0
        cfg.train.steps = COMPILE_MIN_STEPS  # long enough for auto to compile, so on one GPU to replay graphs
        backend = TorchBackend("cuda")
        state = backend.init(cfg)
        assert not torch.backends.cudnn.allow_tf32
        assert state.cuda_graphs == (compile_mode != "off"), compile_mode
        assert backend.device.endswith(f"; {CUDA_GRAPHS_LABEL}") == (compile_mode != "off"), backend.device
        losses[compile_mode] = [backend.train_step(state, x, y, 1e-3)[1] for x, y in batches]
    np.testing.assert_allclose(losses["cudagraphs"], losses["off"], rtol=2e-4)
    np.testing.assert_allclose(losses["auto"], losses["off"], rtol=2e-4)
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.roots, "no CUDA graph was recorded"
    torch._dynamo.reset()
    cfg = step_config(case, "ar", "cudagraphs")
    backend = TorchBackend("cuda")
    state = backend.init(cfg)
    x, y = batches[0]
    replays = [backend.train_step(state, x, y, 0.0)[1] for _ in range(5)]
    assert np.all(np.isfinite(replays)) and len(set(replays[2:])) == 3, replays


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device; the step's CPU-side conditions (no device "
                    "reads, one safe graph) are tested above on CPU tensors with the CUDA code paths chosen")
def test_bf16_cudagraph_step_with_the_head_kernels_trains_like_eager_on_cuda() -> None:
    """bf16 autocast, where the head loss passes over its 16-bit logits with the Triton kernels: six steps replayed
    as CUDA graphs give the eager steps' losses within bf16 rounding (dropout 0), and eager with the kernels gives
    eager without them."""
    from backends.torch.head_loss import kernels_by_default

    torch._dynamo.reset()
    case = ("pcaf", "context", "dense", "first")
    rng = np.random.default_rng(1)
    batches = [(rng.integers(3, 64, (B, T)).astype(np.int32), rng.integers(3, 64, (B, T)).astype(np.int32))
               for _ in range(6)]
    assert kernels_by_default(torch.empty(1, device="cuda"))
    losses = {}
    for name, compile_mode, kernels in (("eager", "off", None), ("aten", "off", False),
                                        ("cudagraphs", "cudagraphs", None)):
        cfg = step_config(case, "ar", compile_mode)
        cfg.profile.dropout = 0.0
        cfg.train.precision = "bf16"
        backend = TorchBackend("cuda")
        state = backend.init(cfg)
        state.module.head.kernels = kernels
        losses[name] = [backend.train_step(state, x, y, 1e-3)[1] for x, y in batches]
    np.testing.assert_allclose(losses["aten"], losses["eager"], rtol=1e-3)
    np.testing.assert_allclose(losses["cudagraphs"], losses["eager"], rtol=2e-2)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="a replayed graph's outputs and pinned uploads need a CUDA device; the loop's "
                    "order is tests/test_loop_pipelining.py's")
def test_losses_read_one_step_late_are_the_steps_own_on_cuda() -> None:
    """The loop reads step N's loss after launching step N+1 (``wait=False``): with CUDA graphs the next replay
    overwrites the graph's loss output, and the next upload reuses pinned host memory; the losses read late are
    still each step's own, as read at once, eager and replayed."""
    torch._dynamo.reset()
    case = ("pcaf", "context", "dense", "first")
    rng = np.random.default_rng(2)
    batches = [(rng.integers(3, 64, (B, T)).astype(np.int32), rng.integers(3, 64, (B, T)).astype(np.int32))
               for _ in range(6)]
    for compile_mode in ("off", "cudagraphs"):
        losses = {}
        for late in (False, True):
            cfg = step_config(case, "ar", compile_mode)
            cfg.profile.dropout = 0.0
            backend = TorchBackend("cuda")
            state = backend.init(cfg)
            read, pending = [], None
            for x, y in batches:
                state, loss = backend.train_step(state, x, y, 1e-3, wait=not late)
                if pending is not None:
                    read.append(float(pending))
                pending = loss
            losses[late] = [*read, float(pending)]
            torch._dynamo.reset()
        # Equal up to the atomics of a GPU's backward (two runs); another step's loss would differ by far more.
        np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5, err_msg=compile_mode)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device; the windowed step's graph is checked above on "
                    "a CPU (test_windowed_flex_step_is_one_cudagraph_safe_graph)")
@pytest.mark.parametrize("variant", ["transformer_local", "transformer_global_local"])
def test_windowed_flex_cudagraph_step_trains_like_eager_on_cuda(variant: str) -> None:
    """The windowed Transformers' next-token step with FlexAttention, replayed as CUDA graphs: five steps (compile,
    capture, three replays) give the eager steps' losses with dropout 0 and every graph captured; with dropout on,
    replays at learning rate 0 draw fresh masks."""
    from torch._dynamo.utils import counters

    rng = np.random.default_rng(3)
    batches = [(rng.integers(3, 64, (2, 450)).astype(np.int32), rng.integers(3, 64, (2,)).astype(np.int32))
               for _ in range(5)]
    losses = {}
    for compile_mode in ("off", "cudagraphs"):
        torch._dynamo.reset()
        counters.clear()
        cfg = windowed_flex_config(variant, "nt", compile_mode)
        cfg.profile.dropout = 0.0
        backend = TorchBackend("cuda")
        state = backend.init(cfg)
        assert state.cuda_graphs == (compile_mode == "cudagraphs")
        losses[compile_mode] = [backend.train_step(state, x, y, 1e-3)[1] for x, y in batches]
    assert counters["inductor"]["cudagraph_skips"] == 0
    np.testing.assert_allclose(losses["cudagraphs"], losses["off"], rtol=2e-4)
    torch._dynamo.reset()
    backend = TorchBackend("cuda")
    state = backend.init(windowed_flex_config(variant, "nt", "cudagraphs"))
    x, y = batches[0]
    replays = [backend.train_step(state, x, y, 0.0)[1] for _ in range(5)]
    assert np.all(np.isfinite(replays)) and len(set(replays[2:])) == 3, replays
    torch._dynamo.reset()
