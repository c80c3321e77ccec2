"""No quadratic array on the sparse JAX routes: full-AR routing of a T = 8192 window.

``jax.make_jaxpr`` gives every intermediate of the traced computation with its static shape, so the
largest one is read off exactly (no execution needed): the equations are walked recursively, into the
sub-jaxprs of ``pjit``, ``scan``/``map``, ``cond`` and ``checkpoint``. A single T×T array would hold
T² = 67M elements; the sparse routes stay linear in T (or bounded by the chunk size).

The ``topk_score`` route holds a ``lax.cond`` whose true branch is the dense fallback: it is measured
separately and must be bounded by the chunk (``chunk_elements`` scores, i.e. a few queries × T), never T×T.
"""

from __future__ import annotations

import math

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import ops
from backends.jax import routing as jr
from backends.jax.ops import CHUNK_ELEMENTS, gather_dot

T, K, D, S = 8192, 16, 16, 16


def _size(var) -> int:
    shape = getattr(var.aval, "shape", ())
    return math.prod(shape)


def _peaks(jaxpr: jex.Jaxpr, conds: list[list[int]]) -> int:
    """Largest outvar (elements) of ``jaxpr`` and its sub-jaxprs, ``cond`` branches excluded; the peak
    of each branch of every ``cond`` met is appended to ``conds`` (one list per cond, branch order)."""
    peak = 0
    for eqn in jaxpr.eqns:
        peak = max([peak, *(_size(v) for v in eqn.outvars)])
        if eqn.primitive.name == "cond":
            conds.append([_peaks(b.jaxpr, conds) for b in eqn.params["branches"]])
            continue
        for sub in jex.jaxprs_in_params(eqn.params):
            peak = max(peak, _peaks(sub, conds))
    return peak


def _measure(fn, *args) -> tuple[int, list[list[int]]]:
    conds: list[list[int]] = []
    return _peaks(jax.make_jaxpr(fn)(*args).jaxpr, conds), conds


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    addr = jnp.asarray(rng.integers(0, 64, (1, T)), jnp.int32)  # ~128 records per bucket: K = 16 overflows
    qpos = jnp.arange(T, dtype=jnp.int32)
    q = jnp.asarray(rng.normal(size=(1, T, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, T, D)), jnp.float32)
    rec = jnp.linspace(0.0, 1.0, T, dtype=jnp.float32)
    return addr, qpos, q, k, rec


@pytest.mark.slow
def test_recent_first_and_bucketed_semantic_are_linear_in_T() -> None:
    """Measured peak: T·K = 131072 elements (the ``[1, T, K]`` slot gathers), against T² = 67M."""
    addr, qpos, _, _, _ = _inputs()
    probs = jnp.ones((1, T, S), jnp.float32) / S
    for name, fn, arg in (
        ("recent", lambda a, q: jr.route_context(a, q, K, "recent"), addr),
        ("first", lambda a, q: jr.route_context(a, q, K, "first"), addr),
        ("bucketed", lambda p, q: jr.route_semantic_bucketed(jr.semantic_buckets(p), q, K), probs),
    ):
        peak, conds = _measure(fn, arg, qpos)
        assert not conds
        assert peak <= T * max(K, S), (name, peak)
        assert peak < T * T // 8


