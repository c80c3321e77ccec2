"""Test-wide settings.

Triton kernels run under the interpreter when no CUDA device is present; the variable must be set
before ``triton`` is first imported, hence here.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The cycle collector at thresholds 50,000 / 50 / 50 instead of Python's 700 / 10 / 10. The tests allocate
# containers by the million (Dynamo's and AOT autograd's traces, OmegaConf's node copies in every composition, JAX's
# tracing), and at the default every 700 of them start a collection that also walks the young survivors. Only
# cyclic garbage waits longer; everything else is freed when its last reference goes, as before.
gc.set_threshold(50_000, 50, 50)

# Under pytest-xdist (`make test` runs two workers on a 2-core machine) each worker, and every process it
# starts, takes one intra-op thread: two workers of two threads each would fight over the cores.
# Set before torch is first imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # The gpu tier runs torch and JAX in one process: JAX's default, 75% of the GPU's memory taken at its first use,
    # would leave torch's tests a quarter (or fail where torch already holds more). Set before JAX starts.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _pinned_jaxlib() -> bool:
    """Whether the installed jaxlib is the release pyproject.toml pins JAX to (read without importing JAX)."""
    try:
        installed = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return False
    with open(REPO / "pyproject.toml", "rb") as fh:
        dependencies = tomllib.load(fh)["project"]["dependencies"]
    return any(re.fullmatch(rf"jax(\[[\w,]+\])?=={re.escape(installed)}", d.replace(" ", "")) for d in dependencies)


# Both XLA settings below are for the project's pinned CPU stack: set only with the pinned jaxlib (_pinned_jaxlib)
# and only on a machine without CUDA. Another jaxlib may not know a flag (XLA exits at start-up on an unknown
# XLA_FLAGS entry, and under pytest's output capture it exits without a word: jaxlib 0.11.2 does so on the second),
# and on a GPU machine JAX compiles for the GPU anyway.
#
# XLA's CPU code generation at LLVM -O0 in tests: JAX test time is mostly compilation, and this takes about 30% off
# it. The arithmetic is the same up to float rounding (measured, see below): XLA's own passes (fusion, layouts, its
# vectorised reductions and its approximations of exp/log/tanh) still run, and LLVM without fast-math may not reorder
# floating-point operations at any level. A level the user set is kept. Set before JAX starts; subprocesses inherit it.
if not HAS_CUDA and _pinned_jaxlib() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# And XLA:CPU's LLVM IR fusion emitters instead of its MLIR fusion emitters (both XLA's own code generators for the
# same optimised HLO program): this halves what compilation is left (a JAX test file's CPU time: -35% to -50%).
# Like -O0, it moves results by float rounding only: a float32 and a float64 forward and gradient of every variant
# and three train steps differ from the default build's in the last bits, as -O0's do; every test compares within
# tolerances, or bit for bit against a run under the same flags. A setting the user made is kept.
if not HAS_CUDA and _pinned_jaxlib() and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()

# JAX's persistent compilation cache, in this checkout's ignored .test_cache/jax/: JAX test time is mostly XLA
# compilation of programs that another test, the other xdist worker, a test's subprocess or the previous run
# compiled already (the same HLO from a new jit wrapper misses JAX's in-memory cache). Every program is kept
# (thresholds 0; by default JAX keeps only those that took a second to compile): the JAX test files take about 40%
# less time from the second run on, and the first run about as long as without the cache. XLA keys an entry on the
# program, the compile options and flags, the jaxlib and the device, so a hit is the executable the compilation
# would have made. No size cap: JAX's capped cache takes a file lock for every read and write, which cost the
# suite more than the cache saved; `make clean` removes the folder (about 30 MB after a run). Not under
# .compile_cache/, which experiments/gpu_paper_rows.py packs and carries. A variable the user set is kept; a fresh
# clone starts empty. Set before JAX starts; subprocesses inherit it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".test_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# Several tests start subprocesses that must import the project from this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smoke_pcaf_run(tmp_path_factory) -> Path:
    """The run directory of wt2-nt-1024/pcaf_context trained at smoke scale by the table driver (what
    ``make reproduce-table SCALE=smoke`` runs); shared by the generation and stream-protocol tests."""
    from experiments.reproduce import main as reproduce_main

    out = tmp_path_factory.mktemp("outputs")
    assert reproduce_main(["--table", "wt2-nt-1024", "--scale", "smoke", "--rows", "pcaf_context",
                           "--output-root", str(out)]) == 0
    runs = list((out / "wt2-nt-1024" / "smoke" / "torch" / "pcaf_context").iterdir())
    assert len(runs) == 1
    return runs[0]


@pytest.fixture
def cuda_code_paths():
    """The torch device whose code paths a step takes: CUDA where present; on a CPU, CPU tensors with the choices
    a CUDA tensor gets (benchmarks.op_census.cuda_code_paths: the Triton candidate kernels, run by the interpreter;
    gathered scores instead of the CPU's sparse products; the segmented key-gradient op; the head loss's kernels
    over 16-bit logits; dropout's mask kernel; the memory read's row and L2 normalisation kernels; the gate's and the
    addresses' kernels; the gathers' chunk size)."""
    import torch

    if HAS_CUDA:
        yield torch.device("cuda")
        return
    from benchmarks.op_census import cuda_code_paths as chosen

    with chosen():
        yield torch.device("cpu")


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Gradients through FlexAttention's eager implementation on a CPU: torch refuses FlexAttention inputs that
    require grad there (it has no fused CPU backward), and so does ``backends.torch.window_attention``; its eager
    reference implementation differentiates all the same, which the CPU tests of the banded path use."""
    from torch.nn.attention import flex_attention as torch_flex

    from backends.torch import window_attention

    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    monkeypatch.setattr(window_attention, "NO_BACKWARD_DEVICES", ())


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module of tiny-tensor tests: more threads only add synchronisation
    on a shared 2-core machine. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- the order in which xdist hands out test files
#
# `make test` gives each worker whole files (--dist loadfile) in collection order (--no-loadscope-reorder), handing a
# worker the next file when its current one is nearly done. Longest first keeps both workers busy to the end: the
# other order leaves one worker alone with a two-minute file after everything else has finished. The durations are
# those of a measured run (FILE_COSTS, seconds per file, summed over its tests' setup, call and teardown); a file
# missing from it counts as FILE_COST_UNKNOWN. Regenerate after tests move:
#     make test PYTEST_ARGS=--write-file-costs
FILE_COSTS = Path(__file__).with_name("file_costs.json")
FILE_COST_UNKNOWN = 5.0


def pytest_addoption(parser):
    parser.addoption("--write-file-costs", action="store_true",
                     help=f"write each test file's summed duration to {FILE_COSTS.name} at the end of the run")


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER") or not FILE_COSTS.is_file():
        return  # one process: the files' own order
    import json

    costs = json.loads(FILE_COSTS.read_text(encoding="utf-8"))
    position = {}
    for item in items:
        position.setdefault(item.nodeid.split("::")[0], len(position))
    # Stable: a file's tests keep their order; files of equal cost keep theirs.
    items.sort(key=lambda item: (-costs.get(item.nodeid.split("::")[0], FILE_COST_UNKNOWN),
                                 position[item.nodeid.split("::")[0]]))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a run without workers) sums the reports
        path = report.nodeid.split("::")[0]
        _durations[path] = _durations.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--write-file-costs") and not os.environ.get("PYTEST_XDIST_WORKER"):
        import json

        costs = {path: round(seconds, 1) for path, seconds in sorted(_durations.items())}
        FILE_COSTS.write_text(json.dumps(costs, indent=1) + "\n", encoding="utf-8")
