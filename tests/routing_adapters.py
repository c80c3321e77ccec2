"""Routing test adapters: each shared case of the routing tests runs on both backends through one interface.

An adapter takes NumPy inputs and returns NumPy arrays: :class:`TorchBackend` (int64 tensors, NumPy's float64,
eager) and :class:`JaxBackend` (int32 arrays; routes under ``jax.jit`` with static K/policy/configuration and a
traced ρ). JAX time in these tests is XLA compilation, so several configurations share one compilation. The
spec-side helpers build inputs and NumPy references. :data:`BOTH` parametrizes a test over both adapters;
:data:`JAX_SLOW` marks the JAX case slow where it compiles for a second or more.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from backends.jax import ops as jops
from backends.jax import routing as jr
from backends.torch import ops as tops
from backends.torch import routing as troute
from pcaf_core import hashing, mixture, records, routing

# ----------------------------------------------------------------------------- spec-side helpers


def unit_rows(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def spec_select(query: np.ndarray, keys: np.ndarray, rec: np.ndarray, rho: float) -> np.ndarray:
    return mixture.selection_score(query, keys, rec, rho)


def assert_same(cand: routing.Candidates, ref: routing.Candidates, msg: str = "") -> None:
    np.testing.assert_array_equal(cand.index, ref.index, err_msg=msg)
    np.testing.assert_array_equal(cand.valid, ref.valid, err_msg=msg)


def earlier_same_bucket(addr: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """``[B, Q]`` number of earlier same-bucket records of each query."""
    return np.array([[np.sum(addr[b, :t] == addr[b, t]) for t in qpos] for b in range(len(addr))])


def token_rows(kind: str, B: int, T: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return rng.integers(0, 50, (B, T))
    if kind == "equal":
        return np.full((B, T), 7)
    return rng.integers(0, 3, (B, T))  # few distinct tokens: long buckets


def router_probs(rng: np.random.Generator, B: int, T: int, S: int, tau: float = 0.2) -> np.ndarray:
    logits = rng.normal(size=(B, T, S)) / tau
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def gather_dot_reference(x: np.ndarray, y: np.ndarray, index: np.ndarray, cot: np.ndarray):
    """``out[b, q, c] = x[b, q]·y[b, index[b, q, c]]`` and the gradients of ``Σ cot·out`` in x and y."""
    b = np.arange(len(x))[:, None, None]
    rows = y[b, index]
    gy = np.zeros_like(y)
    np.add.at(gy, (b, index), cot[..., None] * x[:, :, None, :])
    return np.einsum("bqd,bqcd->bqc", x, rows), np.einsum("bqc,bqcd->bqd", cot, rows), gy


# ----------------------------------------------------------------------------- backend adapters

POLICIES = ("recent", "first")
BANDED = (("query_layout", "ar"),)  # full AR: window scores read off blocked GEMMs, not gathered


class TorchBackend:
    """Torch: int64 index tensors, floats as NumPy gives them (float64 unless asked), eager."""

    name = "torch"
    compiles = False  # every parameter is cheap
    routing = troute

    @staticmethod
    def x64() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # NumPy's float64 carries over

    @staticmethod
    def ints(a) -> torch.Tensor:
        return torch.tensor(np.asarray(a), dtype=torch.int64)

    @staticmethod
    def floats(a, dtype=None) -> torch.Tensor:
        return torch.tensor(np.asarray(a, dtype))

    def candidates(self, c: routing.Candidates) -> routing.Candidates:
        return routing.Candidates(self.ints(c.index), torch.tensor(c.valid))

    @staticmethod
    def numpy(c: routing.Candidates) -> routing.Candidates:
        assert c.index.dtype == torch.int64 and c.valid.dtype == torch.bool
        return routing.Candidates(c.index.numpy(), c.valid.numpy())

    def _vjp(self, f, inputs: tuple, cot: np.ndarray) -> tuple:
        """``f(*inputs)`` and the gradients of ``Σ cot·f`` in each input."""
        args = [self.floats(a).requires_grad_(True) for a in inputs]
        out = f(*args)
        (out * self.floats(cot)).sum().backward()
        return (out.detach().numpy(), *(a.grad.numpy() for a in args))

    def route_context_all(self, addr, qpos, Ks) -> dict:
        a, q = self.ints(addr), self.ints(qpos)
        return {(K, p): self.numpy(troute.route_context(a, q, K, p)) for K in Ks for p in POLICIES}

    def route_context(self, addr, qpos, K: int, policy: str) -> routing.Candidates:
        return self.numpy(troute.route_context(self.ints(addr), self.ints(qpos), K, policy))

    def bucket_layout(self, addr) -> routing.BucketLayout:
        return routing.BucketLayout(*(a.numpy() for a in troute.bucket_layout(self.ints(addr))))

    @staticmethod
    def topk_configs(T: int, mode: str, K: int) -> tuple:
        """Default, forced dense, the smallest window M = K, and one query per dense chunk, each alone (JAX's
        list combines the last two); in full AR each also runs banded (:meth:`route_topk_score`)."""
        return ((), (("strategy", "dense"),), (("sparse_window", K),), (("chunk_elements", max(T, 1)),))

    def route_topk_score(self, addr, qpos, rec, query, keys, rho: float, K: int, configs: tuple) -> list:
        """``[(Candidates, dense)]`` per configuration. For full-AR query positions a configuration without a
        ``query_layout`` also runs banded (``query_layout="ar"``, returned), and the two window paths must agree
        slot for slot, dense flags included."""
        a, q = self.ints(addr), self.ints(qpos)
        sel = troute.SelectionInputs(self.floats(query), self.floats(keys), self.floats(rec), float(rho))
        full_ar = np.array_equal(qpos, np.arange(addr.shape[1]))
        out = []
        for config in configs:
            kw = dict(config)
            got = troute.route_context_topk_score(a, q, K, sel, **kw)
            if full_ar and "query_layout" not in kw:
                banded = troute.route_context_topk_score(a, q, K, sel, query_layout="ar", **kw)
                for x, y in zip((*got[0], got[1]), (*banded[0], banded[1])):
                    torch.testing.assert_close(x, y, rtol=0, atol=0)
                got = banded
            out.append((self.numpy(got[0]), got[1].numpy()))
        return out

    def route_topk_float32(self, addr, qpos, K: int, query, keys, rec, rho: float) -> routing.Candidates:
        sel = troute.SelectionInputs(*(self.floats(v, np.float32) for v in (query, keys, rec)), rho)
        return self.numpy(troute.route_context(self.ints(addr), self.ints(qpos), K, "topk_score", sel))

    def topk_rows(self, score, valid, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx, ok = troute.topk_rows(self.floats(score), torch.tensor(valid), k)
        return idx.numpy(), ok.numpy()

    def semantic_dense_all(self, probs, rec, rho: float, qpos, configs: tuple) -> list:
        p, r, q = self.floats(probs), self.floats(rec), self.ints(qpos)
        return [self.numpy(troute.route_semantic_dense(p, r, rho, q, K, target_leak=leak, chunk_elements=chunk))
                for K, leak, chunk in configs]

    def semantic_bucketed(self, probs, qpos, K: int) -> tuple[np.ndarray, routing.Candidates]:
        buckets = troute.semantic_buckets(self.floats(probs))
        return buckets.numpy(), self.numpy(troute.route_semantic_bucketed(buckets, self.ints(qpos), K))

    def semantic_overlap(self, probs, qpos) -> np.ndarray:
        return troute.semantic_overlap(self.floats(probs), self.ints(qpos)).numpy()

    def combine_hybrid(self, ctx, sem, dedup: bool) -> routing.Candidates:
        return self.numpy(troute.combine_hybrid(self.candidates(ctx), self.candidates(sem), dedup=dedup))

    def gather_records(self, values, cand) -> np.ndarray:
        return troute.gather_records(self.floats(values), self.candidates(cand)).numpy()

    def batch_gather(self, values, index) -> np.ndarray:
        return tops.batch_gather(self.ints(values), self.ints(index)).numpy()

    def gather_dot_vjp(self, x, y, index, cot, chunk: int | None = None) -> tuple:
        idx = self.ints(index)
        return self._vjp(lambda a, b: tops.gather_dot(a, b, idx, chunk_elements=chunk), (x, y), cot)

    def banded_dot_vjp(self, addr, x, y, W: int, cot) -> tuple:
        layout = troute.bucket_layout(self.ints(addr))
        return self._vjp(lambda a, b: tops.banded_dot(layout.order, layout.rank, a, b, W), (x, y), cot)

    def candidate_scores(self, addr, q, k, rec, rho: float, cand, probs, scale: float) -> tuple:
        """The slot scores with the ``recent`` band of ``addr``'s layout, and gathered."""
        from backends.torch.mixture import candidate_scores

        p = self.floats(probs)
        args = (self.floats(q), self.floats(k), self.floats(rec), rho, self.candidates(cand), p, p, scale)
        band = routing.ScoreBand(troute.bucket_layout(self.ints(addr)))
        return candidate_scores(*args, band=band).numpy(), candidate_scores(*args).numpy()

    def permute_rows_and_gather_vjp(self, x, perm, cot) -> tuple:
        """``(out, grad)`` of ``permute_rows`` and of the plain row gather by the same permutation."""
        p = self.ints(perm)
        inverse = torch.argsort(p, dim=1)
        return (self._vjp(lambda v: tops.permute_rows(v, p, inverse), (x,), cot),
                self._vjp(lambda v: tops.batch_gather(v, p), (x,), cot))


