"""JAX backend: flax.linen modules for every model variant, XLA routing with static shapes, canonical
weights I/O, Optax training (mirrors :mod:`pcaf_core` and :mod:`backends.torch` module by module).

``backends.jax`` is a package of this project (never put ``backends/`` itself on ``sys.path``).
"""

# ruff: noqa: E402, I001  (the dispatch setting must come before the modules that use JAX)
from backends.jax.runtime import configure_cpu_dispatch

configure_cpu_dispatch()  # before anything asks JAX for a device (backends/jax/runtime.py says why)

from backends.jax.model_io import JaxForwardOutput, JaxMemoryTrace
from backends.jax.models import CanonicalLM, PCAFModel, TransformerLM, build_model
from backends.jax.params import init_params
from backends.jax.routing import Candidates, SelectionInputs
from backends.jax.weights import load_safetensors, save_safetensors, to_canonical, to_variables

__all__ = [
    "CanonicalLM",
    "Candidates",
    "JaxForwardOutput",
    "JaxMemoryTrace",
    "PCAFModel",
    "SelectionInputs",
    "TransformerLM",
    "build_model",
    "init_params",
    "load_safetensors",
    "save_safetensors",
    "to_canonical",
    "to_variables",
]
