"""The torch backend's device: one it cannot train on is refused with one line saying what to use instead."""

from __future__ import annotations

import pytest
import torch

from backends.torch.backend import TorchBackend


@pytest.mark.parametrize("device", ["mps", "banana", "xla"])
def test_a_device_the_backend_does_not_train_on_is_refused(device: str) -> None:
    with pytest.raises(ValueError, match=rf"^backend.device={device}: the torch backend trains on cpu or cuda"):
        TorchBackend(device)


def test_cuda_without_a_cuda_device_is_refused_with_what_to_use(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^backend.device=cuda: torch .* sees no CUDA device on this machine: use "
                                         r"backend.device=cpu"):
        TorchBackend("cuda")


def test_a_cuda_index_past_the_machine_s_devices_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"^backend.device=cuda:3: this machine has 2 CUDA device\(s\), cuda:0 to "
                                         r"cuda:1$"):
        TorchBackend("cuda:3")


def test_cpu_is_taken() -> None:
    assert TorchBackend("cpu").torch_device == torch.device("cpu")
