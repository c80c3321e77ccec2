"""The Triton kernels as a GPU would run them.

Without a GPU the kernel tests run under Triton's interpreter, which accepts some programs the compiler
rejects. The first test therefore compiles every kernel variant ahead of time for Hopper (sm_90) with
Triton's own toolchain (bundled ptxas; no device needed) and checks ptxas reports no register spills: the routing
kernels, the addresses, the gather_dot key gradient, the head loss's passes over 16-bit logits, dropout's mask alone
and fused with its neighbours, the memory read's row passes, the gate and the L2 normalisation.
The second runs the compiled kernels on a real CUDA device when one is present.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from backends.torch.kernels import torch_impl
from pcaf_core.routing import route_context

_AOT_SCRIPT = textwrap.dedent(
    """
    import os, re, subprocess, tempfile
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from backends.torch.kernels import dropout_fused as df
    from backends.torch.kernels import dropout_mask as dm
    from backends.torch.kernels import gate as gt
    from backends.torch.kernels import gather_grad as gg
    from backends.torch.kernels import addresses as ad
    from backends.torch.kernels import cache_rows as cr
    from backends.torch.kernels import head_softmax as hs
    from backends.torch.kernels import l2_normalize as l2
    from backends.torch.kernels import mixture_rows as mr
    from backends.torch.kernels import triton_impl as ti
    from pcaf_core.hashing import BUCKET_ADD, HASH_MULT

    assert not ti.INTERPRETED
    target = GPUTarget("cuda", 90, 32)
    ptxas = knobs.nvidia.ptxas.path

    def check(fn, sig, consts):
        sig = {**sig, **{k: "constexpr" for k in consts}}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                                options={"num_warps": 4})
        assert kernel.asm["cubin"], fn
        with tempfile.TemporaryDirectory() as scratch:  # ptxas reads a file; nothing is left behind
            ptx = os.path.join(scratch, "kernel.ptx")
            with open(ptx, "w") as fh:
                fh.write(kernel.asm["ptx"])
            report = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx, "-o", os.devnull],
                                    capture_output=True, text=True, check=True).stderr
        spills = [int(n) for n in re.findall(r"(\\d+) bytes spill", report)]
        assert spills and not any(spills), (fn, consts, report)
        print(fn.__name__, consts, re.search(r"Used (\\d+) registers", report).group(1), "registers")

    nt = {"addr_ptr": "*i64", "index_ptr": "*i64", "valid_ptr": "*i1", "T": "i32", "K": "i32",
          "num_buckets": "i32"}
    for hash_in in (False, True):
        for recent in (False, True):
            check(ti._nt_scan_kernel, nt, {"HASH": hash_in, "RECENT": recent, "MULT": HASH_MULT,
                                            "ADD": BUCKET_ADD, "BLOCK": 1024, "K_PAD": 16})
    # Integer arguments equal to 1 are specialised to constants at launch (K = 1; T = 1 launches nothing).
    check(ti._nt_scan_kernel, {k: v for k, v in nt.items() if k != "K"},
          {"K": 1, "HASH": False, "RECENT": True, "MULT": HASH_MULT, "ADD": BUCKET_ADD, "BLOCK": 32, "K_PAD": 1})
    ar = {"saddr_ptr": "*i64", "perm_ptr": "*i64", "index_ptr": "*i64", "valid_ptr": "*i1", "T": "i32",
          "K": "i32", "n_search_steps": "i32"}
    table = {"saddr_ptr": "*i64", "perm_ptr": "*i64", "table_ptr": "*i32", "N": "i32", "num_buckets": "i32",
             "K": "i32"}
    for k_pad in (1, 16, 64):  # K = 1: the narrowest slot tile
        block = ti._tile_block(k_pad, 4096)
        for flag in (False, True):
            check(ti._ar_select_kernel, ar, {"FIRST": flag, "BLOCK_P": block, "K_PAD": k_pad})
            check(ti._bucket_table_kernel, table, {"RECENT": flag, "BLOCK_P": block, "K_PAD": k_pad})
    # The gather_dot key gradient, at the widest feature tile and a narrow one (d = 224 and 16).
    segments = {"perm_ptr": "*i64", "crow_ptr": "*i64", "grad_ptr": "*fp32", "x_ptr": "*fp32", "out_ptr": "*fp32",
                "d": "i32", "C": "i32"}
    for block_d in (gg.MAX_BLOCK_D, 16):
        check(gg._segment_rows_kernel, segments, {"BLOCK_S": gg.BLOCK_SLOTS, "BLOCK_D": block_d})
    # The head loss's passes over 16-bit logits, for each 16-bit dtype.
    for half in ("bf16", "fp16"):
        check(hs._log_normaliser_kernel, {"logits_ptr": f"*{half}", "y_ptr": "*i64", "lse_ptr": "*fp32",
                                          "target_ptr": "*fp32", "N": "i32", "V": "i32", "stride": "i32"},
              {"BLOCK_N": hs.LSE_BLOCK_N, "BLOCK_V": hs.LSE_BLOCK_V})
        check(hs._logit_grad_kernel, {"logits_ptr": f"*{half}", "lse_ptr": "*fp32", "g_ptr": "*fp32", "y_ptr": "*i64",
                                      "dlogits_ptr": f"*{half}", "partial_ptr": "*fp32", "N": "i32", "V": "i32",
                                      "stride": "i32"},
              {"ROWS": hs.GRAD_ROWS, "BLOCK_N": hs.GRAD_BLOCK_N, "BLOCK_V": hs.GRAD_BLOCK_V})
    # Dropout's mask and scale, for each dtype it takes.
    for dtype in ("fp32", "bf16", "fp16"):
        check(dm._dropout_mask_kernel, {"x_ptr": f"*{dtype}", "levels_ptr": "*i16", "out_ptr": f"*{dtype}", "n": "i32",
                                        "cutoff": "i32", "scale": "fp32"},
              {"BLOCK": dm.BLOCK, "OUT_BF16": dtype == "bf16"})
    # The addresses, context orders 1 and 2, with and without the int32 wrap-around, int64 and int32 tokens.
    for tokens in ("i64", "i32"):
        for order in (1, 2):
            for wrap in (False, True):
                check(ad._addresses_kernel, {"tokens_ptr": f"*{tokens}", "out_ptr": "*i64", "N": "i32", "T": "i32",
                                             "num_buckets": "i32"}, {"ORDER": order, "WRAP": wrap, "BLOCK": ad.BLOCK})
    # The gate's last layer, sigmoid and mask at the paper's D = 128 (d = 256), each dtype, both GELU forms.
    for dtype in ("fp32", "bf16", "fp16"):
        _, block_r, block_d = gt._grid(8192, 128)
        rows = {"pre_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "any_ptr": "*u8", "R": "i32",
                "D": "i32"}
        for tanh in (False, True):
            consts = {"CLIP": gt.GATE_CLIP, "TANH": tanh, "PER_TERM": False, "BF16": dtype == "bf16",
                      "BLOCK_R": block_r, "BLOCK_D": block_d}
            check(gt._masked_gate_kernel, {**rows, "out_ptr": "*fp32"}, {**consts, "CLIP_WHEN_EMPTY": True})
            check(gt._masked_gate_grad_kernel, {"g_ptr": "*fp32", **rows, "d_pre_ptr": f"*{dtype}",
                                                "partial_ptr": "*fp32"}, consts)
    # Dropout fused with the GELU before it and the residual add after it.
    for dtype in ("fp32", "bf16", "fp16"):
        levels = {"levels_ptr": "*i16", "n": "i32", "cutoff": "i32", "scale": "fp32"}
        for tanh in (False, True):
            consts = {"TANH": tanh, "OUT_BF16": dtype == "bf16", "BLOCK": df.BLOCK}
            check(df._gelu_dropout_kernel, {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **levels}, consts)
            check(df._gelu_dropout_grad_kernel, {"g_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                                                 **levels}, consts)
        check(df._add_dropout_kernel, {"x_ptr": "*fp32", "y_ptr": f"*{dtype}", "out_ptr": "*fp32", **levels},
              {"Y_BF16": dtype == "bf16", "OUT_BF16": False, "BLOCK": df.BLOCK})
        check(df._add_dropout_grad_kernel, {"g_ptr": "*fp32", "out_ptr": f"*{dtype}", **levels},
              {"OUT_BF16": dtype == "bf16", "BLOCK": df.BLOCK})
    # The memory read's row passes, at K = 16, 32 and 64, and both mixture rules.
    for K in (16, 32, 64):
        _, block_r, block_k = cr._row_grid(8192, K)
        rows = {"BLOCK_R": block_r, "BLOCK_K": block_k}
        check(cr._cache_weights_kernel, {"scores_ptr": "*fp32", "valid_ptr": "*u8", "w_ptr": "*fp32", "R": "i32",
                                         "K": "i32"}, {"MASKED": cr.MASKED_SCORE, "FLOOR": cr.TINY, **rows})
        check(cr._cache_weights_grad_kernel, {"w_ptr": "*fp32", "g_ptr": "*fp32", "out_ptr": "*fp32", "R": "i32",
                                              "K": "i32"}, rows)
        hits = {"values_ptr": "*i64", "valid_ptr": "*u8", "targets_ptr": "*i64", "out_ptr": "*fp32", "R": "i32",
                "K": "i32"}
        for dots in ("fp32", "bf16", "fp16"):
            scores = {"index_ptr": "*i64", "rec_ptr": "*fp32", "R": "i32", "K": "i32", "sqrt_d": "fp32"}
            check(cr._candidate_scores_kernel, {"dots_ptr": f"*{dots}", "rho_ptr": "*fp32", "out_ptr": "*fp32",
                                                **scores}, {"DOTS_BF16": dots == "bf16", **rows})
            check(cr._candidate_scores_grad_kernel, {"g_ptr": "*fp32", "d_dots_ptr": f"*{dots}",
                                                     "partial_ptr": "*fp32", **scores},
                  {"DOTS_BF16": dots == "bf16", **rows})
        check(cr._target_cache_prob_kernel, {"w_ptr": "*fp32", **hits}, rows)
        check(cr._target_cache_prob_grad_kernel, {"g_ptr": "*fp32", **hits}, rows)
    for rule in (mr.FLOORED, mr.LOG):
        consts = {"RULE": rule, "FLOOR": mr.AR_PROB_FLOOR, "BLOCK": mr.ROW_BLOCK}
        check(mr._mixture_target_kernel, {"lp_ptr": "*fp32", "pc_ptr": "*fp32", "gate_ptr": "*fp32",
                                          "out_ptr": "*fp32", "R": "i32"}, consts)
        check(mr._mixture_target_grad_kernel, {**{f"{n}_ptr": "*fp32" for n in ("g", "lp", "pc", "gate", "d_lp",
                                                                                  "d_pc", "d_gate")}, "R": "i32"},
              consts)
    for per_term in (False, True):
        for clip_when_empty in (False, True):
            check(mr._mask_gate_kernel, {"raw_ptr": "*fp32", "any_ptr": "*u8", "out_ptr": "*fp32", "R": "i32"},
                  {"CLIP": mr.GATE_CLIP, "CLIP_WHEN_EMPTY": clip_when_empty, "PER_TERM": per_term,
                   "BLOCK": mr.ROW_BLOCK})
        check(mr._mask_gate_grad_kernel, {"g_ptr": "*fp32", "raw_ptr": "*fp32", "any_ptr": "*u8", "out_ptr": "*fp32",
                                          "R": "i32"}, {"CLIP": mr.GATE_CLIP, "PER_TERM": per_term,
                                                        "BLOCK": mr.ROW_BLOCK})
    # The L2 normalisation, both forms, at d = 256 (the paper's) and 224 (the 41M model's), each dtype.
    for dtype in ("fp32", "bf16", "fp16"):
        for d in (256, 224):
            block_d = triton.next_power_of_2(d)
            for floored in (True, False):
                consts = {"FLOORED": floored, "EPS": l2.L2_MAX_EPS if floored else l2.L2_RSQRT_EPS,
                          "OUT_BF16": dtype == "bf16", "BLOCK_N": l2.ROW_ELEMENTS // block_d, "BLOCK_D": block_d}
                check(l2._l2_normalize_kernel, {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "N": "i32", "d": "i32"},
                      consts)
                check(l2._l2_normalize_grad_kernel, {"x_ptr": f"*{dtype}", "g_ptr": f"*{dtype}",
                                                     "dx_ptr": f"*{dtype}", "N": "i32", "d": "i32"}, consts)
    print("compiled")
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("compiled")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device to run the compiled kernels; the same kernels run under TRITON_INTERPRET "
    "in test_torch_kernels.py and compile for sm_90 in test_kernels_compile_for_sm90_without_spills",
)
@pytest.mark.parametrize("policy", ["recent", "first"])
def test_compiled_kernels_on_cuda(policy: str) -> None:
    from backends.torch.kernels import triton_impl

    rng = np.random.default_rng(5)
    small = rng.integers(0, 13, size=(3, 300))
    for k in (1, 16, 40):
        nt = route_context(small, np.array([299]), k, policy)
        idx, valid = triton_impl.candidates_nt_triton(torch.from_numpy(small).cuda(), k, policy)
        np.testing.assert_array_equal(idx.cpu().numpy(), nt.index)
        np.testing.assert_array_equal(valid.cpu().numpy(), nt.valid)
        ar = route_context(small, np.arange(300), k, policy)
        idx, valid = triton_impl.candidates_ar_triton(torch.from_numpy(small).cuda(), k, policy)
        np.testing.assert_array_equal(idx.cpu().numpy(), ar.index)
        np.testing.assert_array_equal(valid.cpu().numpy(), ar.valid)
    big = torch.from_numpy(rng.integers(0, 2048, size=(8, 4096))).cuda()
    for k in (16, 32):
        for triton_fn, torch_fn in (
            (triton_impl.candidates_nt_triton, torch_impl.candidates_nt_torch),
            (triton_impl.candidates_ar_triton, torch_impl.candidates_ar_torch),
        ):
            got, want = triton_fn(big, k, policy), torch_fn(big, k, policy)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        table = triton_impl.bucket_table_triton(big, 2048, k, policy)
        assert torch.equal(table, torch_impl.bucket_table_torch(big, 2048, k, policy))
