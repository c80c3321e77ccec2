"""Hashing, records and routing of both backends against the NumPy spec :mod:`pcaf_core`: exact addresses and
candidates, slot for slot, on awkward shapes.

Covers the sorted ``recent``/``first`` layout, both branches of the ``topk_score`` route (the sparse proof and
the dense fallback, each forced and asserted), exact score ties, the dense and bucketed semantic routes with and
without the target leak, hybrid combination, gathers, ``gather_dot`` values and gradients, and the banded
products that score full-AR candidates.

Each shared case is written once and runs for both backends through an adapter that takes NumPy inputs and
returns NumPy arrays: :class:`TorchBackend` (int64 tensors, NumPy's float64, eager) and :class:`JaxBackend`
(int32 arrays; routes under ``jax.jit`` with static K/policy/configuration and a traced ρ). JAX time here is
XLA compilation, so several configurations share one compilation and property tests keep fixed shapes; where a
JAX parameter would cost compilations of its own, torch alone runs it (said at each test). The last two
sections hold what one backend alone has: torch's hashing and record helpers (JAX's are in
``tests/test_jax_hashing.py``), window top-k, ``gather_dot`` paths and gradchecks; JAX's eager route,
undifferentiated selection, ``band_gather_dot`` and banded ``topk_score`` scores.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.jax import ops as jops
from backends.jax import routing as jr
from backends.torch import hashing as thash
from backends.torch import ops as tops
from backends.torch import records as trec
from backends.torch import routing as troute
from pcaf_core import hashing, mixture, records, routing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ----------------------------------------------------------------------------- spec-side helpers


def _unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _spec_select(query: np.ndarray, keys: np.ndarray, rec: np.ndarray, rho: float) -> np.ndarray:
    return mixture.selection_score(query, keys, rec, rho)


def _assert_same(cand: routing.Candidates, ref: routing.Candidates, msg: str = "") -> None:
    np.testing.assert_array_equal(cand.index, ref.index, err_msg=msg)
    np.testing.assert_array_equal(cand.valid, ref.valid, err_msg=msg)


def _counts(addr: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """``[B, Q]`` number of earlier same-bucket records of each query."""
    return np.array([[np.sum(addr[b, :t] == addr[b, t]) for t in qpos] for b in range(len(addr))])


def _tokens(kind: str, B: int, T: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return rng.integers(0, 50, (B, T))
    if kind == "equal":
        return np.full((B, T), 7)
    return rng.integers(0, 3, (B, T))  # few distinct tokens: long buckets


def _router_probs(rng: np.random.Generator, B: int, T: int, S: int, tau: float = 0.2) -> np.ndarray:
    logits = rng.normal(size=(B, T, S)) / tau
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _vjp_ref_gather_dot(x: np.ndarray, y: np.ndarray, index: np.ndarray, cot: np.ndarray):
    """``out[b, q, c] = x[b, q]·y[b, index[b, q, c]]`` and the gradients of ``Σ cot·out`` in x and y."""
    b = np.arange(len(x))[:, None, None]
    rows = y[b, index]
    gy = np.zeros_like(y)
    np.add.at(gy, (b, index), cot[..., None] * x[:, :, None, :])
    return np.einsum("bqd,bqcd->bqc", x, rows), np.einsum("bqc,bqcd->bqd", cot, rows), gy


# ----------------------------------------------------------------------------- backend adapters

_POLICIES = ("recent", "first")
_BANDED = (("query_layout", "ar"),)  # full AR: window scores read off blocked GEMMs, not gathered


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
        return {(K, p): self.numpy(troute.route_context(a, q, K, p)) for K in Ks for p in _POLICIES}

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
    return {(K, p): jr.route_context(addr, qpos, K, p) for K in Ks for p in _POLICIES}


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


def _jax_vjp(f, inputs: tuple, cot: jax.Array) -> tuple:
    out, vjp = jax.vjp(f, *inputs)
    return (out, *vjp(cot))


@partial(jax.jit, static_argnames="chunk")
def _jax_gather_dot_vjp(x, y, index, cot, chunk: int | None) -> tuple:
    kw = {} if chunk is None else {"chunk_elements": chunk}
    return _jax_vjp(lambda a, b: jops.gather_dot(a, b, index, **kw), (x, y), cot)


@partial(jax.jit, static_argnames="W")
def _jax_banded_dot_vjp(addr, x, y, cot, W: int) -> tuple:
    layout = jr.bucket_layout(addr)
    return _jax_vjp(lambda a, b: jops.banded_dot(layout.order, layout.rank, a, b, W), (x, y), cot)


@partial(jax.jit, static_argnames="scale")
def _jax_candidate_scores(addr, q, k, rec, rho, cand, probs, scale: float) -> tuple:
    from backends.jax.mixture import candidate_scores

    args = (q, k, rec, rho, cand, probs, probs, scale)
    return candidate_scores(*args, band=routing.ScoreBand(jr.bucket_layout(addr))), candidate_scores(*args)


@jax.jit
def _jax_permute_rows_and_gather_vjp(x, perm, cot) -> tuple:
    inverse = jnp.argsort(perm, axis=1)
    return (_jax_vjp(lambda v: jops.permute_rows(v, perm, inverse), (x,), cot),
            _jax_vjp(lambda v: jops.batch_gather(v, perm), (x,), cot))


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
        banded = (_BANDED,) if mode == "ar" else ()
        if K > 3:
            return ((), *banded)
        configs = ((), (("strategy", "dense"),), *banded)
        if T == 200 and mode == "ar":
            configs += ((("sparse_window", K), ("chunk_elements", T)), (("sparse_window", K), *_BANDED))
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
        got = _jax_gather_dot_vjp(jnp.asarray(x), jnp.asarray(y), self.ints(index), jnp.asarray(cot), chunk)
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


def _backends(slow: tuple[str, ...] = ()) -> list:
    """The ``backend`` parameter: both adapters, those named in ``slow`` marked slow."""
    return [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.name in slow else [])
            for b in (TorchBackend(), JaxBackend())]


BOTH = _backends()
JAX_SLOW = _backends(slow=("jax",))  # the JAX case compiles for a second or more

# ----------------------------------------------------------------------------- recent / first

_CONTEXT_KS = (1, 4, 40)  # K = 40 exceeds most buckets' occupancy
_ROW_SETS = ("hashed", "random", "equal", "few")


def _address_rows(rows: str, T: int, seed: int) -> np.ndarray:
    """``[6, T]`` addresses. ``hashed``: 7 and 32768 buckets, one overflowing bucket (all tokens equal), few
    long buckets, 3 buckets, and every position alone in its bucket (empty buckets everywhere). Otherwise two
    sequences of ``rows`` tokens (:func:`_tokens`) hashed into 64, 5 and 3 buckets. One shape: one compilation."""
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
    tok = _tokens(rows, 2, T, rng)
    return np.concatenate([hashing.addresses(tok, 1, nb) for nb in (64, 5, 3)])


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("rows", _ROW_SETS)
def test_recent_first_match_spec(backend, T: int, mode: str, rows: str) -> None:
    addr = _address_rows(rows, T, seed=T)
    qpos = records.query_positions(T, mode)
    got = backend.route_context_all(addr, qpos, _CONTEXT_KS)
    for (K, policy), cand in got.items():
        _assert_same(cand, routing.route_context(addr, qpos, K, policy), f"K={K} {policy}")
    if rows == "hashed":
        for cand in got.values():  # every position alone in its bucket: empty slots
            assert not cand.valid[5].any() and (cand.index[5] == -1).all()
        if T == 200 and mode == "ar":
            assert got[(4, "recent")].valid[2].sum(-1).max() == 4  # the full bucket overflows K


@pytest.mark.parametrize("backend", BOTH)
def test_empty_buckets_give_empty_slots(backend) -> None:
    got = backend.route_context(np.arange(10)[None], np.arange(10), 3, "recent")  # every position alone
    assert not got.valid.any() and (got.index == -1).all()


@pytest.mark.parametrize("backend", BOTH)
@settings(max_examples=30, deadline=None)
@given(n_buckets=st.integers(1, 6), seed=st.integers(0, 2**16), data=st.data())
def test_recent_first_property(backend, n_buckets: int, seed: int, data: st.DataObject) -> None:
    if backend.compiles:
        T, Ks = 24, _CONTEXT_KS  # fixed shapes: one compilation serves every example
    else:
        T, Ks = data.draw(st.integers(1, 40), label="T"), (data.draw(st.integers(1, 8), label="K"), *_CONTEXT_KS)
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, n_buckets, (2, T))
    qpos = np.arange(T)
    for (K, policy), got in backend.route_context_all(addr, qpos, Ks).items():
        _assert_same(got, routing.route_context(addr, qpos, K, policy), f"K={K} {policy}")
        # Causality and capacity: every valid slot is an earlier same-bucket record.
        idx, ok = got.index, got.valid
        b, q, _ = np.nonzero(ok)
        assert (idx[ok] < qpos[q]).all() and (addr[b, idx[ok]] == addr[b, qpos[q]]).all()


@pytest.mark.parametrize("backend", BOTH)
def test_bucket_layout_is_a_bucket_sort(backend) -> None:
    lay = backend.bucket_layout(np.array([[3, 1, 3, 0, 1, 3]]))
    assert lay.order.tolist() == [[3, 1, 4, 0, 2, 5]]
    assert lay.seg_start.tolist() == [[0, 1, 1, 3, 3, 3]]
    assert np.take_along_axis(lay.order, lay.rank, 1).tolist() == [list(range(6))]
    # Addresses near 2^31 (no address·T + position key to overflow).
    big = backend.bucket_layout(np.array([[2**31 - 1, 5, 2**31 - 1, 5, 0, 2**31 - 1]]))
    assert big.order.tolist() == [[4, 1, 3, 0, 2, 5]]


# ----------------------------------------------------------------------------- topk_score


def _topk_case(T: int, mode: str, seed: int, *, nb: int = 2, kind: str = "random", d: int = 8, mixed: bool = True):
    """``addr, qpos, rec, query, keys`` of 5 sequences (2 without ``mixed``): two of ``kind`` tokens
    (:func:`_tokens`) hashed into ``nb`` buckets, then 50 random tokens in ``nb`` buckets, 3 in 5 buckets, and
    one token (one bucket: every query overflows). Each group draws from its own generator seeded ``seed``;
    unit queries and keys."""
    qpos, rec = records.query_positions(T, mode), records.recency(T, mode)
    rng = np.random.default_rng(seed)
    addr = [hashing.addresses(_tokens(kind, 2, T, rng), 1, nb)]
    keys, query = [_unit(rng, 2, T, d)], [_unit(rng, 2, len(qpos), d)]
    if not mixed:
        return addr[0], qpos, rec, query[0], keys[0]
    rng = np.random.default_rng(seed)
    addr.append(np.stack([hashing.addresses(rng.integers(0, 50, T), 1, nb),
                          hashing.addresses(rng.integers(0, 3, T), 1, 5),
                          hashing.addresses(np.full(T, 7), 1, 7)]))
    query.append(_unit(rng, 3, len(qpos), d))
    keys.append(_unit(rng, 3, T, d))
    return np.concatenate(addr), qpos, rec, np.concatenate(query), np.concatenate(keys)


# (K, nb, kind, mixed): K = 50 above the occupancy of most buckets; K = 4 with one bucket, where every query
# overflows. The last two run in torch alone (in JAX each K is a compilation per configuration), on two sequences.
_TOPK_SPEC_CASES = ((3, 2, "random", True), (50, 3, "random", True), (2, 5, "few", False), (4, 1, "equal", False))


@pytest.mark.parametrize("backend", JAX_SLOW)
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
@pytest.mark.parametrize("rho", [-0.5, 0.0, 0.3, 1.0, 40.0])
def test_topk_score_matches_spec(backend, T: int, mode: str, rho: float) -> None:
    # JAX: K = 3, and K = 50 where T > 2 (at T <= 2 every bucket holds fewer than 3 records).
    cases = _TOPK_SPEC_CASES[: 1 if T <= 2 else 2] if backend.compiles else _TOPK_SPEC_CASES
    with backend.x64():
        for K, nb, kind, mixed in cases:
            addr, qpos, rec, query, keys = _topk_case(T, mode, seed=T + K, nb=nb, kind=kind, mixed=mixed)
            ref = routing.route_context(addr, qpos, K, "topk_score", _spec_select(query, keys, rec, rho))
            configs = backend.topk_configs(T, mode, K)
            for cfg, (got, dense) in zip(configs, backend.route_topk_score(addr, qpos, rec, query, keys, rho, K,
                                                                            configs)):
                _assert_same(got, ref, f"K={K} rho={rho} {cfg}")
                assert dense.shape == (len(addr), len(qpos))


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_topk_score_sparse_proof_branch_is_taken_and_exact(backend) -> None:
    # Buckets over T = 200 hold ~100 records (or all of them), far more than M = 4K = 12; ρ = 40 makes the
    # recency gap between the K-th and the (M+1)-th most recent record exceed 2/√d, so the proof holds.
    with backend.x64():
        addr, qpos, rec, query, keys = _topk_case(200, "ar", seed=1)
        # The proof was needed for most queries (> 100 of the first 400 and > 300 of the last 600)...
        assert (_counts(addr, qpos) > 12).sum() > 700
        ref = routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 40.0))
        for got, dense in backend.route_topk_score(addr, qpos, rec, query, keys, 40.0, 3, ((), _BANDED)):
            assert not dense.any()  # ...and it held for all of them
            _assert_same(got, ref)


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("rho", [-0.5, 0.0])
def test_topk_score_dense_fallback_branch_is_taken_and_exact(backend, rho: float) -> None:
    # ρ < 0 voids the proof; ρ = 0 leaves no recency gap to separate the window from older records.
    with backend.x64():
        addr, qpos, rec, query, keys = _topk_case(200, "ar", seed=2)
        ref = routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, rho))
        # The fallback in one chunk, and (torch; a compilation of its own in JAX) in several.
        configs = ((),) if backend.compiles else ((), (("chunk_elements", 1000),))
        for got, dense in backend.route_topk_score(addr, qpos, rec, query, keys, rho, 3, configs):
            np.testing.assert_array_equal(dense, _counts(addr, qpos) > 12)  # exactly the overflowing queries
            _assert_same(got, ref)


@pytest.mark.parametrize("backend", BOTH)
def test_topk_score_proof_uses_the_vector_norms(backend) -> None:
    # Keys and queries of norm ~4: a bound that assumed unit vectors would wrongly accept the window.
    with backend.x64():
        addr, qpos, rec, query, keys = _topk_case(200, "ar", seed=6)
        rng = np.random.default_rng(6)
        query, keys = query * 4.0, keys * rng.uniform(0.5, 4.0, (len(keys), 200, 1))
        ((got, dense),) = backend.route_topk_score(addr, qpos, rec, query, keys, 8.0, 3, ((),))
        assert dense.any()
        _assert_same(got, routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 8.0)))


@pytest.mark.parametrize("backend", BOTH)
def test_topk_score_mixed_branches(backend) -> None:
    # K = 2 would be a compilation of its own in JAX.
    with backend.x64():
        addr, qpos, rec, query, keys = _topk_case(200, "ar", seed=3, nb=3)
        for K in (3,) if backend.compiles else (3, 2):
            ((got, dense),) = backend.route_topk_score(addr, qpos, rec, query, keys, 4.0, K, ((),))
            assert dense.any() and not dense.all()
            _assert_same(got, routing.route_context(addr, qpos, K, "topk_score",
                                                    _spec_select(query, keys, rec, 4.0)))


# Unit vectors whose dot products are exact in any summation order, so exact score ties are real ties.
_EXACT_UNITS = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0.5, 0.5, 0.5, 0.5], [0.5, -0.5, 0.5, -0.5],
                         [-1, 0, 0, 0], [0, 0, 0.5, 0.5]])


@pytest.mark.parametrize("backend", JAX_SLOW)
@pytest.mark.parametrize("rho", [0.0, 1.0])
@pytest.mark.parametrize("strategy", ["auto", "dense"])
def test_topk_score_ties_go_to_the_lower_index(backend, rho: float, strategy: str) -> None:
    rng = np.random.default_rng(4)
    T = 63
    addr = rng.integers(0, 2, (2, T))
    qpos = np.arange(T)
    rec = records.recency(T, "ar")
    keys = _EXACT_UNITS[rng.integers(0, 2, (2, T))]  # only two distinct keys: many exact ties
    query = _EXACT_UNITS[rng.integers(0, 4, (2, T))]
    ref = routing.route_context(addr, qpos, 5, "topk_score", _spec_select(query, keys, rec, rho))
    configs = ((), _BANDED) if strategy == "auto" else ((("strategy", "dense"),),)
    with backend.x64():
        for cfg, (got, _) in zip(configs, backend.route_topk_score(addr, qpos, rec, query, keys, rho, 5, configs)):
            _assert_same(got, ref, f"{cfg}")


@pytest.mark.parametrize("backend", JAX_SLOW)
@settings(max_examples=30, deadline=None)
@given(nb=st.integers(1, 4), rho=st.sampled_from([-1.0, 0.0, 0.5, 3.0, 50.0]), seed=st.integers(0, 2**16),
       data=st.data())
def test_topk_score_property(backend, nb: int, rho: float, seed: int, data: st.DataObject) -> None:
    if backend.compiles:
        T, K, window = 30, 3, 1  # fixed shapes: one compilation serves every example
    else:
        T, K, window = (data.draw(st.integers(1, 30), label="T"), data.draw(st.integers(1, 6), label="K"),
                        data.draw(st.integers(0, 3), label="window - K"))
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, nb, (2, T))
    qpos = np.arange(T)
    rec = records.recency(T, "ar")
    keys = _EXACT_UNITS[rng.integers(0, len(_EXACT_UNITS), (2, T))]
    query = _EXACT_UNITS[rng.integers(0, len(_EXACT_UNITS), (2, T))]
    ref = routing.route_context(addr, qpos, K, "topk_score", _spec_select(query, keys, rec, rho))
    configs = ((("sparse_window", K + window),), (("sparse_window", K + window), *_BANDED))
    with backend.x64():
        for got, _ in backend.route_topk_score(addr, qpos, rec, query, keys, rho, K, configs):
            _assert_same(got, ref)


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_topk_score_float32_selection_matches_spec(backend) -> None:
    addr, qpos, rec, query, keys = _topk_case(63, "ar", seed=5, nb=3)
    ref = routing.route_context(addr, qpos, 3, "topk_score", _spec_select(query, keys, rec, 1.5))
    _assert_same(backend.route_topk_float32(addr, qpos, 3, query, keys, rec, 1.5), ref)


@pytest.mark.parametrize("backend", BOTH)
def test_route_context_argument_errors(backend) -> None:
    r = backend.routing
    addr, q = backend.ints(np.zeros((1, 4))), backend.ints(np.arange(4))
    with pytest.raises(ValueError, match="needs select"):
        r.route_context(addr, q, 2, "topk_score")
    with pytest.raises(ValueError, match="unknown"):
        r.route_context(addr, q, 2, "oldest")
    sel = r.SelectionInputs(backend.floats(np.zeros((1, 4, 2))), backend.floats(np.zeros((1, 4, 2))),
                            backend.floats(np.zeros(4)), 1.0)
    with pytest.raises(ValueError, match="strategy"):
        r.route_context_topk_score(addr, q, 2, sel, strategy="sparse")
    with pytest.raises(ValueError, match="query_layout 'full' is unknown"):
        r.route_context(addr, q, 2, "recent", query_layout="full")
    with pytest.raises(ValueError, match="query_layout 'ar' needs 4 query positions, got 1"):
        r.route_context_topk_score(addr, backend.ints([3]), 2, sel, query_layout="ar")


@pytest.mark.parametrize("backend", BOTH)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_topk_rows_matches_lexsort(backend, seed: int, data: st.DataObject) -> None:
    if backend.compiles:
        n, T, k = 4, 20, data.draw(st.sampled_from([1, 5, 25]), label="k")  # fixed shapes; k > T: padded slots
    else:
        n, T, k = (data.draw(st.integers(1, 12), label="n"), data.draw(st.integers(1, 20), label="T"),
                   data.draw(st.integers(1, 25), label="k"))
    rng = np.random.default_rng(seed)
    score = rng.integers(-3, 3, (n, T)).astype(np.float64)  # many ties; exact in float32 too
    valid = rng.random((n, T)) < 0.7
    idx, ok = backend.topk_rows(score, valid, k)
    assert idx.shape == ok.shape == (n, k)
    for r in range(n):
        cols = np.flatnonzero(valid[r])
        want = cols[np.lexsort((cols, -score[r, cols]))][:k]
        assert idx[r, : len(want)].tolist() == want.tolist()
        assert ok[r].sum() == len(want) and (idx[r, len(want):] == -1).all()


# ----------------------------------------------------------------------------- semantic

# (K, target_leak, chunk_elements): one chunk, or one query per chunk (per lax.map step in JAX). K = 30 exceeds
# most T. JAX computes its configurations in one compilation, which grows with each: one-query chunks for K = 3
# with the leak alone.
_SEM_CONFIGS = tuple((K, leak, chunk) for K in (3, 30) for leak in (False, True) for chunk in (1 << 22, 1))
_SEM_CONFIGS_JAX = tuple(c for c in _SEM_CONFIGS if c[2] > 1 or c[:2] == (3, True))


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("T", [1, 2, 24, 63])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_semantic_dense_matches_spec(backend, T: int, mode: str) -> None:
    rng = np.random.default_rng(T)
    probs = _router_probs(rng, 2, T, 5)
    qpos = records.query_positions(T, mode)
    rec = records.recency(T, mode)
    overlap = routing.semantic_overlap(probs, qpos)
    configs = _SEM_CONFIGS_JAX if backend.compiles else _SEM_CONFIGS
    with backend.x64():
        for rho in (-0.7, 0.0, 1.3):
            got = backend.semantic_dense_all(probs, rec, rho, qpos, configs)
            for (K, leak, chunk), cand in zip(configs, got):
                ref = routing.route_semantic_dense(overlap, rec, rho, qpos, K, target_leak=leak)
                _assert_same(cand, ref, f"K={K} leak={leak} chunk={chunk} rho={rho}")


@pytest.mark.parametrize("backend", BOTH)
def test_semantic_dense_leak_picks_the_target(backend) -> None:
    T, K = 12, 4
    probs = _router_probs(np.random.default_rng(0), 1, T, 3)
    got, plain = backend.semantic_dense_all(probs, records.recency(T, "ar"), 1.0, np.arange(T),
                                            ((K, True, 1 << 22), (K, False, 1 << 22)))
    for t in range(K):
        assert got.valid[0, t].all() and t in got.index[0, t].tolist()  # record t holds target x_{t+1}
    assert (got.index[0, K:] < np.arange(K, T)[:, None]).all()  # later queries stay causal
    assert not plain.valid[0, 0].any()  # without the leak, query 0 reads nothing


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("T", [1, 2, 63, 200])
@pytest.mark.parametrize("mode", ["nt", "ar"])
def test_semantic_bucketed_matches_spec(backend, T: int, mode: str) -> None:
    rng = np.random.default_rng(T)
    probs = _router_probs(rng, 2, T, 4)
    probs[0, : T // 2] = 0.25  # exact ties: argmax takes the lower bucket
    qpos = records.query_positions(T, mode)
    buckets, got = backend.semantic_bucketed(probs, qpos, 3)
    np.testing.assert_array_equal(buckets, routing.semantic_buckets(probs))
    _assert_same(got, routing.route_semantic_bucketed(routing.semantic_buckets(probs), qpos, 3))


@pytest.mark.parametrize("backend", BOTH)
def test_semantic_overlap_matches_spec(backend) -> None:
    probs = _router_probs(np.random.default_rng(1), 2, 9, 4)
    qpos = np.arange(9)
    with backend.x64():
        got = backend.semantic_overlap(probs, qpos)
    np.testing.assert_allclose(got, routing.semantic_overlap(probs, qpos), rtol=1e-12)


# ----------------------------------------------------------------------------- hybrid, gathers, products


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("dedup", [False, True])
def test_combine_hybrid_matches_spec(backend, dedup: bool) -> None:
    rng = np.random.default_rng(5)
    T, K = 24, 4
    addr = rng.integers(0, 3, (2, T))
    qpos = np.arange(T)
    ctx = routing.route_context(addr, qpos, K, "recent")
    sem = routing.route_semantic_dense(routing.semantic_overlap(_router_probs(rng, 2, T, 3), qpos),
                                       records.recency(T, "ar"), 1.0, qpos, K, target_leak=True)
    ref = routing.combine_hybrid(ctx, sem, dedup=dedup)
    got = backend.combine_hybrid(ctx, sem, dedup)
    _assert_same(got, ref)
    assert got.width == 2 * K
    assert (got.valid.sum(-1) <= ref.valid.sum(-1)).all()
    n_dup = ref.valid.sum() - ctx.valid.sum() - sem.valid.sum()
    assert (n_dup < 0) == dedup  # the case really has duplicates, and dedup removes them


@pytest.mark.parametrize("backend", BOTH)
def test_gather_records_matches_spec(backend) -> None:
    rng = np.random.default_rng(6)
    values = rng.normal(size=(2, 10, 3))
    cand = routing.route_context(rng.integers(0, 2, (2, 10)), np.arange(10), 3, "first")
    got = backend.gather_records(values, cand)  # float64 in torch, float32 in JAX: exact either way
    np.testing.assert_array_equal(got, routing.gather_records(values.astype(got.dtype), cand))
    tok = rng.integers(0, 9, (2, 10))
    np.testing.assert_array_equal(backend.batch_gather(tok, cand.index.clip(0)), routing.gather_records(tok, cand))


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_gather_dot_values_and_gradients(backend) -> None:
    """Values and gradients (float64) against the dense product, chunked in every way."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 6, 3))
    idx = rng.integers(0, 6, (2, 5, 4))  # repeated records within a query: their gradients add
    assert any(len(set(row)) < 4 for row in idx.reshape(-1, 4).tolist())
    cot = rng.normal(size=(2, 5, 4))
    want = _vjp_ref_gather_dot(x, y, idx, cot)
    with backend.x64():
        # Chunks of one query, of two (50 elements, 2·4·3 per query: three chunks, the last one padded in JAX),
        # and all at once.
        for chunk in (1, 50, 10**6):
            got = backend.gather_dot_vjp(x, y, idx, cot, chunk)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-12, err_msg=f"chunk={chunk}")
            for g, w in zip(got[1:], want[1:]):
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"chunk={chunk}")


