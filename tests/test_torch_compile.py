"""The compiled training step (``train.compile``) gives the eager step's losses and gradients.

Every PCAF variant and route × {nt, ar} runs through ``torch.compile`` with ``aot_eager`` (Dynamo's graph
capture and AOT autograd, the compiled path's own layer forms and dropout, without C++ code generation);
one case runs through inductor itself, next-token PCAF-context with dropout on, the configuration the
speed targets are about, and one more on the CUDA code paths, full AR: what ``cudagraphs`` replays. A cold
inductor compile costs half a minute on this CPU (a third less in scalar C++, :func:`scalar_cpp`), hence two
cases, in one file so that the second reuses most of the first's compiled kernels (inductor caches them by their
code; two workers compiling both at once would not).
"""

from __future__ import annotations

import pytest
import torch

from backends.torch import cpu_gemm
from backends.torch.backend import TorchBackend
from backends.torch.compile import COMPILE_MIN_STEPS, COMPILED_LABEL, use_compile
from backends.torch.layers import ConvBlock, causal_depthwise_conv
from tests.compiled_steps import COMPILED_CASES, compare_steps, step_config


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: "-".join(c))
def test_compiled_graph_capture_trains_like_eager(case, mode: str) -> None:
    compare_steps(step_config(case, mode), "aot_eager")


@pytest.fixture
def scalar_cpp():
    """Inductor's C++ for the CPU without its vector intrinsics: the two inductor tests compile a third faster
    (cold, alone on this machine: 25 s against 38 s), and what they check is the same: the step's graph, inductor's
    fusions, dropout's random draws and the custom ops' fallbacks train like eager. The vector code is inductor's
    own, and the CPU speed of compiled steps is measured by `make bench`, not here."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("scalar_cpp")
def test_inductor_compiled_step_trains_like_eager_with_dropout() -> None:
    module = compare_steps(step_config(("pcaf", "context", "dense", "first"), "nt"), "inductor")
    blocks = [m for m in module.modules() if isinstance(m, ConvBlock)]
    assert blocks and all(b.conv_form == "shifted" for b in blocks)


@pytest.mark.slow
@pytest.mark.usefixtures("scalar_cpp")
def test_inductor_compiles_the_cuda_full_ar_step_like_eager(cuda_code_paths: torch.device) -> None:
    """What ``cudagraphs`` replays is inductor's code for the step: full-AR PCAF-context with the GPU's candidate
    kernel and key-gradient op inside the graph (custom ops, run by the Triton interpreter on a CPU) gives the
    eager step's losses and gradients. The benchmarked GPU case; about 8 s here after the test above. (Where a
    CUDA device is present the step runs on the CPU's own paths here, and
    tests/test_torch_cuda_graphs.py::test_cudagraph_step_trains_like_eager_on_cuda runs it there.)"""
    compare_steps(step_config(("pcaf", "context", "dense", "first"), "ar"), "inductor")


def test_shifted_conv_equals_the_convolution() -> None:
    torch.manual_seed(0)
    block = ConvBlock(6, 8, 5, "tanh", 0.0).double()
    y = torch.randn(2, 11, 6, dtype=torch.float64)
    conv = block.conv(torch.nn.functional.pad(y.transpose(1, 2), (4, 0))).transpose(1, 2)
    torch.testing.assert_close(causal_depthwise_conv(y, block.conv.weight, block.conv.bias), conv, rtol=1e-14,
                               atol=1e-14)


@pytest.mark.parametrize("form", ["auto", "conv1d", "shifted"])
def test_conv_form_picks_the_shifted_sum_for_cpu_training_only(monkeypatch, form: str) -> None:
    """``auto``: the shifted multiply-adds when a backward pass follows on a CPU, the convolution under
    ``no_grad``; both give the same output and the shifted form the convolution's gradients."""
    import backends.torch.layers as layers

    calls = []
    monkeypatch.setattr(layers, "causal_depthwise_conv", lambda *a: calls.append(1) or causal_depthwise_conv(*a))
    torch.manual_seed(0)
    block = ConvBlock(6, 8, 5, "tanh", 0.0).double()
    block.conv_form = form
    x = torch.randn(3, 9, 6, dtype=torch.float64, requires_grad=True)
    out = block(x)
    grads = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    assert len(calls) == (form != "conv1d")
    with torch.no_grad():
        evaluated = block(x)
    assert len(calls) == (form != "conv1d") + (form == "shifted")
    torch.testing.assert_close(evaluated, out.detach(), rtol=1e-13, atol=1e-13)
    block.conv_form = "conv1d"
    for got, want in zip(grads, torch.autograd.grad(block(x).sum(), [x, *block.parameters()]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_auto_keeps_full_ar_eager_where_the_head_runs_on_onednn(monkeypatch) -> None:
    """On a CPU whose head products run on oneDNN, which a compiled step cannot use, ``auto`` leaves full-AR steps
    eager; next-token steps, and full-AR steps on CUDA, compile as before."""
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: True)
    case = ("pcaf", "context", "dense", "first")
    ar, nt = step_config(case, "ar", "auto"), step_config(case, "nt", "auto")
    ar.train.steps = nt.train.steps = COMPILE_MIN_STEPS
    assert not use_compile(ar) and not use_compile(ar, torch.device("cpu"))
    assert use_compile(ar, torch.device("cuda"))
    assert use_compile(nt) and use_compile(nt, torch.device("cpu"))
    assert use_compile(step_config(case, "ar", "on"))  # on still compiles


def test_auto_compiles_long_runs_only_and_the_record_says_so(monkeypatch) -> None:
    monkeypatch.setattr(cpu_gemm, "onednn_on_this_cpu", lambda: False)  # a CPU whose head products use oneMKL
    case = ("pcaf", "context", "dense", "first")
    short, long_ = step_config(case, "nt", "auto"), step_config(case, "nt", "auto")
    long_.train.steps = COMPILE_MIN_STEPS
    assert not use_compile(short) and use_compile(long_)
    ar = step_config(case, "ar", "auto")
    ar.train.steps = COMPILE_MIN_STEPS - 1
    assert not use_compile(ar)
    ar.train.steps = COMPILE_MIN_STEPS
    assert use_compile(ar)
    # Where compiling measured slower: routes that rank with a host-side ρ, and the Transformers.
    for other, mode in ((("pcaf", "context", "dense", "topk_score"), "nt"), (("pcaf", "context", "dense", "topk_score"),
                        "ar"), (("pcaf", "semantic", "dense", "recent"), "nt"),
                        (("transformer_dense", "context", "dense", "first"), "nt"),
                        (("transformer_dense", "context", "dense", "first"), "ar")):
        cfg = step_config(other, mode, "auto")
        cfg.train.steps = COMPILE_MIN_STEPS
        assert not use_compile(cfg), (other, mode)
    topk_no_cache = step_config(("pcaf_no_cache", "context", "dense", "topk_score"), "nt", "auto")
    topk_no_cache.train.steps = COMPILE_MIN_STEPS
    assert use_compile(topk_no_cache)  # no cache: its policy ranks nothing
    assert use_compile(step_config(case, "nt", "on")) and not use_compile(step_config(case, "nt", "off"))
    backend = TorchBackend("cpu")
    backend.init(step_config(case, "nt", "on"))  # torch.compile is lazy: building compiles nothing yet
    assert COMPILED_LABEL in backend.device
    plain = TorchBackend("cpu")
    plain.init(short)
    assert COMPILED_LABEL not in plain.device