@partial(jax.jit, static_argnames="Ks")
def _jax_context_all(addr: jax.Array, qpos: jax.Array, Ks: tuple) -> dict:
    return {(K, p): jr.route_context(addr, qpos, K, p) for K in Ks for p in POLICIES}


_jax_route_context = jax.jit(jr.route_context, static_argnums=(2, 3))  # K, policy
_jax_bucket_layout = jax.jit(jr.bucket_layout)
_jax_combine_hybrid = jax.jit(jr.combine_hybrid, static_argnames="dedup")


@partial(jax.jit, static_argnames=("K", "config"))
def _jax_topk(addr, qpos, query, keys, rec, rho, *, K: int, config: tuple) -> tuple[routing.Candidates, jax.Array]:
    """The route under jit: K and the keyword configuration static, ρ traced."""
    return jr.route_context_topk_score(addr, qpos, K, jr.SelectionInputs(query, keys, rec, rho), **dict(config))


@partial(jax.jit, static_argnames="configs")
def _jax_semantic_all(probs, rec, rho, qpos, configs: tuple) -> list:
    return [jr.route_semantic_dense(probs, rec, rho, qpos, K, target_leak=leak, chunk_elements=chunk)
            for K, leak, chunk in configs]


@partial(jax.jit, static_argnames="K")
def _jax_bucketed(probs: jax.Array, qpos: jax.Array, K: int) -> tuple[jax.Array, routing.Candidates]:
    buckets = jr.semantic_buckets(probs)
    return buckets, jr.route_semantic_bucketed(buckets, qpos, K)


