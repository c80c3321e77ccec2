"""FlexAttention windowed attention (``model.attention_impl=banded``, :mod:`backends.torch.window_attention`)
against the masked SDPA path and the spec: values and gradients, dropout on the weights, the block-mask cache,
``auto``'s choice per device, the model under ``torch.compile``, and the refusal to train on a CPU.

FlexAttention's CPU kernels have no backward pass, so torch refuses inputs that require grad on a CPU at its
entry (``_validate_device``), and so does this suite. Its eager implementation (the reference the kernels are
tested against in torch) computes the backward on any device: the ``flex_backward_on_cpu`` fixture lifts both
refusals so that gradients are checked on a CPU through that implementation. The fused kernels' gradients are
checked by the ``gpu`` test at the end, on CUDA.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

from backends.torch import build_model, load_canonical
from backends.torch import window_attention as wa
from backends.torch.layers import Attention, attention_kernel, attention_mask
from pcaf_core import reference
from pcaf_core.config import ATTENTION_IMPLS, ConfigError, MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile
from tests.compiled_steps import attention_step_config, compare_steps, cudagraph_unsafe, recording_backend
from tests.spec_helpers import spec_params

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

CUDA = torch.cuda.is_available()
VARIANTS = ("transformer_local", "transformer_global_local")
# (T, w, g): one partial block; several 128-position blocks with T not a multiple of 128 (blocks skipped); a
# window wider than T; w = 1 (only the query itself: with dropout, whole rows dropped); the paper's w and g.
SHAPES = [(50, 7, 3), (300, 20, 0), (40, 64, 5), (9, 1, 2), (261, 128, 16)]


def _qkv(T: int, dtype=torch.float32, device="cpu", seed: int = 0, head_dim: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, T, head_dim, generator=g, dtype=dtype).to(device).requires_grad_()
                 for _ in range(3))


def _masked(q, k, v, variant, w, g) -> torch.Tensor:
    """The existing path: SDPA under the ``[T, T]`` mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(q.shape[2], variant, w, g, q.device))


def _dropped_reference(q, k, v, variant, w, g, p, keep) -> torch.Tensor:
    """Dense attention with the weights dropped by ``keep`` (read through :func:`wa.keep_index`) and scaled by
    1/(1-p): what dropout on the attention weights computes."""
    T = q.shape[2]
    pos = torch.arange(T, device=q.device)
    allowed = reference.attention_allowed(pos[:, None], pos[None, :], variant, w, g)
    weights = torch.softmax(torch.where(allowed, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -math.inf), -1)
    cols = min(w, T)
    kept = keep[:, :, pos[:, None], wa.keep_index(pos[:, None], pos[None, :], w, cols, wa.n_global_keys(variant, g))]
    return (weights * kept / (1 - p)) @ v


def _grads(out: torch.Tensor, inputs) -> tuple[torch.Tensor, ...]:
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), inputs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,w,g", SHAPES)
def test_flex_matches_masked_sdpa(variant, T, w, g, flex_backward_on_cpu) -> None:
    """fp32 values and gradients of the block-masked FlexAttention equal the masked SDPA path's."""
    q, k, v = _qkv(T)
    out = wa.flex_window_attention(q, k, v, variant, w, g, compiled=False)
    want = _masked(q, k, v, variant, w, g)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,w,g", SHAPES)
def test_flex_dropout_drops_attention_weights(variant, T, w, g, flex_backward_on_cpu) -> None:
    """With dropout the two-call form (kept keys, rescaled by the full row's normaliser) equals dropping the
    softmax weights with the same mask, values and gradients (float64: the identity is exact), rows whose every
    key was dropped included (w = 1 at p = 0.6 drops 60% of the rows whole)."""
    p = 0.6
    q, k, v = _qkv(T, torch.float64)
    keep = wa.draw_keep((2, 2, T), w, wa.n_global_keys(variant, g), p, q.device)
    out = wa.flex_window_attention(q, k, v, variant, w, g, p, compiled=False, keep=keep)
    want = _dropped_reference(q, k, v, variant, w, g, p, keep)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-11)


