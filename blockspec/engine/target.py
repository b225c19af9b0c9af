"""How the decode loop runs the target: eagerly, or as CUDA graphs replayed over static buffers (compile_mode 0).

Both expose the same three calls: verify(block) -> (out, greedy tokens), commit(n), discard(). A graph is captured
for each pass length the mode uses (1 for plain decoding, k+1 for MTP, the block size for DFlash2) and for each
commit(n) of it, once at load time while the state is empty; other lengths (the last cycles near max_tokens) run
eagerly. The captured pass gets the whole KV cache with the position as data; the attention kernel reads only
the filled part (blockspec.kernels.attention).
"""

from __future__ import annotations

import torch

from . import graphs


class EagerTarget:
    def __init__(self, model, state, capture=()):
        self.model, self.state, self.capture = model, state, tuple(capture)

    def verify(self, block: list[int]):
        out = self.model(torch.tensor(block, device=self.model.embed_tokens.weight.device), self.state, self.capture)
        return out, out.logits.argmax(-1).tolist()

    def commit(self, n: int):
        self.state.commit(n)

    def discard(self):
        self.state.discard()


class GraphedTarget(EagerTarget):
    def __init__(self, model, state, capture=(), lengths=(1,), warmup=2):
        super().__init__(model, state, capture)
        self.device = model.embed_tokens.weight.device
        self.pool = torch.cuda.graph_pool_handle()
        self.passes, self.commits = {}, {}
        for t in sorted(set(lengths)):
            self.passes[t] = self._capture_pass(t, warmup)
            for n in range(1, t + 1):
                if state.commit_moves_data(t, n):  # else commit is bookkeeping only: nothing to capture
                    self.commits[t, n] = self._capture_commit(t, n, warmup)
        state.reset()  # warm-ups ran on scratch data

    def _scratch_positions(self, t):
        return torch.arange(self.state.capacity - t, self.state.capacity, device=self.device)

    def _capture_pass(self, t, warmup):
        ids = torch.zeros(t, dtype=torch.long, device=self.device)
        positions = self._scratch_positions(t)  # warm-ups write only cache slots no request has reached

        def run():
            out = self.model(ids, self.state, self.capture, positions=positions)
            self.state.discard()  # bookkeeping only: the replayed pass is opened by verify()
            return out, out.logits.argmax(-1)
        graph, (out, predicted) = graphs.capture(run, warmup, self.pool)
        return graph, ids, positions, out, predicted

    def _capture_commit(self, t, n, warmup):
        def run():
            self.state.begin(t)
            self.state.commit(n)
            self.state.length -= n  # bookkeeping is replayed by hand; only the buffer updates are captured
        return graphs.capture(run, warmup, self.pool)[0]

    def verify(self, block):
        captured = self.passes.get(len(block))
        if captured is None:
            return super().verify(block)
        graph, ids, positions, out, predicted = captured
        start = self.state.begin(len(block))
        ids.copy_(torch.tensor(block), non_blocking=True)
        positions.copy_(torch.arange(start, start + len(block)), non_blocking=True)
        graph.replay()
        return out, predicted.tolist()

    def commit(self, n):
        graph = self.commits.get((self.state.pending, n))
        if graph is None:
            return super().commit(n)
        graph.replay()
        self.state.length += n
        self.state.pending = 0
        for s in self.state.gdn:
            s.pending_len = 0