def jax_vjp(f, inputs: tuple, cot: jax.Array) -> tuple:
    out, vjp = jax.vjp(f, *inputs)
    return (out, *vjp(cot))


@partial(jax.jit, static_argnames="chunk")
def jax_gather_dot_vjp(x, y, index, cot, chunk: int | None) -> tuple:
    kw = {} if chunk is None else {"chunk_elements": chunk}
    return jax_vjp(lambda a, b: jops.gather_dot(a, b, index, **kw), (x, y), cot)


@partial(jax.jit, static_argnames="W")
def _jax_banded_dot_vjp(addr, x, y, cot, W: int) -> tuple:
    layout = jr.bucket_layout(addr)
    return jax_vjp(lambda a, b: jops.banded_dot(layout.order, layout.rank, a, b, W), (x, y), cot)


@partial(jax.jit, static_argnames="scale")
def _jax_candidate_scores(addr, q, k, rec, rho, cand, probs, scale: float) -> tuple:
    from backends.jax.mixture import candidate_scores

    args = (q, k, rec, rho, cand, probs, probs, scale)
    return candidate_scores(*args, band=routing.ScoreBand(jr.bucket_layout(addr))), candidate_scores(*args)


@jax.jit
def _jax_permute_rows_and_gather_vjp(x, perm, cot) -> tuple:
    inverse = jnp.argsort(perm, axis=1)
    return (jax_vjp(lambda v: jops.permute_rows(v, perm, inverse), (x,), cot),
            jax_vjp(lambda v: jops.batch_gather(v, perm), (x,), cot))