# (T, w, g, rows): query rows of pcaf_core.reference.layer_rows, as nt_attention_rows gives them: the global rows
# and a suffix across block boundaries (T=300), the top layer's last row alone, a suffix shorter than the window.
ROW_CASES = [(300, 20, 5, (5, 141)), (261, 128, 16, (0, 1)), (50, 7, 3, (3, 7))]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,w,g,rows", ROW_CASES)
def test_flex_on_query_rows_is_those_rows_of_the_full_attention(variant, T, w, g, rows,
                                                                 flex_backward_on_cpu) -> None:
    """Queries of some rows only (a next-token layer, pcaf_core.reference.nt_attention_rows): FlexAttention's
    values and gradients are those rows of the full attention (fp32), without dropout and, in float64, with the
    weights dropped by the same masks as the dense formula's."""
    q, k, v = _qkv(T)
    kept = torch.as_tensor(reference.layer_rows(T, rows))
    out = wa.flex_window_attention(q[:, :, kept], k, v, variant, w, g, compiled=False, rows=rows)
    want = _masked(q, k, v, variant, w, g)[:, :, kept]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
    p = 0.4
    q, k, v = _qkv(T, torch.float64)
    keep = wa.draw_keep((2, 2, len(kept)), w, wa.n_global_keys(variant, g), p, q.device, keys=T)
    full_keep = torch.ones(2, 2, T, keep.shape[-1], dtype=torch.bool)
    full_keep[:, :, kept] = keep
    out = wa.flex_window_attention(q[:, :, kept], k, v, variant, w, g, p, compiled=False, keep=keep, rows=rows)
    want = _dropped_reference(q, k, v, variant, w, g, p, full_keep)[:, :, kept]
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="rows"):
        wa.flex_window_attention(q, k, v, variant, w, g, compiled=False, rows=rows)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_dropout_step_gives_every_flex_backward_an_output_gradient(variant, flex_backward_on_cpu) -> None:
    """Under ``torch.compile`` the dropout form's backward graph hands each FlexAttention backward the gradient of
    its output: inductor's CUDA lowering of that backward fails on a missing one (a discarded output), which would
    stop every compiled training step with dropout. Captured with AOTAutograd's graphs, as inductor receives them;
    the compiled form gives the eager values and gradients."""
    from torch._dynamo.backends.common import aot_autograd

    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm)
        return gm

    def attend(q, k, v, keep):
        return wa.flex_window_attention(q, k, v, variant, 8, 3, 0.3, keep=keep)

    q, k, v = _qkv(20)
    keep = wa.draw_keep((2, 2, 20), 8, wa.n_global_keys(variant, 3), 0.3, q.device)
    torch._dynamo.reset()
    capture = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=keep_backward)
    out = torch.compile(attend, backend=capture, fullgraph=True, dynamic=False)(q, k, v, keep)
    grads = _grads(out, (q, k, v))
    torch._dynamo.reset()
    calls = [n for gm in backward_graphs for n in gm.graph.nodes if "flex_attention_backward" in str(n.target)]
    assert len(calls) == 2  # the kept-key call and the full row's
    assert all(n.args[5] is not None for n in calls), "a FlexAttention backward gets no output gradient"
    want = wa.flex_window_attention(q, k, v, variant, 8, 3, 0.3, compiled=False, keep=keep)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, exp in zip(grads, _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-6)


def test_dropout_masks_come_from_the_global_generator() -> None:
    """Fresh masks every call at the rate asked for, the same ones again under the same seed."""
    shape, w, g, p = (4, 2, 200), 32, 4, 0.1
    torch.manual_seed(3)
    a = wa.draw_keep(shape, w, g, p, torch.device("cpu"))
    b = wa.draw_keep(shape, w, g, p, torch.device("cpu"))
    torch.manual_seed(3)
    assert a.shape == (4, 2, 200, 36) and torch.equal(a, wa.draw_keep(shape, w, g, p, torch.device("cpu")))
    assert not torch.equal(a, b)
    assert abs(a.float().mean().item() - 0.9) < 0.01
    q, k, v = (x.detach() for x in _qkv(60))
    with torch.no_grad():
        one, two = (wa.flex_window_attention(q, k, v, "transformer_local", 8, 0, 0.5, compiled=False) for _ in "ab")
    assert not torch.equal(one, two)


