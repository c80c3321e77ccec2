"""``train.matmul_precision`` on torch: what a float32 matrix product computes (docs/SPEC.md §9).

PyTorch holds it process-wide: ``torch.set_float32_matmul_precision`` for matrix products (cuBLAS; oneDNN
too) and ``torch.backends.cudnn.allow_tf32`` for cuDNN's convolutions, whose own default is TF32.

| setting | matmuls | cuDNN convolutions |
|---|---|---|
| ``highest`` | ``"highest"``: float32, no TF32 | TF32 off |
| ``high`` | ``"high"``: TF32 on a GPU that has it | TF32 on |
| ``default`` | ``"high"``: TF32, what JAX's default precision runs on a GPU | TF32 on |

``default`` is JAX's name for the platform's fastest float32 product: one bf16 pass on a TPU, TF32 on a GPU.
Torch runs on no TPU, so on torch it is TF32, the same as ``high``. On a CPU every setting computes float32.
The setting covers every product of the step, routing's scores included (JAX's routing asks for float32 per
product, so its candidates never depend on the setting).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pcaf_core.config import MATMUL_PRECISIONS

TORCH_SETTINGS = {  # train.matmul_precision -> (float32_matmul_precision, cuDNN TF32)
    "highest": ("highest", False),
    "high": ("high", True),
    "default": ("high", True),
}
assert set(TORCH_SETTINGS) == set(MATMUL_PRECISIONS)


def set_matmul_precision(precision: str) -> None:
    """Make float32 products compute at ``precision`` (one of :data:`pcaf_core.config.MATMUL_PRECISIONS`)
    from now on, in this process."""
    if precision not in TORCH_SETTINGS:
        raise ValueError(f"matmul precision {precision!r} is unknown: expected one of {list(MATMUL_PRECISIONS)}")
    matmul, cudnn_tf32 = TORCH_SETTINGS[precision]
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """:func:`set_matmul_precision` inside the block, the previous settings restored after it."""
    previous = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    set_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]
