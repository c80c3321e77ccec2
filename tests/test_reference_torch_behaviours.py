"""The reference PyTorch code's NT loss and NT gate, pinned by hand-computed cases in the spec and both backends.

* ``nt_loss_renormalise``: the reference feeds the unnormalised log-mixture to ``F.cross_entropy``, whose
  log-softmax re-normalises it; the NT loss (training and evaluation) is that cross-entropy.
* ``nt_gate_per_term_clamp``: in NT the reference uses ``log1p(-min(λ, 1-1e-5))`` on the parametric term and
  ``log(max(λ, 1e-5))`` on the cache term, so an empty query (λ = 0) keeps parametric weight exactly 1.
  Its full-AR path clips both sides, which the spec's two-sided clip already is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

from backends.jax import build_model as build_jax
from backends.jax import mixture as jax_mixture
from backends.jax import to_variables
from backends.torch import mixture as torch_mixture
from backends.torch.models import build_model as build_torch
from backends.torch.weights import load_canonical
from pcaf_core import hashing, mixture, reference
from pcaf_core.params import init_params
from pcaf_core.profiles import get_profile
from tests.spec_helpers import tiny_memory, tiny_model

V_LARGE = 1000


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _case(vocab: int, seed: int = 0):
    """A reference_torch PCAF-context model and NT windows whose last token recurs (so buckets are occupied)."""
    model = tiny_model("pcaf", vocab=vocab)
    memory = tiny_memory("context", num_buckets=8, candidate_policy="recent")
    profile = get_profile("reference_torch")
    params = init_params(model, memory, profile, seed=seed)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 12, (4, 24))
    # Row 1: one repeated token, then a last token in another bucket, so that NT query is empty.
    addr = hashing.addresses(np.arange(vocab)[None, :], memory.context_order, memory.num_buckets)[0]
    tokens[1] = 3
    tokens[1, -1] = next(v for v in range(4, vocab) if addr[v] != addr[3])
    targets = rng.integers(3, vocab, 4)
    return model, memory, profile, params, tokens, targets


# --------------------------------------------------------------------------- the NT gate, per term


GATES = np.array([[0.0], [4e-6], [0.3], [1.0 - 2e-6]])  # [B=4, Q=1]: empty, tiny, ordinary, saturated


def _hand_mixture(param_lp: np.ndarray, p_cache: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``log((1 - min(λ, 1-1e-5))·p + max(λ, 1e-5)·max(p_cache, 1e-6))``, written out in probabilities."""
    keep = 1.0 - np.minimum(gate, 1.0 - 1e-5)
    lam = np.maximum(gate, 1e-5)
    return np.log(keep[..., None] * np.exp(param_lp) + lam[..., None] * np.maximum(p_cache, 1e-6))


def _hand_inputs(vocab: int = 7):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 1, vocab))
    param_lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    p_cache = np.zeros((4, 1, vocab))
    p_cache[:, 0, 2], p_cache[:, 0, 5] = 0.75, 0.25
    p_cache[0] = 0.0  # the empty query has no cache mass
    return param_lp, p_cache


def test_nt_gate_per_term_matches_the_hand_formula_in_spec_torch_and_jax(x64):
    param_lp, p_cache = _hand_inputs()
    want = _hand_mixture(param_lp, p_cache, GATES)
    spec = mixture.mixture_log_probs(param_lp, p_cache, GATES, nt_floor=True, gate_per_term=True)
    np.testing.assert_allclose(spec, want, rtol=1e-13)
    t = torch_mixture.mixture_log_probs(torch.tensor(param_lp), torch.tensor(p_cache), torch.tensor(GATES),
                                        nt_floor=True, gate_per_term=True)
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-13)
    j = jax_mixture.mixture_log_probs(jnp.asarray(param_lp), jnp.asarray(p_cache), jnp.asarray(GATES),
                                      nt_floor=True, gate_per_term=True)
    np.testing.assert_allclose(np.asarray(j), want, rtol=1e-13)
    # The empty query: parametric weight exactly 1, so the mixture exceeds the parametric head by
    # log(1 + 1e-11/p) on every entry, where the two-sided clip would scale it by (1 - 1e-5).
    two_sided = mixture.mixture_log_probs(param_lp, p_cache, np.clip(GATES, 1e-5, 1 - 1e-5), nt_floor=True)
    np.testing.assert_allclose(spec[0] - two_sided[0], -np.log1p(-1e-5), rtol=1e-4)
    assert (spec[0] > param_lp[0]).all()


def test_nt_gate_per_term_target_entries_agree_with_the_vocabulary_form(x64):
    param_lp, p_cache = _hand_inputs()
    targets = np.array([[2], [0], [5], [6]])
    want = np.take_along_axis(_hand_mixture(param_lp, p_cache, GATES), targets[..., None], -1)[..., 0]
    spec = mixture.target_log_prob(param_lp, p_cache, GATES, targets, nt_floor=True, ar_floor=True, mode="nt",
                                   gate_per_term=True)
    np.testing.assert_allclose(spec, want, rtol=1e-13)
    lp_y = np.take_along_axis(param_lp, targets[..., None], -1)[..., 0]
    pc_y = np.take_along_axis(p_cache, targets[..., None], -1)[..., 0]
    t = torch_mixture.target_log_prob(torch.tensor(lp_y), torch.tensor(pc_y), torch.tensor(GATES), nt_floor=True,
                                      ar_floor=True, mode="nt", gate_per_term=True)
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-13)
    j = jax_mixture.target_log_prob(jnp.asarray(lp_y), jnp.asarray(pc_y), jnp.asarray(GATES), nt_floor=True,
                                    ar_floor=True, mode="nt", gate_per_term=True)
    np.testing.assert_allclose(np.asarray(j), want, rtol=1e-13)


