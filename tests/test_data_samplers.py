"""Window samplers: reproducibility across processes, resume, alignment, full-split coverage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pcaf_core.data import DataError, FullEvalWindows, WindowSampler
from pcaf_core.data.corpora import repo_root

TOKENS = (np.arange(5000, dtype=np.int64) * 7919 % 1000).astype(np.int32)  # position-identifiable enough


def draw(seed: int, n: int = 5, mode: str = "nt", tokens: np.ndarray = TOKENS, T: int = 16, B: int = 4):
    s = WindowSampler(tokens, T, B, mode=mode, seed=seed)
    return [s.next_batch() for _ in range(n)]


def test_same_seed_same_windows_across_processes():
    code = """
    import json, numpy as np
    from pcaf_core.data import WindowSampler
    tokens = (np.arange(5000, dtype=np.int64) * 7919 % 1000).astype(np.int32)
    s = WindowSampler(tokens, 16, 4, mode="ar", seed=10001)
    out = [[b[0].tolist(), b[1].tolist()] for b in (s.next_batch() for _ in range(5))]
    print(json.dumps(out))
    """
    env = {**os.environ, "PYTHONPATH": str(repo_root())}
    runs = [subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                           cwd=repo_root(), timeout=60) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    a, b = (json.loads(r.stdout) for r in runs)
    assert a == b
    here = [[x.tolist(), y.tolist()] for x, y in draw(10001, mode="ar")]
    assert here == a


def test_different_seeds_differ_and_batches_differ():
    a, b = draw(1), draw(2)
    assert any(not np.array_equal(x[0], y[0]) for x, y in zip(a, b))
    assert not np.array_equal(a[0][0], a[1][0])  # the stream moves on


def test_reference_start_distribution_and_formula():
    # Starts are rng.integers(0, N-T-1): every value in [0, N-T-2], never N-T-1.
    n, T = 40, 8
    tokens = np.arange(n, dtype=np.int32)
    s = WindowSampler(tokens, T, 64, mode="ar", seed=0)
    starts = np.concatenate([s.sample_starts() for _ in range(100)])
    assert set(starts.tolist()) == set(range(n - T - 1))
    rng = np.random.default_rng(123)
    expect = rng.integers(0, n - T - 1, size=64)
    np.testing.assert_array_equal(WindowSampler(tokens, T, 64, seed=123).sample_starts(), expect)


def test_nt_and_ar_targets_are_aligned():
    tokens = np.arange(100, dtype=np.int32)  # token value == position
    nt = WindowSampler(tokens, 10, 8, mode="nt", seed=5)
    x, y = nt.next_batch()
    assert x.shape == (8, 10) and y.shape == (8,) and x.dtype == np.int32 and y.dtype == np.int32
    np.testing.assert_array_equal(x, x[:, :1] + np.arange(10))
    np.testing.assert_array_equal(y, x[:, -1] + 1)
    ar = WindowSampler(tokens, 10, 8, mode="ar", seed=5)
    x2, y2 = ar.next_batch()
    assert y2.shape == (8, 10)
    np.testing.assert_array_equal(x2, x)  # same seed, same windows in both modes
    np.testing.assert_array_equal(y2, x2 + 1)
    assert x2.flags.c_contiguous and y2.flags.c_contiguous


def test_state_dict_resumes_the_identical_stream():
    s = WindowSampler(TOKENS, 16, 4, mode="ar", seed=77)
    for _ in range(3):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # checkpoints may store it as JSON
    assert state["batches_drawn"] == 3
    expect = [s.next_batch() for _ in range(4)]
    resumed = WindowSampler(TOKENS, 16, 4, mode="ar", seed=0)
    resumed.load_state_dict(state)
    got = [resumed.next_batch() for _ in range(4)]
    for (a, b), (c, d) in zip(expect, got):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    assert resumed.batches_drawn == 7 and resumed.seed == 77
    with pytest.raises(DataError, match="checkpoint has seq_len=16, this run has 32"):
        WindowSampler(TOKENS, 32, 4, mode="ar").load_state_dict(state)


def test_too_short_split_names_split_and_T():
    with pytest.raises(DataError, match=r"validation split has 11 tokens, too few for windows of T=10.*T\+2 = 12"):
        WindowSampler(np.zeros(11, np.int32), 10, 2, split="validation")
    WindowSampler(np.zeros(12, np.int32), 10, 2).next_batch()  # N = T+2 is the minimum
    with pytest.raises(DataError, match="unknown mode"):
        WindowSampler(TOKENS, 10, 2, mode="lm")
    with pytest.raises(DataError, match=r"too few for one evaluation window of T=10"):
        FullEvalWindows(np.zeros(10, np.int32), 10, 2)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 300), st.integers(1, 40), st.integers(1, 7))
def test_full_ar_windows_score_every_target_exactly_once(n, T, B):
    assume(n >= T + 1)
    tokens = np.arange(n, dtype=np.int32)
    w = FullEvalWindows(tokens, T, B, mode="ar")
    seen = []
    for batch in w:
        assert batch.inputs.shape == (B, T) and batch.targets.shape == (B, T) and batch.mask.shape == (B, T)
        # Each scored target is the token right after its input position.
        np.testing.assert_array_equal(batch.targets[batch.mask], (batch.inputs + 1)[batch.mask])
        seen.extend(batch.targets[batch.mask].tolist())
    assert sorted(seen) == list(range(1, n))  # positions 1..N-1, each once
    assert w.num_targets == n - 1 == len(seen)
    np.testing.assert_array_equal(np.sort(w.target_positions()), np.arange(1, n))
    assert all(s + T <= n - 1 for s in w.starts.tolist())  # every window has a full T-token context


def test_full_ar_last_window_is_end_aligned():
    tokens = np.arange(26, dtype=np.int32)  # N=26, T=10: windows at 0, 10, then 15 (end-aligned)
    w = FullEvalWindows(tokens, 10, 4, mode="ar")
    assert w.starts.tolist() == [0, 10, 15] and w.score_from.tolist() == [0, 0, 5]
    b = w.batch(0)
    assert b.mask[2].tolist() == [False] * 5 + [True] * 5
    assert not b.mask[3].any() and (b.inputs[3] == 0).all()  # padding row
    assert b.num_targets == 25


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 300), st.integers(1, 30), st.integers(1, 40), st.integers(1, 5))
def test_full_nt_windows_are_strided_targets(n, T, stride, B):
    assume(n >= T + 1)
    tokens = np.arange(n, dtype=np.int32)
    w = FullEvalWindows(tokens, T, B, mode="nt", stride=stride)
    pos = []
    for batch in w:
        assert batch.targets.shape == (B,) and batch.mask.shape == (B,)
        np.testing.assert_array_equal(batch.targets[batch.mask], batch.inputs[batch.mask][:, -1] + 1)
        pos.extend(batch.targets[batch.mask].tolist())
    assert pos == list(range(T, n, stride)) and w.num_targets == len(pos)


def test_full_nt_default_stride_is_T_and_max_windows_cuts():
    tokens = np.arange(1000, dtype=np.int32)
    w = FullEvalWindows(tokens, 100, 3, mode="nt")
    assert w.stride == 100 and w.target_positions().tolist() == list(range(100, 1000, 100))
    assert len(w) == 3
    cut = FullEvalWindows(tokens, 100, 3, mode="ar", max_windows=2)
    assert cut.num_windows == 2 and cut.num_targets == 200
    unpadded = FullEvalWindows(tokens, 100, 4, mode="nt", pad_batches=False)
    assert [b.inputs.shape[0] for b in unpadded] == [4, 4, 1]
    with pytest.raises(DataError, match="do not overlap"):
        FullEvalWindows(tokens, 100, 3, mode="ar", stride=50)


def test_samplers_work_on_memmaps(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, TOKENS)
    mm = np.load(p, mmap_mode="r")
    a = WindowSampler(mm, 16, 4, mode="ar", seed=3).next_batch()
    b = WindowSampler(TOKENS, 16, 4, mode="ar", seed=3).next_batch()
    np.testing.assert_array_equal(a[0], b[0])
    assert type(a[0]) is np.ndarray  # a batch is a plain in-memory array, not a view of the file
    assert sum(x.num_targets for x in FullEvalWindows(mm, 64, 8)) == len(TOKENS) - 1
