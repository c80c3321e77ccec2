# Paper tables, sweeps, figures and parameter counts (experiments/, paper_tables/).
# Default: the WikiText full-AR rows of the headline table at T=1024 (its measured wall time at SCALE=cpu:
# docs/results/README.md). Naming TABLE runs all of that table's rows unless ROWS is given.
ifeq ($(origin TABLE),undefined)
TABLE := main-303m
ROWS ?= *_wt103_t1024
endif
ROWS ?= *
SCALE ?= cpu
BACKEND ?= torch
OUTPUTS ?= outputs
OVERRIDES ?=
SWEEP_ROW ?= wt2-nt-1024/pcaf_context
SWEEP ?= memory.top_k=4,8,16,32
# SWEEP_DIR=<a sweep's directory>: run the sweep in it again, its finished jobs reused and its stopped ones resumed.
SWEEP_DIR ?=
# LAUNCHER=local|slurm: every run as a submitit job (its own process here, or a Slurm job), with the cluster extra
# installed on demand; JOBS=N: at most N local jobs at once; NO_WAIT=1: submit and return (the same command again
# collects and renders); STEP_COST=<csv of experiments.step_cost --csv>: Slurm job times from measured steps.
# Settings: OVERRIDES='hydra.launcher.partition=gpu ...' (docs/EXPERIMENTS.md, "On a cluster").
LAUNCHER ?=
JOBS ?=
NO_WAIT ?=
STEP_COST ?=
LAUNCHER_STAMP := $(if $(strip $(LAUNCHER)),$(VENV)/.installed-cluster)
LAUNCH_ARGS = $(if $(strip $(LAUNCHER)),--launcher $(call q,$(LAUNCHER))) $(if $(strip $(JOBS)),--jobs $(call q,$(JOBS))) \
  $(if $(strip $(NO_WAIT)),--no-wait) $(if $(strip $(STEP_COST)),--step-cost $(call q,$(STEP_COST)))
# The tables reproduce-all runs and figures renders (FIGURE_TABLES=wt2-nt-1024 renders one).
ALL_TABLES := wt2-nt-1024 wt2-nt-2048 wt103-nt-baselines wt103-nt-ablations sweeps-41m main-303m semantic-leak-audit
FIGURE_TABLES ?= $(ALL_TABLES)
# OVERRIDES and SWEEP are lists of Hydra overrides (shell words); every path variable is quoted.

.PHONY: reproduce-table reproduce-all sweep figures paper-results params step-cost

# One paper table: run its rows (reusing completed runs), collect, render. The last line printed is
# the path of the rendered Markdown table.
reproduce-table: $(VENV)/.installed $(LAUNCHER_STAMP) data
	$(PY) -m experiments.reproduce --table $(call q,$(TABLE)) --scale $(call q,$(SCALE)) --backend $(call q,$(BACKEND)) \
	  --rows $(call q,$(ROWS)) --output-root $(call q,$(OUTPUTS)) $(LAUNCH_ARGS) $(OVERRIDES)

reproduce-all: $(VENV)/.installed $(LAUNCHER_STAMP) data
	@for t in $(ALL_TABLES); do \
	  $(PY) -m experiments.reproduce --table $$t --scale $(call q,$(SCALE)) --backend $(call q,$(BACKEND)) \
	    --output-root $(call q,$(OUTPUTS)) $(LAUNCH_ARGS) $(OVERRIDES) || exit $$?; \
	done

# Per-row step cost of a table at a scale (the row's own shapes and text, a few timed steps): what a scale's
# budget is calibrated from. Run it alone on the machine.
step-cost: $(VENV)/.installed data
	$(PY) -m experiments.step_cost --table $(call q,$(TABLE)) --scale $(call q,$(SCALE)) --backend $(call q,$(BACKEND)) \
	  --rows $(call q,$(ROWS)) $(OVERRIDES)

# A Hydra multirun sweep over one row; ends in one table and one plot in the sweep directory, under
# $(OUTPUTS)/multirun/ (a sweep job is never taken for its row's run: docs/EXPERIMENTS.md, "Run identity").
sweep: $(VENV)/.installed $(LAUNCHER_STAMP) data
	$(PY) -m experiments.run -m experiment=$(call q,$(SWEEP_ROW)) scale=$(call q,$(SCALE)) backend=$(call q,$(BACKEND)) \
	  $(call q,output_root=$(call hydra_str,$(OUTPUTS))) $(if $(strip $(LAUNCHER)),hydra/launcher=$(call q,$(LAUNCHER))) \
	  $(if $(strip $(JOBS)),hydra.sweeper.max_batch_size=$(call q,$(JOBS))) $(SWEEP) $(OVERRIDES) \
	  $(if $(strip $(SWEEP_DIR)),$(call q,hydra.sweep.dir=$(call hydra_str,$(SWEEP_DIR))))

# Re-render every table and figure from the run records already under $(OUTPUTS) (each row from its own runs,
# chosen by identity; sweep jobs are listed, not rendered as rows) into $(FIGURES_OUT). OVERRIDES: the ones the
# rows were trained with. The committed paper-scale GPU rows: make paper-results.
FIGURES_OUT ?= $(OUTPUTS)/tables
figures: $(VENV)/.installed
	@for t in $(FIGURE_TABLES); do \
	  $(PY) -m paper_tables render --table $$t --scale $(call q,$(SCALE)) --backend $(call q,$(BACKEND)) \
	    --runs $(call q,$(OUTPUTS)) --out $(call q,$(FIGURES_OUT)) $(OVERRIDES) || exit $$?; \
	done

# The committed paper-scale tables, figures and torch-beside-JAX pages rendered again from docs/results/runs alone,
# each backend's records with the overrides its rows were trained with (experiments/paper_results.py).
paper-results: $(VENV)/.installed
	$(PY) -m experiments.paper_results

# Every paper-scale row's parameter count from the instantiated model (meta device), beside the paper's.
params: $(VENV)/.installed
	$(PY) -m experiments.params_report