def test_block_mask_is_built_once_per_length_and_device() -> None:
    """The block mask of a (T, w, g, device) is kept; a new T builds its own, which skips blocks."""
    wa._BLOCK_MASKS.clear()
    first = wa.window_block_mask(300, 20, 0, torch.device("cpu"))
    assert wa.window_block_mask(300, 20, 0, torch.device("cpu")) is first
    other = wa.window_block_mask(600, 20, 0, torch.device("cpu"))
    assert other is not first and len(wa._BLOCK_MASKS) == 2
    # 600 positions = 5 blocks of 128: each query block reads itself and the block before, 9 of 25 block pairs.
    assert int(other.kv_num_blocks.sum()) + int(other.full_kv_num_blocks.sum()) == 9


def _model(impl: str, variant: str = "transformer_global_local", T: int = 150, d_model: int = 16,
           window: int = 7) -> torch.nn.Module:
    model = ModelConfig(variant=variant, vocab_size=40, d_model=d_model, d_hidden=24, n_layers=2, n_heads=2,
                        window=window, n_global=3, max_seq_len=T, attention_impl=impl)
    profile = get_profile("corrected")
    net = build_model(model, MemoryConfig(), profile)
    load_canonical(net, spec_params(model, MemoryConfig(), profile, seed=1))
    return net


def _tokens(T: int = 150) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 40, (2, T), generator=g), torch.randint(0, 40, (2, T), generator=g)


def test_auto_is_masked_on_cpu_and_banded_on_cuda() -> None:
    """``auto`` runs FlexAttention on CUDA only (no backward pass on a CPU); ``banded``/``masked`` are what they
    say; the dense Transformer and linear attention are never windowed."""
    attn = {impl: Attention(8, 2, "transformer_local", 4, 0, 4, 0.0, impl) for impl in ("auto", "banded", "masked")}
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [attn[i].banded(cpu) for i in ("auto", "banded", "masked")] == [False, True, False]
    assert [attn[i].banded(cuda) for i in ("auto", "banded", "masked")] == [True, True, False]
    assert not Attention(8, 2, "transformer_dense", 4, 0, 4, 0.0, "auto").banded(cuda)
    assert not Attention(8, 2, "transformer_local", 4, 0, 4, 0.0, "blocked").banded(cuda)  # SDPA, not FlexAttention


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_record_names_the_attention_kernel_that_runs(device) -> None:
    """The record's label (:func:`backends.torch.layers.attention_kernel`) names what ``Attention`` computes with:
    FlexAttention exactly where ``banded()`` says so, and a next-token run's short layers as masked SDPA."""
    dev = torch.device(device)
    names = {(impl, nt): attention_kernel(impl, dev, nt) for impl in ATTENTION_IMPLS for nt in (False, True)}
    flex = "FlexAttention (masked SDPA in layers of under 128 query rows)"
    assert names == {("auto", False): "FlexAttention" if device == "cuda" else "masked SDPA",
                     ("auto", True): flex if device == "cuda" else "masked SDPA",
                     ("banded", False): "FlexAttention", ("banded", True): flex,
                     ("blocked", False): "blocked SDPA", ("blocked", True): "blocked SDPA",
                     ("masked", False): "masked SDPA", ("masked", True): "masked SDPA"}
    for impl in ATTENTION_IMPLS:
        attn = Attention(8, 2, "transformer_local", 4, 0, 4, 0.0, impl)
        assert names[(impl, False)].startswith("FlexAttention") == attn.banded(dev)
        assert not attn.banded(dev, query_rows=wa.FLEX_BLOCK - 1)  # the short layers the suffix names


def test_training_banded_on_cpu_is_refused_in_one_line() -> None:
    net = _model("banded").train()
    x, y = _tokens()
    with pytest.raises(ValueError, match=r"^model\.attention_impl=banded uses FlexAttention, which has no backward "
                                         r"pass on cpu .*: train with model\.attention_impl=masked \(or auto\) there$"):
        net(x, y, "ar").loss.backward()


