"""DFlash2 speculative decoding: an external block-diffusion drafter proposes block_size - 1 tokens in one pass.

The drafter reads the target's intermediate features (outputs of its target_layer_ids) of committed positions
only: prefill chunks and the committed rows of each verification pass are appended to its bounded context.
The proposal length comes from the drafter checkpoint's block size (self_speculative_num_tokens does not change it).
Under sampling the candidate selector draws each proposal and reports the distribution it drew from (the
speculative-sampling rule's q; drafter/model.py CandidateSelector).
"""

from __future__ import annotations

import torch

from ..drafter.model import DFlash2Drafter, Selection
from . import graphs
from .decode import Proposer
from .sampling import Sampler


class DFlash2Proposer(Proposer):
    name = "dflash2"

    def __init__(self, drafter: DFlash2Drafter, draft_head=None, sampler: Sampler | None = None,
                 tree_budget: int = 0, tree_scores: str = "transition", tree_lookup: int = 0):
        """`drafter`: loaded, packed (and quantized) around the target's embedding and head; `draft_head`: the
        shared head over a draft vocabulary the drafter proposes over (None: the full head); `sampler`: the
        engine's, the request's sampling (None: greedy); `tree_budget`: draft nodes per tree (0: chains), ordered
        by `tree_scores` (layers/tree.py), its last `tree_lookup` nodes a branch copied from the context
        (layers/tree.py ContextLookup)."""
        self.drafter = drafter
        self.tree_budget, self.tree_marginal, self.tree_lookup = tree_budget, tree_scores == "marginal", tree_lookup
        self.draft_head = draft_head
        self.sampler = sampler
        if draft_head is not None:
            drafter.set_head(draft_head.logits, draft_head.ids)
        self.capture_layers = tuple(drafter.target_layer_ids)
        self.max_proposals = drafter.block_size - 1
        self.draft_width = drafter.config.selector_top_k
        self.graph, self.tree_graph, self.append_graphs = None, None, {}  # CUDA graphs only
        self.selection, self.proposed = None, 0  # the last proposal's sampling walk, and how many were proposed
        self.tree_selection = None  # the last tree's sampling walk

    def reset(self):
        self.drafter.reset()

    def allocate_snapshots(self, count: int) -> int:
        return self.drafter.context.allocate_snapshots(count)

    def save(self, slot, out, row):
        self.drafter.context.save(slot)

    def restore(self, slot, position, token):
        self.drafter.context.restore(slot)

    def observe(self, out, first, tokens, next_tokens, drafts=True):
        rows = len(tokens)
        if rows not in self.append_graphs:  # prefill chunks (and eager mode)
            self.drafter.append_context(out.features[:rows], first)
            return
        if first != self.drafter.context.length:
            raise ValueError(f"context append at {first}, but {self.drafter.context.length} positions are committed")
        self.features_in[:rows].copy_(out.features[:rows])
        self.append_start.fill_(first)
        self.append_graphs[rows].replay()
        self.drafter.context.commit(first, rows)

    def propose(self, anchor, position, k):
        self.proposed = k
        sampled = self.sampler is not None and not self.sampler.greedy
        uniforms = self.sampler.uniforms(self.max_proposals) if sampled else None
        if self.graph is None:
            self.selection = Selection(self.sampler.temperature, uniforms.to(self.drafter.device)) if sampled else None
            return self.drafter.propose(anchor, position, self.selection)[:k]
        self.anchor.fill_(anchor)
        self.position.fill_(position)
        if sampled:
            self.selection.uniforms.copy_(uniforms, non_blocking=True)
        self.graph.replay()
        return self.proposals[:k]

    def propose_tree(self, anchor, position, branch: list[int] = ()):
        """The cycle's draft tree; `branch`: with a tree_lookup, the tokens its branch copies from the context (up to
        tree_lookup). Under sampling its chain is the selector's sampled walk, whose proposals and q `tree_draft`
        returns for the walk's speculative-sampling tests (engine/sampling.py walk)."""
        sampled = self.sampler is not None and not self.sampler.greedy
        uniforms = self.sampler.uniforms(self.max_proposals) if sampled else None
        branch = list(branch)[:self.tree_lookup]
        branch = branch + [0] * (self.tree_lookup - len(branch)) + [len(branch)] if self.tree_lookup else None
        if self.tree_graph is None:
            self.tree_selection = (Selection(self.sampler.temperature, uniforms.to(self.drafter.device))
                                   if sampled else None)
            branch = None if branch is None else torch.tensor(branch, device=self.drafter.device)
            return self.drafter.propose_tree(anchor, position, self.tree_budget, self.tree_marginal,
                                             self.tree_selection, branch)
        self.anchor.fill_(anchor)
        self.position.fill_(position)
        if branch is not None:  # a pinned buffer: the copy is ordered on the stream, the host does not wait
            self.branch_host.copy_(torch.tensor(branch))
            self.branch.copy_(self.branch_host, non_blocking=True)
        if sampled:
            self.tree_selection.uniforms.copy_(uniforms, non_blocking=True)
        self.tree_graph.replay()
        return self.tree

    def tree_draft(self):
        """(candidate ids, q) [rows, K] of the last sampled tree's chain."""
        return self.tree_selection.candidates, self.tree_selection.probs

    def draft(self):
        k = self.proposed
        return self.selection.candidates[:k].clone(), self.selection.probs[:k].clone()

    def capture_graphs(self, pool=None, warmup: int = 2):
        """With CUDA graphs, at load time: the whole proposal (embedding, layers, convolutions, logits, selector walk;
        with a tree budget, also the tree's) as one CUDA graph over a static anchor and position, and the context
        append of each verification length (1..block_size committed rows) as one graph each. With a sampler the
        walk reads the request's temperature and uniforms from the device (greedy at temperature 0): one proposal
        graph serves both."""
        drafter, device = self.drafter, self.drafter.device
        self.anchor = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        if self.sampler is not None:
            self.selection = Selection(self.sampler.temperature,
                                       torch.ones(self.max_proposals, dtype=torch.float64, device=device))
        self.graph, self.proposals = graphs.capture(lambda: drafter.propose(self.anchor, self.position,
                                                                            self.selection), warmup, pool)
        if self.tree_budget:  # the drafter's pass and the tree built from it, as one graph, in a pool of its own:
            # the tree is read after the target's pass, which would overwrite outputs in the shared pool
            if self.sampler is not None:  # its own outputs; the same temperature, uniforms of its own
                self.tree_selection = Selection(self.sampler.temperature, self.selection.uniforms.clone())
            self.branch, self.branch_host = None, None  # the lookup branch's tokens and count, read by the graph
            if self.tree_lookup:
                self.branch = torch.zeros(self.tree_lookup + 1, dtype=torch.long, device=device)
                self.branch_host = torch.zeros(self.tree_lookup + 1, dtype=torch.long).pin_memory()
            self.tree_graph, self.tree = graphs.capture(lambda: drafter.propose_tree(
                self.anchor, self.position, self.tree_budget, self.tree_marginal, self.tree_selection, self.branch),
                warmup)
        block = drafter.block_size
        width = len(drafter.target_layer_ids) * drafter.config.hidden_size  # the target's captured layers
        self.features_in = torch.zeros(block, width, device=device, dtype=drafter.dtype)
        self.append_start = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = offsets = torch.arange(block, device=device)  # kept: a graph holds no reference to it
        self.append_graphs = {
            rows: graphs.capture(lambda rows=rows: drafter.encode_context(self.features_in[:rows],
                                                                          self.append_start + offsets[:rows]),
                                 warmup, pool)[0]
            for rows in range(1, block + 1)}
        drafter.reset()  # warm-ups wrote scratch context rows
