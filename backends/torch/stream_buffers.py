"""Fixed-capacity buffers of the torch streaming state (:mod:`backends.torch.streaming`).

* :class:`BucketStore`: the PCAF memory. Per sequence and bucket a ring of K pool rows (``[B, NB, K]``
  int32) over one record pool (keys ``[B, P, d]``, positions, values, router probabilities). Under
  ``recent`` a record entering a full bucket takes the row of the bucket's oldest record (O(1), no
  search); under ``first`` it is dropped. The pool holds at most ``min(t, NB·K)`` records and grows by
  doubling, so the memory is bounded by ``B·NB·K`` records and a step's cost does not depend on t.
  Writes are tensor ops without host synchronisation (a dropped record is written to scratch row 0).
* :class:`KVCache`: a Transformer layer's keys and values: contiguous and growing by doubling (dense),
  a ring of the last ``window`` positions (local), plus the first ``n_global`` (global-local).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.torch.routing import Candidates, bucket_layout
from pcaf_core.reference import attention_allowed

# --------------------------------------------------------------------------------------------- PCAF memory


@dataclass
class BucketStore:
    """At most K records per bucket and sequence: per-bucket rings of pool rows over a record pool.

    slot: ``[B, NB, K]`` int32 pool row of ring entry j; count: ``[B, NB]`` int32 records offered to the
    bucket (ring entry of the n-th record: ``n mod K``); keys ``[B, P, d]``, pos/value ``[B, P]`` int64,
    probs ``[B, P, S]`` or None: the pool, row 0 a scratch row; used: ``[B]`` int64 rows in use
    (1 + records kept); offered: records offered so far (a host int, for the pool's growth).
    """

    slot: torch.Tensor
    count: torch.Tensor
    keys: torch.Tensor
    pos: torch.Tensor
    value: torch.Tensor
    probs: torch.Tensor | None
    used: torch.Tensor
    policy: str
    offered: int = 0

    @classmethod
    def empty(cls, batch: int, buckets: int, top_k: int, d: int, n_probs: int | None, policy: str,
              capacity: int, dtype: torch.dtype, device: torch.device) -> BucketStore:
        rows = 1 + min(max(capacity, 16), buckets * top_k)
        return cls(
            slot=torch.zeros((batch, buckets, top_k), dtype=torch.int32, device=device),
            count=torch.zeros((batch, buckets), dtype=torch.int32, device=device),
            keys=torch.zeros((batch, rows, d), dtype=dtype, device=device),
            pos=torch.zeros((batch, rows), dtype=torch.int64, device=device),
            value=torch.zeros((batch, rows), dtype=torch.int64, device=device),
            probs=None if n_probs is None else torch.zeros((batch, rows, n_probs), dtype=dtype, device=device),
            used=torch.ones(batch, dtype=torch.int64, device=device),
            policy=policy)

    @property
    def top_k(self) -> int:
        return self.slot.shape[-1]

    @property
    def max_records(self) -> int:
        """Records a sequence's store can ever hold: buckets × K."""
        return self.slot.shape[1] * self.top_k

    def nbytes(self) -> int:
        tensors = (self.slot, self.count, self.keys, self.pos, self.value, self.used) + \
            (() if self.probs is None else (self.probs,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def used_nbytes(self) -> int:
        """Bytes of the ring tables plus the pool rows in use by the fullest sequence, times the batch: the
        memory the records kept so far need (the pool's spare rows excluded)."""
        B = self.slot.shape[0]
        row = sum(x[0, :1].numel() * x.element_size() for x in (self.keys, self.pos, self.value))
        if self.probs is not None:
            row += self.probs[0, :1].numel() * self.probs.element_size()
        tables = sum(t.numel() * t.element_size() for t in (self.slot, self.count, self.used))
        return tables + B * int(self.used.max()) * row

    def _reserve(self, records: int) -> None:
        """Room for ``records`` kept records (at most buckets × K) in the pool, doubling its rows."""
        need = 1 + min(records, self.max_records)
        rows = self.keys.shape[1]
        if need <= rows:
            return
        new_rows = min(max(need, 2 * rows), 1 + self.max_records)

        def grow(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros((x.shape[0], new_rows - rows, *x.shape[2:]))], dim=1)

        self.keys, self.pos, self.value = grow(self.keys), grow(self.pos), grow(self.value)
        if self.probs is not None:
            self.probs = grow(self.probs)

    def insert(self, address: torch.Tensor, key: torch.Tensor, pos: int, value: torch.Tensor,
               probs: torch.Tensor | None) -> None:
        """Offer the record ``(pos, key [B, d], value [B], probs [B, S])`` of every sequence to its bucket
        ``address [B]``: ``recent`` overwrites the bucket's oldest record when it holds K, ``first`` drops
        the new record then."""
        self._reserve(self.offered + 1)
        self.offered += 1
        b = torch.arange(address.shape[0], device=address.device)
        c = self.count[b, address].to(torch.int64)
        j = c % self.top_k
        full = c >= self.top_k
        old = self.slot[b, address, j].to(torch.int64)
        if self.policy == "recent":
            write = torch.ones_like(full)
            row = torch.where(full, old, self.used)
        else:
            write = ~full
            row = torch.where(write, self.used, torch.zeros_like(old))  # dropped: scratch row 0
        self.used = self.used + (write & ~full).to(torch.int64)
        self.keys[b, row] = key.to(self.keys.dtype)
        self.pos[b, row] = pos
        self.value[b, row] = value
        if self.probs is not None:
            self.probs[b, row] = probs.to(self.probs.dtype)
        self.slot[b, address, j] = torch.where(write, row, old).to(torch.int32)
        self.count[b, address] = (c + 1).to(torch.int32)

    def read(self, address: torch.Tensor, min_pos: torch.Tensor | None = None
             ) -> tuple[Candidates, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The records a query in bucket ``address [B]`` reads, in the spec's slot order (most recent first
        under ``recent``, earliest first under ``first``); records before ``min_pos [B]`` are invisible.

        Returns candidates (positions, ``[B, K]``), their keys ``[B, K, d]``, values ``[B, K]`` and router
        probabilities ``[B, K, S]`` (or None).
        """
        B, K = address.shape[0], self.top_k
        b = torch.arange(B, device=address.device)
        c = self.count[b, address].to(torch.int64)
        i = torch.arange(K, device=address.device)
        j = (c[:, None] - 1 - i) % K if self.policy == "recent" else i.expand(B, K)
        valid = i < c.clamp(max=K)[:, None]
        rows = torch.where(valid, self.slot[b, address].to(torch.int64).gather(1, j), 0)
        pos = self.pos.gather(1, rows)
        if min_pos is not None:
            valid = valid & (pos >= min_pos[:, None])
        keys = self.keys[b[:, None], rows]
        probs = None if self.probs is None else self.probs[b[:, None], rows]
        return Candidates(torch.where(valid, pos, -1), valid), keys, self.value.gather(1, rows), probs

    def bulk_load(self, address: torch.Tensor, keys: torch.Tensor, value: torch.Tensor,
                  probs: torch.Tensor | None) -> None:
        """Load records ``0..n-1`` (address ``[B, n]``, keys ``[B, n, d]``, value ``[B, n]``, probs) into an
        empty store as n :meth:`insert` calls would: per bucket the last K (``recent``, ring entry of the
        i-th record ``i mod K``) or the first K (``first``). One sort per sequence."""
        if self.offered:
            raise ValueError("bulk_load needs an empty store")
        B, n = address.shape
        self._reserve(n)
        self.offered = n
        if n == 0:
            return
        layout = bucket_layout(address)
        slots = torch.arange(n, device=address.device)
        for bi in range(B):
            order = layout.order[bi]
            rank = slots - layout.seg_start[bi]  # rank of each sorted record inside its bucket
            sorted_addr = address[bi, order]
            counts = torch.bincount(sorted_addr, minlength=self.slot.shape[1])
            keep = rank >= counts[sorted_addr] - self.top_k if self.policy == "recent" else rank < self.top_k
            kept = order[keep]
            rows = 1 + torch.arange(len(kept), device=address.device)
            self.keys[bi, rows] = keys[bi, kept].to(self.keys.dtype)
            self.pos[bi, rows] = kept
            self.value[bi, rows] = value[bi, kept]
            if self.probs is not None:
                self.probs[bi, rows] = probs[bi, kept].to(self.probs.dtype)
            self.slot[bi, sorted_addr[keep], rank[keep] % self.top_k] = rows.to(torch.int32)
            self.count[bi] = counts.to(torch.int32)
            self.used[bi] = 1 + len(kept)


# --------------------------------------------------------------------------------------------- Transformers


@dataclass
class KVCache:
    """One attention layer's cache. keys / values ``[B, H, N, hd]``; pos: position of each entry (host
    ints, the same for every sequence), -1 = empty. ``ring`` (local attention) overwrites entry
    ``t mod window``; otherwise entries are appended (and the buffer doubles when full). ``prefix_*`` hold
    the first ``n_global`` positions of global-local attention."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: list[int]
    ring: bool
    length: int = 0
    prefix_keys: torch.Tensor | None = None
    prefix_values: torch.Tensor | None = None
    prefix_len: int = 0

    def nbytes(self) -> int:
        tensors = [self.keys, self.values]
        if self.prefix_keys is not None:
            tensors += [self.prefix_keys, self.prefix_values]
        return sum(t.numel() * t.element_size() for t in tensors)

    def used_nbytes(self) -> int:
        """Bytes of the entries in use (the buffer's spare entries excluded)."""
        per = self.keys[:, :, :1].numel() * self.keys.element_size() * 2
        prefix = 0 if self.prefix_keys is None else self.prefix_len * per
        return self.length * per + prefix

    def reserve(self, n: int) -> None:
        """Room for ``n`` appended entries (appending caches only), doubling the buffer."""
        size = self.keys.shape[2]
        if n <= size:
            return
        new = max(n, 2 * size)
        pad = (0, 0, 0, new - size)
        self.keys, self.values = F.pad(self.keys, pad), F.pad(self.values, pad)
        self.pos.extend([-1] * (new - size))

    def append(self, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store position t's key and value ``[B, H, hd]`` (positions arrive in increasing order)."""
        if self.prefix_keys is not None and t < self.prefix_keys.shape[2]:
            self.prefix_keys[:, :, t], self.prefix_values[:, :, t] = k, v
            self.prefix_len = t + 1
        if self.ring:
            j = t % self.keys.shape[2]
            self.keys[:, :, j], self.values[:, :, j] = k, v
            self.pos[j] = t
            self.length = min(self.length + 1, self.keys.shape[2])
            return
        self.reserve(self.length + 1)
        self.keys[:, :, self.length], self.values[:, :, self.length] = k, v
        self.pos[self.length] = t
        self.length += 1

    def attend(self, q: torch.Tensor, t: int, variant: str, window: int, n_global: int) -> torch.Tensor:
        """Attention of position t's query ``[B, H, hd]`` over the visible cached keys -> ``[B, H, hd]``."""
        if not self.ring:
            k, v = self.keys[:, :, : self.length], self.values[:, :, : self.length]
            return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]
        n = self.length
        pos = torch.tensor(self.pos[:n], device=q.device)
        ok = attention_allowed(t, pos, variant, window, n_global)
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        if self.prefix_len:
            ok = ok & (pos >= self.prefix_len)  # those positions are read from the prefix
            k = torch.cat([self.prefix_keys[:, :, : self.prefix_len], k], dim=2)
            v = torch.cat([self.prefix_values[:, :, : self.prefix_len], v], dim=2)
            ok = torch.cat([torch.ones(self.prefix_len, dtype=torch.bool, device=q.device), ok])
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=ok[None, None, None])[:, :, 0]
