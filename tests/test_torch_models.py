"""Torch models beyond the spec comparison: gradients (gradcheck in float64), input validation, the
output flags, dropout placement, initialisation schemes, the factory, and mixed precision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from backends.torch import PCAFModel, TransformerLM, build_model, load_canonical, to_canonical
from backends.torch.dropout import Dropout
from pcaf_core.config import MODEL_VARIANTS, TRANSFORMER_VARIANTS, MemoryConfig, ModelConfig
from pcaf_core.dropout import dropout_scale
from pcaf_core.params import count_params, init_params, param_shapes, sinusoidal_table
from pcaf_core.profiles import PROFILES, get_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(vocab_size=16, d_model=6, d_hidden=8, n_layers=1, kernel_size=3, n_heads=2, window=3, n_global=1,
            linear_chunk=4, max_seq_len=12)


def _configs(variant: str, route: str = "context", index: str = "dense", policy: str = "topk_score",
             profile: str = "corrected", **model_overrides):
    model = ModelConfig(variant=variant, **{**TINY, **model_overrides})
    memory = MemoryConfig(route=route, semantic_index=index, candidate_policy=policy, num_buckets=5, top_k=2,
                          semantic_buckets=4, semantic_temperature=0.5, semantic_score_scale=0.5, fixed_gate=0.3)
    return model, memory, get_profile(profile)


def _net(model, memory, profile, *, rho: float = 0.8, seed: int = 0) -> torch.nn.Module:
    """A float64 eval-mode model on the spec's init with random biases/LayerNorm parameters and ρ."""
    params = init_params(model, memory, profile, seed=seed)
    rng = np.random.default_rng(seed + 7)
    for name, value in params.items():
        if name == "memory.recency_scale":
            params[name] = np.array(rho)
        elif name == "embed.weight":
            params[name] = rng.normal(size=value.shape)
        elif value.ndim == 1:
            params[name] = value + 0.2 * rng.normal(size=value.shape)
    net = build_model(model, memory, profile, dtype=torch.float64)
    load_canonical(net, params)
    return net.eval()


def _window(T: int, mode: str, *, B: int = 2, distinct: int = 5, vocab: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = torch.tensor(rng.integers(0, distinct, (B, T)))
    shape = (B,) if mode == "nt" else (B, T)
    targets = torch.tensor(np.where(rng.random(shape) < 0.5, rng.integers(0, distinct, shape),
                                    rng.integers(0, vocab, shape)))
    return tokens, targets


# ----------------------------------------------------------------------------- gradients

GRAD_CASES = [  # (variant, route, index, policy, profile, mode, parameters)
    ("pcaf", "context", "dense", "topk_score", "corrected", "nt",
     ["memory.recency_scale", "memory.query.weight", "gate.out.weight", "embed.weight[:4]"]),
    ("pcaf", "context", "dense", "topk_score", "reference_jax", "ar",
     ["memory.recency_scale", "memory.key.weight", "gate.out.weight", "embed.weight[:4]"]),
    ("pcaf", "semantic", "dense", "topk_score", "reference_jax", "ar",
     ["memory.recency_scale", "memory.router.weight", "memory.query.weight", "gate.hidden.bias"]),
    ("pcaf", "semantic", "bucketed", "topk_score", "corrected", "nt",
     ["memory.router.weight", "memory.router.bias", "memory.key.weight"]),
    ("pcaf", "hybrid", "dense", "first", "reference_torch", "nt",
     ["memory.recency_scale", "memory.router_norm.weight", "memory.query.weight", "gate.out.bias"]),
    ("pcaf", "hybrid", "bucketed", "recent", "corrected", "ar",
     ["memory.recency_scale", "memory.router.weight", "blocks.0.conv.weight", "embed.weight[:4]"]),
    ("pcaf_no_gate", "context", "dense", "recent", "corrected", "ar", ["memory.recency_scale", "memory.query.weight"]),
    ("local_conv", "context", "dense", "topk_score", "corrected", "ar", ["blocks.0.conv.weight", "head.out.bias"]),
    ("transformer_dense", "context", "dense", "topk_score", "corrected", "ar",
     ["blocks.0.attn.qkv.weight", "pos.table", "embed.weight[:4]"]),
    ("transformer_global_local", "context", "dense", "topk_score", "reference_torch", "nt",
     ["blocks.0.attn.qkv.weight", "blocks.0.attn.out.bias"]),
    ("linear_attention", "context", "dense", "topk_score", "corrected", "ar",
     ["blocks.0.attn.qkv.weight", "blocks.0.mlp_in.weight"]),
]


def _loss_fn(net: torch.nn.Module, names: list[str], tokens, targets, mode: str, *, full: bool = False):
    """The loss (or the full mixture log-probs) as a function of the named parameters; ``name[:n]`` takes
    the first n rows of a parameter and keeps the rest fixed."""
    base = dict(net.named_parameters())

    def split(name: str) -> tuple[str, int | None]:
        if name.endswith("]"):
            key, rows = name[:-1].split("[:")
            return key, int(rows)
        return name, None

    inputs = []
    for name in names:
        key, rows = split(name)
        value = base[key].detach()
        inputs.append((value if rows is None else value[:rows]).clone().requires_grad_())

    def f(*values: torch.Tensor) -> torch.Tensor:
        over = {}
        for name, value in zip(names, values):
            key, rows = split(name)
            over[key] = value if rows is None else torch.cat([value, base[key].detach()[rows:]])
        out = functional_call(net, over, (tokens, targets, mode),
                              {"need_log_probs": full, "need_predictions": False})
        return out.log_probs if full else out.loss

    return f, inputs


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "-".join(c[:6]))
def test_gradcheck(case) -> None:
    variant, route, index, policy, profile, mode, names = case
    model, memory, prof = _configs(variant, route, index, policy, profile)
    net = _net(model, memory, prof)
    tokens, targets = _window(10, mode)
    f, inputs = _loss_fn(net, names, tokens, targets, mode)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("profile", ["reference_jax", "corrected"])
