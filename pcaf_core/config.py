"""Typed configuration for every run: model, memory, profile, data, training, evaluation.

The dataclasses double as Hydra structured configs (``experiments`` registers them), so a
wrong key or type fails at composition. Value checks live in ``__post_init__`` and raise
:class:`ConfigError` naming the offending field; call :func:`validate` on an assembled
:class:`RunConfig` (or build the dataclasses directly) to run them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MODEL_VARIANTS = (
    "pcaf",  # PCAF with learned gate; the route comes from MemoryConfig.route
    "pcaf_no_gate",  # constant gate MemoryConfig.fixed_gate, still masked when no candidate
    "pcaf_no_cache",  # PCAF parameters, parametric path only
    "local_conv",  # embedding + conv blocks + head
    "transformer_dense",
    "transformer_local",
    "transformer_global_local",
    "linear_attention",
)
PCAF_VARIANTS = ("pcaf", "pcaf_no_gate", "pcaf_no_cache")
CACHE_VARIANTS = ("pcaf", "pcaf_no_gate")
TRANSFORMER_VARIANTS = ("transformer_dense", "transformer_local", "transformer_global_local", "linear_attention")
WINDOWED_VARIANTS = ("transformer_local", "transformer_global_local")  # softmax attention over a window
# How a backend computes windowed attention (model.attention_impl): banded = only the key blocks within the
# window (torch: FlexAttention with a block mask; JAX: a blocked band of GEMMs); blocked = query blocks, each
# against its window's keys and the global ones (torch: through scaled_dot_product_attention; JAX: the same
# blocked band as banded); masked = every [T, T] score under the mask; auto = the backend's choice per device
# (docs/KERNELS.md, "Windowed attention").
ATTENTION_IMPLS = ("auto", "banded", "blocked", "masked")
ROUTES = ("context", "semantic", "hybrid")
SEMANTIC_INDEXES = ("dense", "bucketed")
CANDIDATE_POLICIES = ("topk_score", "recent", "first")
MODES = ("nt", "ar")
GELU_FORMS = ("tanh", "erf")
L2NORM_FORMS = ("rsqrt_eps", "max_eps")
ROUTER_FORMS = ("linear_bias", "layernorm_linear")
POSITIONAL_FORMS = ("trainable_jax", "fixed_torch")
INIT_FORMS = ("jax_normal", "torch_default")
PRECISIONS = ("fp32", "bf16", "auto")  # auto: bf16 where the device has a bf16 matrix unit
COMPILE_MODES = ("auto", "on", "off", "cudagraphs")
HEAD_LOSS_FORMS = ("auto", "full", "chunked")  # auto: head_loss_chunks says where the tiles run
# What a float32 matrix product computes (docs/SPEC.md §9); "profile": the profile's own setting
# (pcaf_core.profiles.matmul_precision).
MATMUL_PRECISIONS = ("highest", "high", "default")
PROFILE_MATMUL_PRECISION: dict[str, str] = {
    # The paper's TPU runs multiplied float32 matrices at JAX's default precision (one bf16 pass on a TPU,
    # TF32 on a GPU).
    "reference_jax": "default",
    # The paper's PyTorch code ran float32 with TF32 off (PyTorch's default for matmuls).
    "reference_torch": "highest",
    "corrected": "highest",
}
"""What ``train.matmul_precision=profile`` means under each profile (docs/SPEC.md §9). It lives here, not in
``pcaf_core.profiles`` (which builds its profiles from this module's dataclasses), so that a config checks it
without importing that module."""
EVAL_PROTOCOLS = ("reference", "full", "both")
DATASETS = ("wikitext2", "wikitext103", "pg19", "pg19_mini", "text")  # text: your own (pcaf_core.data.own_corpus)
DATA_LAYOUTS = ("tokens", "raw", "hf")


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and what to do."""


def _require(cond: bool, section: str, name: str, value: Any, what: str) -> None:
    if not cond:
        raise ConfigError(f"{section}.{name}={value!r} is invalid: {what}")


def _one_of(section: str, name: str, value: Any, allowed: tuple) -> None:
    _require(value in allowed, section, name, value, f"expected one of {list(allowed)}")


INT_LIMIT = 2**63
"""Every integer setting must lie in (-2^63, 2^63): NumPy, torch and JAX hold them in int64 at most."""
MAX_BUCKETS = 2**31
"""B: both backends hold bucket ids in int32 arithmetic (JAX: at most 2^31; below it with int32 wrap-around)."""


def _check_numbers(section: str, obj: Any) -> None:
    """Every ``float`` field finite, every ``int`` field an integer within :data:`INT_LIMIT` (an infinite
    learning rate or a 10^20-bucket memory would otherwise fail far from the key that caused it)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.type == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            _require(math.isfinite(value), section, f.name, value, "must be a finite number")
        elif f.type == "int" and isinstance(value, int) and not isinstance(value, bool):
            _require(-INT_LIMIT < value < INT_LIMIT, section, f.name, value,
                     "is out of range: integer settings must lie within +-2^63")


@dataclass
class ModelConfig:
    """Network shape. ``vocab_size`` V, ``d_model`` d, ``d_hidden`` (MLP and head width)."""

    variant: str = "pcaf"
    vocab_size: int = 20000
    d_model: int = 256
    d_hidden: int = 1000
    n_layers: int = 2
    kernel_size: int = 5
    n_heads: int = 4
    window: int = 128  # local attention: keys with t - s < window (self included)
    n_global: int = 16  # global-local attention: the first n_global positions are visible to all
    linear_chunk: int = 64  # linear attention chunk length (an implementation detail; exact)
    max_seq_len: int = 1024  # the trainable positional table has max_seq_len rows
    attention_impl: str = "auto"  # windowed attention: auto | banded | blocked | masked (same values, other kernels)

    def __post_init__(self) -> None:
        s = "model"
        _check_numbers(s, self)
        _one_of(s, "variant", self.variant, MODEL_VARIANTS)
        for name in ("vocab_size", "d_model", "d_hidden", "n_layers", "kernel_size", "n_heads",
                     "window", "linear_chunk", "max_seq_len"):
            _require(int(getattr(self, name)) >= 1, s, name, getattr(self, name), "must be >= 1")
        _require(self.vocab_size >= 3, s, "vocab_size", self.vocab_size,
                 "must hold the specials <pad>, <unk>, <eos>")
        _require(self.n_global >= 0, s, "n_global", self.n_global, "must be >= 0")
        _one_of(s, "attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _require(self.attention_impl == "auto" or self.variant in WINDOWED_VARIANTS, s, "attention_impl",
                 self.attention_impl, f"applies to {list(WINDOWED_VARIANTS)} only, not {self.variant!r}: leave it auto")
        if self.variant in TRANSFORMER_VARIANTS:
            _require(self.d_model % self.n_heads == 0, s, "n_heads", self.n_heads,
                     f"must divide d_model={self.d_model}")
        if self.variant in PCAF_VARIANTS:
            _require(self.d_model >= 2, s, "d_model", self.d_model, "the gate needs d_model // 2 >= 1")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class MemoryConfig:
    """Associative memory: address buckets B, top-K, context order n, semantic router S/τ/λ."""

    route: str = "context"
    semantic_index: str = "dense"  # dense = the reference's all-pairs overlap; bucketed = argmax bucket
    candidate_policy: str = "topk_score"
    num_buckets: int = 32768
    top_k: int = 16
    context_order: int = 1
    semantic_buckets: int = 256
    semantic_temperature: float = 0.2
    semantic_score_scale: float = 1.0
    fixed_gate: float = 0.5  # used by pcaf_no_gate

    def __post_init__(self) -> None:
        s = "memory"
        _require(1 <= self.num_buckets <= MAX_BUCKETS, s, "num_buckets", self.num_buckets,
                 "B must lie in [1, 2^31] (bucket ids are 32-bit in both backends)")
        _check_numbers(s, self)
        _one_of(s, "route", self.route, ROUTES)
        _one_of(s, "semantic_index", self.semantic_index, SEMANTIC_INDEXES)
        _one_of(s, "candidate_policy", self.candidate_policy, CANDIDATE_POLICIES)
        _require(self.top_k >= 1, s, "top_k", self.top_k, "K must be >= 1")
        _require(self.context_order >= 1, s, "context_order", self.context_order, "n must be >= 1")
        _require(self.semantic_buckets >= 1, s, "semantic_buckets", self.semantic_buckets, "S must be >= 1")
        _require(self.semantic_temperature > 0, s, "semantic_temperature", self.semantic_temperature,
                 "tau must be > 0")
        _require(self.semantic_score_scale >= 0, s, "semantic_score_scale", self.semantic_score_scale,
                 "lambda must be >= 0")
        _require(0.0 <= self.fixed_gate <= 1.0, s, "fixed_gate", self.fixed_gate, "must lie in [0, 1]")


@dataclass
class ProfileConfig:
    """A named set of switches: what the reference code does where it differs from the normative spec.

    ``pcaf_core.profiles`` defines ``reference_jax``, ``reference_torch`` and ``corrected``;
    docs/SPEC.md gives the formula behind each switch.
    """

    name: str = "corrected"
    # --- hashing -------------------------------------------------------------------------
    hash_int32_wraparound: bool = False
    # --- architecture details ------------------------------------------------------------
    gelu: str = "tanh"
    l2norm: str = "rsqrt_eps"
    router: str = "linear_bias"
    router_in_context_models: bool = False  # unused router params carried by non-semantic PCAF
    local_conv_full_param_set: bool = False  # local_conv carries PCAF's memory/gate/router params
    positional: str = "trainable_jax"
    # Amplitude of the positional signal: the trainable table starts at (or the fixed table is)
    # positional_scale x sinusoids. 1 in every reference; see docs/SPEC.md §"Positions".
    positional_scale: float = 1.0
    init: str = "jax_normal"
    # --- correctness quirks ---------------------------------------------------------------
    semantic_ar_target_leak: bool = False
    hybrid_dedup: bool = True
    nt_mixture_floor: bool = False  # log max(p_cache, 1e-6) inside logaddexp: unnormalised
    ar_mixture_floor: bool = False  # prob-space mixture, log max(p, 1e-8)
    ar_accuracy_parametric_only: bool = False
    gate_clip_when_empty: bool = False  # clip lambda to >= 1e-5 even when the gate was masked to 0
    # NT only: log1p(-min(λ, 1-1e-5)) on the parametric term and log(max(λ, 1e-5)) on the cache term,
    # each clamped on its own side, instead of one two-sided clip of λ (gate_clip_when_empty then has
    # no effect in NT: an empty query keeps weight 1 on the parametric term).
    nt_gate_per_term_clamp: bool = False
    # NT only: the loss is -log_softmax(log-mixture)[target], i.e. the (unnormalised) mixture is
    # re-normalised over the vocabulary before the target is read, in training and evaluation.
    nt_loss_renormalise: bool = False
    # --- training regularisation ----------------------------------------------------------
    dropout: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping
    weight_decay_all_params: bool = True

    def __post_init__(self) -> None:
        s = "profile"
        _check_numbers(s, self)
        _one_of(s, "gelu", self.gelu, GELU_FORMS)
        _one_of(s, "l2norm", self.l2norm, L2NORM_FORMS)
        _one_of(s, "router", self.router, ROUTER_FORMS)
        _one_of(s, "positional", self.positional, POSITIONAL_FORMS)
        _one_of(s, "init", self.init, INIT_FORMS)
        _require(math.isfinite(self.positional_scale) and self.positional_scale >= 0, s, "positional_scale",
                 self.positional_scale, "must be a finite number >= 0 (1 = the reference sinusoids)")
        _require(0.0 <= self.dropout < 1.0, s, "dropout", self.dropout, "must lie in [0, 1)")
        _require(self.grad_clip_norm >= 0, s, "grad_clip_norm", self.grad_clip_norm, "must be >= 0 (0 = off)")


@dataclass
class DataConfig:
    """Corpus, tokenizer and token budgets (docs/REFERENCE_CODE.md §5.1; docs/DATA.md).

    ``name``: a published corpus, or ``text``: a corpus of your own, the folder ``data_dir``
    (:mod:`pcaf_core.data.own_corpus`).
    ``layout``: ``tokens`` (WikiText ``wiki.*.tokens``), ``raw`` (WikiText ``wiki.*.raw``; PG-19's
    one file per book, which ``tokens`` also names for PG-19), ``hf`` (Hugging Face datasets).
    ``tokenizer``: ``regex`` (the reference ``\\w+|[^\\w\\s]``), ``whitespace`` or ``auto``
    (whitespace for the pre-tokenized WikiText ``tokens`` release, regex otherwise).
    ``rows``: ``nonempty`` (each non-empty line / book is a document, the reference), ``lines``
    (every WikiText line, blank ones included, gets an ``<eos>``: the release's own counts) or
    ``auto`` (lines for the ``tokens`` release, nonempty otherwise).
    """

    name: str = "wikitext2"
    layout: str = "tokens"
    tokenizer: str = "auto"
    rows: str = "auto"
    data_dir: str | None = None  # None: $PCAF_DATA_DIR, the project's data/, then ../shared/data; text: the corpus
    cache_dir: str | None = None  # None: $PCAF_CACHE_DIR, then <repo>/data_cache
    max_vocab: int = 20000
    min_freq: int = 2
    max_train_tokens: int = 0  # 0 = the whole split
    max_eval_tokens: int = 0
    eval_split: str = "validation"

    def __post_init__(self) -> None:
        s = "data"
        _check_numbers(s, self)
        _one_of(s, "name", self.name, DATASETS)
        _one_of(s, "layout", self.layout, DATA_LAYOUTS)
        _one_of(s, "tokenizer", self.tokenizer, ("auto", "regex", "whitespace"))
        _one_of(s, "rows", self.rows, ("auto", "nonempty", "lines"))
        if self.name.startswith("pg19"):
            _require(self.rows != "lines", s, "rows", self.rows, "PG-19 rows are whole books: use 'nonempty' or 'auto'")
            _require(self.layout != "hf" or self.name != "pg19_mini", s, "layout", self.layout,
                     "pg19_mini exists only locally: use 'raw'")
        if self.name == "text":
            _require(bool(self.data_dir), s, "data_dir", self.data_dir,
                     "data.name=text reads a corpus of your own: set data.data_dir=<the folder holding its splits>")
            _require(self.layout != "hf", s, "layout", self.layout, "a text corpus is read from its folder: use 'raw'")
        _require(self.max_vocab >= 4, s, "max_vocab", self.max_vocab, "must exceed the 3 specials")
        _require(self.min_freq >= 1, s, "min_freq", self.min_freq, "must be >= 1")
        _require(self.max_train_tokens >= 0, s, "max_train_tokens", self.max_train_tokens, "must be >= 0")
        _require(self.max_eval_tokens >= 0, s, "max_eval_tokens", self.max_eval_tokens, "must be >= 0")
        _one_of(s, "eval_split", self.eval_split, ("validation", "test"))


@dataclass
class TrainConfig:
    """Optimisation budget and schedule (docs/REFERENCE_CODE.md §5.4-5.5)."""

    mode: str = "nt"
    seq_len: int = 1024
    batch_size: int = 64
    steps: int = 5000
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0  # 1.0 with warmup 0 = constant LR, as the reference default
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    precision: str = "fp32"
    # Compile the training step (torch: torch.compile of the forward; JAX always jit-compiles).
    # auto: where it pays for its compile time (backends.torch.compile.use_compile says when), on one CUDA
    # device also replayed as CUDA graphs (use_cuda_graphs);
    # cudagraphs: compiled and replayed as CUDA graphs (torch, one CUDA device, one process).
    compile: str = "auto"
    # The training loss's vocabulary head (backends/*/head_loss.py): "full" computes the [N, V] logits as
    # one tile, "chunked" in tiles of head_position_chunk x head_vocab_chunk and never holds [N, V]; "auto"
    # tiles where one tile would be large (head_loss_chunks). The same values either way, to float rounding.
    head_loss: str = "auto"
    head_position_chunk: int = 1024
    head_vocab_chunk: int = 8192
    # highest | high | default (MATMUL_PRECISIONS) or "profile": the profile's (pcaf_core.profiles).
    matmul_precision: str = "profile"
    seed: int = 1234
    train_sample_seed: int = 10001
    checkpoint_every: int = 0  # 0 = only at the end
    log_every: int = 0  # learning-curve rows every N steps besides the evaluation steps (0 = only those)

    def __post_init__(self) -> None:
        s = "train"
        _check_numbers(s, self)
        _one_of(s, "mode", self.mode, MODES)
        _require(self.seq_len >= 2, s, "seq_len", self.seq_len, "T must be >= 2")
        _require(self.batch_size >= 1, s, "batch_size", self.batch_size, "must be >= 1")
        _require(self.steps >= 1, s, "steps", self.steps, "must be >= 1")
        _require(self.lr > 0, s, "lr", self.lr, "must be > 0")
        _require(0 <= self.warmup_steps <= self.steps, s, "warmup_steps", self.warmup_steps,
                 f"must lie in [0, steps={self.steps}]")
        _require(0.0 <= self.min_lr_ratio <= 1.0, s, "min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]")
        _require(self.weight_decay >= 0, s, "weight_decay", self.weight_decay, "must be >= 0")
        _require(0 <= self.beta1 < 1, s, "beta1", self.beta1, "must lie in [0, 1)")
        _require(0 <= self.beta2 < 1, s, "beta2", self.beta2, "must lie in [0, 1)")
        _require(self.eps > 0, s, "eps", self.eps, "must be > 0")
        _one_of(s, "precision", self.precision, PRECISIONS)
        _one_of(s, "compile", self.compile, COMPILE_MODES)
        _one_of(s, "head_loss", self.head_loss, HEAD_LOSS_FORMS)
        _require(self.head_position_chunk >= 1, s, "head_position_chunk", self.head_position_chunk,
                 "must be >= 1 (positions per head-loss tile)")
        _require(self.head_vocab_chunk >= 1, s, "head_vocab_chunk", self.head_vocab_chunk,
                 "must be >= 1 (vocabulary entries per head-loss tile)")
        _one_of(s, "matmul_precision", self.matmul_precision, ("profile", *MATMUL_PRECISIONS))
        _require(self.checkpoint_every >= 0, s, "checkpoint_every", self.checkpoint_every, "must be >= 0")
        _require(self.log_every >= 0, s, "log_every", self.log_every, "must be >= 0 (0 = evaluation steps only)")


@dataclass
class EvalConfig:
    """Evaluation cadence and protocol (docs/DESIGN.md §7)."""

    protocol: str = "both"
    every: int = 500
    batches: int = 50
    batch_size: int = 0  # 0 = the training batch size
    full_batch_size: int = 0  # windows per batch of the full protocol's pass; 0 = the eval batch size
    eval_sample_seed: int = 20001
    full_max_windows: int = 0  # 0 = every window of the split (the full protocol)
    full_nt_stride: int = 1  # NT full protocol: a target every N positions (1 = every position)
    ppl_cap_log: float = 20.0  # reference: PPL = exp(min(20, loss))

    def __post_init__(self) -> None:
        s = "eval"
        _check_numbers(s, self)
        _one_of(s, "protocol", self.protocol, EVAL_PROTOCOLS)
        _require(self.every >= 1, s, "every", self.every, "must be >= 1")
        _require(self.batches >= 1, s, "batches", self.batches, "must be >= 1")
        _require(self.batch_size >= 0, s, "batch_size", self.batch_size, "must be >= 0 (0 = train batch)")
        _require(self.full_batch_size >= 0, s, "full_batch_size", self.full_batch_size,
                 "must be >= 0 (0 = the eval batch size)")
        _require(self.full_max_windows >= 0, s, "full_max_windows", self.full_max_windows, "must be >= 0")
        _require(self.full_nt_stride >= 1, s, "full_nt_stride", self.full_nt_stride, "must be >= 1")


@dataclass
class RunConfig:
    """Everything one run needs. ``experiments`` builds it from Hydra; tests build it directly."""

    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.train.matmul_precision == "profile":
            _require(self.profile.name in PROFILE_MATMUL_PRECISION, "train", "matmul_precision", "profile",
                     f"profile.name={self.profile.name!r} has no default matmul precision: set "
                     f"train.matmul_precision to one of {list(MATMUL_PRECISIONS)}")
        if self.profile.hash_int32_wraparound:
            _require(self.memory.num_buckets < MAX_BUCKETS, "memory", "num_buckets", self.memory.num_buckets,
                     "must be below 2^31 under profile.hash_int32_wraparound (int32 hash arithmetic)")
        if self.model.variant in TRANSFORMER_VARIANTS and self.profile.positional == "trainable_jax":
            _require(self.train.seq_len <= self.model.max_seq_len, "train", "seq_len", self.train.seq_len,
                     f"exceeds model.max_seq_len={self.model.max_seq_len} (the positional table's rows)")


HEAD_LOSS_AUTO_LOGITS = 2**28
"""``train.head_loss=auto`` trains through tiles when one step's ``[N, V]`` logits on one device would hold more
elements than this (1 GiB in float32), and in one tile otherwise (docs/KERNELS.md, "Chunked head loss")."""


def head_loss_chunks(cfg: RunConfig, parts: int = 1) -> tuple[int, int] | None:
    """``(position chunk, vocabulary chunk)`` of the training loss's head tiles, or None for one tile
    (``train.head_loss``). ``parts``: how many devices share a training batch (its rows split evenly), so
    one device's head reads ``batch_size / parts`` windows of T positions (full AR) or of one (next token).

    ``auto`` tiles only where one tile's logits would exceed :data:`HEAD_LOSS_AUTO_LOGITS` elements: tiles
    cost a fourth ``N·H·V`` product (the backward pass recomputes them), so where the logits fit, one tile is
    the faster form.
    """
    t = cfg.train
    positions = -(-t.batch_size // parts) * (t.seq_len if t.mode == "ar" else 1)
    large = positions * cfg.model.vocab_size > HEAD_LOSS_AUTO_LOGITS
    if t.head_loss == "full" or (t.head_loss == "auto" and not large):
        return None
    return t.head_position_chunk, t.head_vocab_chunk


def head_loss_label(chunks: tuple[int, int] | None) -> str:
    """How a run's head loss ran, for its record's ``device`` field."""
    return "head loss in one tile" if chunks is None else f"head loss in {chunks[0]}x{chunks[1]} tiles"


def attention_label(kernel: str) -> str:
    """How a windowed-attention run's attention ran (``kernel``: the backend's name for what
    ``model.attention_impl`` chose on its device), for its record's ``device`` field: ``auto`` differs by device,
    and the record says which one ran."""
    return f"windowed attention by {kernel}"


def validate(cfg: RunConfig) -> RunConfig:
    """Re-run every section's checks (after fields were mutated) and return ``cfg``."""
    for f in fields(cfg):
        getattr(cfg, f.name).__post_init__()
    cfg.__post_init__()
    return cfg
