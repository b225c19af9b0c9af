"""How the decode loop runs the target on the decode state: eagerly, or as CUDA graphs replayed over static buffers.

Both expose forward(ids) (a pass of any length, e.g. a prefill chunk), run(anchor, proposals) -> (out, the greedy
tokens, the block anchor + proposals: device tensors, no host synchronisation; the proposals stay where the proposer
wrote them on the device) and verify(block) -> (out, the greedy tokens as a list); every pass opens the state's
transaction (DecodeState.begin) and the caller commits or discards it. A graph is
captured for each pass length the mode uses (1 for plain decoding, k+1 for MTP, the block size for DFlash2), and the
state captures each commit(n) of those lengths, once at load time while the state is empty; other lengths (the last
cycles near max_tokens, prefill) run eagerly. The captured pass gets the whole KV cache with the position as data;
the attention kernel reads only the filled part (blockspec.kernels.attention).
"""

from __future__ import annotations

import torch

from ..layers.tree import DraftTree, TreeLayout
from . import graphs
from .sampling import TOP_K_CAP, walk


def walk_and_stage(state, out, tree: DraftTree, layout: TreeLayout, start, depth: int, *sampled):
    """A tree pass's walk (sampled: its uniforms, draft, filters and width) and its kept path staged for the commit
    (DecodeState.stage_path). Returns (the path's feature rows, the walk's result)."""
    result = walk(out.logits, tree, depth, *sampled)
    return state.stage_path(start, layout.window_rows, out.features, result, depth + 1), result


class EagerTarget:
    execution = "eager"

    def __init__(self, model, state, capture=()):
        self.model, self.state, self.capture = model, state, tuple(capture)
        self.device = model.embed_tokens.weight.device

    def forward(self, ids: torch.Tensor, all_logits: bool = True):
        start = self.state.begin(ids.shape[0])
        return self.model(ids, self.state.layers, start=start, capture=self.capture, all_logits=all_logits)

    def run(self, anchor: int, proposals: torch.Tensor | None = None):
        anchor_id = torch.tensor([anchor], device=self.device)
        block = anchor_id if proposals is None else torch.cat([anchor_id, proposals])
        out = self.forward(block)
        return out, out.logits.argmax(-1), block

    def verify(self, block: list[int]):
        proposals = torch.tensor(block[1:], device=self.device) if len(block) > 1 else None
        out, greedy, _ = self.run(block[0], proposals)
        return out, greedy.tolist()

    def run_tree(self, tree, depth: int, sampler=None, draft=None):
        """One pass over a draft tree's nodes (layers/tree.py, at most `depth` below the root) from the committed
        length, walked (engine/sampling.py) and its kept path staged for DecodeState.commit_path, the pass left pending;
        returns (the pass's features at the walk's path [depth + 1, F], the walk's result as a device tensor). The
        walk is greedy, or sampled with a sampler (not greedy) and the chain's draft (candidate ids, q), its
        uniforms drawn from the sampler."""
        start = self.state.begin(tree.size)
        layout = TreeLayout.build(tree.parents, tree.depth, start, self.model.config.linear_conv_kernel_dim, depth)
        out = self.model(tree.tokens, self.state.layers, start=start, capture=self.capture, tree=layout)
        if sampler is None:
            return walk_and_stage(self.state, out, tree, layout, start, depth)
        uniforms = sampler.uniforms(2 * (depth + 1)).to(self.device)
        return walk_and_stage(self.state, out, tree, layout, start, depth, uniforms, draft, sampler.filters(),
                              sampler.width())