class JaxBackend:
    """JAX: int32 index arrays, floats at the default width (float64 inside :meth:`x64`); routes under
    ``jax.jit`` (the ``_jax_*`` functions above), each new shape or static argument one compilation."""

    name = "jax"
    compiles = True
    routing = jr

    @staticmethod
    def x64() -> contextlib.AbstractContextManager:
        return jax.enable_x64(True)

    @staticmethod
    def ints(a) -> jax.Array:
        return jnp.asarray(a, jnp.int32)

    @staticmethod
    def floats(a, dtype=None) -> jax.Array:
        return jnp.asarray(a, dtype)

    def candidates(self, c: routing.Candidates) -> routing.Candidates:
        return routing.Candidates(self.ints(c.index), jnp.asarray(c.valid))

    @staticmethod
    def numpy(c: routing.Candidates) -> routing.Candidates:
        assert c.index.dtype == jnp.int32 and c.valid.dtype == jnp.bool_
        return routing.Candidates(np.asarray(c.index), np.asarray(c.valid))

    def route_context_all(self, addr, qpos, Ks) -> dict:
        got = _jax_context_all(self.ints(addr), self.ints(qpos), tuple(Ks))
        return {key: self.numpy(c) for key, c in got.items()}

    def route_context(self, addr, qpos, K: int, policy: str) -> routing.Candidates:
        return self.numpy(_jax_route_context(self.ints(addr), self.ints(qpos), K, policy))

    def bucket_layout(self, addr) -> routing.BucketLayout:
        return routing.BucketLayout(*(np.asarray(a) for a in _jax_bucket_layout(self.ints(addr))))

    @staticmethod
    def topk_configs(T: int, mode: str, K: int) -> tuple:
        """Default, forced dense, and (AR, T = 200) the smallest window M = K with one query per dense chunk;
        in AR also the banded window scores (default window, and M = K at T = 200, where M does not divide T).
        Each is a compilation, so the redundant ones are left out: K = 50 (above the occupancy of most
        buckets) needs only the default (and, AR, banded); the property test covers other small windows."""
        banded = (BANDED,) if mode == "ar" else ()
        if K > 3:
            return ((), *banded)
        configs = ((), (("strategy", "dense"),), *banded)
        if T == 200 and mode == "ar":
            configs += ((("sparse_window", K), ("chunk_elements", T)), (("sparse_window", K), *BANDED))
        return configs

    def route_topk_score(self, addr, qpos, rec, query, keys, rho: float, K: int, configs: tuple) -> list:
        """``[(Candidates, dense)]`` per configuration; tests with equal shapes share compilations."""
        query = jnp.asarray(query)
        args = (self.ints(addr), self.ints(qpos), query, jnp.asarray(keys), jnp.asarray(rec),
                jnp.asarray(rho, query.dtype))
        return [(self.numpy(c), np.asarray(d)) for c, d in (_jax_topk(*args, K=K, config=cfg) for cfg in configs)]

    def route_topk_float32(self, addr, qpos, K: int, query, keys, rec, rho: float) -> routing.Candidates:
        with jax.default_matmul_precision("highest"):
            sel = jr.SelectionInputs(*(jnp.asarray(v, jnp.float32) for v in (query, keys, rec)), rho)
            return self.numpy(_jax_route_context(self.ints(addr), self.ints(qpos), K, "topk_score", sel))

    def topk_rows(self, score, valid, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx, ok = jr.topk_rows(jnp.asarray(score), jnp.asarray(valid), k)
        return np.asarray(idx), np.asarray(ok)

    def semantic_dense_all(self, probs, rec, rho: float, qpos, configs: tuple) -> list:
        got = _jax_semantic_all(jnp.asarray(probs), jnp.asarray(rec), jnp.asarray(rho), self.ints(qpos),
                                tuple(configs))
        return [self.numpy(c) for c in got]

    def semantic_bucketed(self, probs, qpos, K: int) -> tuple[np.ndarray, routing.Candidates]:
        buckets, cand = _jax_bucketed(jnp.asarray(probs, jnp.float32), self.ints(qpos), K)
        return np.asarray(buckets), self.numpy(cand)

    def semantic_overlap(self, probs, qpos) -> np.ndarray:
        return np.asarray(jr.semantic_overlap(jnp.asarray(probs), self.ints(qpos)))

    def combine_hybrid(self, ctx, sem, dedup: bool) -> routing.Candidates:
        return self.numpy(_jax_combine_hybrid(self.candidates(ctx), self.candidates(sem), dedup=dedup))

    def gather_records(self, values, cand) -> np.ndarray:
        return np.asarray(jr.gather_records(jnp.asarray(values), self.candidates(cand)))

    def batch_gather(self, values, index) -> np.ndarray:
        return np.asarray(jops.batch_gather(jnp.asarray(values), jnp.asarray(index)))

    def gather_dot_vjp(self, x, y, index, cot, chunk: int | None = None) -> tuple:
        got = jax_gather_dot_vjp(jnp.asarray(x), jnp.asarray(y), self.ints(index), jnp.asarray(cot), chunk)
        return tuple(np.asarray(a) for a in got)

    def banded_dot_vjp(self, addr, x, y, W: int, cot) -> tuple:
        got = _jax_banded_dot_vjp(self.ints(addr), jnp.asarray(x), jnp.asarray(y), jnp.asarray(cot), W)
        return tuple(np.asarray(a) for a in got)

    def candidate_scores(self, addr, q, k, rec, rho: float, cand, probs, scale: float) -> tuple:
        """The slot scores with the ``recent`` band of ``addr``'s layout, and gathered."""
        got = _jax_candidate_scores(self.ints(addr), *(jnp.asarray(v) for v in (q, k, rec, rho)),
                                    self.candidates(cand), jnp.asarray(probs), scale)
        return tuple(np.asarray(a) for a in got)

    def permute_rows_and_gather_vjp(self, x, perm, cot) -> tuple:
        """``(out, grad)`` of ``permute_rows`` and of the plain row gather by the same permutation."""
        got = _jax_permute_rows_and_gather_vjp(jnp.asarray(x), self.ints(perm), jnp.asarray(cot))
        return tuple(tuple(np.asarray(a) for a in pair) for pair in got)


def backend_params(slow: tuple[str, ...] = ()) -> list:
    """The ``backend`` parameter: both adapters, those named in ``slow`` marked slow."""
    return [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.name in slow else [])
            for b in (TorchBackend(), JaxBackend())]


