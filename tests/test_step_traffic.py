"""``benchmarks/step_traffic``: the bytes and FLOPs each op of an eager step is charged, the floors they give, and the
step counted on the CUDA code paths of a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import step_traffic
from benchmarks.common import write_csv
from benchmarks.step_traffic import OpTraffic


def _charged(fn) -> list[OpTraffic]:
    mode = step_traffic.traffic_mode()
    with mode:
        fn()
    return mode.ops


def test_a_product_is_charged_its_operands_result_and_flops() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    (op,) = _charged(lambda: torch.mm(a, b))
    assert (op.name, op.read, op.written, op.flops, op.dtype) == ("aten::mm", (64 * 32 + 32 * 16) * 4, 64 * 16 * 4,
                                                                  2 * 64 * 32 * 16, "fp32")
    a16, b16 = a.bfloat16(), b.bfloat16()
    (op,) = _charged(lambda: torch.mm(a16, b16))
    assert op.dtype == "bf16" and op.read == (64 * 32 + 32 * 16) * 2


def test_in_place_ops_read_and_write_what_they_update_and_copies_only_write() -> None:
    x, y = torch.randn(100), torch.randn(100)
    (op,) = _charged(lambda: x.mul_(y))
    assert (op.read, op.written) == (800, 400)
    (op,) = _charged(lambda: x.copy_(y))
    assert (op.read, op.written) == (400, 400)
    xs, ys = [torch.randn(10), torch.randn(30)], [torch.randn(10), torch.randn(30)]
    (op,) = _charged(lambda: torch._foreach_copy_(xs, ys))
    assert (op.read, op.written) == (160, 160)
    (op,) = _charged(lambda: torch._foreach_mul_(xs, 2.0))
    assert (op.read, op.written) == (160, 160)


def test_fills_and_draws_read_nothing_and_gathers_read_their_rows() -> None:
    x = torch.randn(1000, 8)
    (op,) = _charged(lambda: torch.zeros_like(x))
    assert (op.read, op.written) == (0, 32_000)
    (op,) = _charged(lambda: torch.randint(0, 5, (50,)))
    assert op.read == 0
    index = torch.arange(10)
    (op,) = _charged(lambda: torch.index_select(x, 0, index))
    assert (op.read, op.written) == (10 * 8 * 4 + 10 * 8, 10 * 8 * 4)  # ten rows and the index, not the table
    weight = torch.randn(20_000, 4)
    (op,) = _charged(lambda: torch.nn.functional.embedding(index, weight))
    assert op.read == 10 * 4 * 4 + 80


def test_views_and_allocations_are_not_charged() -> None:
    x = torch.randn(4, 6)
    assert _charged(lambda: (x.view(6, 4), x.t(), torch.empty_like(x))) == []


def test_the_fused_optimiser_reads_its_gradients_without_writing_them() -> None:
    p = torch.nn.Parameter(torch.randn(1000))
    p.grad = torch.randn(1000)
    opt = torch.optim.AdamW([p], fused=True)
    opt.step()  # the state exists
    ops = [o for o in _charged(opt.step) if o.name == "aten::_fused_adamw_"]
    assert len(ops) == 1
    assert ops[0].read == 4 * 4000 + 4  # param, grad, both moments and the step count
    assert ops[0].written == 3 * 4000  # param and both moments


def test_floors_take_the_longer_of_flops_and_bytes() -> None:
    peaks, bandwidth = {"fp32": 1000.0, "bf16": 4000.0}, 100.0  # GFLOP/s, GB/s
    gemm = OpTraffic("aten::mm", 1_000_000, 0, 4_000_000_000, "bf16")  # 1 ms of FLOPs, 0.01 ms of bytes
    copy = OpTraffic("aten::add", 150_000, 50_000, 0, "")  # 2e5 bytes: 0.002 ms
    assert step_traffic.op_floor_ms(gemm, peaks, bandwidth) == pytest.approx(1.0)
    assert step_traffic.op_floor_ms(copy, peaks, bandwidth) == pytest.approx(0.002)
    total = step_traffic.summary([gemm, copy, copy], peaks, bandwidth)
    assert total["floor_ms"] == pytest.approx(1.004) and total["gemm_floor_ms"] == pytest.approx(1.0)
    assert total["bytes_floor_ms"] == pytest.approx(0.004) and total["ops"] == 3 and total["gflop"] == 4.0
    rows = step_traffic.by_op([copy, gemm, copy], peaks, bandwidth)
    assert [(r["op"], r["count"]) for r in rows] == [("aten::mm", 1), ("aten::add", 2)]
    assert rows[1]["read_mb"] == 0.3 and rows[1]["floor_ms"] == pytest.approx(0.004)
    assert "floor_ms" not in step_traffic.by_op([copy])[0]


@pytest.fixture(scope="module")
def counted() -> dict[tuple[str, bool], list[OpTraffic]]:
    return {(p, fused): step_traffic.count_step(p, T=16, batch=1, fused=fused) for p in ("bf16", "fp32")
            for fused in (True, False)}


def test_the_fused_step_moves_fewer_bytes_in_fewer_ops(counted) -> None:
    for precision in ("bf16", "fp32"):
        fused, aten = counted[(precision, True)], counted[(precision, False)]
        assert len(fused) < len(aten)
        assert sum(o.read + o.written for o in fused) < sum(o.read + o.written for o in aten)
        # The same products, but for the gate's one-column layer, which is inside the gate's kernel: uncounted.
        gate_layer = 3 * 2 * 16 * 128  # forward and two gradient products of [16, 128] @ [128, 1]
        assert sum(o.flops for o in aten) - sum(o.flops for o in fused) == gate_layer
    names = {o.name for o in counted[("bf16", True)]}
    assert {"pcaf::head_log_normaliser", "pcaf::head_logit_grad", "pcaf::masked_gate"} <= names
    # The head's three products at V = 20,000, h = 1,000 over 16 positions, in bf16 under autocast.
    head = [o for o in counted[("bf16", True)] if o.flops == 2 * 16 * 1000 * 20_000]
    assert len(head) == 3 and {o.dtype for o in head} == {"bf16"}
    assert {o.dtype for o in counted[("fp32", True)] if o.flops} == {"fp32"}


def test_the_custom_ops_as_shapes_dispatch_what_their_kernels_do(counted) -> None:
    """With each ``pcaf::`` op giving zeros of its outputs' shapes (the command line's count on a CPU), the step
    dispatches the same ops, charged the same bytes and FLOPs, as with the kernels run under Triton's interpreter."""
    for (precision, fused), ops in counted.items():
        assert step_traffic.count_step(precision, T=16, batch=1, fused=fused, kernels=False) == ops
    # The next-token step's own ops (the receptive field's gathers, the row kernels), once.
    assert (step_traffic.count_step("bf16", T=16, batch=1, mode="nt", kernels=False)
            == step_traffic.count_step("bf16", T=16, batch=1, mode="nt"))


def test_main_prints_floors_at_a_runs_rates(tmp_path: Path, capsys, monkeypatch) -> None:
    def count(*args, **kwargs):
        assert (tmp_path / "bandwidth.csv").exists(), "the rates are read before the step is counted"
        assert kwargs["kernels"] is False
        return [OpTraffic("aten::mm", 10**9, 0, 10**12, "bf16")]

    monkeypatch.setattr(step_traffic, "count_step", count)
    with pytest.raises(SystemExit, match="bandwidth.csv is missing"):
        write_csv(tmp_path / "gemm.csv", [{"gemm": "head", "dtype": d, "gflops": g}
                                          for d, g in (("fp32", 50_000), ("bf16", 500_000))])
        step_traffic.main(["--bench-dir", str(tmp_path)])
    write_csv(tmp_path / "bandwidth.csv", [{"op": "copy", "dtype": "bf16", "mb": 1000, "ms": 1, "gb_per_s": 2000}])
    assert step_traffic.main(["--bench-dir", str(tmp_path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "1.0 GB read" in out and "floor 2.0 ms" in out and "aten::mm" in out  # 1 TFLOP at 500 TFLOP/s
