"""The head loss's passes over 16-bit logits on CUDA: the log-normaliser forward, the logits' gradient backward.

Under bf16 autocast the one-tile head loss (:class:`backends.torch.head_loss._TargetLogSoftmax`) keeps the ``[N, V]``
logits in 16 bits and needs two passes over them:

- forward, per row: the log-normaliser ``lse_n = log Σ_v exp(logits[n, v])`` in float32 and the target's logit
  ``logits[n, y_n]``;
- backward, per element: ``dlogits[n, v] = g_n·onehot(y_n)[v] − g_n·exp(logits[n, v] − lse_n)`` formed in float32
  and stored in the logits' dtype (the input of the two 16-bit gradient products), and its column sums in float32
  (the bias gradient).

In ATen each pass is several kernels that write float32 ``[N, V]`` temporaries: the widening copy, ``logsumexp``'s
maximum, shifted copy, ``exp`` and sum forward; a shifted widening copy, ``exp_``, ``mul_``, the target
``scatter_add_``, the column sum and the cast back to 16 bits backward. At the WikiText-2 paper shape (N = 8,192,
V = 20,000) each float32 ``[N, V]`` array is 655 MB, and in the op table of an H100's eager bf16 full-AR step
``aten::sub``, ``exp_``, ``mul_`` and ``amax`` alone take 2.9 ms a step of the 9.2 ms the GPU is busy
(docs/results/bench_cuda/profile_bf16.txt).
Here each pass is one kernel that reads the 16-bit logits once (and the backward writes the 16-bit gradient
once), plus a sum over ``[cdiv(N, BLOCK_N), V]`` per-block column sums: the bias gradient is summed in a fixed
order, deterministic, with no atomics.

Ops (namespace ``pcaf``), each the Triton kernel where :func:`backends.torch.kernels.triton_enabled` holds and
ATen elsewhere (:func:`log_normaliser_torch`, :func:`logit_grad_torch`, the reference the kernels are tested
against: ``tests/test_torch_head_softmax.py``):

- ``pcaf::head_log_normaliser(Tensor logits, Tensor y) -> (Tensor lse, Tensor target)``: logits ``[N, V]``
  16-bit, y ``[N]`` int64 -> ``[N]`` float32 each;
- ``pcaf::head_logit_grad(Tensor logits, Tensor lse, Tensor g, Tensor y) -> (Tensor dlogits, Tensor dbias)``:
  ``[N, V]`` in the logits' dtype and ``[V]`` float32.

A row whose maximum is infinite is shifted by 0, not by the infinity, as ``torch.logsumexp`` does. A target outside
``[0, V)`` reads NaN (the loop checks every batch's ids on the host, :func:`pcaf_core.batches.check_batch`).
"""

from __future__ import annotations

import torch

from backends.torch.kernels.ops import triton_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a Triton build: the torch path serves every device
    triton = None  # type: ignore[assignment]

LSE_BLOCK_N, LSE_BLOCK_V = 8, 512
"""Forward tile: 8 rows a program, 512 columns a step (4,096 float32 values: 32 a thread at 4 warps). For sm_90 this
takes 64 registers a thread with Triton 3.6 and 3.7; 1,024 columns took 126-128, a quarter of an SM's warps
resident, and spilled 16 bytes a thread with Triton 3.6 (the release beside torch 2.11's CUDA builds): the pass
streams the logits once, so more resident warps keep more loads in flight."""
GRAD_ROWS, GRAD_BLOCK_N, GRAD_BLOCK_V = 64, 16, 256
"""Backward: a program covers 64 rows of 256 columns, ``[16, 256]`` at a time (32 values a thread at 4 warps), and
sums its columns over all 64 rows: the column sums are ``cdiv(N, 64)`` rows of ``V`` float32 (10 MB at N = 8,192,
V = 20,000). One ``[64, 128]`` tile a program instead needs 255 registers and spills 476 bytes a thread on sm_90
(``tests/test_torch_kernels_compile.py`` compiles these kernels for sm_90 and checks that nothing spills)."""

