"""The decode state transaction shared by every decoding mode, and its only owner.

A forward pass of k tokens is opened with begin(k) (its first position), runs on top of the committed state and is
left pending. Then exactly one of:
  commit(n)  keep the first n tokens (1 <= n <= k): attention caches move their length, DeltaNet layers end
             exactly at the boundary after token n;
  discard()  forget the pass; the committed state is untouched.
A draft tree's pass (layers/tree.py) is kept with commit_path(n) instead, of the path the pass staged on the device
(stage_path): the kept path's attention entries move to contiguous positions and DeltaNet layers build the state
after its nodes from the deltas the tree pass recorded.
The counters (`length`, `pending`) change here and nowhere else. With CUDA graphs the buffer updates of each
commit(n) are captured once (`capture_commits`) and commit replays them; the bookkeeping stays plain Python.
Buffers are allocated once per engine; reset() starts a new request without reallocating.

Snapshots (engine/reuse.py): save(slot) copies the committed DeltaNet conv histories and recurrent states into
preallocated slots; restore(slot, length) copies them back and cuts the committed length to the position they were
saved at. Attention caches need no copy: their entries before that position are still the committed ones.

`in_place` (plain decoding, where every pass is committed whole): DeltaNet passes write their final state over the
committed one, saving a 3 MB copy per layer and token, and one-token passes shift the conv history in place too, so
their commit is bookkeeping only; neither a partial commit nor a discard can restore the state (discard is
bookkeeping only: the next request resets).
"""

from __future__ import annotations

import torch

from ..errors import BlockspecError
from ..kernels.tree_paths import stage
from ..layers.attention import KVCache
from ..layers.gdn import commits, keep_paths
from . import graphs


