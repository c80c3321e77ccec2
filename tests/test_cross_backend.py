"""Torch vs JAX on the same canonical weights and inputs (the one test file that imports both backends).

Every variant × {nt, ar} × {reference_jax, reference_torch, corrected} (the cache variants with each
route, semantic index and candidate policy): addresses and candidates exactly equal; log-probs, the
parametric head, target log-probs, loss, cache weights and gate within 1e-4 in float32 at the highest
matmul precision (``train.matmul_precision=highest`` on both backends); equal predictions. A ``gpu``-marked
case runs the same checks with both backends on one CUDA device (one PCAF variant per route, both modes).
Weights travel torch -> safetensors -> JAX -> safetensors -> torch with every parameter's bytes unchanged,
so one file serves both backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch

import backends.jax as jx
import backends.torch as tx
from backends.jax.precision import matmul_precision as jax_matmul_precision
from backends.torch.precision import matmul_precision as torch_matmul_precision
from pcaf_core.config import MODEL_VARIANTS
from pcaf_core.params import param_shapes
from tests.spec_helpers import PLAIN_CASES, RHO, configs, spec_params, window

PROFILES = ("reference_jax", "reference_torch", "corrected")
CROSS_CASES = [
    ("pcaf", "context", "dense", "topk_score"),
    ("pcaf", "context", "dense", "recent"),
    ("pcaf", "semantic", "dense", "first"),
    ("pcaf", "semantic", "bucketed", "topk_score"),
    ("pcaf", "hybrid", "dense", "topk_score"),
    ("pcaf_no_gate", "hybrid", "bucketed", "first"),
] + PLAIN_CASES


@pytest.fixture(autouse=True, scope="module")
def _torch_settings():
    """Tiny tensors: one intra-op thread; exact float32 matmuls on both sides (``highest``: no TF32 on a GPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch_matmul_precision("highest"), jax_matmul_precision("highest"):
        yield
    torch.set_num_threads(n)


def _np(x) -> np.ndarray:
    return (x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor)
            else np.asarray(x, dtype=np.float64))


def _close(a, b, what: str) -> None:
    np.testing.assert_allclose(_np(a), _np(b), rtol=1e-4, atol=1e-5, err_msg=what)


def _jax_device(kind: str):
    """JAX's first device of ``kind`` (``"cpu"`` or ``"gpu"``), None when JAX has none."""
    try:
        return jax.devices(kind)[0]
    except RuntimeError:
        return None


def _check_agreement(case, mode: str, profile_name: str, device: str = "cpu") -> None:
    """Torch and JAX forwards of ``case`` on the same canonical float32 weights and window, torch on ``device``
    (``"cpu"`` or ``"cuda"``) and JAX on its device of the same kind; asserts where each ran, then agreement."""
    model, memory, profile = configs(*case, profile=profile_name)
    params = {k: v.astype(np.float32) for k, v in spec_params(model, memory, profile, rho=RHO[profile_name]).items()}
    tokens, targets = window(20, mode)

    net = tx.load_canonical(tx.build_model(model, memory, profile), params).to(device).eval()
    with torch.no_grad():
        t_out = net(torch.tensor(tokens, device=device), torch.tensor(targets, device=device), mode)
    jax_device = _jax_device("gpu" if device == "cuda" else "cpu")
    with jax.default_device(jax_device):
        j_out = jx.build_model(model, memory, profile).apply(jx.to_variables(params, np.float32), jnp.asarray(tokens),
                                                             jnp.asarray(targets), mode)
    assert t_out.hidden.device.type == device and j_out.hidden.devices() == {jax_device}

    _close(j_out.hidden, t_out.hidden, "hidden")
    _close(j_out.param_log_probs, t_out.param_log_probs, "param_log_probs")
    _close(j_out.log_probs, t_out.log_probs, "log_probs")
    _close(j_out.target_log_prob, t_out.target_log_prob, "target_log_prob")
    _close(j_out.loss, t_out.loss, "loss")
    np.testing.assert_array_equal(np.asarray(j_out.prediction), t_out.prediction.cpu().numpy(), err_msg="prediction")
    if t_out.memory is None:
        assert j_out.memory is None
        return
    jm, tm = j_out.memory, t_out.memory
    np.testing.assert_array_equal(np.asarray(jm.addresses), tm.addresses.cpu().numpy(), err_msg="addresses")
    np.testing.assert_array_equal(np.asarray(jm.cand.index), tm.cand.index.cpu().numpy(), err_msg="candidate index")
    np.testing.assert_array_equal(np.asarray(jm.cand.valid), tm.cand.valid.cpu().numpy(), err_msg="candidate valid")
    assert tm.cand.valid.any()
    _close(jm.cache_weights, tm.cache_weights, "cache_weights")
    _close(jm.gate, tm.gate, "gate")
    _close(jm.p_cache, tm.p_cache, "p_cache")