def _band_case(T: int = 75, W: int = 8, d: int = 6, seed: int = 11):
    """Addresses in 3 buckets (each holding more than W records, T not a multiple of W), rows, and the
    ``recent`` slots of every position: the layout :func:`banded_dot` reads."""
    rng = np.random.default_rng(seed)
    addr = rng.integers(0, 3, (2, T))
    x, y = rng.normal(size=(2, T, d)), rng.normal(size=(2, T, d))
    return addr, x, y, routing.route_context(addr, np.arange(T), W, "recent")


@pytest.mark.parametrize("backend", JAX_SLOW)
@pytest.mark.parametrize("T", [75, 80, 5])
def test_banded_dot_equals_gather_dot_on_the_recent_slots(backend, T: int) -> None:
    """Values and gradients of banded_dot equal gather_dot's on every valid slot (float64), with T a multiple
    of the width, not one, and shorter than it."""
    W = 8
    addr, x, y, win = _band_case(T=T, W=W)
    ok = win.valid
    assert T < W or (ok.sum() > 4 * T and (~ok).sum() > 20)
    assert T != 75 or (ok.sum() > 500 and (~ok).sum() > 100)
    cot = np.where(ok, np.random.default_rng(1).normal(size=ok.shape), 0.0)
    with backend.x64():
        banded = backend.banded_dot_vjp(addr, x, y, W, cot)
        gathered = backend.gather_dot_vjp(x, y, win.index.clip(0), cot)
    np.testing.assert_allclose(banded[0][ok], gathered[0][ok], rtol=1e-12)
    for got, want in zip(banded[1:], gathered[1:]):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", JAX_SLOW)
