"""Training on the CUDA code paths equals training on the CPU's: every ``pcaf::`` kernel an eager CUDA step takes
(candidates, gathered scores and their key gradient, the head's 16-bit passes, dropout alone and fused with its
neighbours, the L2 normalisation, the memory read's row passes), run on CPU tensors through Triton's interpreter
(``benchmarks.op_census.cuda_code_paths``), against the ATen paths a CPU step takes, over a few AdamW steps of
PCAF-context with dropout 0.1 from one seed.

Each kernel has its own tests; this one checks that together, wired into the model, backward pass and optimiser,
they train the same model: float32 losses equal to float32 rounding, bf16 autocast ones to bfloat16 rounding.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from backends.torch import cpu_gemm
from backends.torch.backend import TorchBackend
from backends.torch.layers import ConvBlock
from benchmarks.op_census import cuda_code_paths
from experiments.table_plan import compose_row

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = 12


def _losses(precision: str, kernels: bool) -> list[float]:
    overrides = ["train.mode=ar", "train.seq_len=32", "train.batch_size=4", "data.max_vocab=64",
                 f"train.precision={precision}"]
    cfg = compose_row("wt2-nt-1024", "pcaf_context", "smoke", "torch", overrides)[0].run
    assert cfg.profile.dropout > 0
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 12, (4, 32)), rng.integers(0, 12, (4, 32))) for _ in range(STEPS)]  # many hits
    paths = cuda_code_paths() if kernels else mock.patch.object(cpu_gemm, "onednn_on_this_cpu", lambda: False)
    # Products through ATen both ways (the CPU's oneDNN products round differently), the conv as on CUDA.
    with paths, mock.patch.object(cpu_gemm, "onednn_on_this_cpu", lambda: False):
        backend = TorchBackend("cpu")
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