class GraphedTarget(EagerTarget):
    execution = "cuda-graphs"

    def __init__(self, model, state, capture=(), lengths=(1,), warmup=2, tree_size=0, tree_depth=0, sampler=None,
                 draft_width=1):
        super().__init__(model, state, capture)
        self.pool = torch.cuda.graph_pool_handle()
        self.passes = {t: self._capture_pass(t, warmup) for t in sorted(set(lengths))}
        state.capture_commits(lengths, self.pool, warmup)
        self.tree_depth = tree_depth
        if tree_size:  # the path commits first, as the tree pass's graph writes their inputs; in a pool of their own,
            # as captured before it they could reuse its outputs' memory, read after the commit (the kept features)
            state.capture_path_commits(tree_depth + 1, torch.cuda.graph_pool_handle(), warmup)
        self.tree_pass = self._capture_tree(tree_size, tree_depth, warmup) if tree_size else None
        self.sampled_walks = {}
        if tree_size and sampler is not None:
            self._capture_sampled_walks(sampler, draft_width, warmup)
        state.reset()  # warm-ups ran on scratch data

    def _capture_tree(self, size, depth, warmup):
        """The pass over a tree of `size` nodes, its greedy walk and the kept path's staging, the layout built in the
        graph from the nodes' parents and depths and the committed length, all static inputs."""
        nodes = torch.arange(size, device=self.device)
        # warm-ups run on a well-formed tree: the root and invalid children of it
        tree = DraftTree.of(torch.zeros_like(nodes), torch.zeros_like(nodes), (nodes > 0).long(), nodes == 0)
        start = torch.full((), self.state.capacity - size, dtype=torch.long, device=self.device)  # unreached slots
        kernel = self.model.config.linear_conv_kernel_dim

        def run():
            layout = TreeLayout.build(tree.parents, tree.depth, start, kernel, depth)
            out = self.model(tree.tokens, self.state.layers, capture=self.capture, tree=layout)
            return out, layout, *walk_and_stage(self.state, out, tree, layout, start, depth)
        graph, outputs = graphs.capture(run, warmup, self.pool)
        return graph, tree, start, outputs

    def _capture_sampled_walks(self, sampler, draft_width, warmup):
        """The sampled walk of the tree pass's logits (its static outputs), one graph per ranking width (Sampler),
        over static uniforms and draft and the request's filters, with the kept path's staging, in a pool of their
        own: the walk's result is read after the path's commit, whose graph would overwrite outputs in the shared
        pool."""
        _, tree, start, (out, layout, _, _) = self.tree_pass
        depth = self.tree_depth
        uniforms = torch.ones(2 * (depth + 1), dtype=torch.float64, device=self.device)
        draft = (torch.zeros(depth, draft_width, dtype=torch.long, device=self.device),
                 torch.zeros(depth, draft_width, device=self.device))
        pool = torch.cuda.graph_pool_handle()
        for width in (None, TOP_K_CAP):
            def run(width=width):
                return walk_and_stage(self.state, out, tree, layout, start, depth, uniforms, draft, sampler.filters(),
                                      width)
            graph, outputs = graphs.capture(run, warmup, pool)
            self.sampled_walks[width] = graph, uniforms, draft, outputs

    def run_tree(self, tree, depth: int, sampler=None, draft=None):
        if self.tree_pass is None or self.tree_pass[1].size != tree.size or depth != self.tree_depth:
            return super().run_tree(tree, depth, sampler, draft)
        graph, static, start, outputs = self.tree_pass
        static.nodes.copy_(tree.nodes)
        start.fill_(self.state.begin(tree.size))
        graph.replay()
        if sampler is None:
            return outputs[2:]
        walk_graph, uniforms, static_draft, walked = self.sampled_walks[sampler.width()]
        uniforms.copy_(sampler.uniforms(uniforms.shape[0]), non_blocking=True)
        for static_part, part in zip(static_draft, draft):
            static_part.copy_(part)
        walk_graph.replay()
        return walked

    def _capture_pass(self, t, warmup):
        ids = torch.zeros(t, dtype=torch.long, device=self.device)
        # warm-ups write only cache slots no request has reached
        positions = torch.arange(self.state.capacity - t, self.state.capacity, device=self.device)

        def run():
            out = self.model(ids, self.state.layers, positions=positions, capture=self.capture)
            return out, out.logits.argmax(-1)
        graph, (out, predicted) = graphs.capture(run, warmup, self.pool)
        return graph, ids, positions, out, predicted

    def run(self, anchor, proposals=None):
        t = 1 + (0 if proposals is None else proposals.shape[0])
        captured = self.passes.get(t)
        if captured is None:
            return super().run(anchor, proposals)
        graph, ids, positions, out, predicted = captured
        start = self.state.begin(t)
        ids[:1].fill_(anchor)
        if proposals is not None:  # before the replay, which may overwrite them (the shared pool)
            ids[1:].copy_(proposals)
        positions.copy_(torch.arange(start, start + t), non_blocking=True)
        graph.replay()
        return out, predicted, ids
