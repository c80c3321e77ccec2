# Benchmarks: CSV under bench/ (gitignored); ratios are measured side by side in one run.
.PHONY: bench bench-quick bench-routing bench-models bench-report bench-kernels bench-train-step bench-precision \
	bench-backends bench-decode bench-cuda bench-cuda-steps bench-cuda-curves bench-head-loss

# The benchmark report: routing cost against T, training throughput and fraction of the matmul peak, torch
# beside JAX, rendered into docs/results/bench.md with every speed target judged. The parts
# run one after another (never in parallel: they time the whole machine); run it on an otherwise idle machine.
# Measured alone on 2-core machines: 1,127 s = 18.8 minutes on an AMD EPYC whose GEMMs ran faster (routing 102 s,
# models 530 s, backends 489 s; at 4598e64; models 432 s and backends 494 s again at 2013f89/f40ae94, 389 s and
# 464 s at ce7b822); 1,444 s = 24.1 minutes on an AMD EPYC from a fresh clone (routing 127 s,
# models 646 s, backends 663 s; the committed report's run, 3 backend rounds, full-AR steps of 4,096 tokens),
# 1,351 s in the run before it (at f4dcc7a: 126, 563, 657 s); 1,540 s on the
# EPYC before the eager conv and oneMKL changes (routing 142 s, models 688 s, backends 704 s); 1,560 s = 26.0
# minutes on a Xeon with AVX-512 (routing 153 s, models 600 s, backends 801 s; the same settings, earlier code);
# BACKENDS_ROUNDS=2 saves about 250 s; 1,054-1,143 s in earlier runs with 2 rounds and full-AR batch 1);
# 1,638 s = 27.3 minutes on an AMD EPYC in an earlier version (2 rounds, full-AR batch 1).
# BENCH=quick (or make bench-quick) runs T=256-1024 stand-ins in under 2 minutes (72 s on the Xeon, 59-115 s on
# the EPYC), writing its CSVs and report under bench/quick/ (rows labelled bench_set=quick), so the full run's
# CSVs and the committed report are left alone; the renderer refuses to mix the two kinds of run or to put quick
# rows in docs/results.
BENCH ?= full
ifeq ($(BENCH),quick)
BENCH_FLAGS := --quick
BENCH_DIR := bench/quick
BENCH_REPORT ?= bench/quick/bench.md
BENCH_RESULTS := bench/quick
else
BENCH_FLAGS :=
BENCH_DIR := bench
BENCH_REPORT ?= docs/results/bench.md
BENCH_RESULTS := docs/results
endif

bench: $(VENV)/.installed
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory bench-routing && \
	$(MAKE) --no-print-directory bench-models && \
	$(MAKE) --no-print-directory bench-backends BACKENDS_RESULTS=$(call q,$(BENCH_RESULTS)) && \
	$(MAKE) --no-print-directory bench-report && \
	echo "make bench BENCH=$(BENCH): $$(( $$(date +%s) - start )) s wall"

bench-quick:
	$(MAKE) --no-print-directory bench BENCH=quick

# Full-AR routing forward + backward, dense reference-style against the sparse routes, T=1K-16K, torch and JAX.
bench-routing: $(VENV)/.installed
	$(PY) -m benchmarks.bench_routing $(BENCH_FLAGS) --out $(call q,$(BENCH_DIR)/routing.csv)

# Training throughput, step memory and fraction of the fp32 matmul peak at the WikiText-2 paper shapes (torch).
bench-models: $(VENV)/.installed
	$(PY) -m benchmarks.bench_models $(BENCH_FLAGS) --out $(call q,$(BENCH_DIR)/models.csv) --profile-dir $(call q,$(BENCH_DIR))

bench-report: $(VENV)/.installed
	$(PY) -m benchmarks.bench_report --bench-dir $(call q,$(BENCH_DIR)) --out $(call q,$(BENCH_REPORT))

bench-kernels: $(VENV)/.installed
	$(PY) benchmarks/bench_kernels.py --out bench/kernels.csv

# Fused head loss and fused AdamW against the unfused training step, side by side (about 2 minutes).
bench-train-step: $(VENV)/.installed
	$(PY) -m benchmarks.bench_train_step --out bench/train_step.csv

# The head loss in one tile against tiles (train.head_loss), torch and JAX, the head alone and whole cpu-scale
# full-AR training steps (about 3 minutes on a 2-core EPYC; docs/KERNELS.md, "Chunked head loss").
bench-head-loss: $(VENV)/.installed
	$(PY) -m benchmarks.bench_head_loss --out bench/head_loss.csv --rounds 9 --chunks 1024x8192,256x2048
	$(PY) -m benchmarks.bench_head_loss --out bench/head_loss_steps.csv --rounds 9 --train-steps

# bf16 autocast vs fp32 learning curves of the cpu-scale PCAF-context row (45 s on a 2-core EPYC with AVX-512
# BF16; far longer where bf16 products run in a scalar fallback). bench-report judges bench/precision.csv.
bench-precision: $(VENV)/.installed data
	$(PY) -m benchmarks.precision_check --steps 120 --every 30 --out docs/results/bf16-vs-fp32.md --csv bench/precision.csv