class DecodeState:
    def __init__(self, model, capacity: int, max_partial: int, device, dtype, in_place: bool = False,
                 snapshots: int = 0):
        c = model.config
        self.capacity = capacity
        mixers = [layer.linear_attn for layer in model.layers if not layer.is_attention]
        # the DeltaNet layers of one shape (every layer of Qwen3.5) in one stack: a commit, partial, whole or of a
        # tree's path, is then one launch or copy for all of them (commits, keep_paths)
        stacked = len({m.state_shape() for m in mixers}) == 1
        stack = mixers[0].new_stack(len(mixers), max_partial, device, dtype) if stacked else None
        self.layers = [
            KVCache(capacity, c.num_key_value_heads, c.head_dim, device, dtype) if layer.is_attention
            else layer.linear_attn.new_state(max_partial, device, dtype, stack,
                                             mixers.index(layer.linear_attn) if stacked else 0)
            for layer in model.layers
        ]
        self.gdn = [s for s in self.layers if not isinstance(s, KVCache)]
        if in_place:
            for s in self.gdn:
                s.write_in_place()
        self.snapshot_bytes = sum(s.allocate_snapshots(snapshots) for s in self.gdn)
        self.commit_graphs = {}  # (pass length, n) -> the captured buffer updates of commit(n)
        self.path_graphs = {}    # n -> the captured buffer updates of commit_path of an n-node path
        self.path_in = self.history_rows_in = self.start_in = None  # commit_path's inputs (stage_path)
        self.length = 0    # committed tokens
        self.pending = 0   # tokens of the pass awaiting commit/discard

    def reset(self):
        for s in self.gdn:
            s.reset()
        self.length = self.pending = 0

    def save(self, slot: int):
        """Copy the committed DeltaNet states into snapshot `slot` (no pass may be pending)."""
        if self.pending:
            raise RuntimeError("snapshot of a state with a pending pass")
        for s in self.gdn:
            s.save(slot)

    def restore(self, slot: int, length: int):
        """Come back to the committed state saved in `slot` when `length` tokens were committed; the attention
        caches' entries before `length` must still hold the same tokens' keys and values (the caller checks)."""
        for s in self.gdn:
            s.restore(slot)
        self.length, self.pending = length, 0

    def begin(self, k: int) -> int:
        """Open a k-token pass; returns its first position."""
        if self.pending:
            raise RuntimeError("previous pass was neither committed nor discarded")
        if self.length + k > self.capacity:
            raise BlockspecError(f"context_length {self.capacity} exceeded ({self.length} + {k} tokens)")
        self.pending = k
        return self.length

    def commit(self, n: int):
        t = self.pending
        if not 1 <= n <= t:
            raise ValueError(f"commit({n}) of a {t}-token pass")
        graph = self.commit_graphs.get((t, n))
        if graph is not None:
            graph.replay()
        else:
            self._move(t, n)
        self.length += n
        self.pending = 0

    def stage_path(self, start, window_rows: torch.Tensor, features: torch.Tensor, walked: torch.Tensor,
                   longest: int) -> torch.Tensor:
        """On the device, from a tree walk's result `walked` (engine/sampling.py walk): the next commit_path's inputs,
        written where the commit reads them (under CUDA graphs the tree pass's graph records the writes into the
        buffers the commit graphs read, so nothing is copied between the read back and the commit): the pass's
        first position `start` (an int, or a 0-dim device tensor), the path of at most `longest` nodes and the conv
        window rows after its last kept node (of the layout's `window_rows`, layers/tree.py). Returns the pass's
        feature rows [longest, F] of the path's nodes in path order (rows past the kept ones: the root's), which
        the drafter's context reads."""
        if self.path_in is None or self.path_in.shape[0] != longest:  # eager: sized by the path
            self._allocate_path_inputs(longest, walked.device)
            self.path_graphs = {}  # they read the buffers replaced
        if not isinstance(start, torch.Tensor):
            start = torch.full((), start, dtype=torch.long, device=walked.device)
        return stage(walked, window_rows, features, start, self.path_in, self.history_rows_in, self.start_in)

    def commit_path(self, n: int):
        """Keep the first n nodes of the staged path (stage_path) of a pending tree pass."""
        if not 1 <= n <= min(self.pending, self.path_in.shape[0]):
            raise ValueError(f"commit of a {n}-node path of a {self.pending}-node tree")
        graph = self.path_graphs.get(n)
        if graph is not None:
            graph.replay()
        else:
            self._keep_path(self.length, self.path_in[:n], self.history_rows_in)
        self.length += n
        self.pending = 0

    def _allocate_path_inputs(self, longest: int, device):
        self.path_in = torch.zeros(longest, dtype=torch.long, device=device)
        self.history_rows_in = torch.zeros(self.gdn[0].history.shape[0] if self.gdn else 0, dtype=torch.long,
                                           device=device)
        self.start_in = torch.full((), self.capacity - longest, dtype=torch.long, device=device)

    def _keep_path(self, start, path, history_rows):
        for s in self.layers:
            if isinstance(s, KVCache):
                s.keep_path(start, path)
        if self.gdn:
            keep_paths(self.gdn, path, history_rows)

    def capture_path_commits(self, longest: int, pool, warmup: int = 2):
        """Capture commit_path of every path length 1..longest over static inputs, before the tree pass that stages
        them is captured (warm-ups on scratch data: reset() before use)."""
        device = self.gdn[0].history.device if self.gdn else self.layers[0].k.device
        self._allocate_path_inputs(longest, device)
        for n in range(1, longest + 1):
            self.path_graphs[n] = graphs.capture(
                lambda n=n: self._keep_path(self.start_in, self.path_in[:n], self.history_rows_in), warmup, pool)[0]

    def discard(self):
        self.pending = 0

    def commit_moves_data(self, t: int, n: int) -> bool:
        """Whether commit(n) of a t-token pass touches any buffer (attention caches only move their length)."""
        return any(s.commit_moves_data(t, n) for s in self.gdn)

    def _move(self, t: int, n: int):
        commits(self.gdn, t, n)

    def capture_commits(self, lengths, pool, warmup: int = 2):
        """Capture, for each pass length, the buffer updates of every commit(n) that has any (attention caches and
        in-place one-token passes only move the length). Warm-ups run on scratch data: reset() before use."""
        for t in sorted(set(lengths)):
            for n in range(1, t + 1):
                if self.commit_moves_data(t, n):
                    self.commit_graphs[t, n] = graphs.capture(lambda t=t, n=n: self._move(t, n), warmup, pool)[0]
