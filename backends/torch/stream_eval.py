"""The ``stream`` evaluation protocol on torch (:mod:`pcaf_core.stream_protocol` defines it).

Documents are read in groups of ``batch`` (longest first, so a group's documents have similar lengths);
each step runs the backbone and the head once and reads the memory once per condition.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from backends.torch.streaming import TorchStream, TorchStreamState, insert_record
from pcaf_core.stream_protocol import ConditionResult, MemoryCondition


def _fresh_stores(stream: TorchStream, batch: int, capacity: int) -> TorchStreamState:
    """A state holding only empty bucket stores (the ``window`` condition's memory)."""
    full = stream.init(batch, capacity=capacity)
    return TorchStreamState(t=0, batch=batch, context=full.context, semantic=full.semantic)


@torch.no_grad()
def evaluate_stream(
    stream: TorchStream,
    documents: list[np.ndarray],
    conditions: list[MemoryCondition],
    *,
    batch: int = 8,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[ConditionResult], dict[str, float]]:
    """Summed NLL per condition over every predicted token of ``documents`` (``[n_i]`` token ids each), and
    timing (``seconds``, ``steps``, ``tokens``: document tokens read)."""
    if not stream.uses_cache:
        raise ValueError("the stream protocol measures a memory: the model has none")
    results = [ConditionResult(c) for c in conditions]
    T = stream.window
    order = np.argsort([-len(d) for d in documents], kind="stable")
    device = stream.device
    start, steps, tokens = time.perf_counter(), 0, 0
    for g0 in range(0, len(order), batch):
        group = [documents[i] for i in order[g0:g0 + batch]]
        B, L = len(group), max(len(d) for d in group)
        x = torch.zeros((B, L), dtype=torch.int64, device=device)
        for b, d in enumerate(group):
            x[b, :len(d)] = torch.as_tensor(np.asarray(d, dtype=np.int64))
        lengths = torch.tensor([len(d) for d in group], device=device)
        state = stream.init(B, capacity=L)
        window_state = None
        for t in range(L - 1):  # the last position of the longest document has no target
            tok = x[:, t]
            h = stream.backbone_step(state, tok)
            param_lp = stream.net.head(h)
            query, prev = stream.observe(state, tok, h)
            raw_gate = stream.raw_gate(h)
            if t % T == 0:
                window_state = _fresh_stores(stream, B, min(T, L))
            elif prev is not None:
                insert_record(window_state, prev, t - 1, tok)
            target, live = x[:, t + 1], (t + 1) < lengths
            for res in results:
                cond = res.condition
                if cond.kind == "none":
                    lp_y = param_lp.gather(1, target[:, None])[:, 0]
                else:
                    source = window_state if cond.kind == "window" else state
                    bound = cond.min_pos(t)
                    min_pos = None if bound is None else torch.full((B,), bound, dtype=torch.int64, device=device)
                    read = stream.read_memory(source, t, query, raw_gate, min_pos)
                    lp_y = stream.target_log_prob(read, param_lp, target)
                res.nll_sum -= float(torch.where(live, lp_y.double(), 0.0).sum())
                res.targets += int(live.sum())
            state.t += 1
            steps += 1
        tokens += int(lengths.sum())
        if progress is not None:
            done = min(g0 + batch, len(order))
            progress(f"{done}/{len(order)} documents, {tokens} tokens, {time.perf_counter() - start:.0f} s")
    return results, {"seconds": time.perf_counter() - start, "steps": steps, "tokens": tokens}
