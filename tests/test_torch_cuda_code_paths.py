"""Training on the CUDA code paths equals training on the CPU's: every ``pcaf::`` kernel an eager CUDA step takes
(candidates, gathered scores and their key gradient, the head's 16-bit passes, dropout alone and fused with its
neighbours, the L2 normalisation, the memory read's row passes), run on CPU tensors through Triton's interpreter
(``benchmarks.op_census.cuda_code_paths``), against the ATen paths a CPU step takes, over a few AdamW steps of
PCAF-context with dropout 0.1 from one seed.

Each kernel has its own tests; this one checks that together, wired into the model, backward pass and optimiser,
they train the same model: float32 losses equal to float32 rounding, bf16 autocast ones to bfloat16 rounding. On a
CUDA device (``gpu``-marked, ``make test-gpu``) the same steps run with the compiled kernels against the ATen forms
on CUDA, and each kernel runs at the paper's shape against its ATen form.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch

from backends.torch import cpu_gemm
from backends.torch.backend import TorchBackend
from backends.torch.layers import ConvBlock
from benchmarks.op_census import aten_forms, cuda_code_paths
from experiments.table_plan import compose_row

# Twelve training steps a case, four cases (about 8 s): the whole suite's, not the edit-test loop's.
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]
STEPS = 12


def _losses(precision: str, kernels: bool, device: str = "cpu") -> list[float]:
    """The training losses of :data:`STEPS` eager steps on ``device`` with the kernels an eager CUDA step takes
    (``kernels``; on a CPU, the CUDA code paths through the interpreter) or with the ATen forms."""
    overrides = ["train.mode=ar", "train.seq_len=32", "train.batch_size=4", "data.max_vocab=64",
                 f"train.precision={precision}", "train.compile=off"]
    cfg = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", overrides)[0].run
    assert cfg.profile.dropout > 0
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 12, (4, 32)), rng.integers(0, 12, (4, 32))) for _ in range(STEPS)]  # many hits
    if device == "cpu":
        paths = cuda_code_paths() if kernels else contextlib.nullcontext()
    else:
        paths = contextlib.nullcontext() if kernels else aten_forms()
    # Products through ATen both ways (the CPU's oneDNN products round differently), the conv as on CUDA.
    with paths, mock.patch.object(cpu_gemm, "onednn_on_this_cpu", lambda: False):
        backend = TorchBackend(device)
        state = backend.init(cfg)
        for m in state.module.modules():
            if isinstance(m, ConvBlock):
                m.conv_form = "conv1d"
        torch.manual_seed(1)  # dropout's draws
        return [backend.train_step(state, x, y, 1e-3)[1] for x, y in batches]


@pytest.mark.parametrize("precision, tolerance", [("fp32", 2e-6), ("bf16", 5e-4)])
def test_training_on_the_cuda_code_paths_equals_the_cpu_paths(precision: str, tolerance: float) -> None:
    with_kernels, without = _losses(precision, True), _losses(precision, False)
    np.testing.assert_allclose(with_kernels, without, rtol=tolerance, atol=0)
    assert with_kernels[-1] < with_kernels[0]  # it learns


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; on a CPU the Triton "
                                "interpreter runs the same kernels in the tests above")


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("precision, tolerance", [("fp32", 2e-6), ("bf16", 5e-4)])
def test_training_on_cuda_with_the_compiled_kernels_equals_its_aten_forms(precision: str, tolerance: float) -> None:
    """The kernels compiled for the GPU, in an eager CUDA step, against the same CUDA step with every choice made
    for the ATen forms (the same generator, so the same dropout masks)."""
    from backends.torch.kernels import cache_rows

    called = mock.Mock(wraps=cache_rows.candidate_scores)
    with mock.patch.object(cache_rows, "candidate_scores", called):
        with_kernels = _losses(precision, True, "cuda")
    assert called.called
    np.testing.assert_allclose(with_kernels, _losses(precision, False, "cuda"), rtol=tolerance, atol=0)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_compiled_at_the_paper_shape_equal_their_aten_forms(dtype: torch.dtype) -> None:
    """Each kernel of an eager step at the WikiText-2 paper shape (full AR, T=1,024, batch 8: 8,192 query rows of
    K=16 slots, d=256, the MLP's 1,000 features) on CUDA, against its ATen form on the same tensors; tolerances as
    in the kernels' own tests (which run them through the interpreter at small shapes)."""
    from backends.torch.kernels import cache_rows, dropout_fused, l2_normalize, mixture_rows
    from pcaf_core.dropout import DROPOUT_LEVELS, dropout_scale, dropout_threshold

    gen = torch.Generator(device="cuda").manual_seed(0)
    R, K, T, d = 8192, 16, 1024, 256

    def close(got, want, rtol):
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * want.float().abs().max().item())

    dots = torch.randn(R, K, device="cuda", generator=gen).to(dtype)
    index = torch.randint(-1, T, (R, K), device="cuda", generator=gen)
    recency, rho = torch.rand(T, device="cuda", generator=gen), torch.tensor(0.7, device="cuda")
    scores = cache_rows.candidate_scores(dots, index, recency, rho, d**0.5)
    close(scores, cache_rows.candidate_scores_torch(dots, index, recency, rho, d**0.5), 1e-6)
    valid = torch.rand(R, K, device="cuda", generator=gen) < 0.7
    w = cache_rows.cache_weights(scores, valid)
    close(w, cache_rows.cache_weights_torch(scores, valid), 1e-5)
    g = torch.randn(R, K, device="cuda", generator=gen)
    close(cache_rows.cache_weights_grad(w, g), cache_rows.cache_weights_grad_torch(w, g), 1e-5)
    values = torch.randint(0, 8, (R, K), device="cuda", generator=gen)
    targets = torch.randint(0, 8, (R,), device="cuda", generator=gen)
    pc = cache_rows.target_cache_prob(w, values, valid, targets)
    close(pc, cache_rows.target_cache_prob_torch(w, values, valid, targets), 1e-5)
    lp = torch.randn(R, device="cuda", generator=gen) - 4
    gate = mixture_rows.mask_gate(torch.rand(R, device="cuda", generator=gen), valid.any(-1), True, False)
    for rule in (mixture_rows.FLOORED, mixture_rows.LOG):
        close(mixture_rows.mixture_target(lp, pc, gate, rule), mixture_rows.mixture_target_torch(lp, pc, gate, rule),
              1e-5)
        for got, want in zip(mixture_rows.mixture_target_grad(lp, lp, pc, gate, rule),
                             mixture_rows.mixture_target_grad_torch(lp, lp, pc, gate, rule), strict=True):
            close(got, want, 1e-4)
    x = torch.randn(R, d, device="cuda", generator=gen).to(dtype)
    for floored in (True, False):
        close(l2_normalize.l2_normalize(x, floored), l2_normalize.l2_normalize_torch(x, floored)[0],
              1e-5 if dtype == torch.float32 else 2**-7)
    cutoff, scale = dropout_threshold(0.1) - DROPOUT_LEVELS // 2, dropout_scale(0.1)
    h = torch.randn(8, 1024, 1000, device="cuda", generator=gen).to(dtype)
    levels = torch.randint(-(2**15), 2**15, h.shape, device="cuda", generator=gen, dtype=torch.int16)
    for tanh in (False, True):
        close(dropout_fused.gelu_dropout(h, levels, cutoff, scale, tanh),
              dropout_fused.gelu_dropout_torch(h, levels, cutoff, scale, tanh),
              1e-5 if dtype == torch.float32 else 2**-7)
    from backends.torch import hashing
    from backends.torch.kernels import addresses, gate

    pre = torch.randn(R, 128, device="cuda", generator=gen).to(dtype)
    w, b = (torch.randn(128, device="cuda", generator=gen) / 12).to(dtype), torch.zeros(1, device="cuda").to(dtype)
    any_valid = valid.any(-1)
    close(gate.masked_gate(pre, w, b, any_valid, tanh=False, clip_when_empty=True, per_term=False),
          gate.masked_gate_torch(pre, w, b, any_valid, False, True, False), 1e-5 if dtype == torch.float32 else 2**-7)

    tokens = torch.randint(0, 20000, (8, 1024), device="cuda", generator=gen)
    for wrap in (False, True):
        assert torch.equal(addresses.addresses(tokens, 1, 32768, wrap),
                           hashing.bucket_of(hashing.context_hash(tokens, 1, int32_wraparound=wrap), 32768,
                                             int32_wraparound=wrap))
    stream = torch.randn(8, 1024, 1000, device="cuda", generator=gen)
    assert torch.equal(dropout_fused.add_dropout(stream, h, levels, cutoff, scale),
                       dropout_fused.add_dropout_torch(stream, h, levels, cutoff, scale))
