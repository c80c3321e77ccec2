"""``benchmarks/op_census``: the eager step's ops on the CUDA code paths, counted on a CPU tensor."""

from __future__ import annotations

import pytest

from benchmarks import op_census

pytestmark = pytest.mark.slow  # a paper-shape model, bf16 products in this CPU's scalar fallback: about 5 s


@pytest.fixture(scope="module")
def counts():
    return {p: op_census.census(precision=p, T=16, batch=1) for p in ("bf16", "fp32")}


def test_the_command_line_s_count_without_the_kernels_is_the_same(counts) -> None:
    """``python -m benchmarks.op_census`` counts with the ``pcaf::`` ops as shapes (no Triton interpreter)."""
    for precision, count in counts.items():
        assert op_census.census(precision=precision, T=16, batch=1, kernels=False) == count


def test_the_census_takes_the_cuda_code_paths(counts) -> None:
    for count in counts.values():
        assert count["pcaf::ar_candidates"] == 1  # the Triton candidate kernel, not the CPU's selection
        assert count["pcaf::gather_dot_grad_y"] == 1  # the segmented key gradient
        assert "pcaf::onednn_linear" not in count  # products through ATen, as on CUDA
        assert count["aten::mm"] > 0
        assert not any(name in count for name in ("aten::view", "aten::detach", "aten::empty_like"))
    assert counts["bf16"]["pcaf::head_log_normaliser"] == 1  # the head's kernels over 16-bit logits
    for count in counts.values():  # dropout: the draw, then one kernel each way, alone or fused with a neighbour
        fused = count["pcaf::gelu_dropout"] + count["pcaf::add_dropout"]
        assert count["pcaf::gelu_dropout"] == 3 and count["pcaf::add_dropout"] == 2  # the blocks' and the head's
        assert count["pcaf::dropout_mask"] + 2 * fused == 2 * count["aten::randint"] > 0


def test_a_bf16_step_casts_its_weights_in_one_copy_each_way(counts) -> None:
    assert counts["bf16"]["aten::_foreach_copy_"] == 2
    assert "aten::_foreach_copy_" not in counts["fp32"]


def test_main_prints_the_total_and_the_most_frequent_ops(capsys: pytest.CaptureFixture[str]) -> None:
    assert op_census.main(["--precision", "fp32", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PCAF-context ar fp32, eager, CUDA code paths: ") and lines[0].endswith(" ops a step")
    assert len(lines) == 4 and all(int(line.split()[0]) > 0 for line in lines[1:])


def test_the_memory_reads_passes_are_one_kernel_each_way(counts) -> None:
    for count in counts.values():
        for op in ("candidate_scores", "cache_weights", "target_cache_prob", "mixture_target"):
            assert count[f"pcaf::{op}"] == count[f"pcaf::{op}_grad"] == 1
        assert count["pcaf::l2_normalize"] == count["pcaf::l2_normalize_grad"] == 2  # the keys and the queries
        assert count["pcaf::addresses"] == 1 and "aten::remainder" not in count
        assert count["pcaf::masked_gate"] == count["pcaf::masked_gate_grad"] == 1 and "aten::sigmoid" not in count
    # The softmax's and the mixture's ATen ops are gone (fp32 logits keep them in the head loss).
    assert "aten::amax" not in counts["bf16"] and "aten::log" not in counts["bf16"]


def test_another_profile_is_counted_with_its_own_switches() -> None:
    """The benchmark's reference_torch trains with dropout 0.1; corrected without dropout."""
    corrected = op_census.census(precision="fp32", T=16, batch=1, profile="corrected")
    reference = op_census.census(precision="fp32", T=16, batch=1)
    assert "aten::randint" not in corrected and reference["aten::randint"] > 0  # dropout's draws
    assert corrected["pcaf::mixture_target"] == reference["pcaf::mixture_target"] == 1


def test_the_aten_passes_step_takes_no_fused_kernel(counts) -> None:
    """``fused=False`` (bench_cuda's ``ATen passes`` case): no fused ``pcaf::`` kernel, the candidate kernel and the
    segmented key gradient still, and more ops than the fused step."""
    aten = op_census.census(precision="bf16", T=16, batch=1, fused=False)
    assert {name for name in aten if name.startswith("pcaf::")} == {"pcaf::ar_candidates", "pcaf::gather_dot_grad_y"}
    assert sum(aten.values()) > sum(counts["bf16"].values()) + 40
