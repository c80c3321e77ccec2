"""Windowed attention as a blocked band through SDPA (``model.attention_impl=blocked``,
:func:`backends.torch.window_attention.blocked_window_attention`): values and gradients against the masked SDPA
path on whole windows and on a next-token layer's query rows, dropout on the attention weights at its rate, no
``[T, T]`` array, and a next-token training step of a ``blocked`` model against the masked full window.
Everything runs on a CPU: SDPA has a backward pass on every device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.torch import window_attention as wa
from backends.torch.layers import attention_mask
from pcaf_core import reference
from tests.test_torch_window_attention import _grads, _model, _tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = ("transformer_local", "transformer_global_local")
# (T, w, g, rows): a partial block; several blocks, T not a multiple of w; w wider than T; w = 1; the paper's w
# and g; then a next-token layer's rows (the global rows and a suffix across blocks, the last row alone, a suffix
# shorter than the window).
CASES = [(50, 7, 3, None), (300, 20, 0, None), (40, 64, 5, None), (9, 1, 2, None), (261, 128, 16, None),
         (300, 20, 5, (5, 141)), (261, 128, 16, (0, 1)), (50, 7, 3, (3, 7)), (300, 20, 0, (0, 141))]


def _qkv(T: int, dtype=torch.float64, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, T, 8, generator=g, dtype=dtype).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,w,g,rows", CASES)
def test_blocked_is_the_masked_attention(variant, T, w, g, rows) -> None:
    """float64 values and gradients equal masked SDPA's on the same query rows, to rounding."""
    q, k, v = _qkv(T)
    kept = torch.as_tensor(reference.layer_rows(T, rows)) if rows else torch.arange(T)
    out = wa.blocked_window_attention(q[:, :, kept], k, v, variant, w, g, rows=rows)
    mask = attention_mask(T, variant, w, g, q.device)[kept]
    want = F.scaled_dot_product_attention(q[:, :, kept], k, v, attn_mask=mask)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)
    if rows:
        with pytest.raises(ValueError, match="rows"):
            wa.blocked_window_attention(q, k, v, variant, w, g, rows=rows)


def test_blocked_refuses_other_variants() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="not 'transformer_dense'"):
        wa.blocked_window_attention(q, k, v, "transformer_dense", 4, 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_blocked_dropout_drops_attention_weights_at_its_rate(variant) -> None:
    """With uniform weights (q = 0) over values of 1, a row's output is the share of its visible keys kept,
    scaled by 1/(1-p): its mean over many rows is 1, some rows drop everything (w = 2, p = 0.5: 0 for a quarter
    of the rows past the first), the output differs between calls and gradients are finite."""
    T, w, g, p = 400, 2, 3, 0.5
    q = torch.zeros(4, 4, T, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 4, T, 8, dtype=torch.float64)
    v = torch.ones(4, 4, T, 8, dtype=torch.float64)
    torch.manual_seed(0)
    out = wa.blocked_window_attention(q, k, v, variant, w, g, p)
    assert abs(out[..., 0].mean().item() - 1.0) < 0.03
    dropped_rows = (out[:, :, 1:, 0] == 0).double().mean().item()
    assert 0.15 < dropped_rows < 0.3 if variant == "transformer_local" else dropped_rows < 0.15
    assert not torch.equal(out, wa.blocked_window_attention(q, k, v, variant, w, g, p))
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(grad).all()
    with torch.no_grad():
        torch.testing.assert_close(wa.blocked_window_attention(q, k, v, variant, w, g, 0.0), v)


def test_blocked_builds_no_square_array() -> None:
    """The cached mask of a whole window holds ``T·(b + w - 1 + g)`` entries a head, not ``T²``."""
    wa._BAND_MASKS.clear()
    q, k, v = _qkv(1024, torch.float32)
    with torch.no_grad():
        wa.blocked_window_attention(q, k, v, "transformer_global_local", 128, 16)
    (mask,) = wa._BAND_MASKS.values()
    assert mask.shape == (1, 3 * 8, 128, 128 + 127 + 16)  # 3 heads x 8 blocks


@pytest.mark.parametrize("variant", VARIANTS)
def test_next_token_step_of_a_blocked_model_matches_the_masked_full_window(variant) -> None:
    """A next-token training step of a ``blocked`` model (the sub-window, each layer's query rows as blocks) gives
    the ``masked`` model's full-window loss and gradients; in full AR the two models' losses agree too."""
    x, y = _tokens(300)
    results = {}
    for impl, receptive in (("blocked", True), ("masked", False)):
        net = _model(impl, variant, 300, window=130).train()  # corrected profile: dropout 0
        net.nt_receptive_field = receptive
        loss = net(x, y[:, -1], "nt", need_log_probs=False, need_predictions=False).loss
        loss.backward()
        results[impl] = (loss, [p.grad for p in net.parameters()], net(x, y, "ar").loss)
    torch.testing.assert_close(results["blocked"][0], results["masked"][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results["blocked"][1], results["masked"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(results["blocked"][2], results["masked"][2], rtol=1e-5, atol=1e-6)


def test_blocked_model_compiles_into_one_graph_and_trains_like_masked() -> None:
    """``train.compile=on``: the blocked path (its mask built inside the traced step, as in a fresh process) traces
    into one graph (``fullgraph=True`` raises at any break) and gives the masked model's loss and gradients
    (``aot_eager``: inductor's capture without code generation)."""
    x, y = _tokens(300)
    nets = {impl: _model(impl, "transformer_global_local", 300, window=130).train() for impl in ("blocked", "masked")}
    wa._BAND_MASKS.clear()
    torch._dynamo.reset()
    step = torch.compile(lambda: nets["blocked"](x, y, "ar", need_log_probs=False, need_predictions=False).loss,
                         backend="aot_eager", fullgraph=True, dynamic=False)
    loss = step()
    loss.backward()
    want = nets["masked"](x, y, "ar", need_log_probs=False, need_predictions=False).loss
    want.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for got, exp in zip(nets["blocked"].parameters(), nets["masked"].parameters(), strict=True):
        torch.testing.assert_close(got.grad, exp.grad, rtol=1e-4, atol=1e-6)
