# PCAF reproduction suite. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3.11
# VENV names make targets ($(VENV)/.installed), which cannot hold spaces; every other path variable may hold
# spaces, quotes or non-ASCII characters: recipes pass them through $(call q,...).
VENV ?= .venv
PY := $(VENV)/bin/python
# $(call q,TEXT): TEXT as one shell word, whatever it holds ('it'\''s').
q = '$(subst ','\'',$(1))'
# $(call hydra_str,TEXT): TEXT as a quoted Hydra override value ('a path', its quotes escaped as \').
hydra_str = '$(subst ',\',$(1))'
PYTEST_ARGS ?=
# Optional dependency groups of pyproject.toml installed besides dev, comma-separated: make setup EXTRAS=cluster.
# Each has its own stamp ($(VENV)/.installed-<extra>), so asking for one that is not installed installs it.
EXTRAS ?=
comma := ,
# glibc malloc keeps freed memory instead of unmapping it: 1.6-1.8x faster CPU training steps, same
# numbers (experiments/allocator.py explains; its entry points set this themselves when run directly).
export GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295:glibc.malloc.hugetlb=1

.PHONY: help setup test lint clean

# Feature targets (data, bench, reproduce-table, ...) live in mk/*.mk.
-include mk/*.mk

help:
	@echo "make setup   - create $(VENV) and install the project with dev extras (EXTRAS=cluster adds the cluster launchers;"
	@echo "               EXTRAS=gpu or tpu the JAX backend's CUDA or TPU plugin; comma-separated)"
	@echo "make test    - run the whole test suite (sets up first, with the cluster extra its launcher tests use)"
	@echo "make test-fast - the fast tier: no slow and no gpu tests (the edit-test loop)"
	@echo "make test-hermetic - the fast tier with XLA_FLAGS=...device_count=4, then with OMP_NUM_THREADS=1"
	@echo "               (times of all three: docs/results/README.md, \"Test suite\")"
	@echo "make test-gpu - the gpu tier on a CUDA machine (GPU_PY=python3 where there is no $(VENV))"
	@echo "make test-slurm - the cluster path against real Slurm: a one-node cluster started here (root; installs"
	@echo "               Debian's Slurm, munge and MariaDB with make slurm-deps); CI runs it after make test"
	@echo "make lint    - ruff check"
	@echo "make data    - verify the corpora and build the token caches (WikiText-2 vendored; pg19-mini when found)"
	@echo "make data-summary - splits, documents, tokens, vocabulary, OOV rate, cache location"
	@echo "make reproduce-table TABLE=<name> SCALE=<paper|gpu|cpu|smoke> BACKEND=<torch|jax> [ROWS=<globs>]"
	@echo "make reproduce-all SCALE=...  - every table"
	@echo "make step-cost TABLE=<name> SCALE=<scale> [ROWS=<globs>] - per-row step cost and the training time it implies"
	@echo "make sweep SWEEP_ROW=<table>/<row> SWEEP='memory.top_k=4,8,16,32' SCALE=smoke - Hydra multirun"
	@echo "    LAUNCHER=local|slurm (reproduce-table, sweep): one job per run, on this machine or a Slurm cluster"
	@echo "make figures - re-render tables and figures from existing run records"
	@echo "make paper-results - the committed paper-scale tables and figures again, from docs/results/runs"
	@echo "make params  - paper-scale parameter counts from the instantiated models"
	@echo "make bench   - the benchmark report docs/results/bench.md (routing vs T, throughput and fraction of peak,"
	@echo "               torch beside JAX; CSV and plots under bench/); BACKENDS_ROUNDS=2 for a shorter run;"
	@echo "               BENCH=quick (make bench-quick): small stand-ins, renders bench/quick/bench.md"
	@echo "make bench-decode | bench-kernels | bench-train-step | bench-head-loss | bench-precision | bench-data - the other benchmarks"
	@echo "make bench-cuda    - GPU speed targets, bf16 included, eager and as CUDA graphs: docs/results/bench_cuda.md"
	@echo "                     (= bench-cuda-steps + bench-cuda-curves, one GPU command each; GPU_PY=python3 without $(VENV))"
	@echo "Measured wall times of these targets: docs/results/README.md"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# An extra on top of the dev install (EXTRAS, or a target that needs it, e.g. LAUNCHER=...).
$(VENV)/.installed-%: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[dev,$*]'
	touch $@

setup: $(VENV)/.installed $(foreach e,$(subst $(comma), ,$(EXTRAS)),$(VENV)/.installed-$(e))

# Two tiers (pytest markers, tests/conftest.py): `make test-fast` leaves out the `slow` and `gpu` tests (the
# edit-test loop), `make test` runs everything but the `slurm` tier (make test-slurm, which needs root and daemons;
# CI runs both). One pytest worker per core (pytest-xdist), each test file on one
# worker so its module fixtures are built once, handed out longest file first (tests/conftest.py, which also gives
# each worker one intra-op thread). Both print their wall time last; the measured times are in
# docs/results/README.md ("Test suite").
PYTEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
.PHONY: test-fast test-hermetic
test: $(VENV)/.installed $(VENV)/.installed-cluster
	@start=$$SECONDS; $(PYTEST) -m "not slurm" --durations=25 $(PYTEST_ARGS); code=$$?; \
	  echo "make test: $$((SECONDS - start)) s wall"; exit $$code

test-fast: $(VENV)/.installed $(VENV)/.installed-cluster
	@start=$$SECONDS; $(PYTEST) -m "not slow and not gpu" --durations=10 $(PYTEST_ARGS); code=$$?; \
	  echo "make test-fast: $$((SECONDS - start)) s wall"; exit $$code

# The fast tier under the environments a user may have set: several emulated JAX devices, one OpenMP thread.
test-hermetic: $(VENV)/.installed $(VENV)/.installed-cluster
	XLA_FLAGS=--xla_force_host_platform_device_count=4 $(MAKE) --no-print-directory test-fast
	OMP_NUM_THREADS=1 $(MAKE) --no-print-directory test-fast

# The gpu tier, on a machine with CUDA: every gpu-marked test (the files that hold one), each named as it ends (-v),
# in one process. A GPU machine without this project's environment runs it as `make test-gpu GPU_PY=python3` with
# .gpu_site (experiments/gpu_paper_rows.py --make-site) and the checkout on PYTHONPATH.
GPU_PY ?= $(PY)
GPU_TEST_FILES = $(shell grep -l 'pytest.mark.gpu' tests/test_*.py)
.PHONY: test-gpu
test-gpu:
	@start=$$SECONDS; $(GPU_PY) -m pytest -v -p no:cacheprovider -m gpu $(GPU_TEST_FILES) $(PYTEST_ARGS); code=$$?; \
	  echo "make test-gpu: $$((SECONDS - start)) s wall"; exit $$code

# The slurm tier: tests/test_slurm.py submits tables and sweeps with sbatch to a one-node Slurm it starts on this
# machine (tests/local_slurm.py: munge, MariaDB, slurmdbd, slurmctld, slurmd, as root). Its own target, not part of
# make test: about 105 s spent mostly waiting on Slurm, which would hold one of make test's two workers; .ci/run runs
# it after make test.
SLURM_PACKAGES = $(shell $(PY) -c 'from tests.local_slurm import PACKAGES; print(*PACKAGES)')
.PHONY: slurm-deps test-slurm
slurm-deps: $(VENV)/.installed
	@if $(PY) -c 'import sys; from tests.local_slurm import missing_binaries; sys.exit(bool(missing_binaries()))'; \
	then :; elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make slurm-deps: installs Debian's $(SLURM_PACKAGES) with apt-get as root; elsewhere install them" \
	       "yourself"; exit 2; \
	else apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  $(SLURM_PACKAGES) >/dev/null && echo "installed $(SLURM_PACKAGES)"; fi

test-slurm: $(VENV)/.installed $(VENV)/.installed-cluster slurm-deps
	@start=$$SECONDS; $(PY) -m pytest -v -p no:cacheprovider -m slurm tests/test_slurm.py $(PYTEST_ARGS); code=$$?; \
	  echo "make test-slurm: $$((SECONDS - start)) s wall"; exit $$code

lint: $(VENV)/.installed
	$(PY) -m ruff check pcaf_core backends benchmarks experiments paper_tables tests

clean:
	rm -rf $(VENV) .pytest_cache .test_cache