def test_candidate_scores_with_a_band_equal_the_gathered_scores(backend) -> None:
    """The scores the models compute for full-AR recent / bucketed semantic slots, with and without the
    band, router term included."""
    addr, q, k, win = _band_case(W=8, d=5)
    logits = np.random.default_rng(3).normal(size=(2, 75, 4))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    with backend.x64():
        banded, gathered = backend.candidate_scores(addr, q, k, records.recency(75, "ar"), 0.7, win, probs, 1.0)
    np.testing.assert_allclose(banded[win.valid], gathered[win.valid], rtol=1e-12)


@pytest.mark.parametrize("backend", BOTH)
def test_permute_rows_vjp_is_the_inverse_gather(backend) -> None:
    """permute_rows' own backward (a gather by the inverse) equals autodiff of the plain row gather."""
    rng = np.random.default_rng(9)
    perm = np.stack([rng.permutation(11) for _ in range(2)])
    x = rng.normal(size=(2, 11, 3))
    cot = rng.normal(size=(2, 11, 3))
    (out, grad), (want, want_grad) = backend.permute_rows_and_gather_vjp(x, perm, cot)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(grad, want_grad)


# ----------------------------------------------------------------------------- torch only


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("int32", [False, True])
@pytest.mark.parametrize("num_buckets", [1, 7, 16, 32768, 2**31 - 1])
def test_torch_addresses_match_spec_bit_for_bit(order: int, int32: bool, num_buckets: int) -> None:
    rng = np.random.default_rng(order * 10 + int32)
    tok = rng.integers(0, 40000, (3, 37))
    tok[0, :5] = [0, 2**31 - 1, 2**31 - 2, 123456789, 1]  # int32 extremes
    got = thash.addresses(torch.tensor(tok), order, num_buckets, int32_wraparound=int32)
    want = hashing.addresses(tok, order, num_buckets, int32_wraparound=int32)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(
        thash.context_hash(torch.tensor(tok), order, int32_wraparound=int32).numpy(),
        hashing.context_hash(tok, order, int32_wraparound=int32))