def test_gradcheck_full_mixture(profile: str) -> None:
    model, memory, prof = _configs("pcaf", "hybrid", "dense", "topk_score", profile)
    net = _net(model, memory, prof)
    tokens, targets = _window(8, "nt")
    f, inputs = _loss_fn(net, ["memory.recency_scale", "memory.query.weight", "gate.out.weight"], tokens, targets,
                         "nt", full=True)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("distinct", [16, 3])
def test_gradients_are_finite_with_empty_queries_and_cache_misses(mode: str, distinct: int) -> None:
    # corrected: an empty query's gate is exactly 0 and a missed target has p_cache = 0, so log 0 = -inf
    # enters the mixture; no NaN may reach any gradient.
    model, memory, prof = _configs("pcaf", "hybrid", "bucketed", "recent", "corrected")
    net = _net(model, memory, prof)
    tokens, _ = _window(12, mode, distinct=distinct)
    targets = torch.full((2,) if mode == "nt" else (2, 12), 15)  # id 15 never occurs in the window
    out = net(tokens, targets, mode)
    assert (out.memory.gate == 0).any() or mode == "nt"
    out.loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


# ----------------------------------------------------------------------------- input validation


def test_input_validation_names_the_value_and_the_limit() -> None:
    """Static checks only: token-id ranges are the loop's job (tests/test_batches.py)."""
    model, memory, prof = _configs("pcaf")
    net = _net(model, memory, prof)
    tokens, targets = _window(6, "nt")
    with pytest.raises(ValueError, match="nt targets must be"):
        net(tokens, torch.zeros(2, 6, dtype=torch.int64), "nt")
    with pytest.raises(ValueError, match="ar targets must be"):
        net(tokens, targets, "ar")
    with pytest.raises(ValueError, match="integer"):
        net(tokens.double(), targets, "nt")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        net(tokens[0], targets, "nt")
    with pytest.raises(ValueError, match="mode"):
        net(tokens, targets, "bidirectional")


def test_sequence_longer_than_the_positional_table() -> None:
    model, memory, prof = _configs("transformer_dense")
    net = _net(model, memory, prof)
    with pytest.raises(ValueError, match=r"T=13 exceeds model.max_seq_len=12"):
        net(torch.zeros(1, 13, dtype=torch.int64), None, "ar")
    # fixed sinusoids (reference_torch) have no table to run out of
    model, memory, prof = _configs("transformer_dense", profile="reference_torch")
    net = _net(model, memory, prof)
    out = net(torch.zeros(1, 30, dtype=torch.int64), None, "ar")
    assert out.param_log_probs.shape == (1, 30, 16)
    for T in (5, 40):  # a prefix of the cached table, then a longer one
        got = net.pos(T, torch.float64, torch.device("cpu"))
        np.testing.assert_array_equal(got.numpy(), sinusoidal_table(T, 6, "fixed_torch"))