def test_topk_score_sparse_path_is_below_quadratic_and_dense_branch_is_chunked() -> None:
    """Measured peaks at T = 8192, K = 16, M = 64, d = 16: outside the fallback, the ``[1, 4096, 64, 16]``
    gather chunk of ``gather_dot`` (4.2M elements = ``CHUNK_ELEMENTS``); the fallback branch, one
    ``[1, 32, 8192]`` score chunk (262144: at most ``_FALLBACK_CHUNK`` queries a step); T² would be 67M.
    With ``chunk_elements = 16·T`` both fall to the ``[1, T, 65]`` window (532480 elements) and one
    ``[1, 16, 8192]`` score chunk (131072): the fallback is bounded by the chunk, not by T²."""
    addr, qpos, q, k, rec = _inputs()

    def route(chunk: int):
        def fn(a, qp, qq, kk, r, rho):
            return jr.route_context_topk_score(a, qp, K, jr.SelectionInputs(qq, kk, r, rho), chunk_elements=chunk)
        return fn

    for chunk in (CHUNK_ELEMENTS, 16 * T):
        peak, conds = _measure(route(chunk), addr, qpos, q, k, rec, jnp.float32(1.0))
        assert len(conds) == 1, conds
        keep_sparse, dense_fallback = conds[0]
        assert max(peak, keep_sparse) <= max(chunk, T * (4 * K + 1)) < T * T // 8, (chunk, peak, keep_sparse)
        assert dense_fallback <= chunk, (chunk, dense_fallback)
        rows = min(chunk // T, jr._FALLBACK_CHUNK)
        assert dense_fallback >= rows * T // 2  # it really scores whole rows of T records

    # strategy="dense" is the fallback on its own: same chunk bound, no cond.
    def dense(a, qp, qq, kk, r, rho):
        sel = jr.SelectionInputs(qq, kk, r, rho)
        return jr.route_context_topk_score(a, qp, K, sel, strategy="dense", chunk_elements=16 * T)

    peak, conds = _measure(dense, addr, qpos, q, k, rec, jnp.float32(1.0))
    assert not conds and peak <= 16 * T, peak


def test_semantic_dense_is_chunked() -> None:
    """The dense semantic route is O(T²) work by definition, but its memory is one chunk of queries:
    measured peak ``chunk_elements`` (the ``[1, 16, 8192]`` overlap chunk at ``chunk_elements = 16·T``)."""
    probs = jnp.ones((1, T, S), jnp.float32) / S
    qpos = jnp.arange(T, dtype=jnp.int32)
    rec = jnp.linspace(0.0, 1.0, T, dtype=jnp.float32)
    peak, _ = _measure(lambda p, r, q: jr.route_semantic_dense(p, r, 1.0, q, K, target_leak=True,
                                                              chunk_elements=16 * T), probs, rec, qpos)
    assert T * S <= peak <= 16 * T, peak


def test_the_default_chunk_is_the_platforms(monkeypatch) -> None:
    """``chunk_elements=None``: 4M elements on a CPU; on a GPU or TPU 64M, so the dense semantic route at the 41M
    full-AR shape (batch 8, T = 2,048, S = 256) scores all 33.5M overlaps in one chunk (no ``lax.map``) instead of
    eight; and one chunk selects what many chunks select."""
    assert ops.chunk_elements_for(None) == CHUNK_ELEMENTS and ops.chunk_elements_for(7) == 7

    def maps(fn, *args) -> int:
        text = str(jax.make_jaxpr(fn)(*args))
        return text.count("scan[") + text.count(" scan(") + text.count("while[")

    B, T41, S41 = 8, 2048, 256
    probs = jax.ShapeDtypeStruct((B, T41, S41), jnp.float32)
    rec, qpos = jax.ShapeDtypeStruct((T41,), jnp.float32), jnp.arange(T41, dtype=jnp.int32)
    def route():  # a new function each time: make_jaxpr keeps the trace of one it has seen
        return lambda p, r, q: jr.route_semantic_dense(p, r, 1.0, q, 32)

    assert maps(route(), probs, rec, qpos) > 0  # a CPU: chunks of 256 queries, in a loop
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ops.chunk_elements_for(None) == ops.CHUNK_ELEMENTS_ACCELERATOR
    peak, _ = _measure(route(), probs, rec, qpos)
    assert maps(route(), probs, rec, qpos) == 0 and peak == B * T41 * T41  # one chunk: every overlap at once
    monkeypatch.undo()
    rng = np.random.default_rng(3)
    small = jnp.asarray(rng.dirichlet(np.ones(8), size=(2, 40)), jnp.float32)
    r40, q40 = jnp.linspace(0.0, 1.0, 40, dtype=jnp.float32), jnp.arange(40, dtype=jnp.int32)
    one = jr.route_semantic_dense(small, r40, 0.5, q40, 4, chunk_elements=ops.CHUNK_ELEMENTS_ACCELERATOR)
    many = jr.route_semantic_dense(small, r40, 0.5, q40, 4, chunk_elements=2 * 40)  # one query a chunk
    assert np.array_equal(one.index, many.index) and np.array_equal(one.valid, many.valid)


def test_gather_dot_gradient_keeps_no_gathered_copy() -> None:
    """Reverse mode through ``gather_dot`` at ``chunk_elements = 16·T``: measured peak T·d = 131072
    elements (the key gradient itself); the plain gather-then-einsum keeps the ``[1, T, K, d]`` gather
    (2.1M) as a residual."""
    _, _, q, k, _ = _inputs()
    idx = jnp.zeros((1, T, K), jnp.int32)

    def chunked(a, b):
        return jnp.sum(gather_dot(a, b, idx, chunk_elements=16 * T) ** 2)

    def plain(a, b):
        return jnp.sum(jnp.einsum("bqd,bqcd->bqc", a, jax.vmap(lambda v, i: v[i])(b, idx)) ** 2)

    peak, _ = _measure(jax.grad(chunked, argnums=(0, 1)), q, k)
    naive, _ = _measure(jax.grad(plain, argnums=(0, 1)), q, k)
    assert peak <= 16 * T and naive == T * K * D, (peak, naive)
