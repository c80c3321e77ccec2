"""The memory read's row kernels (``backends.torch.kernels.cache_rows`` and ``mixture_rows``) against their ATen
forms, and a training step with them against one without.

- the candidates' scores from their products, forward and gradients, in each dtype of the products: the ATen
  form's values bit for bit (the same float32 operations in the same order), ρ's gradient to float32 rounding;
- cache weights and their gradient: empty rows, one valid slot, junk scores in empty slots, K that is not a power of
  two, row counts that do not fill a program;
- ``p_cache`` at the target and its gradient: targets held by several slots, by empty slots, by none;
- the mixture's two rules, forward and gradients: a floored mixture, λ and p_cache at 0, λ at the clip's bounds
  (where ``log(1 − λ)`` needs log1p's digits);
- the gate's mask and clip, each combination of the profiles' switches, bit for bit with the plain ops and the
  clamp's gradient;
- the ops' registrations (``torch.library.opcheck``) and one-line refusals;
- a full-AR and a next-token step of PCAF-context on the CUDA code paths: loss and every gradient equal with the
  kernels and without, in float32, under each profile's rule.

The kernels run compiled on CUDA and under ``TRITON_INTERPRET=1`` here (the conftest sets it without a GPU); exp
and log may differ from ATen's in the last float32 bit, so values are compared to float32 rounding.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from backends.torch import mixture
from backends.torch.kernels import cache_rows, mixture_rows
from backends.torch.kernels.ops import triton_enabled
from pcaf_core.mixture import AR_PROB_FLOOR, GATE_CLIP

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = [(1, 1), (7, 5), (300, 16), (130, 33)]
"""(R, K): one slot; K under a power of two; rows past one program (K=16: 128 rows a program); K past 32."""
RULES = [mixture_rows.FLOORED, mixture_rows.LOG]
# log(0) = -inf is the rule's value for a zero λ or p_cache; Triton's interpreter computes it in numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 2e-6) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * max(1.0, want.abs().max().item()))


def _slots(R: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(R, K, generator=g) * 4
    valid = torch.rand(R, K, generator=g) < 0.7
    valid[0, 0] = True
    if R > 2:
        valid[1] = False  # an empty row: weights and gradient 0
        valid[2] = False
        valid[2, -1] = True  # one valid slot: weight 1
    scores[~valid] = 1e30  # junk in empty slots never reaches the softmax
    values = torch.randint(0, 4, (R, K), generator=g)
    targets = torch.randint(0, 4, (R,), generator=g)
    return [t.to(DEVICE) for t in (scores, valid, values, targets)]


def test_kernels_run_as_triton_on_this_machine() -> None:
    assert triton_enabled(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R, K", SHAPES)
def test_candidate_scores_and_gradients_equal_the_aten_form(R: int, K: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    T = 40
    dots = (torch.randn(R, K, generator=gen) * 3).to(dtype).to(DEVICE)
    index = torch.randint(-1, T, (R, K), generator=gen).to(DEVICE)  # -1: an empty slot, read as position 0
    recency = torch.rand(T, generator=gen).to(DEVICE)
    rho = torch.tensor(0.7, device=DEVICE)
    sqrt_d = 16.0**0.5 if K % 2 else 224**0.5
    scores = cache_rows.candidate_scores(dots, index, recency, rho, sqrt_d)
    assert scores.dtype == torch.float32
    # The same float32 operations in the same order (the quotient rounded to the products' dtype first).
    assert torch.equal(scores, cache_rows.candidate_scores_torch(dots, index, recency, rho, sqrt_d))
    g = torch.randn(R, K, generator=gen).to(DEVICE)
    d_dots, d_rho = cache_rows.candidate_scores_grad(g, index, recency, sqrt_d, dtype)
    want_dots, want_rho = cache_rows.candidate_scores_grad_torch(g, index, recency, sqrt_d, dtype)
    assert d_dots.dtype == dtype and torch.equal(d_dots, want_dots)
    assert d_rho.shape == () and torch.allclose(d_rho, want_rho[0], rtol=1e-5, atol=1e-6)
    # And both against autograd's chain through the plain ops.
    leaf_dots, leaf_rho = dots.clone().requires_grad_(), rho.clone().requires_grad_()
    (leaf_dots / sqrt_d + leaf_rho * recency[index.clamp(min=0)]).backward(g)
    assert torch.equal(leaf_dots.grad, d_dots) and torch.allclose(leaf_rho.grad, d_rho, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("R, K", SHAPES)
def test_cache_weights_and_gradient_equal_the_aten_form(R: int, K: int) -> None:
    scores, valid, _, _ = _slots(R, K)
    w = cache_rows.cache_weights(scores, valid)
    want = cache_rows.cache_weights_torch(scores, valid)
    _close(w, want)
    assert torch.all(w[~valid] == 0)
    if R > 2:
        assert torch.all(w[1] == 0) and w[2, -1] == 1.0
    g = torch.randn(R, K, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _close(cache_rows.cache_weights_grad(want, g), cache_rows.cache_weights_grad_torch(want, g))


@pytest.mark.parametrize("R, K", SHAPES)
def test_target_cache_prob_and_gradient_equal_the_aten_form(R: int, K: int) -> None:
    scores, valid, values, targets = _slots(R, K)
    w = cache_rows.cache_weights_torch(scores, valid)
    pc = cache_rows.target_cache_prob(w, values, valid, targets)
    _close(pc, cache_rows.target_cache_prob_torch(w, values, valid, targets))
    g = torch.randn(R, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = cache_rows.target_cache_prob_grad(g, values, valid, targets)
    assert torch.equal(got, cache_rows.target_cache_prob_grad_torch(g, values, valid, targets))


def _mixture_inputs(rule: int, R: int = 200):
    g = torch.Generator().manual_seed(3 + rule)
    lp = torch.randn(R, generator=g) * 3 - 4
    pc = torch.rand(R, generator=g)
    gate = torch.rand(R, generator=g).clamp(GATE_CLIP, 1 - GATE_CLIP)
    pc[:4] = 0.0  # a cache miss
    gate[4:8] = 0.0  # an empty query's gate under corrected
    pc[8:10], gate[8:10] = 0.0, 0.0  # both
    gate[10], gate[11] = GATE_CLIP, 1 - GATE_CLIP  # the clip's bounds: log(1 - λ) needs log1p
    lp[12:16], pc[12:16] = -200.0, 0.0  # below the floor
    lp[16] = 0.0  # a certain head
    if rule == mixture_rows.FLOORED:
        gate[4:10] = GATE_CLIP  # the reference profiles clip an empty query's gate too
    grad = torch.randn(R, generator=g)
    return [t.to(DEVICE) for t in (lp, pc, gate, grad)]


@pytest.mark.parametrize("rule", RULES)
def test_mixture_target_and_gradients_equal_the_aten_form(rule: int) -> None:
    lp, pc, gate, g = _mixture_inputs(rule)
    out = mixture_rows.mixture_target(lp, pc, gate, rule)
    want = mixture_rows.mixture_target_torch(lp, pc, gate, rule)
    _close(out, want)
    if rule == mixture_rows.FLOORED:
        assert torch.all(out[12:16] == torch.log(torch.tensor(AR_PROB_FLOOR)))
    for got, ref in zip(mixture_rows.mixture_target_grad(g, lp, pc, gate, rule),
                        mixture_rows.mixture_target_grad_torch(g, lp, pc, gate, rule), strict=True):
        assert torch.all(torch.isfinite(ref))
        _close(got, ref, rtol=1e-5)


def test_the_log_rule_keeps_log1p_digits_at_the_gate_clip() -> None:
    lp = torch.zeros(2, device=DEVICE)
    gate = torch.tensor([GATE_CLIP, 2e-9], device=DEVICE)  # 1 - 2e-9 rounds to 1 in float32
    out = mixture_rows.mixture_target(lp, torch.zeros(2, device=DEVICE), gate, mixture_rows.LOG)
    torch.testing.assert_close(out, torch.log1p(-gate), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("per_term", [False, True])
@pytest.mark.parametrize("clip_when_empty", [False, True])
def test_mask_gate_and_gradient_equal_the_plain_ops(clip_when_empty: bool, per_term: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    raw = torch.rand(300, generator=gen)
    raw[:4] = torch.tensor([0.0, GATE_CLIP, 1 - GATE_CLIP, 1.0])  # the clip's bounds: its gradient passes at them
    raw[4:6] = torch.tensor([GATE_CLIP / 2, 1 - GATE_CLIP / 2])  # clipped: no gradient
    any_valid = torch.rand(300, generator=gen) < 0.8
    any_valid[:6] = True
    raw, any_valid = raw.to(DEVICE), any_valid.to(DEVICE)
    g = torch.randn(300, generator=gen).to(DEVICE)
    lam = mixture_rows.mask_gate(raw, any_valid, clip_when_empty, per_term)
    leaf = raw.clone().requires_grad_()
    want = mixture_rows.mask_gate_torch(leaf, any_valid, clip_when_empty, per_term)
    want.backward(g)
    assert torch.equal(lam, want.detach())
    assert torch.equal(mixture_rows.mask_gate_grad(g, raw, any_valid, per_term), leaf.grad)
    assert torch.equal(mixture_rows.mask_gate_grad_torch(g, raw, any_valid, per_term), leaf.grad)


def test_the_ops_registrations() -> None:
    scores, valid, values, targets = _slots(7, 5)
    w = cache_rows.cache_weights_torch(scores, valid)
    lp, pc, gate, g = _mixture_inputs(mixture_rows.LOG)
    ops = torch.ops.pcaf
    rec, rho = torch.rand(9, device=DEVICE), torch.tensor(0.5, device=DEVICE)
    index = values.clamp(max=8) - 1  # -1 .. 3: some empty slots
    cases = [(ops.candidate_scores, (scores.bfloat16(), index, rec, rho, 2.0)),
             (ops.candidate_scores_grad, (torch.ones_like(w), index, rec, 2.0, torch.bfloat16))]
    cases += [(ops.cache_weights, (scores, valid)), (ops.cache_weights_grad, (w, torch.ones_like(w))),
             (ops.target_cache_prob, (w, values, valid, targets)),
             (ops.target_cache_prob_grad, (g[:7].contiguous(), values, valid, targets))]
    cases += [(op, args) for rule in RULES for op, args in
              ((ops.mixture_target, (lp, pc, gate, rule)), (ops.mixture_target_grad, (g, lp, pc, gate, rule)))]
    any_valid = torch.rand(gate.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE) < 0.8
    for per_term in (False, True):
        cases += [(ops.mask_gate, (gate, any_valid, clip, per_term)) for clip in (False, True)]
        cases.append((ops.mask_gate_grad, (g, gate, any_valid, per_term)))
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_bad_inputs_are_refused_in_one_line() -> None:
    scores, valid, values, targets = _slots(7, 5)
    for bad in (scores.double(), scores.t()):
        with pytest.raises(ValueError, match="contiguous float32 rows") as err:
            cache_rows.cache_weights(bad, valid)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="contiguous ids and masks"):
        cache_rows.target_cache_prob(scores, values.t().contiguous().t(), valid, targets)
    with pytest.raises(ValueError, match="shape \\(7,\\)"):
        mixture_rows.mixture_target(targets.float(), targets.float()[:3], targets.float(), mixture_rows.LOG)


@pytest.mark.parametrize("profile, mode", [("reference_torch", "ar"), ("corrected", "ar"), ("corrected", "nt"),
                                           ("reference_jax", "nt")])
def test_a_training_step_with_the_kernels_equals_one_without(profile: str, mode: str, cuda_code_paths) -> None:
    from backends.torch import build_model
    from pcaf_core.config import MemoryConfig, ModelConfig
    from pcaf_core.profiles import get_profile

    model = ModelConfig(variant="pcaf", vocab_size=24, d_model=8, d_hidden=16, n_layers=1, kernel_size=3,
                        max_seq_len=32)
    memory = MemoryConfig(route="context", candidate_policy="recent", num_buckets=7, top_k=4, context_order=1)
    prof = get_profile(profile, dropout=0.0)
    torch.manual_seed(0)
    tokens = torch.randint(0, 6, (2, 17), device=DEVICE)  # few distinct tokens: many hits
    x, y = tokens[:, :-1], tokens[:, 1:]
    if mode == "nt":
        y = y[:, -1:]
    results = []
    for kernels in (True, False):
        net = build_model(model, memory, prof, seed=1, device=DEVICE).train()
        counted = mock.Mock(wraps=mixture_rows.mixture_target)
        with mock.patch.object(mixture, "kernels_by_default", return_value=kernels), \
                mock.patch.object(mixture_rows, "mixture_target", counted):
            out = net(x, y, mode, need_log_probs=False, need_predictions=False)
            out.loss.backward()
        assert counted.call_count == int(kernels)
        results.append((out.loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}))
    (loss_k, grads_k), (loss_a, grads_a) = results
    _close(loss_k, loss_a)
    assert grads_k.keys() == grads_a.keys() and "memory.key.weight" in grads_k and "gate.out.bias" in grads_k
    for name in grads_a:
        _close(grads_k[name], grads_a[name], rtol=1e-5)
