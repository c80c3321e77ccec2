"""The head's training loss, one tile (``full``) against tiles (``chunked``), on both backends.

For each shape (N positions, H = d_hidden, V) and form: the median seconds of the output layer's loss,
forward and backward (``[N, H] @ [H, V]``, log-softmax at the targets, the three gradients), and the peak
memory of its intermediates: on torch the live bytes of every buffer allocated inside the step
(``benchmarks.torch_memory.PeakLiveBytes``), on JAX XLA's temporary buffer size of the compiled step
(``memory_analysis().temp_size_in_bytes``). Rows run interleaved (every form once per round), so a
neighbour's load hits each form alike.

With ``--train-steps``, the same comparison for whole training steps (``Backend.train_step``: forward,
backward, AdamW) of the cpu scale's full-AR PCAF-context row (``main-303m``, ``pcaf_context_wt103_t1024``) at
each shape's V (the row sets N = 512 and H = 512), ``train.head_loss=full`` against ``chunked``
(``train.head_position_chunk`` x ``head_vocab_chunk`` from ``--chunks``' first pair); peak memory as above,
of one whole step. Run it as training runs, with the suite's malloc settings (``make`` exports them:
``experiments/allocator.py``).

    python -m benchmarks.bench_head_loss [--out bench/head_loss.csv] [--rounds 7] [--backends torch,jax]
    [--shapes 512x512x8000,512x512x20000] [--chunks 1024x8192,256x2048] [--train-steps]

The default shape is the cpu scale's full-AR step (``main-303m``: batch 2 x T=256 positions, d_hidden 512,
V = 8,000), and V = 20,000 beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import environment_labels, labels_line, write_csv


def _parse_pairs(text: str, n: int) -> list[tuple[int, ...]]:
    out = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    if any(len(p) != n for p in out):
        raise SystemExit(f"expected {n} numbers joined by 'x' in every item of {text!r}")
    return out


def torch_case(N: int, H: int, V: int, chunks: tuple[int, int] | None, dtype: str):
    """A callable running one forward + backward of the torch head loss, and one measuring its peak bytes."""
    import torch

    from backends.torch.head_loss import chunked_target_log_softmax, target_log_softmax
    from benchmarks.torch_memory import PeakLiveBytes

    g = torch.Generator().manual_seed(0)
    z = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
    b = torch.zeros(V, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)

    def step() -> None:
        z.grad = w.grad = b.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            if chunks is None:
                out = target_log_softmax(z, w, b, y)
            else:
                out = chunked_target_log_softmax(z, w, b, y, position_chunk=chunks[0], vocab_chunk=chunks[1])
        (-out.mean()).backward()

    def peak() -> int:
        step()  # the gradients exist before the probe, as in a training step after the first
        with PeakLiveBytes() as probe:
            step()
        return probe.peak_bytes

    return step, peak


def jax_case(N: int, H: int, V: int, chunks: tuple[int, int] | None, dtype: str):
    """The jitted JAX head loss's gradient step and its XLA temporary bytes."""
    import jax
    import jax.numpy as jnp

    from backends.jax.head_loss import chunked_target_log_softmax

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    cd = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    z = jax.random.normal(k[0], (N, H))
    w = jax.random.normal(k[1], (H, V)) / H**0.5
    b = jnp.zeros(V)
    y = jax.random.randint(k[2], (N,), 0, V)

    def loss(z, w, b):
        zc, wc = z.astype(cd), w.astype(cd)
        if chunks is None:  # layers.Head.target_log_prob's one-tile form
            from backends.jax.layers import affine

            logits = affine(zc, wc, b).astype(cd).astype(jnp.float32)
            lp = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
        else:
            lp = chunked_target_log_softmax(zc, wc, b, y, *chunks)
        return -lp.mean()

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    compiled = fn.lower(z, w, b).compile()

    def step() -> None:
        jax.block_until_ready(compiled(z, w, b))

    def peak() -> int:
        return int(compiled.memory_analysis().temp_size_in_bytes)

    return step, peak