def test_torch_int32_wraparound_differs_from_int64_for_order_two() -> None:
    tok = np.random.default_rng(0).integers(0, 40, (1, 64))
    a32 = thash.addresses(torch.tensor(tok), 2, 7, int32_wraparound=True).numpy()
    a64 = thash.addresses(torch.tensor(tok), 2, 7, int32_wraparound=False).numpy()
    assert (a32 != a64).any()  # the switch matters, so the exact match above is informative


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20), st.integers(1, 4), st.integers(1, 10**6),
       st.booleans())
def test_torch_addresses_property(tokens: list[int], order: int, num_buckets: int, int32: bool) -> None:
    tok = np.array([tokens])
    got = thash.addresses(torch.tensor(tok), order, num_buckets, int32_wraparound=int32).numpy()
    np.testing.assert_array_equal(got, hashing.addresses(tok, order, num_buckets, int32_wraparound=int32))


def test_torch_hash_argument_errors() -> None:
    with pytest.raises(ValueError, match="context order"):
        thash.context_hash(torch.zeros(1, 3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="num_buckets"):
        thash.bucket_of(torch.zeros(1, 3, dtype=torch.int64), 0)


def test_torch_records_helpers_match_spec() -> None:
    for T in (1, 2, 5):
        for mode in ("nt", "ar"):
            np.testing.assert_array_equal(trec.query_positions(T, mode).numpy(), records.query_positions(T, mode))
            np.testing.assert_array_equal(trec.recency(T, mode).numpy(), records.recency(T, mode))
    tok = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(trec.successor_values(torch.tensor(tok)).numpy(), records.successor_values(tok))
    with pytest.raises(ValueError, match="mode"):
        trec.query_positions(3, "bidirectional")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 7), st.integers(0, 2**16),
       st.sampled_from([torch.float32, torch.float64]))