# ----------------------------------------------------------------------------- output flags


@pytest.mark.parametrize("profile", ["reference_jax", "corrected"])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_output_flags(profile: str, mode: str) -> None:
    model, memory, prof = _configs("pcaf", "hybrid", "dense", "topk_score", profile)
    net = _net(model, memory, prof)
    tokens, targets = _window(10, mode)
    full = net(tokens, targets, mode)
    lean = net(tokens, targets, mode, need_log_probs=False, need_predictions=False)
    assert lean.log_probs is None and lean.prediction is None and lean.memory.p_cache is None
    assert lean.param_log_probs is None  # the head is read at the targets only (head_loss)
    torch.testing.assert_close(lean.loss, full.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lean.target_log_prob, full.target_log_prob, rtol=1e-12, atol=1e-12)
    preds = net(tokens, targets, mode, need_log_probs=False)
    torch.testing.assert_close(preds.prediction, full.prediction)
    if mode == "ar" and prof.ar_accuracy_parametric_only:  # parametric argmax: no mixture is built
        assert preds.log_probs is None
        torch.testing.assert_close(preds.prediction, full.param_log_probs.argmax(-1))
    no_targets = net(tokens, None, mode)
    assert no_targets.loss is None and no_targets.target_log_prob is None
    assert full.loss.requires_grad and full.loss.ndim == 0
    # the target entry of the full distribution is the loss's log-probability (no floor distorts it here)
    if not (mode == "ar" and prof.ar_mixture_floor):
        tgt = targets.reshape(2, -1)
        torch.testing.assert_close(full.log_probs.gather(-1, tgt[..., None])[..., 0], full.target_log_prob)


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("variant", ["pcaf", "transformer_local"])
def test_dropout_placement_and_train_mode(variant: str) -> None:
    model, memory, prof = _configs(variant, "hybrid", profile="reference_torch", n_layers=2)
    assert prof.dropout == 0.1
    net = _net(model, memory, prof)
    calls: dict[str, int] = {}
    for name, module in net.named_modules():
        if isinstance(module, Dropout):
            assert module.p == 0.1
            module.register_forward_hook(lambda m, i, o, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    tokens, targets = _window(10, "ar")
    eval_loss = net(tokens, targets, "ar").loss
    # After the GELU of the block MLP and on every residual branch (conv blocks have one, Transformer
    # blocks two); after the GELU of the head.
    per_block = 3 if variant in TRANSFORMER_VARIANTS else 2
    assert calls == {"blocks.0.drop": per_block, "blocks.1.drop": per_block, "head.drop": 1}
    net.train()
    torch.manual_seed(0)
    a = net(tokens, targets, "ar").loss
    b = net(tokens, targets, "ar").loss
    assert a != b and a != eval_loss
    if variant in TRANSFORMER_VARIANTS:  # the attention weights drop out too
        for module in net.modules():
            if isinstance(module, Dropout):
                module.p = 0.0
        assert net(tokens, targets, "ar").loss != net(tokens, targets, "ar").loss
    net.eval()
    assert net(tokens, targets, "ar").loss == eval_loss


def test_dropout_rate_scale_gradient_and_stream() -> None:
    """The 16-bit mask: drops round(p·2^16) in 2^16 of the elements, scales the rest by the inverse of the
    actual keep rate, back-propagates through the same mask, follows torch's seed, and is the identity in
    eval mode or at rate 0; rates outside [0, 1) are refused."""
    drop = Dropout(0.1).train()
    assert drop.threshold == 6554 and drop.scale == dropout_scale(0.1)
    x = torch.ones(1_000_001, dtype=torch.float64, requires_grad=True)  # odd: half of one 32-bit draw is unused
    torch.manual_seed(3)
    y = drop(x)
    kept = y != 0
    rate = 1 - kept.double().mean().item()
    assert abs(rate - 6554 / 2**16) < 4 * (0.1 * 0.9 / x.numel()) ** 0.5  # 4 standard errors
    assert torch.all(y[kept] == drop.scale)
    y.backward(torch.arange(x.numel(), dtype=torch.float64))
    torch.testing.assert_close(x.grad, torch.where(kept, torch.arange(x.numel(), dtype=torch.float64) * drop.scale,
                                                   0.0))
    torch.manual_seed(3)
    assert torch.equal(drop(x.detach()), y.detach())
    assert not torch.equal(drop(x.detach()), y.detach())
    assert drop.eval()(x) is x and Dropout(0.0).train()(x) is x
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="outside \\[0, 1\\)"):
            Dropout(bad)


