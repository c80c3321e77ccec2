"""What JAX's routing alone has: the eager route on a batch of one, undifferentiated ``topk_score`` selection,
``band_gather_dot`` and the banded ``topk_score`` scores, each against its gathered equivalent.

The cases both backends share are in ``tests/test_routing.py`` and ``tests/test_routing_semantic.py``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax import ops as jops
from backends.jax import routing as jr
from pcaf_core import records, routing
from tests.routing_adapters import (
    JaxBackend,
    address_rows,
    assert_same,
    band_case,
    jax_gather_dot_vjp,
    jax_vjp,
    topk_case,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.mark.slow
def test_jax_batch_of_one_eager() -> None:
    addr = address_rows("hashed", 30, seed=1)[3:4]
    qpos = np.arange(30)
    got = JaxBackend.numpy(jr.route_context(addr, qpos, 3, "recent"))
    assert_same(got, routing.route_context(addr, qpos, 3, "recent"))


@pytest.mark.slow
def test_jax_topk_score_selection_is_not_differentiated() -> None:
    # Gradients flow through the scores of the selected slots, never through the selection: the
    # gradient equals the one with the candidates held fixed.
    addr, qpos, rec, query, keys = topk_case(24, "ar", seed=7, d=4)
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
    addr, x, y, _ = band_case(T=T, W=W, seed=seed)
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
    return jax_vjp(lambda a, b: jops.band_gather_dot(order, rank, a, b, index, W, outside_pairs=outside_pairs),
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
        gathered = jax_gather_dot_vjp(x, y, jnp.maximum(index, 0), cot, None)
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


@pytest.mark.parametrize("shape", [(6, 257), (3, 4, 20)])
def test_argmax_last_is_jnp_argmax(shape) -> None:
    """The first maximum, ties and infinities included, and the first NaN where a row holds one."""
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), shape))
    x = np.round(x, 1)  # ties
    x[0] = -np.inf
    x[1, ..., 3] = np.inf
    x[1, ..., 9] = np.inf
    x[2, ..., 5] = np.nan
    x[2, ..., 2] = np.nan
    x[2, ..., 1] = np.inf
    got = jops.argmax_last(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(np.asarray(jax.jit(jops.argmax_last)(jnp.asarray(x))), np.asarray(got))