def test_torch_window_topk_matches_lexsort(n: int, M: int, k: int, seed: int, dtype: torch.dtype) -> None:
    """The k best window slots by descending score, ties to the older slot (larger j), and the k-th score,
    on rows full of exact ties and empty (-inf) slots, so that ties straddle the k-th place. Which empty
    slots fill a row with fewer than k others is left open (the route marks them empty)."""
    k = min(k, M)
    rng = np.random.default_rng(seed)
    score = rng.integers(-2, 2, (1, n, M)).astype(np.float64)  # exact in float32 too; -0.0 equals 0.0
    score[rng.random((1, n, M)) < 0.3] = -np.inf
    score[score == 0] *= np.where(rng.random(int((score == 0).sum())) < 0.5, -1.0, 1.0)
    j, kth = troute._window_topk(torch.tensor(score, dtype=dtype), k)
    straddled = 0
    for r in range(n):
        row = score[0, r]
        ref = np.lexsort((-np.arange(M), -row))[:k]  # the last key sorts first: score desc, then j desc
        got = j[0, r].numpy()
        finite = np.isfinite(row[ref])
        np.testing.assert_array_equal(got[finite], ref[finite])
        assert np.all(np.isneginf(row[got[~finite]])) and len(set(got.tolist())) == k
        assert kth[0, r].item() == row[ref[-1]]
        straddled += np.isfinite(row[ref[-1]]) and np.sum(row >= row[ref[-1]]) > k
    if n >= 20 and M >= k + 3:
        assert straddled > 0  # the re-pick of straddling rows ran (no such row: about 1e-6 here)


