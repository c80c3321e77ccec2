"""PyTorch backend: modules for every model variant, vectorised routing, canonical weights I/O.

``backends.torch`` is a package of this project (never put ``backends/`` itself on ``sys.path``).
"""

from backends.torch.runtime import configure_mkl

configure_mkl()  # before any oneMKL call (backends/torch/runtime.py says why)

from backends.torch.model_io import TorchForwardOutput, TorchMemoryTrace  # noqa: E402
from backends.torch.models import CanonicalLM, PCAFModel, TransformerLM, build_model  # noqa: E402
from backends.torch.params import init_params  # noqa: E402
from backends.torch.routing import Candidates, SelectionInputs  # noqa: E402
from backends.torch.weights import (  # noqa: E402
    canonical_shapes,
    load_canonical,
    load_safetensors,
    save_safetensors,
    to_canonical,
)

__all__ = [
    "CanonicalLM",
    "Candidates",
    "PCAFModel",
    "SelectionInputs",
    "TorchForwardOutput",
    "TorchMemoryTrace",
    "TransformerLM",
    "build_model",
    "canonical_shapes",
    "init_params",
    "load_canonical",
    "load_safetensors",
    "save_safetensors",
    "to_canonical",
]