def test_reference_torch_gate_is_per_term_in_nt_and_two_sided_in_ar():
    prof = get_profile("reference_torch")
    assert mixture.mixture_rule(prof, "nt").gate_per_term and not mixture.mixture_rule(prof, "ar").gate_per_term
    for name in ("reference_jax", "corrected"):
        assert not mixture.mixture_rule(get_profile(name), "nt").gate_per_term
    model, memory, profile, params, tokens, targets = _case(40)
    ar = reference.forward(params, tokens, model, memory, profile, "ar", np.roll(tokens, -1, axis=1))
    empty = ~ar.memory.cand.valid.any(-1)
    assert empty.any() and np.allclose(ar.memory.gate[empty], 1e-5)  # AR: masked, then clipped (both sides)
    nt = reference.forward(params, tokens, model, memory, profile, "nt", targets)
    empty = ~nt.memory.cand.valid.any(-1)
    assert empty.any() and (nt.memory.gate[empty] == 0).all()  # NT: masked only; each term clamps itself


# --------------------------------------------------------------------------- the re-normalised NT loss


def test_spec_nt_loss_is_the_log_softmax_of_the_log_mixture():
    model, memory, profile, params, tokens, targets = _case(V_LARGE)
    out = reference.forward(params, tokens, model, memory, profile, "nt", targets)
    mix = out.log_probs[:, 0]  # [B, V], unnormalised
    lse = np.log(np.exp(mix).sum(-1))
    np.testing.assert_allclose(out.target_log_prob[:, 0], mix[np.arange(4), targets] - lse, rtol=1e-12)
    # The re-normalisation is what the switch changes: by log(mass), λ·1e-6·(V - distinct) to first order.
    plain = mixture.target_log_prob(out.param_log_probs, out.memory.p_cache, out.memory.gate, targets[:, None],
                                    nt_floor=True, ar_floor=True, mode="nt", gate_per_term=True)[:, 0]
    np.testing.assert_allclose(plain - out.target_log_prob[:, 0], lse, rtol=1e-9, atol=1e-14)
    hit = out.memory.cand.valid[:, 0].any(-1)
    assert hit.any() and (lse[hit] > 1e-5).all()


def _torch_net(model, memory, profile, params):
    net = build_torch(model, memory, profile, dtype=torch.float64)
    load_canonical(net, params)
    return net.eval()


@pytest.mark.parametrize("training_path", [False, True], ids=["evaluation", "training"])
def test_torch_nt_loss_equals_cross_entropy_over_the_unnormalised_log_mixture(training_path: bool):
    model, memory, profile, params, tokens, targets = _case(V_LARGE)
    net = _torch_net(model, memory, profile, params)
    tok, tgt = torch.tensor(tokens), torch.tensor(targets)
    with torch.no_grad():
        full = net(tok, tgt, "nt")
        out = net(tok, tgt, "nt", need_log_probs=False, need_predictions=False) if training_path else full
    ce = F.cross_entropy(full.log_probs[:, 0], tgt)
    assert abs(float(out.loss) - float(ce)) < 1e-6
    unnormalised_nll = -full.log_probs[:, 0].gather(-1, tgt[:, None]).mean()
    assert float(ce - unnormalised_nll) > 1e-5  # the switch is visible at this V: the test can fail
    ref = reference.forward(params, tokens, model, memory, profile, "nt", targets)
    np.testing.assert_allclose(float(out.loss), ref.loss, rtol=1e-10)


def test_torch_renormalised_loss_backpropagates_like_cross_entropy():
    model, memory, profile, params, tokens, targets = _case(V_LARGE, seed=1)
    net = _torch_net(model, memory, profile, params)
    tok, tgt = torch.tensor(tokens), torch.tensor(targets)
    net(tok, tgt, "nt", need_log_probs=False, need_predictions=False).loss.backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    F.cross_entropy(net(tok, tgt, "nt").log_probs[:, 0], tgt).backward()
    for name, p in net.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("training_path", [False, True], ids=["evaluation", "training"])
def test_jax_nt_loss_equals_cross_entropy_over_the_unnormalised_log_mixture(x64, training_path: bool):
    model, memory, profile, params, tokens, targets = _case(V_LARGE)
    net = build_jax(model, memory, profile, dtype=jnp.float64)
    variables = to_variables(params, jnp.float64)
    full = net.apply(variables, jnp.asarray(tokens), jnp.asarray(targets), "nt")
    out = (net.apply(variables, jnp.asarray(tokens), jnp.asarray(targets), "nt", need_log_probs=False,
                     need_predictions=False) if training_path else full)
    ce = optax.softmax_cross_entropy_with_integer_labels(full.log_probs[:, 0], jnp.asarray(targets)).mean()
    assert abs(float(out.loss) - float(ce)) < 1e-6
    ref = reference.forward(params, tokens, model, memory, profile, "nt", targets)
    np.testing.assert_allclose(float(out.loss), ref.loss, rtol=1e-10)


def test_only_reference_torch_renormalises():
    assert mixture.mixture_rule(get_profile("reference_torch"), "nt").renormalise
    assert not mixture.mixture_rule(get_profile("reference_torch"), "ar").renormalise
    for name in ("reference_jax", "corrected"):
        assert not mixture.mixture_rule(get_profile(name), "nt").renormalise
