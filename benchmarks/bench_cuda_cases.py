"""The cases ``benchmarks.bench_cuda`` times on one GPU, and how each becomes a run config.

A :class:`GpuCase` names a model, mode, shape, precision and step kind (eager, inductor, CUDA graphs, or ``xla`` for
the JAX step); :func:`gpu_cases` lists the full set (or the ``--smoke`` stand-ins), and :func:`case_config` composes
each from the same Hydra rows as ``benchmarks.bench_models``.
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, replace

from benchmarks.bench_cuda_report import ATEN_PASSES
from pcaf_core.config import validate

SMOKE_SCALE = "smoke"
"""The scale a ``--smoke`` run builds its models at (experiments/conf/scale/smoke.yaml: d=16, h=32, one block, the
Transformers 2 heads and window 8; V=20,000 as the paper's, so the WikiText-2 batches fit): it checks the script,
and a paper-width model would only make that slower. Its rows record the widths (``d``, ``d_hidden``, ``layers``)."""


@dataclass(frozen=True)
class GpuCase:
    model: str
    mode: str
    T: int
    batch: int
    precision: str = "fp32"
    compile: str = "eager"  # a COMPILES label (torch), or "xla" (a JAX step)
    dropout: float = 0.1
    head_loss: str = "auto"  # train.head_loss
    backend: str = "torch"
    kernels: bool = True  # False: ATen's forms instead of the fused pcaf:: kernels (benchmarks.op_census.aten_forms)

    @property
    def label(self) -> str:
        """The row's model name: the model, and what sets the case apart from the model's main rows."""
        if self.backend == "jax":
            return f"{self.model} (JAX)"
        if not self.kernels:
            return f"{self.model}, {ATEN_PASSES}"
        return f"{self.model}, {self.head_loss} head" if self.head_loss != "auto" else self.model


WINDOWED_MODELS = ("local Transformer (FlexAttention)", "global-local Transformer (FlexAttention)",
                   "local Transformer (blocked SDPA)", "global-local Transformer (blocked SDPA)",
                   "local Transformer (masked dense SDPA)")
"""The windowed-attention cases (``benchmarks.bench_models.MODELS`` labels): FlexAttention over the window's block
mask (``model.attention_impl=banded``, what ``auto`` runs on CUDA), SDPA over query blocks and their windows' keys
(``blocked``), and the masked ``[T, T]`` SDPA they replace."""


def gpu_cases(smoke: bool = False) -> list[GpuCase]:
    """Full AR at 8,192 tokens a step (T=1024 batch 8, T=2048 batch 4); next-token at T=2048 with the paper
    row's batch 64 (PCAF) and the dense Transformer's batch 8, and the local and global-local Transformers with
    FlexAttention beside the masked local one at the ``wt2-nt-2048`` rows' batch 32, dropout matched; each fp32
    beside bf16, the PCAF cases eager, and also replayed as CUDA graphs (``cudagraphs``; the steps wait on kernel
    launches), some compiled without them (``inductor``); the T=1024 full-AR PCAF-context step also with a chunked
    head loss and on the JAX backend. ``smoke``: T=64 stand-ins of the eager full-AR and next-token cases, the
    chunked head and the JAX step (fp32 only: the JAX bf16 step is tests/test_jax_train.py's; here it would add
    a second XLA compile to every smoke run). The eager T=1024 full-AR PCAF-context step also runs in bf16 with
    ATen's forms instead of the fused ``pcaf::`` kernels (:data:`ATEN_PASSES`; bf16 only: the eager target it
    serves is bf16's), the step the kernels replace, so the two are timed side by side."""
    P, S, D = "PCAF-context", "PCAF-semantic (bucketed)", "dense Transformer (SDPA)"
    if smoke:
        base = [GpuCase(P, "ar", 64, 2), GpuCase(P, "ar", 64, 2, kernels=False),
                GpuCase(P, "ar", 64, 2, head_loss="chunked"),
                GpuCase(P, "ar", 64, 2, compile="xla", backend="jax"), GpuCase(P, "nt", 64, 4),
                GpuCase(D, "nt", 64, 2)]
        base += [GpuCase(m, "nt", 64, 2) for m in WINDOWED_MODELS]
    else:
        base = [GpuCase(P, "ar", 1024, 8), GpuCase(P, "ar", 1024, 8, kernels=False),
                GpuCase(P, "ar", 1024, 8, compile="inductor"),
                GpuCase(P, "ar", 1024, 8, compile="cudagraphs"),
                GpuCase(P, "ar", 1024, 8, head_loss="chunked"),
                GpuCase(P, "ar", 1024, 8, compile="cudagraphs", head_loss="chunked"),
                GpuCase(P, "ar", 1024, 8, compile="xla", backend="jax"),
                GpuCase(S, "ar", 1024, 8),
                GpuCase(S, "ar", 1024, 8, compile="cudagraphs"), GpuCase(P, "ar", 2048, 4),
                GpuCase(P, "ar", 2048, 4, compile="cudagraphs"), GpuCase(P, "nt", 2048, 64),
                GpuCase(P, "nt", 2048, 64, compile="inductor"), GpuCase(P, "nt", 2048, 64, compile="cudagraphs"),
                GpuCase(D, "nt", 2048, 8)]
        base += [GpuCase(m, "nt", 2048, 32) for m in WINDOWED_MODELS]
    return [replace(c, precision=p) for c in base for p in ("fp32", "bf16")
            if not (smoke and c.backend == "jax" and p == "bf16") and (c.kernels or p == "bf16")]


@functools.cache
def _fp32_config(cpu_case, backend: str, head_loss: str, scale: str):
    from benchmarks.bench_models import run_config

    return run_config(cpu_case, backend, (f"train.head_loss={head_loss}",), scale)


def case_config(case: GpuCase, cpu_case, scale: str = "paper"):
    """The composed run config of ``case`` (``cpu_case``: its ``benchmarks.bench_models`` case) at ``scale``: each
    row is composed once (a Hydra composition costs about half a second), in fp32, and a bf16 case is that config
    with ``train.precision=bf16`` (nothing else in a composition depends on the precision once it is not
    ``auto``), validated again. A fresh copy each call: :func:`device_config` edits it."""
    cfg = copy.deepcopy(_fp32_config(replace(cpu_case, precision="fp32"), case.backend, case.head_loss, scale))
    cfg.train.precision = cpu_case.precision
    return validate(cfg)


CPU_STAND_IN = "; a CPU stand-in for FlexAttention, which has no backward pass on a CPU"


def device_config(cfg, device: str) -> tuple[object, str]:
    """``cfg`` for ``device`` and a note for its policy label: on a CPU (``--smoke``) a FlexAttention case trains
    masked, since FlexAttention has no backward pass there, and its label says so."""
    if device == "cpu" and cfg.model.attention_impl == "banded":
        cfg.model.attention_impl = "masked"
        return cfg, CPU_STAND_IN
    return cfg, ""


def failure_row(case: GpuCase, section: str, err: Exception) -> dict:
    """A compiled case that did not run: its labels and the error's first line (the page lists them)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    print(f"[bench_cuda {section} {case.label} {case.mode} T={case.T} batch={case.batch} {case.precision} "
          f"{case.compile}] did not run: {message}", file=sys.stderr, flush=True)
    return {"section": section, "model": case.label, "mode": case.mode, "T": case.T, "batch": case.batch,
            "dtype": case.precision, "compile": case.compile, "error": message}


def windowed_cases(cases: list[GpuCase]) -> list[GpuCase]:
    """``--only-windowed``: the windowed-attention cases and the next-token dense SDPA ones they are set beside."""
    dense = "dense Transformer (SDPA)"
    return [c for c in cases if c.model in WINDOWED_MODELS or (c.model == dense and c.mode == "nt")]
