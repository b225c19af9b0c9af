"""Native MTP self-speculation: the checkpoint's own MTP head drafts k tokens by chaining itself.

MTP row p pairs the target's hidden state at position p with the token at p+1 and predicts the token at p+2; it
uses RoPE position p and writes its KV cache entry p. After each verification the committed rows are (re)written
from the target's verified hidden states, so draft rows written while chaining are scratch and roll back for free:
the MTP cache, like the target's attention caches, commits by length.
"""

from __future__ import annotations

import torch

from ..layers.attention import KVCache
from ..layers.draft_head import DraftHead
from ..models.mtp import MTPHead
from . import graphs
from .decode import Proposer


class MTPProposer(Proposer):
    name = "mtp"

    def __init__(self, model, head: MTPHead, num_drafts: int, capacity: int, device, dtype,
                 draft_head: DraftHead | None = None):
        c = model.config
        self.model, self.head = model, head
        self.draft_head = draft_head  # drafts over a subset of the vocabulary (None: the full shared head)
        self.max_proposals = num_drafts
        self.caches = [KVCache(capacity, c.num_key_value_heads, c.head_dim, device, dtype) for _ in head.layers]
        self.graphs = {}  # rows observed -> (graph, drafts): CUDA graphs only
        self.reset()

    def reset(self):
        self.first_draft = None   # the head's guess for the token after the anchor
        self.chain_hidden = None  # its hidden state, the input of the next chained step
        self.drafts = None        # all drafts of the next cycle, when a graph computed them on the device

    def step(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, visible: int | None):
        """Run MTP rows at `positions` on final-normed hidden states; returns (the rows' final-normed outputs [T, h],
        greedy draft of the last row as a 1-element tensor). Outputs feed the lm_head and, when chaining, the next
        step. visible=None passes the whole cache, the position being data (graph capture)."""
        embedded = self.model.embed(next_tokens)
        rope = self.model.rope(positions, embedded.dtype)
        x = self.head(embedded, hidden, self.caches, positions, rope, visible)
        normed = self.head.norm(x)
        if self.draft_head is not None:
            return normed, self.draft_head(normed[-1:])
        return normed, self.model.logits(normed[-1:]).argmax(-1)

    def step_at(self, hidden, next_tokens, position: int):
        positions = torch.arange(position, position + next_tokens.shape[0], device=hidden.device)
        normed, draft = self.step(hidden, next_tokens, positions, position + next_tokens.shape[0])
        return normed, int(draft)

    def observe(self, out, first, tokens, next_tokens):
        rows = len(tokens)
        if rows in self.graphs:  # a verification pass: observe and chain every draft in one replay
            graph, drafts = self.graphs[rows]
            self.hidden_in[:rows].copy_(out.hidden[:rows])
            self.ids_in[:rows].copy_(torch.tensor(next_tokens), non_blocking=True)
            self.start.fill_(first)
            graph.replay()
            self.drafts = drafts
            return
        self.drafts = None
        next_ids = torch.tensor(next_tokens, device=out.hidden.device)
        # the head reads the target's final-normed hidden state (as vLLM / SGLang feed it)
        x, self.first_draft = self.step_at(self.model.norm(out.hidden[:rows]), next_ids, first)
        self.chain_hidden = x[-1:]

    def propose(self, anchor, position, k):
        if self.drafts is not None:
            return self.drafts[:k].tolist()
        drafts, hidden = [self.first_draft], self.chain_hidden
        for i in range(1, k):
            hidden, draft = self.step_at(hidden, torch.tensor([drafts[-1]], device=hidden.device),
                                             position + i - 1)
            drafts.append(draft)
        return drafts

    def capture_graphs(self, pool=None, warmup: int = 2):
        """With CUDA graphs: for each verification length n (1..k+1 committed rows), one CUDA graph that observes
        the n rows and chains all k drafts on the device, so a cycle costs one replay and one host sync."""
        device, rows_max = self.caches[0].k.device, self.max_proposals + 1
        hidden, dtype = self.model.config.hidden_size, self.caches[0].k.dtype
        self.hidden_in = torch.zeros(rows_max, hidden, device=device, dtype=dtype)
        self.ids_in = torch.zeros(rows_max, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.steps = steps = torch.arange(rows_max, device=device)  # kept: a graph holds no reference to it

        def draft_all(rows):
            x, draft = self.step(self.model.norm(self.hidden_in[:rows]), self.ids_in[:rows],
                                 self.start + steps[:rows], None)
            drafts, hidden = [draft], x[-1:]
            for i in range(1, self.max_proposals):  # chained row i sits at position start + rows + i - 1
                hidden, draft = self.step(hidden, drafts[-1], self.start + rows - 1 + steps[i:i + 1], None)
                drafts.append(draft)
            return torch.cat(drafts)
        self.graphs = {rows: graphs.capture(lambda rows=rows: draft_all(rows), warmup, pool)
                       for rows in range(1, rows_max + 1)}
        self.reset()
