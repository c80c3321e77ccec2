# Benchmarks: CSV under bench/ (gitignored); ratios are measured side by side in one run.
.PHONY: bench bench-throughput bench-train-step bench-kernels bench-precision bench-backends

bench: bench-data bench-kernels bench-throughput bench-train-step bench-backends

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
bench-backends: $(VENV)/.installed
	$(PY) -m benchmarks.bench_backends --out bench/backends.csv