# The speed targets on a CUDA GPU (bf16 autocast against fp32, fraction of peak, next-token against SDPA, the
# windowed-attention Transformers with FlexAttention, the chunked head loss, the JAX full-AR step, routing, a
# profile of the full-AR step) and the bf16 learning curves at the WikiText-2 paper shape in full AR, with the
# eager step, the step replayed as CUDA graphs, the eager step with the head loss in tiles and the JAX step,
# rendered into docs/results/bench_cuda.md with its CSVs in docs/results/bench_cuda/. The paper-shape rows read the
# tokenized WikiText-2 release (data.layout=tokens). The JAX cases need JAX's CUDA plugin, else the page lists
# them as not run and the JAX curves are skipped. Wall time: docs/results/README.md (each curve pair about 1-2
# minutes on an H100; split across commands with --sections and the curve lines run one by one).
CUDA_RESULTS := docs/results/bench_cuda
CUDA_CURVES := --row wt2-nt-1024/pcaf_context --scale paper --steps 600 --every 100
CUDA_CURVE_ROW := train.mode=ar train.batch_size=8 data.layout=tokens
# Two halves, each within one 10-minute command of a lent GPU: bench-cuda-steps (the benchmark sections, about 7
# minutes on an H100) and bench-cuda-curves (the four curve pairs, then the page). On a GPU machine without this
# project's .venv, GPU_PY=python3 runs them with that machine's Python (and no set-up or data step: send the token
# cache along; the checkout and .gpu_site on PYTHONPATH, as for make test-gpu).
ifeq ($(origin GPU_PY),undefined)
CUDA_DEPS := $(VENV)/.installed data
CUDA_PY = $(PY)
else
CUDA_DEPS :=
CUDA_PY = $(GPU_PY)
endif
bench-cuda: bench-cuda-steps bench-cuda-curves

bench-cuda-steps: $(CUDA_DEPS)
	$(CUDA_PY) -m benchmarks.bench_cuda --out-dir bench/cuda

bench-cuda-curves: $(CUDA_DEPS)
	$(CUDA_PY) -m benchmarks.precision_check $(CUDA_CURVES) --out bench/cuda/precision.md --csv bench/cuda/precision.csv \
		$(CUDA_CURVE_ROW)
	$(CUDA_PY) -m benchmarks.precision_check $(CUDA_CURVES) --out bench/cuda/precision_cudagraphs.md \
		--csv bench/cuda/precision_cudagraphs.csv $(CUDA_CURVE_ROW) train.compile=cudagraphs
	$(CUDA_PY) -m benchmarks.precision_check $(CUDA_CURVES) --out bench/cuda/precision_chunked.md \
		--csv bench/cuda/precision_chunked.csv $(CUDA_CURVE_ROW) train.head_loss=chunked
	$(CUDA_PY) -m benchmarks.precision_check $(CUDA_CURVES) --backend jax --accelerator-only \
		--out bench/cuda/precision_jax.md --csv bench/cuda/precision_jax.csv $(CUDA_CURVE_ROW)
	mkdir -p $(call q,$(CUDA_RESULTS)) && rm -f $(call q,$(CUDA_RESULTS)/failures.csv) && \
		cp bench/cuda/*.csv bench/cuda/*.txt bench/cuda/*.json.gz bench/cuda/precision*.md $(call q,$(CUDA_RESULTS))/
	$(CUDA_PY) -m benchmarks.bench_cuda --render $(call q,$(CUDA_RESULTS)) --doc docs/results/bench_cuda.md

# One training step of every PCAF variant and local conv (both modes) on torch and on JAX, in alternating fresh
# processes, plus the JAX full-AR step at the 41M shape. BACKENDS_RESULTS=docs/results writes the committed copy
# (bench_backends_cpu.{csv,md}).
BACKENDS_RESULTS ?= bench
BACKENDS_ROUNDS ?= 3
bench-backends: $(VENV)/.installed
	$(PY) -m benchmarks.bench_backends $(BENCH_FLAGS) --rounds $(BACKENDS_ROUNDS) --out $(call q,$(BENCH_DIR)/backends.csv) \
		--results-dir $(call q,$(BACKENDS_RESULTS))

# Decode cost per generated token against context (1K-64K), batch 1 and 8: PCAF-context, the dense
# Transformer with a KV cache, local conv (about 5 minutes on the 2-core CPU). DECODE_RESULTS=docs/results
# writes the committed copy (decode_cpu.{csv,png,md}); BENCH_ARGS=--quick checks that it runs (20 s).
DECODE_RESULTS ?= bench
BENCH_ARGS ?=
bench-decode: $(VENV)/.installed
	$(PY) -m benchmarks.bench_decode --out bench/decode.csv --results-dir $(call q,$(DECODE_RESULTS)) $(BENCH_ARGS)
