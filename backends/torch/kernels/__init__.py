"""Candidate-selection kernels for the context (exact-hash) route: Triton with a pure-torch fallback.

Public API:

* :func:`candidates_nt` -- next-token candidates ``[B, 1, K]`` (op ``pcaf::bucket_lookup_nt``);
* :func:`candidates_ar` -- full-autoregressive candidates ``[B, T, K]`` (op ``pcaf::ar_candidates``);
* :func:`build_bucket_table` / :func:`lookup_bucket_table` -- per-sequence ``[B, num_buckets, K]``
  bucket table (op ``pcaf::bucket_table``) and a read of one bucket per sequence;
* :func:`triton_enabled` -- whether an input would run the Triton path.

All follow ``pcaf_core.routing.route_context`` exactly under the ``recent`` and ``first`` policies.
The implementation-specific entry points live in :mod:`.triton_impl` and :mod:`.torch_impl`.
"""

from backends.torch.kernels.ops import (
    build_bucket_table,
    candidates_ar,
    candidates_nt,
    lookup_bucket_table,
    triton_enabled,
)

__all__ = [
    "build_bucket_table",
    "candidates_ar",
    "candidates_nt",
    "lookup_bucket_table",
    "triton_enabled",
]