@pytest.mark.slow
def test_compiled_flex_forward_matches_masked_model() -> None:
    """The one compiled case (inductor's CPU FlexAttention, 6-15 s to compile here): a two-layer global-local
    model in evaluation with ``banded`` gives the ``masked`` model's outputs, and the spec's; a local model with
    another window then reuses the compiled kernel (w and g are tensors to Dynamo, not constants)."""
    from torch._dynamo.utils import counters

    x, y = _tokens()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _model("banded").eval()(x, y, "ar")
        want = _model("masked").eval()(x, y, "ar")
        graphs = counters["stats"]["unique_graphs"]
        local = _model("banded", "transformer_local", window=12).eval()(x, y, "ar")
        assert counters["stats"]["unique_graphs"] == graphs
        torch.testing.assert_close(local.hidden, _model("masked", "transformer_local", window=12).eval()(x, y, "ar")
                                   .hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.hidden, want.hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.target_log_prob, want.target_log_prob, rtol=1e-4, atol=1e-5)
    model = ModelConfig(variant="transformer_global_local", vocab_size=40, d_model=16, d_hidden=24, n_layers=2,
                        n_heads=2, window=7, n_global=3, max_seq_len=150)
    spec = reference.forward(spec_params(model, MemoryConfig(), get_profile("corrected"), seed=1), x.numpy(), model,
                             MemoryConfig(), get_profile("corrected"), "ar", y.numpy())
    np.testing.assert_allclose(out.target_log_prob.numpy(), spec.target_log_prob, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_model_under_torch_compile_trains_like_masked(flex_backward_on_cpu) -> None:
    """``train.compile=on`` compiles the model's forward and backward: the FlexAttention path traces into one graph
    (the compiled ``flex_attention`` and the block-mask cache inline; ``fullgraph=True`` raises, with the reason, at
    any graph break) and gives the masked model's loss and gradients, eager (``aot_eager``: the same capture as
    inductor, without code generation, which has no CPU backward)."""
    import torch._dynamo

    x, y = _tokens()
    nets = {impl: _model(impl).train() for impl in ("banded", "masked")}  # corrected profile: dropout 0
    losses, grads = {}, {}
    torch._dynamo.reset()
    wa._BLOCK_MASKS.clear()  # built inside the traced step, as a fresh process does
    wa._SCALARS.clear()
    for impl, net in nets.items():
        def loss(net=net):
            return net(x, y, "ar", need_log_probs=False, need_predictions=False).loss

        step = torch.compile(loss, backend="aot_eager", dynamic=False, fullgraph=True) if impl == "banded" else loss
        losses[impl] = step()
        losses[impl].backward()
        grads[impl] = [p.grad for p in net.parameters()]
    torch._dynamo.reset()
    torch.testing.assert_close(losses["banded"], losses["masked"], rtol=1e-5, atol=1e-6)
    for got, want in zip(grads["banded"], grads["masked"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _compiled_next_token_step_cold(variant: str, device: str, backend: str) -> None:
    """A next-token training step with the reference profile's dropout, whose two lower layers put at least a
    block of rows through FlexAttention's dropout form, compiled by ``backend`` from an empty block-mask cache (as
    a fresh process, a paper row's first step, meets it): one graph with no break (Dynamo's counters), and the
    eager step's loss and gradients under the same dropout draws. ``aot_eager`` records AOT's graphs as it runs
    them, and they must hold nothing a CUDA graph cannot capture (``train.compile=cudagraphs`` takes this step:
    tests/test_torch_cuda_graphs.py)."""
    from torch._dynamo.utils import counters

    import backends.torch.layers as torch_layers
    from backends.torch.backend import TorchBackend, TrainingLoss
    from backends.torch.compile import compile_training
    from pcaf_core.config import RunConfig, TrainConfig

    T = 450  # past the receptive field (g + 3·127 + 1 rows), so the step reads a sub-window
    cfg = RunConfig(model=ModelConfig(variant=variant, vocab_size=64, d_model=32, d_hidden=24, n_layers=3, n_heads=2,
                                      window=128, n_global=2, max_seq_len=T, attention_impl="banded"),
                    profile=get_profile("reference_torch"), train=TrainConfig(mode="nt", seq_len=T, batch_size=2))
    state = TorchBackend(device).init(cfg)
    state.module.train()
    x, y = (t.to(device) for t in _tokens(T))
    y = y[:, -1]
    torch._dynamo.reset()
    counters.clear()
    wa._BLOCK_MASKS.clear()
    wa._SCALARS.clear()
    flex_rows, flex = [], wa.flex_window_attention

    def counted(q, *args, **kwargs):
        flex_rows.append(q.shape[2])
        return flex(q, *args, **kwargs)

    results = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_layers, "flex_window_attention", counted)
        recorded = recording_backend() if backend == "aot_eager" else None
        compiler = recorded[0] if recorded else backend
        for name, step in (("compiled", compile_training(state.module, TrainingLoss(state.module), backend=compiler)),
                           ("eager", TrainingLoss(state.module))):
            torch.manual_seed(11)
            loss = step(x, y, "nt")
            loss.backward()
            results[name] = (loss.detach(), {n: p.grad.clone() for n, p in state.module.named_parameters()
                                             if p.grad is not None})
            state.module.zero_grad(set_to_none=True)
            if name == "compiled":  # before the eager step compiles FlexAttention calls of its own
                graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    torch._dynamo.reset()
    assert graphs == 1 and not breaks, breaks
    if recorded:  # a forward and a backward, each capturable as a CUDA graph
        _, aot, mutated = recorded
        assert len(aot) == 2 and cudagraph_unsafe(aot, mutated) == []
    g = wa.n_global_keys(variant, 2)
    assert sorted(set(flex_rows), reverse=True) == [g + 2 * 127 + 1, g + 127 + 1]  # the two lower layers' rows
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=1e-5, atol=0)
    scale = max(float(grad.abs().max()) for grad in results["eager"][1].values())
    for name, want in results["eager"][1].items():
        torch.testing.assert_close(results["compiled"][1][name], want, rtol=1e-4, atol=1e-6 * scale, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_next_token_step_with_dropout_traces_flex_rows_cold(variant, flex_backward_on_cpu) -> None:
    """``train.compile=on`` as a paper row's first step meets it (:func:`_compiled_next_token_step_cold`), through
    ``aot_eager``: inductor's capture without its code generation, which has no CPU backward."""
    _compiled_next_token_step_cold(variant, "cpu", "aot_eager")


@pytest.mark.parametrize("variant", VARIANTS)
def test_next_token_step_on_flex_rows_matches_the_masked_full_window(variant, flex_backward_on_cpu,
                                                                       monkeypatch) -> None:
    """A next-token training step of a ``banded`` model (the sub-window, each layer's rows through FlexAttention,
    its eager implementation here) gives the ``masked`` model's full-window loss and gradients. w = 130 so that the
    lower layer keeps at least a block of rows (133 of 262) and runs FlexAttention; the top layer's one row runs
    SDPA (fewer rows than a block)."""
    import backends.torch.layers as torch_layers

    monkeypatch.setattr(wa, "compiled_flex_attention", lambda: torch_flex.flex_attention)
    flex_rows = []

    def counted(q, *args, **kwargs):
        flex_rows.append(q.shape[2])
        return wa.flex_window_attention(q, *args, **kwargs)

    monkeypatch.setattr(torch_layers, "flex_window_attention", counted)
    x, y = _tokens(300)
    results = {}
    for impl, receptive in (("banded", True), ("masked", False)):
        net = _model(impl, variant, T=300, window=130).train()  # corrected profile: dropout 0
        net.nt_receptive_field = receptive
        loss = net(x, y[:, -1], "nt", need_log_probs=False, need_predictions=False).loss
        loss.backward()
        results[impl] = (loss, [p.grad for p in net.parameters()])
    g = wa.n_global_keys(variant, 3)
    assert reference.nt_attention_rows(net.model_config, 300) == [(g, 130), (0, 1)]
    assert flex_rows == [g + 130]  # the lower layer's rows; the top layer's one row ran SDPA
    torch.testing.assert_close(results["banded"][0], results["masked"][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results["banded"][1], results["masked"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_attention_impl_is_checked() -> None:
    assert ModelConfig(variant="transformer_local", attention_impl="banded").attention_impl == "banded"
    with pytest.raises(ConfigError, match=r"model\.attention_impl='flex' is invalid: expected one of"):
        ModelConfig(variant="transformer_local", attention_impl="flex")
    with pytest.raises(ConfigError, match="applies to .* only, not 'transformer_dense': leave it auto"):
        ModelConfig(variant="transformer_dense", attention_impl="masked")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the fused FlexAttention kernels' backward runs on CUDA; on a CPU the same "
                    "code is checked above through FlexAttention's eager implementation")
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_flex_on_cuda_matches_masked(variant) -> None:
    """On CUDA, the compiled kernels (the path ``auto`` takes there) at the paper's head dimension 48: fp32 values
    and gradients equal the masked SDPA path's at every shape, and with dropout equal the dense formula under the
    same mask; the model's ``auto`` and ``masked`` losses and gradients agree. Each shape, with and without a
    ``score_mod``, compiles a graph of its own: more than Dynamo's 8 per function, past which FlexAttention would
    run unfused (with a warning), so the limit is raised here and every shape runs the compiled kernels."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch._dynamo.config.patch(recompile_limit=4 * (len(SHAPES) + len(ROW_CASES)) + 8):
        _compiled_flex_matches_masked(variant)


def _compiled_flex_matches_masked(variant) -> None:
    for T, w, g in SHAPES:
        q, k, v = (x.detach().cuda().requires_grad_() for x in _qkv(T, head_dim=48))
        out = wa.flex_window_attention(q, k, v, variant, w, g)
        want = _masked(q, k, v, variant, w, g)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-3, atol=1e-4)
        keep = wa.draw_keep((2, 2, T), w, wa.n_global_keys(variant, g), 0.3, q.device)
        out = wa.flex_window_attention(q, k, v, variant, w, g, 0.3, keep=keep)
        want = _dropped_reference(q, k, v, variant, w, g, 0.3, keep)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-3, atol=1e-4)
    for T, w, g, rows in ROW_CASES:  # queries of some rows only (next-token layers)
        q, k, v = (x.detach().cuda().requires_grad_() for x in _qkv(T, head_dim=48))
        kept = torch.as_tensor(reference.layer_rows(T, rows), device=q.device)
        out = wa.flex_window_attention(q[:, :, kept], k, v, variant, w, g, rows=rows)
        want = _masked(q, k, v, variant, w, g)[:, :, kept]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-3, atol=1e-4)
    for mode, T, w in (("ar", 150, 7), ("nt", 300, 130)):  # nt: a lower layer of 130+ query rows
        x, y = (t.cuda() for t in _tokens(T))
        losses = {}
        for impl in ("auto", "masked"):
            net = _model(impl, variant, T=T, d_model=96, window=w).cuda().train()  # head_dim 48
            net.nt_receptive_field = impl == "auto"  # the sub-window and its rows, against the full window
            loss = net(x, y if mode == "ar" else y[:, -1], mode).loss
            loss.backward()
            losses[impl] = (loss.item(), net.blocks[0].attn.qkv.weight.grad.norm().item())
        np.testing.assert_allclose(losses["auto"], losses["masked"], rtol=1e-4, err_msg=mode)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="inductor compiles FlexAttention's backward for CUDA only; on a CPU "
                    "test_compiled_next_token_step_with_dropout_traces_flex_rows_cold checks the graph it gets")
@pytest.mark.parametrize("variant", VARIANTS)
def test_inductor_next_token_step_on_flex_rows_from_a_cold_start_on_cuda(variant) -> None:
    """The paper rows' ``train.compile=on`` first step on CUDA (:func:`_compiled_next_token_step_cold`, inductor,
    fp32 with TF32 off): one graph, FlexAttention's kernels for the two lower layers' rows, the eager step's loss
    and gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _compiled_next_token_step_cold(variant, "cuda", "inductor")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="inductor compiles FlexAttention's backward for CUDA only; on a CPU "
                    "test_compiled_dropout_step_gives_every_flex_backward_an_output_gradient checks the graph it gets")
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_inductor_step_with_dropout_trains_like_eager_on_cuda(variant, mode) -> None:
    """``train.compile=on`` on CUDA: the windowed Transformer's training step with dropout, compiled by inductor
    (FlexAttention's forward and backward inside the step's graph), gives the eager step's losses and gradients
    under the same dropout masks (what stopped the first compiled paper-scale row)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    compare_steps(attention_step_config(variant, mode), "inductor", device="cuda")