def train_step_case(backend_name: str, V: int, chunks: tuple[int, int] | None, dtype: str):
    """One training step of the cpu-scale full-AR PCAF-context row at vocabulary ``V`` and its peak bytes."""
    from experiments.table_plan import compose_row

    form = ["train.head_loss=full"] if chunks is None else [
        "train.head_loss=chunked", f"train.head_position_chunk={chunks[0]}", f"train.head_vocab_chunk={chunks[1]}"]
    cfg = compose_row("main-303m", "pcaf_context_wt103_t1024", "cpu", backend_name,
                      [*form, f"model.vocab_size={V}", f"train.precision={dtype}", "train.compile=off",
                       "backend.device=cpu"])[0].run
    if backend_name == "torch":
        from backends.torch.backend import TorchBackend

        backend = TorchBackend("cpu")
    else:
        from backends.jax.backend import JaxBackend

        backend = JaxBackend("cpu")
    holder = {"state": backend.init(cfg)}
    rng = np.random.default_rng(0)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    x, y = rng.integers(3, V, (B, T)).astype(np.int32), rng.integers(3, V, (B, T)).astype(np.int32)

    def step() -> None:
        holder["state"], _ = backend.train_step(holder["state"], x, y, 1e-4)

    def peak() -> int:
        if backend_name == "torch":
            from benchmarks.torch_memory import PeakLiveBytes

            with PeakLiveBytes() as probe:
                step()
            return probe.peak_bytes
        compiled = backend._need()
        return int(compiled.train.lower(holder["state"], x, y, np.float32(1e-4)).compile()
                   .memory_analysis().temp_size_in_bytes)

    return step, peak, (B * T, cfg.model.d_hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/head_loss.csv")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--shapes", default="512x512x8000,512x512x20000", help="N x H x V, comma-separated")
    parser.add_argument("--chunks", default="1024x8192", help="position x vocabulary chunk, comma-separated")
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--train-steps", action="store_true", help="whole training steps instead of the head alone")
    args = parser.parse_args(argv)
    forms: list[tuple[int, int] | None] = [None, *_parse_pairs(args.chunks, 2)]
    if args.train_steps:
        forms = forms[:2]
    rows = []
    for N, H, V in _parse_pairs(args.shapes, 3):
        for dtype in args.dtypes.split(","):
            for backend in args.backends.split(","):
                if args.train_steps:  # the row sets N and H
                    built = [train_step_case(backend, V, form, dtype) for form in forms]
                    N, H = built[0][2]
                    cases = [(form, step, peak) for form, (step, peak, _) in zip(forms, built)]
                else:
                    make = torch_case if backend == "torch" else jax_case
                    cases = [(form, *make(N, H, V, form, dtype)) for form in forms]
                for _, step, _ in cases:
                    step()  # warm-up (and JAX's compilation)
                times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
                for _ in range(args.rounds):
                    for i, (_, step, _) in enumerate(cases):
                        t0 = time.perf_counter()
                        step()
                        times[i].append(time.perf_counter() - t0)
                base = statistics.median(times[0])
                for i, (form, _, peak) in enumerate(cases):
                    med = statistics.median(times[i])
                    rows.append({"what": "train step" if args.train_steps else "head loss", "backend": backend,
                                 "dtype": dtype, "N": N, "H": H, "V": V,
                                 "form": "full" if form is None else f"chunked {form[0]}x{form[1]}",
                                 "ms": round(1e3 * med, 2), "ms_min": round(1e3 * min(times[i]), 2),
                                 "vs_full": round(base / med, 3), "peak_mb": round(peak() / 2**20, 1)})
                    r = rows[-1]
                    print(f"{r['what']:10} {backend:5} {dtype:4} N={N} H={H} V={V:6} {r['form']:20} {r['ms']:8.2f} ms "
                          f"(min {r['ms_min']:.2f})  x{r['vs_full']:.3f} of full  peak {r['peak_mb']:7.1f} MiB",
                          flush=True)
    labels = environment_labels()
    write_csv(args.out, [{**r, **labels} for r in rows])
    print(labels_line(labels))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