# The fast tier (make test-fast) keeps one case per route and mode, the profiles rotated; the rest are slow.
_FAST_AGREE = {(CROSS_CASES[0], "nt", "reference_jax"), (CROSS_CASES[0], "ar", "corrected"),
               (CROSS_CASES[2], "nt", "corrected"), (CROSS_CASES[2], "ar", "reference_torch"),
               (CROSS_CASES[4], "nt", "reference_torch"), (CROSS_CASES[4], "ar", "reference_jax")}
AGREE_PARAMS = [pytest.param(c, m, p, id=f"{'-'.join(c)}-{m}-{p}",
                             marks=() if (c, m, p) in _FAST_AGREE else pytest.mark.slow)
                for c in CROSS_CASES for m in ("nt", "ar") for p in PROFILES]


@pytest.mark.parametrize(("case", "mode", "profile_name"), AGREE_PARAMS)
def test_torch_and_jax_agree(case, mode: str, profile_name: str) -> None:
    _check_agreement(case, mode, profile_name)


GPU_CASES = [  # one PCAF variant per route
    ("pcaf", "context", "dense", "recent"),
    ("pcaf", "semantic", "bucketed", "recent"),
    ("pcaf", "hybrid", "dense", "topk_score"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _jax_device("gpu") is None,
                    reason="needs a CUDA device that both torch and JAX (jax[cuda]) see; the same checks run on "
                           "the CPU in test_torch_and_jax_agree")
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(c))
def test_torch_and_jax_agree_on_one_cuda_device(case, mode: str) -> None:
    """Both backends on the first CUDA device at ``highest`` (the module's setting: no TF32 anywhere), so
    float32 means float32 on both and they agree as closely as on a CPU. Torch takes its CUDA code paths
    (the Triton candidate kernels, the segmented key gradient), JAX XLA:GPU's."""
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    _check_agreement(case, mode, "corrected", device="cuda")


def _tensor_bytes(path) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in safetensors.numpy.load_file(str(path)).items()}


@pytest.mark.parametrize("profile_name", PROFILES)
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_safetensors_round_trip_is_byte_exact(tmp_path, variant: str, profile_name: str) -> None:
    """torch -> file -> JAX -> file -> torch -> file: every parameter's bytes survive each hop."""
    model, memory, profile = configs(variant, "hybrid", profile=profile_name)
    expected = param_shapes(model, memory, profile)
    net = tx.build_model(model, memory, profile, seed=5)  # the profile's own init scheme
    first = tx.save_safetensors(tmp_path / "torch.safetensors", net)
    tree = jx.load_safetensors(first, expected)
    second = jx.save_safetensors(tmp_path / "jax.safetensors", tree, expected=expected)
    back = tx.load_safetensors(second, tx.build_model(model, memory, profile, seed=6))
    third = tx.save_safetensors(tmp_path / "torch2.safetensors", back)
    want = _tensor_bytes(first)
    assert set(want) == set(expected)
    assert _tensor_bytes(second) == want
    assert _tensor_bytes(third) == want
    for name, value in tx.to_canonical(back).items():  # and the rebuilt torch module holds them
        assert value.tobytes() == want[name], name


