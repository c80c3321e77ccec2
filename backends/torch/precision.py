"""``train.matmul_precision`` on torch (docs/SPEC.md §9 says what each value computes).

PyTorch holds it process-wide: ``torch.set_float32_matmul_precision`` for matrix products and
``torch.backends.cudnn.allow_tf32`` for cuDNN's convolutions, whose own default is TF32.

| setting | matmuls | cuDNN convolutions |
|---|---|---|
| ``highest`` | ``"highest"`` | TF32 off |
| ``high`` | ``"high"`` (TF32) | TF32 on |
| ``default`` | ``"high"`` (TF32) | TF32 on |

``default`` is TF32 because that is the fastest float32 product JAX's default gives on a GPU; torch runs on
no TPU, where it would be one bf16 pass.
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