if triton is not None:

    @triton.jit
    def _log_normaliser_kernel(
        logits_ptr,  # [N, V] 16-bit, rows ``stride`` apart
        y_ptr,  # [N] int64
        lse_ptr,  # [N] float32 out
        target_ptr,  # [N] float32 out
        N,
        V,
        stride,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Grid ``(cdiv(N, BLOCK_N),)``: an online maximum and rescaled sum over each row's column blocks."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        base = rows.to(tl.int64) * stride
        top = tl.full([BLOCK_N], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_N], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = rmask[:, None] & (cols < V)[None, :]
            x = tl.load(logits_ptr + base[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, axis=1))
            # Shift by the running maximum where it is finite, by 0 where it is infinite (torch.logsumexp's rule).
            old_shift = tl.where((top == float("inf")) | (top == float("-inf")), 0.0, top)
            shift = tl.where((new_top == float("inf")) | (new_top == float("-inf")), 0.0, new_top)
            # A row with nothing summed yet stays at 0 (exp of the shift difference may overflow).
            rescaled = tl.where(total > 0, total * tl.exp(old_shift - shift), total)
            total = rescaled + tl.sum(tl.exp(x - shift[:, None]), axis=1)
            top = new_top
        shift = tl.where((top == float("inf")) | (top == float("-inf")), 0.0, top)
        # (Rows past N take log(1): nothing to store, and no log(0) on them.)
        tl.store(lse_ptr + rows, shift + tl.log(tl.where(rmask, total, 1.0)), mask=rmask)
        y = tl.load(y_ptr + rows, mask=rmask, other=0)
        inside = (y >= 0) & (y < V)
        target = tl.load(logits_ptr + base + y, mask=rmask & inside, other=float("nan")).to(tl.float32)
        tl.store(target_ptr + rows, target, mask=rmask)

    @triton.jit
    def _logit_grad_kernel(
        logits_ptr,  # [N, V] 16-bit, rows ``stride`` apart
        lse_ptr,  # [N] float32
        g_ptr,  # [N] float32: the incoming gradient of each row's target log-probability
        y_ptr,  # [N] int64
        dlogits_ptr,  # [N, V] out, the logits' dtype, contiguous
        partial_ptr,  # [cdiv(N, BLOCK_N), V] float32 out: each row block's column sums
        N,
        V,
        stride,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Grid ``(cdiv(N, ROWS), cdiv(V, BLOCK_V))``: ``ROWS`` rows of ``BLOCK_V`` columns a program, ``BLOCK_N``
        rows at a time, and their column sums."""
        block = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        cmask = cols < V
        column_sum = tl.zeros([BLOCK_V], tl.float32)
        for r0 in range(0, ROWS, BLOCK_N):
            rows = block * ROWS + r0 + tl.arange(0, BLOCK_N)
            rmask = rows < N
            mask = rmask[:, None] & cmask[None, :]
            rows64 = rows.to(tl.int64)
            x = tl.load(logits_ptr + rows64[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
            g = tl.load(g_ptr + rows, mask=rmask, other=0.0)
            y = tl.load(y_ptr + rows, mask=rmask, other=-1)
            # The ATen path's order: exp(logit − lse)·(−g), then + g at the target.
            d = tl.exp(x - lse[:, None]) * (-g)[:, None]
            d = tl.where(cols[None, :] == y[:, None], d + g[:, None], d)
            d = tl.where(mask, d, 0.0)
            tl.store(dlogits_ptr + rows64[:, None] * V + cols[None, :], d.to(dlogits_ptr.dtype.element_ty), mask=mask)
            column_sum += tl.sum(d, axis=0)
        tl.store(partial_ptr + block.to(tl.int64) * V + cols, column_sum, mask=cmask)


def log_normaliser_triton(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, target)`` ``[N]`` float32 of 16-bit ``logits [N, V]`` (rows contiguous) by one kernel."""
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    target = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        _log_normaliser_kernel[(triton.cdiv(N, LSE_BLOCK_N),)](
            logits, y, lse, target, N, V, logits.stride(0), BLOCK_N=LSE_BLOCK_N, BLOCK_V=LSE_BLOCK_V)
    return lse, target


def logit_grad_triton(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dlogits [N, V] in the logits' dtype, dbias [V] float32)`` by one kernel and a sum of its column sums."""
    N, V = logits.shape
    dlogits = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    blocks = triton.cdiv(N, GRAD_ROWS)
    partial = torch.empty(blocks, V, dtype=torch.float32, device=logits.device)
    if N == 0:
        return dlogits, torch.zeros(V, dtype=torch.float32, device=logits.device)
    _logit_grad_kernel[(blocks, triton.cdiv(V, GRAD_BLOCK_V))](
        logits, lse, g, y, dlogits, partial, N, V, logits.stride(0), ROWS=GRAD_ROWS, BLOCK_N=GRAD_BLOCK_N,
        BLOCK_V=GRAD_BLOCK_V)
    return dlogits, partial.sum(dim=0)


def log_normaliser_torch(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``(lse, target)`` in ATen (float32 passes): the one-tile head loss's 16-bit forward off CUDA."""
    wide = logits.float()
    return torch.logsumexp(wide, dim=-1), wide.gather(1, y[:, None])[:, 0]


def logit_grad_torch(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, y: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``(dlogits, dbias)`` in ATen: the one-tile head loss's 16-bit backward off CUDA."""
    # float32 from the 16-bit logits in one pass (type promotion), then in place.
    dlogits = torch.sub(logits, lse[:, None]).exp_().mul_(-g[:, None])
    dlogits.scatter_add_(1, y[:, None], g[:, None])
    return dlogits.to(logits.dtype), dlogits.sum(0)


def _check(logits: torch.Tensor, *rows: torch.Tensor) -> None:
    if logits.ndim != 2 or logits.dtype not in (torch.bfloat16, torch.float16) or logits.stride(1) != 1:
        raise ValueError(f"head softmax kernels take [N, V] bfloat16/float16 logits with contiguous rows, got "
                         f"{logits.dtype} of shape {tuple(logits.shape)} and strides {logits.stride()}")
    for r in rows:
        if r.shape != logits.shape[:1] or not r.is_contiguous():
            raise ValueError(f"head softmax kernels take contiguous [N] = [{logits.shape[0]}] row vectors, got "
                             f"shape {tuple(r.shape)}")


@torch.library.custom_op("pcaf::head_log_normaliser", mutates_args=())
def _head_log_normaliser(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pcaf::head_log_normaliser``: see :func:`log_normaliser`."""
    if triton is not None and triton_enabled(logits):
        return log_normaliser_triton(logits, y)
    return log_normaliser_torch(logits, y)


@_head_log_normaliser.register_fake
def _head_log_normaliser_fake(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("pcaf::head_logit_grad", mutates_args=())
def _head_logit_grad(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, y: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pcaf::head_logit_grad``: see :func:`logit_grad`."""
    if triton is not None and triton_enabled(logits):
        return logit_grad_triton(logits, lse, g, y)
    return logit_grad_torch(logits, lse, g, y)


@_head_logit_grad.register_fake
def _head_logit_grad_fake(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, y: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(logits), logits.new_empty((logits.shape[1],), dtype=torch.float32)


def log_normaliser(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log Σ_v exp(logits[n, v]), logits[n, y_n])``, ``[N]`` float32 each: logits ``[N, V]`` bf16/fp16 with
    contiguous rows, y ``[N]`` int64 ids in ``[0, V)``."""
    _check(logits, y)
    return torch.ops.pcaf.head_log_normaliser(logits, y)


def logit_grad(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, y: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dlogits, dbias)``: ``dlogits[n, v] = g_n·onehot(y_n)[v] − g_n·exp(logits[n, v] − lse_n)`` formed in
    float32 and stored in the logits' dtype ``[N, V]``, and its float32 column sums ``[V]``. lse, g: ``[N]``
    float32; y ``[N]`` int64."""
    _check(logits, lse, g, y)
    return torch.ops.pcaf.head_logit_grad(logits, lse, g, y)
