"""Peak memory of a torch computation on a CPU, from the tensors it allocates.

``tracemalloc`` does not see torch's buffers, and a process's peak RSS mixes everything the process ever
held. A ``TorchDispatchMode`` sees the output of every ATen op (forward and backward): each output whose
storage is new (not an input's storage, so views and in-place updates do not count) adds its bytes while
that storage lives; a finaliser on the storage subtracts them when torch frees it. ``peak_bytes`` is the
largest sum over the region, i.e. the peak of intermediate buffers: activations, saved tensors, gradients
and temporaries, without the inputs and parameters that existed before. ``largest_bytes`` is the single
largest buffer (the figure ``tests/test_torch_memory.py`` bounds).

Storages keep their Python object alive as long as torch holds the storage (PyObject preservation), which
is what makes the finaliser fire at the real free; :func:`storage_frees_are_seen` checks that on the
running torch.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def dense_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors holding ``t``'s bytes: ``t`` itself, or a sparse tensor's indices and values
    (sparse tensors have no storage of their own)."""
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed, plain = ((t.crow_indices(), t.col_indices()) if t.layout in (torch.sparse_csr, torch.sparse_bsr)
                             else (t.ccol_indices(), t.row_indices()))
        return compressed, plain, t.values()
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    return (t,)


def _tensors(tree) -> list[torch.Tensor]:
    """Every strided tensor in a pytree of op arguments or outputs (sparse ones by their parts), meta excluded."""
    return [p for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"
            for p in dense_parts(t)]


class PeakLiveBytes(TorchDispatchMode):
    """``with PeakLiveBytes() as probe: ...`` then ``probe.peak_bytes``, ``probe.largest_bytes``,
    ``probe.largest_op`` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self.largest_op = ""
        self._live: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs or {}))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if key in inputs or key in self._live or nbytes == 0:
                continue
            self._live[key] = nbytes
            weakref.finalize(storage, self._freed, key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if nbytes > self.largest_bytes:
                self.largest_bytes, self.largest_op = nbytes, str(func)
        return out


def storage_frees_are_seen() -> bool:
    """True when a storage's finaliser waits for torch to free it (the probe's premise): a tensor saved for
    backward outlives its Python name, and its bytes must stay counted until backward releases it."""
    x = torch.ones(1024, requires_grad=True)
    with PeakLiveBytes() as probe:
        loss = x.exp().sum()  # the exp output has no Python name left; its backward node keeps it
        held = probe.live_bytes
        del loss
    return held >= 4096
