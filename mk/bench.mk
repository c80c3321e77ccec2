# Benchmarks: CSV under bench/ (gitignored); ratios are measured side by side in one run.
.PHONY: bench bench-throughput bench-train-step bench-kernels bench-precision bench-backends bench-decode

bench: bench-data bench-kernels bench-throughput bench-train-step bench-backends bench-decode

bench-kernels: $(VENV)/.installed
	$(PY) benchmarks/bench_kernels.py --out bench/kernels.csv

bench-throughput: $(VENV)/.installed
	$(PY) benchmarks/bench_throughput.py --out bench/throughput.csv

# Fused head loss and fused AdamW against the unfused training step, side by side (about 2 minutes).
bench-train-step: $(VENV)/.installed
	$(PY) -m benchmarks.bench_train_step --out bench/train_step.csv

# bf16 autocast vs fp32 learning curves of the cpu-scale PCAF-context row (about 5 minutes).
bench-precision: $(VENV)/.installed data
	$(PY) benchmarks/precision_check.py --steps 120 --every 30 --out bench/bf16-vs-fp32.md --csv bench/bf16-vs-fp32.csv

# One training step of the cpu-scale rows on torch and on JAX, in alternating fresh processes (about 6 minutes).
# BACKENDS_RESULTS=docs/results writes the committed copy (bench_backends_cpu.{csv,md}).
BACKENDS_RESULTS ?= bench
bench-backends: $(VENV)/.installed
	$(PY) -m benchmarks.bench_backends --out bench/backends.csv --results-dir $(BACKENDS_RESULTS)

# Decode cost per generated token against context (1K-64K), batch 1 and 8: PCAF-context, the dense
# Transformer with a KV cache, local conv (about 5 minutes on the 2-core CPU). DECODE_RESULTS=docs/results
# writes the committed copy (decode_cpu.{csv,png,md}); BENCH_ARGS=--quick checks that it runs (20 s).
DECODE_RESULTS ?= bench
BENCH_ARGS ?=
bench-decode: $(VENV)/.installed
	$(PY) -m benchmarks.bench_decode --out bench/decode.csv --results-dir $(DECODE_RESULTS) $(BENCH_ARGS)