@pytest.mark.parametrize("path", ["sparse", "gather"])
def test_torch_gather_dot_paths(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths: the CSR products (CPU float64 here) and the chunked row gathers (CUDA, bf16, compiled);
    gradcheck, no_grad, one input differentiable, out-of-range slots, more slots than records."""
    if path == "gather":
        monkeypatch.setattr(tops, "_sparse_path", lambda x, y, index: False)
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.normal(size=(2, 5, 3)), requires_grad=True)
    y = torch.tensor(rng.normal(size=(2, 6, 3)), requires_grad=True)
    idx = torch.tensor(rng.integers(0, 6, (2, 5, 4)))  # repeated records within a query: their gradients add
    assert tops._sparse_path(x, y, idx) == (path == "sparse")
    assert any(len(set(row)) < 4 for row in idx.reshape(-1, 4).tolist())
    dense = torch.einsum("bqd,bqcd->bqc", x, y[torch.arange(2)[:, None, None], idx])
    for chunk in (1, 7, 10**6):  # chunks of one query, of a few, and all at once
        torch.testing.assert_close(tops.gather_dot(x, y, idx, chunk_elements=chunk), dense)
        with torch.no_grad():
            torch.testing.assert_close(tops.gather_dot(x, y, idx, chunk_elements=chunk), dense)
        assert torch.autograd.gradcheck(lambda a, b, c=chunk: tops.gather_dot(a, b, idx, chunk_elements=c), (x, y))
    # one input differentiable: the other gets no gradient and the first the same one
    xs = x.detach().clone().requires_grad_(True)
    tops.gather_dot(xs, y.detach(), idx).sum().backward()
    expected = torch.autograd.grad(dense.sum(), x, retain_graph=True)[0]
    torch.testing.assert_close(xs.grad, expected)
    with pytest.raises(IndexError, match="out of range"):
        tops.gather_dot(x, y, torch.full_like(idx, 6))
    # more slots than records (C > B·T, windows shorter than K): the gather path, same values
    short = torch.tensor(rng.normal(size=(1, 2, 3)), requires_grad=True)
    few = torch.tensor([[[0, 1, 1, 0, 0]]])
    assert not tops._sparse_path(x[:1, :1], short, few)
    assert torch.autograd.gradcheck(lambda a, b: tops.gather_dot(a, b, few),
                                    (x[:1, :1].detach().requires_grad_(), short))


def test_torch_gather_dot_takes_the_gather_path_in_bf16() -> None:
    x, y = torch.randn(1, 4, 8, dtype=torch.bfloat16), torch.randn(1, 6, 8, dtype=torch.bfloat16)
    idx = torch.randint(0, 6, (1, 4, 3))
    assert not tops._sparse_path(x, y, idx) and tops._sparse_path(x.float(), y.float(), idx)
    torch.testing.assert_close(tops.gather_dot(x, y, idx).float(), tops.gather_dot(x.float(), y.float(), idx),
                               atol=0.1, rtol=0.02)


def test_torch_candidate_scores_refuse_a_topk_score_band() -> None:
    """Torch scores ``topk_score`` candidates by gathering: a band with a window width is refused."""
    from backends.torch.mixture import candidate_scores

    addr, q, k, win = _band_case(W=8, d=5)
    layout = troute.bucket_layout(torch.tensor(addr))
    cand = TorchBackend().candidates(win)
    args = (torch.tensor(q), torch.tensor(k), torch.tensor(records.recency(75, "ar")), 0.7, cand)
    with pytest.raises(ValueError, match="pass no band"):
        candidate_scores(*args, band=routing.ScoreBand(layout, 12))


def test_torch_permute_rows_gradcheck() -> None:
    rng = np.random.default_rng(9)
    perm = torch.tensor(np.stack([rng.permutation(11) for _ in range(2)]))
    inverse = torch.argsort(perm, dim=1)
    x = torch.tensor(rng.normal(size=(2, 11, 3)), requires_grad=True)
    assert torch.equal(tops.permute_rows(x, perm, inverse), tops.batch_gather(x, perm))
    assert torch.autograd.gradcheck(lambda v: tops.permute_rows(v, perm, inverse), (x,))


# ----------------------------------------------------------------------------- JAX only


@pytest.mark.slow
def test_jax_batch_of_one_eager() -> None:
    addr = _address_rows("hashed", 30, seed=1)[3:4]
    qpos = np.arange(30)
    got = JaxBackend.numpy(jr.route_context(addr, qpos, 3, "recent"))
    _assert_same(got, routing.route_context(addr, qpos, 3, "recent"))


@pytest.mark.slow
def test_jax_topk_score_selection_is_not_differentiated() -> None:
    # Gradients flow through the scores of the selected slots, never through the selection: the
    # gradient equals the one with the candidates held fixed.
    addr, qpos, rec, query, keys = _topk_case(24, "ar", seed=7, d=4)
    rec32 = jnp.asarray(rec, jnp.float32)

    def slot_scores(q: jax.Array, k: jax.Array, cand: routing.Candidates) -> jax.Array:
        return jnp.sum(jnp.where(cand.valid, jops.gather_dot(q, k, jnp.maximum(cand.index, 0)), 0.0))

    def loss(q: jax.Array, k: jax.Array) -> jax.Array:
        cand = jr.route_context(addr, qpos, 2, "topk_score", jr.SelectionInputs(q, k, rec32, 1.0))
        return slot_scores(q, k, cand), cand

    q, k = jnp.asarray(query, jnp.float32), jnp.asarray(keys, jnp.float32)
    (gq, gk), cand = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(q, k)
    fixed = jax.jit(jax.grad(slot_scores, argnums=(0, 1)))(q, k, cand)
    np.testing.assert_allclose(np.asarray(gq), np.asarray(fixed[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gk), np.asarray(fixed[1]), rtol=1e-6)
    assert float(jnp.abs(gq).sum()) > 0


def _scattered_slots(T: int = 75, W: int = 8, C: int = 5, seed: int = 5):
    """A bucket layout and, for every position, C slots drawn from all its earlier same-bucket records (so
    many lie further back than W sorted slots), some empty: the shape of ``topk_score`` candidates with
    dense-fallback queries among them."""
    addr, x, y, _ = _band_case(T=T, W=W, seed=seed)
    layout = jr.bucket_layout(jnp.asarray(addr))
    order, rank, start = (np.array(a) for a in layout)
    rng = np.random.default_rng(seed)
    index = np.full((2, T, C), -1)
    for b in range(2):
        for t in range(T):
            earlier = order[b, start[b, rank[b, t]]:rank[b, t]]
            pick = rng.permutation(earlier)[:C]
            index[b, t, :len(pick)] = pick
    return layout, x, y, jnp.asarray(index)


@partial(jax.jit, static_argnames=("W", "outside_pairs"))
def _jax_band_gather_dot_vjp(order, rank, x, y, index, cot, W: int, outside_pairs: int) -> tuple:
    return _jax_vjp(lambda a, b: jops.band_gather_dot(order, rank, a, b, index, W, outside_pairs=outside_pairs),
                    (x, y), cot)


@pytest.mark.parametrize(("outside_pairs", "band_width"), [(4096, 8), (7, 8), (4096, 80)],
                         ids=["compact", "every-slot", "none-outside"])
@pytest.mark.slow
def test_jax_band_gather_dot_equals_gather_dot(outside_pairs: int, band_width: int) -> None:
    """Values and gradients on every non-empty slot, inside the band and outside it: outside pairs gathered
    compactly, or (more of them than ``outside_pairs``) every slot gathered; with a band wider than the
    sequence no pair lies outside and nothing is gathered."""
    W = band_width
    with jax.enable_x64(True):
        layout, x, y, index = _scattered_slots(W=8)
        ok = np.asarray(index) >= 0
        offset = np.asarray(layout.rank)[..., None] - 1 - np.take_along_axis(
            np.asarray(layout.rank), np.maximum(np.asarray(index), 0).reshape(2, -1), axis=1).reshape(index.shape)
        outside = (ok & (offset >= W)).sum()
        assert (ok & (offset < W)).sum() > 300 and (~ok).sum() > 20
        assert outside > 100 if W == 8 else outside == 0
        cot = jnp.where(ok, jnp.asarray(np.random.default_rng(2).normal(size=ok.shape)), 0.0)
        x, y = jnp.asarray(x), jnp.asarray(y)
        banded = _jax_band_gather_dot_vjp(layout.order, layout.rank, x, y, index, cot, W=W,
                                          outside_pairs=outside_pairs)
        gathered = _jax_gather_dot_vjp(x, y, jnp.maximum(index, 0), cot, None)
        np.testing.assert_allclose(np.asarray(banded[0])[ok], np.asarray(gathered[0])[ok], rtol=1e-12)
        for f, g in zip(banded[1:], gathered[1:]):
            np.testing.assert_allclose(np.asarray(f), np.asarray(g), rtol=1e-10, atol=1e-12)


@partial(jax.jit, static_argnames="K")
def _jax_topk_band_scores(addr, q, k, rec, rho, K: int) -> tuple:
    """The full-AR route (ρ traced) and its candidates' scores with the route's band and gathered."""
    from backends.jax.mixture import candidate_scores

    layout = jr.bucket_layout(addr)
    cand, dense = jr.route_context_topk_score(addr, jnp.arange(addr.shape[1]), K, jr.SelectionInputs(q, k, rec, rho),
                                              query_layout="ar", layout=layout)
    args = (q, k, rec, rho, cand)
    band = routing.ScoreBand(layout, routing.topk_sparse_window(K))
    return cand, dense, layout.rank, candidate_scores(*args, band=band), candidate_scores(*args)


@pytest.mark.slow
def test_jax_topk_score_candidates_scored_with_a_band_equal_the_gathered_scores() -> None:
    """Full-AR ``topk_score`` as the models run it (M = 4K, the route's band), with queries the proof
    cannot cover (ρ < 0 sends every overflowing query to the dense fallback): the banded scores equal the
    gathered ones on every valid slot, and some of those slots lie outside the M-window."""
    T, K, d = 120, 2, 4
    M = routing.topk_sparse_window(K)
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        addr = jnp.asarray(rng.integers(0, 2, (1, T)))
        q, k = (jnp.asarray(rng.normal(size=(1, T, d))) for _ in range(2))
        rec = jnp.asarray(records.recency(T, "ar"))
        for rho in (0.5, -0.5):
            cand, dense, rank, banded, gathered = _jax_topk_band_scores(addr, q, k, rec, jnp.asarray(rho), K=K)
            ok = np.asarray(cand.valid)
            np.testing.assert_allclose(np.asarray(banded)[ok], np.asarray(gathered)[ok], rtol=1e-12)
        rank = np.asarray(rank)[0]
        offset = rank[:, None] - 1 - rank[np.maximum(np.asarray(cand.index)[0], 0)]
        assert np.asarray(dense).any() and (ok[0] & (offset >= M)).any()
