# PCAF reproduction suite. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help setup test lint clean

# Feature targets (data, bench, reproduce-table, ...) live in mk/*.mk.
-include mk/*.mk

help:
	@echo "make setup   - create $(VENV) and install the project with dev extras"
	@echo "make test    - run the test suite (runs setup first when $(VENV) is missing)"
	@echo "make lint    - ruff check"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check pcaf_core backends experiments paper_tables tests

clean:
	rm -rf $(VENV) .pytest_cache
