"""Native MTP self-speculation: the checkpoint's own MTP head drafts k tokens by chaining itself.

MTP row p pairs the target's hidden state at position p with the token at p+1 and predicts the token at p+2; it
uses RoPE position p and writes its KV cache entry p. After each verification the committed rows are (re)written
from the target's verified hidden states, so draft rows written while chaining are scratch and roll back for free:
the MTP cache, like the target's attention caches, commits by length.

Under sampling each draft is drawn from the head's own distribution processed with the request's filters
(engine/sampling.py), with the request's uniforms, and that distribution is kept as the acceptance rule's q.
"""

from __future__ import annotations

import torch

from ..layers.attention import KVCache
from ..layers.draft_head import DraftHead
from ..models.mtp import MTPHead
from . import graphs
from .decode import Proposer
from .sampling import Sampler, draw, processed_probs


class MTPProposer(Proposer):
    name = "mtp"

    def __init__(self, model, head: MTPHead, num_drafts: int, capacity: int, device, dtype,
                 draft_head: DraftHead | None = None, sampler: Sampler | None = None):
        c = model.config
        self.model, self.head = model, head
        self.draft_head = draft_head  # drafts over a subset of the vocabulary (None: the full shared head)
        self.sampler = sampler        # the engine's: the request's sampling (None: greedy)
        # the token id of each column of the draft logits
        self.vocabulary = draft_head.ids if draft_head is not None else torch.arange(c.vocab_size, device=device)
        self.draft_width = self.vocabulary.numel()
        self.max_proposals = num_drafts
        self.caches = [KVCache(capacity, c.num_key_value_heads, c.head_dim, device, dtype) for _ in head.layers]
        self.graphs = {}  # (rows observed, sampled) -> (graph, (drafts, their distributions)): CUDA graphs only
        self.allocate_snapshots(0)
        self.reset()

    def reset(self):
        self.first_draft = None   # the head's guess for the token after the anchor
        self.first_probs = None   # under sampling, the distribution it was drawn from
        self.last_probs = None    # under sampling, the distribution of step_at's last draft
        self.chain_hidden = None  # its hidden state, the input of the next chained step
        self.chain_uniforms = None  # under sampling, the uniforms of the cycle's drafts
        self.drafts = None        # all drafts of the next cycle, when a graph computed them on the device
        self.probs = None         # under sampling, the distribution of each draft of the cycle [k, draft_width]
        self.proposed = 0

    def sampling(self) -> bool:
        return self.sampler is not None and not self.sampler.greedy

    def step(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, visible: int | None,
             uniform: torch.Tensor | None = None):
        """Run MTP rows at `positions` on final-normed hidden states; returns (the rows' final-normed outputs [T, h],
        the last row's draft as a 1-element tensor, and with a `uniform` [1] the distribution it was drawn from
        [1, draft_width], else greedy and None). Outputs feed the lm_head and, when chaining, the next step.
        visible=None passes the whole cache, the position being data (graph capture)."""
        embedded = self.model.embed(next_tokens)
        rope = self.model.rope(positions, embedded.dtype)
        x = self.head(embedded, hidden, self.caches, positions, rope, visible)
        normed = self.head.norm(x)
        last = normed[-1:]
        if uniform is None:
            if self.draft_head is not None:
                return normed, self.draft_head(last), None
            return normed, self.model.logits(last).argmax(-1), None
        logits = self.draft_head.logits(last) if self.draft_head is not None else self.model.logits(last)
        probs = processed_probs(logits, *self.sampler.filters())
        return normed, self.vocabulary[draw(probs, uniform)], probs

    def step_at(self, hidden, next_tokens, position: int, uniform=None):
        """step() eagerly at `position`: (normed outputs, the draft as an int); the draft's distribution (under
        sampling) is kept in last_probs."""
        positions = torch.arange(position, position + next_tokens.shape[0], device=hidden.device)
        normed, draft, self.last_probs = self.step(hidden, next_tokens, positions, position + next_tokens.shape[0],
                                                   uniform)
        return normed, int(draft)

    def allocate_snapshots(self, count: int) -> int:
        self.saved_hidden = torch.zeros(count, self.model.config.hidden_size, device=self.caches[0].k.device,
                                        dtype=self.caches[0].k.dtype)
        return self.saved_hidden.nbytes

    def save(self, slot, out, row):
        self.saved_hidden[slot].copy_(out.hidden[row])

    def restore(self, slot, position, token):
        """Cache rows before position - 1 pair the kept hidden states with kept tokens and stay; row position - 1
        pairs the saved hidden state with the token now at `position`, so it is recomputed (one head row)."""
        self.reset()
        device = self.saved_hidden.device
        self.write_rows(self.model.norm(self.saved_hidden[slot:slot + 1]), torch.tensor([token], device=device),
                        position - 1)

    def write_rows(self, hidden, next_tokens, first: int):
        """The head's cache rows first.. from final-normed hidden states and the tokens after them, no draft."""
        positions = torch.arange(first, first + next_tokens.shape[0], device=hidden.device)
        rope = self.model.rope(positions, hidden.dtype)
        self.head(self.model.embed(next_tokens), hidden, self.caches, positions, rope, first + next_tokens.shape[0])

    def observe(self, out, first, tokens, next_tokens, drafts=True):
        rows, sampled = len(tokens), self.sampling()
        if not drafts:
            self.write_rows(self.model.norm(out.hidden[:rows]), torch.tensor(next_tokens, device=out.hidden.device),
                            first)
            return
        uniforms = self.sampler.uniforms(self.max_proposals) if sampled else None  # the next cycle's drafts
        if (rows, sampled) in self.graphs:  # a verification pass: observe and chain every draft in one replay
            graph, (drafts, probs) = self.graphs[rows, sampled]
            self.hidden_in[:rows].copy_(out.hidden[:rows])
            self.ids_in[:rows].copy_(torch.tensor(next_tokens), non_blocking=True)
            self.start.fill_(first)
            if sampled:
                self.uniforms_in.copy_(uniforms, non_blocking=True)
            graph.replay()
            self.drafts, self.probs = drafts, probs
            return
        self.drafts = None
        device = out.hidden.device
        next_ids = torch.tensor(next_tokens, device=device)
        self.chain_uniforms = uniforms.to(device) if sampled else None
        # the head reads the target's final-normed hidden state (as vLLM / SGLang feed it)
        x, self.first_draft = self.step_at(self.model.norm(out.hidden[:rows]), next_ids, first, self._uniform(0))
        self.chain_hidden, self.first_probs = x[-1:], self.last_probs

    def _uniform(self, i: int):
        return None if self.chain_uniforms is None else self.chain_uniforms[i:i + 1]

    def propose(self, anchor, position, k):
        self.proposed = k
        if self.drafts is not None:
            return self.drafts[:k]
        drafts, hidden, probs = [self.first_draft], self.chain_hidden, [self.first_probs]
        for i in range(1, k):
            hidden, draft = self.step_at(hidden, torch.tensor([drafts[-1]], device=hidden.device), position + i - 1,
                                         self._uniform(i))
            drafts.append(draft)
            probs.append(self.last_probs)
        self.probs = torch.cat(probs) if self.chain_uniforms is not None else None
        return torch.tensor(drafts, device=hidden.device)

    def draft(self):
        k = self.proposed
        return self.vocabulary.expand(k, -1), self.probs[:k].clone()  # the ids: a buffer of the head's own

    def capture_graphs(self, pool=None, warmup: int = 2):
        """With CUDA graphs: for each verification length n (1..k+1 committed rows), one CUDA graph that observes
        the n rows and chains all k drafts on the device, so a cycle costs one replay and one host sync; one greedy
        and one sampling each (the filter values are the sampler's tensors)."""
        device, rows_max = self.caches[0].k.device, self.max_proposals + 1
        hidden, dtype = self.model.config.hidden_size, self.caches[0].k.dtype
        self.hidden_in = torch.zeros(rows_max, hidden, device=device, dtype=dtype)
        self.ids_in = torch.zeros(rows_max, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.uniforms_in = torch.ones(self.max_proposals, dtype=torch.float64, device=device)
        self.steps = steps = torch.arange(rows_max, device=device)  # kept: a graph holds no reference to it

        def draft_all(rows, sampled):
            uniforms = self.uniforms_in if sampled else None
            x, draft, q = self.step(self.model.norm(self.hidden_in[:rows]), self.ids_in[:rows],
                                    self.start + steps[:rows], None, uniforms[:1] if sampled else None)
            drafts, probs, hidden = [draft], [q], x[-1:]
            for i in range(1, self.max_proposals):  # chained row i sits at position start + rows + i - 1
                hidden, draft, q = self.step(hidden, drafts[-1], self.start + rows - 1 + steps[i:i + 1], None,
                                             uniforms[i:i + 1] if sampled else None)
                drafts.append(draft)
                probs.append(q)
            return torch.cat(drafts), torch.cat(probs) if sampled else None
        kinds = (False, True) if self.sampler is not None else (False,)
        self.graphs = {(rows, sampled): graphs.capture(lambda rows=rows, sampled=sampled: draft_all(rows, sampled),
                                                       warmup, pool)
                       for rows in range(1, rows_max + 1) for sampled in kinds}
        self.reset()
