# Data targets (docs/DATA.md): prepare corpora, verify checksums, build token caches.
#   make data                          WikiText-2 (vendored) always; pg19-mini when found
#   make data DATA_DIR=/path/to/data   also search that folder (same as PCAF_DATA_DIR=...)
#   make data-prepare DATA=wikitext103 DATA_ARGS="data.layout=raw data.max_vocab=32000"
#   make data-summary                  splits, documents, tokens, vocabulary, OOV, cache location
#   make bench-data                    build/load timings -> bench/data.csv
DATA_DIR ?=
DATA ?= wikitext2
DATA_ARGS ?=
# Relative to the repository (the recipes' working directory), quoted: it may hold spaces.
DATA_ENV := $(if $(DATA_DIR),PCAF_DATA_DIR=$(call q,$(DATA_DIR)))

.PHONY: data data-prepare data-summary bench-data

data: $(VENV)/.installed
	$(DATA_ENV) $(PY) -m pcaf_core.data prepare data=wikitext2 data.max_vocab=20000
	$(DATA_ENV) $(PY) -m pcaf_core.data prepare data=pg19_mini data.max_vocab=32000 --optional

data-prepare: $(VENV)/.installed
	$(DATA_ENV) $(PY) -m pcaf_core.data prepare data=$(DATA) $(DATA_ARGS)

data-summary: $(VENV)/.installed
	$(DATA_ENV) $(PY) -m pcaf_core.data summary data=wikitext2 data.max_vocab=20000 --conventions -q
	$(DATA_ENV) $(PY) -m pcaf_core.data summary data=pg19_mini data.max_vocab=32000 --optional -q

bench-data: $(VENV)/.installed
	$(DATA_ENV) $(PY) benchmarks/bench_data.py --out bench/data.csv
