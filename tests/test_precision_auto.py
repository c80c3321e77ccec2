"""``train.precision=auto``: bf16 only where the hardware multiplies bf16 matrices, resolved before a run
starts so the saved config, the deviations and the record name the precision that actually ran."""

from __future__ import annotations

import pytest

from backends.jax import backend as jax_backend
from backends.torch import backend as torch_backend
from experiments.table_plan import compose_row
from pcaf_core import sysinfo
from pcaf_core.loop import run_training
from pcaf_core.results import read_metrics
from tests.bigram_backend import BigramBackend, markov_corpus, small_cfg


@pytest.mark.parametrize(("has_unit", "want"), [(True, "bf16"), (False, "fp32")])
def test_torch_auto_follows_the_cpus_bf16_matrix_unit(monkeypatch, has_unit: bool, want: str) -> None:
    monkeypatch.setattr(torch_backend, "cpu_has_bf16_matmul", lambda: has_unit)
    precision, why = torch_backend.auto_precision("cpu")
    assert precision == want and "bf16 matrix unit" in why
    assert torch_backend.TorchBackend("cpu").auto_precision()[0] == want


def test_jax_auto_is_float32_on_cpu_and_bf16_on_accelerators() -> None:
    assert jax_backend.auto_precision("cpu")[0] == "fp32"
    assert jax_backend.auto_precision("tpu")[0] == "bf16" and jax_backend.auto_precision("gpu")[0] == "bf16"


def test_cpu_flags_name_the_bf16_units(monkeypatch) -> None:
    monkeypatch.setattr(sysinfo, "cpu_flags", lambda: {"avx2", "fma", "amx_bf16", "amx_tile"})
    assert sysinfo.cpu_has_bf16_matmul()
    monkeypatch.setattr(sysinfo, "cpu_flags", lambda: {"avx2", "fma"})
    assert not sysinfo.cpu_has_bf16_matmul()
    # AVX-512 BF16 without AMX: bf16 products measured slower than float32, so it does not count
    monkeypatch.setattr(sysinfo, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_bf16"})
    assert not sysinfo.cpu_has_bf16_matmul()


@pytest.mark.parametrize("has_unit", [True, False])
def test_the_cpu_scale_resolves_auto_and_records_it(monkeypatch, has_unit: bool) -> None:
    monkeypatch.setattr(torch_backend, "cpu_has_bf16_matmul", lambda: has_unit)
    run = compose_row("main-303m", "pcaf_context_wt103_t1024", "cpu", "torch", ["backend.device=cpu"])[0]
    precision_lines = [d for d in run.deviations if d.startswith("train.precision:")]
    assert run.run.train.precision == run.cfg.train.precision == ("bf16" if has_unit else "fp32")
    if has_unit:  # a deviation from the paper's fp32, saying why
        assert precision_lines == ["train.precision: 'fp32' -> 'bf16' (scale=cpu; auto: this CPU has a bf16 "
                                   "matrix unit (AMX))"]
    else:  # the paper's own precision: nothing to record
        assert precision_lines == []


def test_the_loop_records_the_precision_auto_resolved_to(tmp_path) -> None:
    class Backend(BigramBackend):
        def auto_precision(self) -> tuple[str, str]:
            return "bf16", "test"

    cfg = small_cfg(precision="auto", steps=2)
    loop_record = run_training(cfg, Backend(), tmp_path, corpus=markov_corpus(), progress=False)
    assert loop_record.precision == "bf16" == read_metrics(tmp_path).precision