@pytest.mark.slow
def test_jax_init_loads_into_torch_and_agrees() -> None:
    """A JAX-initialised model (torch_default scheme) saved canonically runs identically in torch."""
    model, memory, profile = configs("pcaf", "hybrid", profile="reference_torch")
    jparams = jx.init_params(model, memory, profile, seed=11)
    canonical = jx.to_canonical(jx.to_variables(jparams), param_shapes(model, memory, profile))
    net = tx.load_canonical(tx.build_model(model, memory, profile), canonical).eval()
    tokens, targets = window(16, "nt")
    with torch.no_grad():
        t_out = net(torch.tensor(tokens), torch.tensor(targets), "nt")
    j_out = jax.jit(lambda p: jx.build_model(model, memory, profile).apply(
        jx.to_variables(p), jnp.asarray(tokens), jnp.asarray(targets), "nt"))(canonical)
    _close(j_out.log_probs, t_out.log_probs, "log_probs")
    np.testing.assert_array_equal(np.asarray(j_out.memory.cand.index), t_out.memory.cand.index.numpy())


GRAD_CASES = [
    (("pcaf", "hybrid", "dense", "topk_score"), "corrected", "ar"),
    (("pcaf", "hybrid", "bucketed", "recent"), "reference_jax", "nt"),
    (("pcaf_no_gate", "semantic", "dense", "first"), "reference_torch", "ar"),
    (("transformer_global_local", "context", "dense", "topk_score"), "reference_jax", "ar"),
    (("linear_attention", "context", "dense", "topk_score"), "reference_torch", "nt"),
]


@pytest.mark.parametrize(("case", "profile_name", "mode"), GRAD_CASES,
                         ids=[f"{c[0]}-{p}-{m}" for c, p, m in GRAD_CASES])
@pytest.mark.slow
def test_torch_and_jax_gradients_agree(case, profile_name: str, mode: str) -> None:
    """The training signal: d loss / d every canonical parameter, float64, evaluation mode (no dropout)."""
    model, memory, profile = configs(*case, profile=profile_name)
    params = spec_params(model, memory, profile, rho=RHO[profile_name])
    tokens, targets = window(16, mode)

    net = tx.load_canonical(tx.build_model(model, memory, profile, dtype=torch.float64), params).eval()
    out = net(torch.tensor(tokens), torch.tensor(targets), mode, need_log_probs=False, need_predictions=False)
    out.loss.backward()
    with torch.no_grad():  # the gradients in the canonical layouts: put them where the weights were
        for p in net.parameters():  # unused parameters (the no-gate model's gate) get no gradient: 0
            p.copy_(torch.zeros_like(p) if p.grad is None else p.grad)
    t_grads = tx.to_canonical(net)

    with jax.enable_x64(True):
        jnet = jx.build_model(model, memory, profile, dtype=jnp.float64)

        def loss(p):
            return jnet.apply({"params": p}, jnp.asarray(tokens), jnp.asarray(targets), mode,
                              need_log_probs=False, need_predictions=False).loss

        grads = jax.jit(jax.grad(loss))(jx.to_variables(params, jnp.float64)["params"])
        j_grads = jx.to_canonical(grads, param_shapes(model, memory, profile))
    assert list(j_grads) == list(t_grads)
    for name, g in t_grads.items():
        np.testing.assert_allclose(j_grads[name], g, rtol=1e-6, atol=1e-10, err_msg=name)
    # The comparison is informative: the gradient reaches every parameter the forward uses. (In NT a
    # single query per window may find no target in its cache, and the reference NT floor then cuts the
    # memory's gradient, so there only the backbone and head are required to receive one.)
    used = [n for n in t_grads if not (model.variant == "pcaf_no_gate" and n.startswith("gate."))
            and (mode == "ar" or not n.startswith(("memory.", "gate.")))]
    assert all(np.abs(t_grads[n]).max() > 0 for n in used), [n for n in used if not np.abs(t_grads[n]).max()]
