"""Torch side of a checkpoint directory (the loop writes ``loop_state.json`` beside these files).

``<run_dir>/checkpoints/step_<N>/``

* ``model.safetensors`` — the weights as the canonical parameter dict (``backends.torch.weights``),
  so a JAX run or the NumPy reference can read them; no pickle.
* ``optimizer.pt`` — ``torch.optim.AdamW.state_dict()`` (plain tensors, numbers, lists and dicts).
* ``rng_rank<r>.pt`` — rank ``r``'s torch CPU (and CUDA) generator states (dropout).

Both ``.pt`` files are read back with ``torch.load(..., weights_only=True)``, which refuses
arbitrary pickled objects. The directory is written under a temporary name and renamed by the loop,
so these writes need not be atomic one by one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.torch.weights import load_safetensors, save_safetensors

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


def rng_file(rank: int) -> str:
    """File name of rank ``rank``'s generator states."""
    return f"rng_rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """This process's torch generator states as plain tensors."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_weights(module: nn.Module, path: Path) -> None:
    """Canonical weights of ``module`` as safetensors at ``path``."""
    save_safetensors(path, module)


def load_weights(module: nn.Module, path: Path) -> None:
    """Load canonical safetensors ``path`` into ``module`` (fails naming missing/extra/mis-shaped keys)."""
    load_safetensors(path, module)


def save_torch_state(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Write this rank's share of the backend state into ``directory`` (rank 0: weights and
    optimiser, identical on every rank under DDP; every rank: its generator states)."""
    directory = Path(directory)
    if rank == 0:
        save_weights(module, directory / WEIGHTS_FILE)
        torch.save({"optimizer": optimizer.state_dict()}, directory / OPTIMIZER_FILE)
    torch.save(rng_state(), directory / rng_file(rank))


def load_optimizer_state(directory: Path, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Load ``optimizer.pt`` from ``directory`` into ``optimizer``."""
    data = torch.load(Path(directory) / OPTIMIZER_FILE, map_location=device, weights_only=True)
    optimizer.load_state_dict(data["optimizer"])


def load_rng_state(directory: Path, rank: int) -> bool:
    """Restore rank ``rank``'s generator states; False when the checkpoint has none for this rank
    (it was written with fewer processes)."""
    path = Path(directory) / rng_file(rank)
    if not path.is_file():
        return False
    set_rng_state(torch.load(path, map_location="cpu", weights_only=True))
    return True
