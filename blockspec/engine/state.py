"""The decode state transaction shared by every decoding mode.

A forward pass of k tokens runs on top of the committed state and is left pending. Then exactly one of:
  commit(n)  keep the first n tokens (1 <= n <= k): attention caches move their length, DeltaNet layers end
             exactly at the boundary after token n;
  discard()  forget the pass; the committed state is untouched.
Buffers are allocated once per engine; reset() starts a new request without reallocating.

`in_place` (plain decoding, where every pass is committed whole): DeltaNet passes write their final state over the
committed one, saving a 3 MB copy per layer and token, and one-token passes shift the conv history in place too, so
their commit is bookkeeping only; neither a partial commit nor a discard can restore the state (discard is
bookkeeping only: the next request resets).
"""

from __future__ import annotations

from ..errors import BlockspecError
from ..layers.attention import KVCache


class DecodeState:
    def __init__(self, model, capacity: int, max_partial: int, device, dtype, in_place: bool = False):
        c = model.config
        self.capacity = capacity
        self.layers = [
            KVCache(capacity, c.num_key_value_heads, c.head_dim, device, dtype) if layer.is_attention
            else layer.linear_attn.new_state(max_partial, device, dtype)
            for layer in model.layers
        ]
        self.gdn = [s for s in self.layers if not isinstance(s, KVCache)]
        if in_place:
            for s in self.gdn:
                s.write_in_place()
        self.length = 0    # committed tokens
        self.pending = 0   # tokens of the pass awaiting commit/discard

    def reset(self):
        for s in self.gdn:
            s.reset()
        self.length = self.pending = 0

    def begin(self, k: int) -> int:
        """Open a k-token pass; returns its first position."""
        if self.pending:
            raise RuntimeError("previous pass was neither committed nor discarded")
        if self.length + k > self.capacity:
            raise BlockspecError(f"context_length {self.capacity} exceeded ({self.length} + {k} tokens)")
        self.pending = k
        for s in self.gdn:
            s.pending_len = k
        return self.length

    def commit_moves_data(self, t: int, n: int) -> bool:
        """Whether commit(n) of a t-token pass touches any buffer (attention caches only move their length)."""
        return any(s.commit_moves_data(t, n) for s in self.gdn)

    def commit(self, n: int):
        if not 1 <= n <= self.pending:
            raise ValueError(f"commit({n}) of a {self.pending}-token pass")
        for s in self.gdn:
            s.commit(n)
        self.length += n
        self.pending = 0

    def discard(self):
        for s in self.gdn:
            s.discard()
        self.pending = 0