BOTH = backend_params()
JAX_SLOW = backend_params(slow=("jax",))  # the JAX case compiles for a second or more


# ----------------------------------------------------------------------------- shared cases


def address_rows(rows: str, T: int, seed: int) -> np.ndarray:
    """``[6, T]`` addresses. ``hashed``: 7 and 32768 buckets, one overflowing bucket (all tokens equal), few
    long buckets, 3 buckets, and every position alone in its bucket (empty buckets everywhere). Otherwise two
    sequences of ``rows`` tokens (:func:`token_rows`) hashed into 64, 5 and 3 buckets. One shape: one compilation."""
    rng = np.random.default_rng(seed)
    if rows == "hashed":
        return np.stack([
            hashing.addresses(rng.integers(0, 50, T), 1, 7),
            hashing.addresses(rng.integers(0, 5000, T), 2, 32768),
            hashing.addresses(np.full(T, 7), 1, 3),
            hashing.addresses(rng.integers(0, 3, T), 1, 3),
            rng.integers(0, 3, T),
            np.arange(T),
        ])
    tok = token_rows(rows, 2, T, rng)
    return np.concatenate([hashing.addresses(tok, 1, nb) for nb in (64, 5, 3)])


def topk_case(T: int, mode: str, seed: int, *, nb: int = 2, kind: str = "random", d: int = 8, mixed: bool = True):
    """``addr, qpos, rec, query, keys`` of 5 sequences (2 without ``mixed``): two of ``kind`` tokens
    (:func:`token_rows`) hashed into ``nb`` buckets, then 50 random tokens in ``nb`` buckets, 3 in 5 buckets, and
    one token (one bucket: every query overflows). Each group draws from its own generator seeded ``seed``;
    unit queries and keys."""
    qpos, rec = records.query_positions(T, mode), records.recency(T, mode)
    rng = np.random.default_rng(seed)
    addr = [hashing.addresses(token_rows(kind, 2, T, rng), 1, nb)]
    keys, query = [unit_rows(rng, 2, T, d)], [unit_rows(rng, 2, len(qpos), d)]
    if not mixed:
        return addr[0], qpos, rec, query[0], keys[0]
    rng = np.random.default_rng(seed)
    addr.append(np.stack([hashing.addresses(rng.integers(0, 50, T), 1, nb),
                          hashing.addresses(rng.integers(0, 3, T), 1, 5),
                          hashing.addresses(np.full(T, 7), 1, 7)]))
    query.append(unit_rows(rng, 3, len(qpos), d))
    keys.append(unit_rows(rng, 3, T, d))
    return np.concatenate(addr), qpos, rec, np.concatenate(query), np.concatenate(keys)


def band_case(T: int = 75, W: int = 8, d: int = 6, seed: int = 11):
    """Addresses in 3 buckets (each holding more than W records, T not a multiple of W), rows, and the
    ``recent`` slots of every position: the layout each backend's ``ops.banded_dot`` reads."""
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, 3, (2, T))
    x, y = rng.normal(size=(2, T, d)), rng.normal(size=(2, T, d))
    return addr, x, y, routing.route_context(addr, np.arange(T), W, "recent")