@pytest.mark.slow
def test_dropout_compiles_without_a_graph_break() -> None:
    """The mask's random draw traces under torch.compile (an in-place ``random_`` would split the compiled step
    at every dropout), and the traced layer draws what the eager one draws from the same seed."""
    import torch._dynamo

    drop = Dropout(0.1).train()
    x = torch.randn(4, 33)
    explained = torch._dynamo.explain(drop)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(drop, backend="aot_eager", fullgraph=True)
    torch.manual_seed(5)
    eager = drop(x)
    torch.manual_seed(5)
    assert torch.equal(compiled(x), eager)


def test_no_dropout_profile_is_deterministic_in_train_mode() -> None:
    model, memory, prof = _configs("transformer_dense", profile="corrected")
    net = _net(model, memory, prof)
    tokens, targets = _window(10, "ar")
    expected = net(tokens, targets, "ar").loss
    net.train()
    assert net(tokens, targets, "ar").loss == expected


# ----------------------------------------------------------------------------- init and factory

BIG = dict(vocab_size=3000, d_model=32, d_hidden=64, n_layers=2, kernel_size=5, n_heads=4, max_seq_len=64)


def test_jax_normal_init_statistics_and_determinism() -> None:
    model = ModelConfig(variant="pcaf", **BIG)
    memory, prof = MemoryConfig(route="hybrid", semantic_buckets=16), get_profile("reference_jax")
    a = to_canonical(build_model(model, memory, prof, seed=3))
    b = to_canonical(build_model(model, memory, prof, seed=3))
    c = to_canonical(build_model(model, memory, prof, seed=4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embed.weight"], c["embed.weight"])
    assert abs(a["embed.weight"].std() - 0.02) < 0.001
    assert abs(a["head.out.weight"].std() - 1 / math.sqrt(64)) < 0.005
    assert abs(a["blocks.0.conv.weight"].std() - 1 / math.sqrt(5)) < 0.05
    assert float(a["memory.recency_scale"]) == 1.0
    for name, value in a.items():
        if name.endswith(".bias"):
            assert not value.any(), name
        elif value.ndim == 1:
            assert (value == 1).all(), name


def test_torch_default_init_and_global_rng_untouched() -> None:
    state = torch.get_rng_state()
    pcaf = build_model(ModelConfig(variant="pcaf", **BIG), MemoryConfig(), get_profile("reference_torch"), seed=1)
    tf = build_model(ModelConfig(variant="transformer_dense", **BIG), MemoryConfig(), get_profile("reference_torch"))
    assert torch.equal(state, torch.get_rng_state())
    a, t = to_canonical(pcaf), to_canonical(tf)
    assert abs(a["embed.weight"].std() - 1.0) < 0.02  # nn.Embedding: N(0, 1)
    bound = 1 / math.sqrt(32)
    assert np.abs(a["blocks.0.mlp_in.weight"]).max() <= bound and a["blocks.0.mlp_in.bias"].any()
    assert np.abs(a["blocks.0.conv.weight"]).max() <= 1 / math.sqrt(5)
    assert float(a["memory.recency_scale"]) == 1.0
    assert not t["blocks.0.attn.qkv.bias"].any() and not t["blocks.0.attn.out.bias"].any()
    xavier = math.sqrt(6 / (32 + 96))
    assert np.abs(t["blocks.0.attn.qkv.weight"]).max() <= xavier
    assert "pos.table" not in t  # fixed sinusoids are not parameters


def test_trainable_positional_table_starts_at_the_sinusoids() -> None:
    net = build_model(ModelConfig(variant="linear_attention", **BIG), MemoryConfig(), get_profile("corrected"))
    np.testing.assert_allclose(to_canonical(net)["pos.table"], sinusoidal_table(64, 32, "trainable_jax"), rtol=1e-6)


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_factory_types_and_canonical_names(variant: str, profile: str) -> None:
    model = ModelConfig(variant=variant, **TINY)
    for route in ("context", "semantic"):
        memory = MemoryConfig(route=route, semantic_buckets=4)
        prof = get_profile(profile)
        net = build_model(model, memory, prof, dtype=torch.float64)
        assert isinstance(net, TransformerLM if variant in TRANSFORMER_VARIANTS else PCAFModel)
        assert all(p.dtype == torch.float64 for p in net.parameters())
        shapes = param_shapes(model, memory, prof)
        canon = to_canonical(net)
        assert list(canon) == list(shapes)
        assert {k: v.shape for k, v in canon.items()} == shapes
        assert sum(p.numel() for p in net.parameters()) == count_params(model, memory, prof)


def test_meta_device_build_counts_parameters() -> None:
    model, memory = ModelConfig(variant="pcaf", **BIG), MemoryConfig(route="hybrid")
    for profile in ("reference_jax", "reference_torch"):
        with torch.device("meta"):
            net = build_model(model, memory, get_profile(profile))
        assert all(p.is_meta for p in net.parameters())
        assert sum(p.numel() for p in net.parameters()) == count_params(model, memory, get_profile(profile))


def test_bf16_autocast_training_step_is_finite() -> None:
    model, memory, prof = _configs("pcaf", "hybrid", "dense", "topk_score", "reference_torch")
    net = build_model(model, memory, prof).train()
    tokens, targets = _window(12, "ar")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(tokens, targets, "ar", need_log_probs=False, need_predictions=False)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in net.parameters())


def test_bf16_gate_is_a_float32_sigmoid_that_the_clip_keeps_below_one() -> None:
    # JAX's Gate takes the sigmoid of the widened logit; a bf16 sigmoid would round λ >= 0.998 to exactly 1, and
    # the mask's clip to 1 - 1e-5 (1 in bf16) would leave log(1 - λ) = -inf.
    from backends.torch import mixture
    from backends.torch.layers import Gate

    gate = Gate(4, "tanh")
    with torch.no_grad():
        gate.out.bias.fill_(8.0)
    h = torch.randn(2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        raw = gate(h)
        logit = gate.out(torch.nn.functional.gelu(gate.hidden(gate.norm(h)), approximate="tanh"))[..., 0]
    assert logit.dtype == torch.bfloat16 and raw.dtype == torch.float32
    assert torch.equal(raw, torch.sigmoid(logit.float()))
    assert torch.all(raw < 1.0) and torch.all(torch.sigmoid(logit) == 1.0)  # what a bf16 sigmoid gave
    lam = mixture.mask_gate(raw, torch.ones(2, 3, dtype=torch.bool), clip_when_empty=True)
    assert torch.all(torch.isfinite(torch.log1p(-lam)))


class _IndexPuts(TorchDispatchMode):
    """Every ``index_put`` (the backward of indexing a tensor with a position tensor) an op sequence runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("index_put", "index_put_", "_index_put_impl_"):
            self.calls.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["ar", "nt"])
@pytest.mark.parametrize("route, index, policy", [("context", "dense", "recent"), ("context", "dense", "topk_score"),
                                                  ("semantic", "bucketed", "topk_score"), ("hybrid", "dense", "first")])
def test_training_step_reads_the_query_rows_without_a_scatter(route: str, index: str, policy: str, mode: str) -> None:
    # The query rows are a slice of the hidden states (records.query_rows): indexing them with the query
    # positions instead would add an accumulating index_put per use to the backward pass, a sort and a
    # scatter kernel each on CUDA under deterministic algorithms, every step.
    model, memory, prof = _configs("pcaf", route, index, policy, "reference_torch")
    net = build_model(model, memory, prof).train()
    tokens, targets = _window(12, mode)
    seen = _IndexPuts()
    with seen:
        out = net(tokens, targets, mode, need_log_probs=False, need_predictions=False)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    assert seen.calls == []


@pytest.mark.parametrize("profile", PROFILES)
def test_no_cache_trains_exactly_as_local_conv(profile: str) -> None:
    """PCAF no cache is local conv's network with the memory and gate built and unused: from one seed the shared
    weights, the training loss and its gradients are the same bits (the table's note on the two rows)."""
    tokens, targets = _window(10, "nt")
    out = {}
    for variant in ("pcaf_no_cache", "local_conv"):
        model, memory, prof = _configs(variant, profile=profile)
        net = build_model(model, memory, prof, seed=3).train()
        torch.manual_seed(11)  # dropout's masks
        loss = net(tokens, targets, "nt").loss
        loss.backward()
        out[variant] = (loss, {n: (p.detach().clone(), p.grad) for n, p in net.named_parameters()})
    (loss_nc, nc), (loss_lc, lc) = out["pcaf_no_cache"], out["local_conv"]
    assert torch.equal(loss_nc, loss_lc)
    assert set(lc) <= set(nc)  # reference_jax builds the router params into local conv too
    for name, (value, grad) in lc.items():
        assert torch.equal(nc[name][0], value), name
        assert (grad is None and nc[name][1] is None) or torch.equal(nc[name][1], grad), name  # None: unused
    assert all(nc[name][1] is None for name in set(nc) - set(lc))  # the memory and gate get no signal


@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_no_cache_trains_exactly_as_local_conv_with_clipping(mode: str) -> None:
    """Through the backend's whole training step, clipping active at every step, dropout on: the two rows' losses
    and shared weights stay the same bits. The memory and gate's zero gradients stay out of the clip's norm, whose
    sums would otherwise run in another order."""
    from backends.torch.backend import TorchBackend
    from pcaf_core.config import DataConfig, EvalConfig, RunConfig, TrainConfig

    rng = np.random.default_rng(4)
    T, B, V = 10, 4, TINY["vocab_size"]
    batches = [(rng.integers(0, V, (B, T)), rng.integers(0, V, (B,) if mode == "nt" else (B, T))) for _ in range(8)]
    runs = {}
    for variant in ("pcaf_no_cache", "local_conv"):
        model, memory, _ = _configs(variant)
        cfg = RunConfig(model=model, memory=memory, profile=get_profile("reference_torch", grad_clip_norm=1e-3),
                        data=DataConfig(max_vocab=V), eval=EvalConfig(),
                        train=TrainConfig(mode=mode, seq_len=T, batch_size=B, steps=len(batches), seed=5,
                                          checkpoint_every=0, compile="off"))
        assert cfg.profile.dropout > 0
        backend = TorchBackend("cpu")
        state = backend.init(cfg)
        losses = []
        for x, y in batches:
            state, loss = backend.train_step(state, x, y, 1e-2)
            losses.append(loss)
        runs[variant] = (losses, {n: p.detach().clone() for n, p in state.module.named_parameters()})
    (loss_nc, nc), (loss_lc, lc) = runs["pcaf_no_cache"], runs["local_conv"]
    assert loss_nc == loss_lc
    for name, value in lc.items():
        assert torch.equal(nc[name], value), name


def _l2_normalize_by_autograd(x: torch.Tensor, form: str) -> torch.Tensor:
    """The normalisation as plain ops, differentiated by autograd's chain rule."""
    from backends.torch.kernels.l2_normalize import L2_MAX_EPS, L2_RSQRT_EPS

    if form == "rsqrt_eps":
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_RSQRT_EPS)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=L2_MAX_EPS)


@pytest.mark.parametrize("form", ["rsqrt_eps", "max_eps"])
def test_l2_normalize_gradient_is_autograds(form: str) -> None:
    from backends.torch.layers import l2_normalize

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen)
    x[0, 1] = 0.0  # a zero row: max_eps's floor holds, rsqrt_eps's eps dominates
    x[1, 2] *= 1e-14  # a row below max_eps's floor
    g = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = l2_normalize(got_x, form), _l2_normalize_by_autograd(want_x, form)
    assert torch.equal(got, want)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-12, atol=0)
    torch.autograd.gradcheck(lambda t: l2_normalize(t, form), (x[2].clone().requires_grad_(),))
    # bf16 (autocast's projections): the same value, the gradient within bf16 rounding.
    xb, xr = x.bfloat16().requires_grad_(), x.bfloat16().requires_grad_()
    yb, yr = l2_normalize(xb, form), _l2_normalize_by_autograd(xr, form)
    assert torch.equal(yb, yr)
    yb.backward(g.bfloat16())
    yr.backward(g.bfloat16())
    torch.testing.assert_close(xb.grad.double(), xr.grad.double(), rtol=3e-2, atol=3e-2 * xr.grad.abs().max().item())
