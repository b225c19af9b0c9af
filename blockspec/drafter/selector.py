"""Candidate selector: picks each proposal among the top-K tokens of its row, given the previous pick.

score(prev -> cand at row i) = logit_i[cand] + < predecessor[prev] * P h_i , successor[cand] >
The walk starts from the anchor token (the last committed token). Greedy, it takes each row's best score; with a
`Selection` at temperature T > 0 (sampling), it draws each row's pick from q = softmax(scores / T) over the row's
candidates, given the pick before it, by inverse CDF with one uniform per row, and reports q: the distribution the
proposal was really drawn from, which the speculative-sampling rule needs (as the reference selector, dflash's
CandidateSelector.select, draws and reports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.drafter.tree import DraftTree, build_tree, transition_log_probs
from blockspec.kernels.drafter_selector import greedy_walk, sampled_walk


@dataclass
class Selection:
    """A sampling walk's inputs (temperature, a 0-dim tensor, 0 = greedy; one uniform in (0, 1] per row, float64)
    and outputs: each row's candidate token ids and the probabilities q it drew from [rows, K]."""

    temperature: torch.Tensor
    uniforms: torch.Tensor
    candidates: torch.Tensor | None = None
    probs: torch.Tensor | None = None


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.successor_codebook = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False, dtype=dtype)

    def transition_scores(
        self, unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor, projected: torch.Tensor
    ) -> torch.Tensor:
        """Scores [K] of moving from token `previous` ([1]) to each of `candidates` ([K], logits `unary`)."""
        query = self.predecessor_codebook(previous)[0] * projected  # [rank]
        return unary + self.successor_codebook(candidates) @ query

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             vocabulary: torch.Tensor | None = None, selection: Selection | None = None) -> torch.Tensor:
        """hidden [n, H], logits [n, V], anchor [1] -> chosen tokens [n]. No host synchronisation. With a draft
        vocabulary, logits column j is token vocabulary[j] (layers/draft_head.py). With a `selection`, the walk
        samples at its temperature and fills its candidates and probs."""
        # Unsorted, like the reference: candidate order decides exact score ties (common in bf16).
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        if vocabulary is not None:
            candidates = vocabulary[candidates]
        codebooks = self.predecessor_codebook.weight, self.successor_codebook.weight
        projected = self.hidden_projection(hidden)
        if selection is None:
            return greedy_walk(unary, candidates, projected, anchor.reshape(1), *codebooks)
        chosen, selection.probs = sampled_walk(unary, candidates, projected, anchor.reshape(1), *codebooks,
                                               selection.temperature, selection.uniforms)
        selection.candidates = candidates
        return chosen

    def tree(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, budget: int,
             vocabulary: torch.Tensor | None = None, marginal: bool = False,
             selection: Selection | None = None) -> DraftTree:
        """A draft tree of `budget` nodes (drafter/tree.py) holding the walk's chain: the greedy walk's, or with a
        `selection` the sampled walk's (its candidates and probs filled as `walk` fills them); no host
        synchronisation."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        if vocabulary is not None:
            candidates = vocabulary[candidates]
        codebooks = self.predecessor_codebook.weight, self.successor_codebook.weight
        projected = self.hidden_projection(hidden)
        if selection is None:
            chain = greedy_walk(unary, candidates, projected, anchor.reshape(1), *codebooks)
        else:
            chain, selection.probs = sampled_walk(unary, candidates, projected, anchor.reshape(1), *codebooks,
                                                  selection.temperature, selection.uniforms)
            selection.candidates = candidates
        table = transition_log_probs(unary, candidates, projected, anchor, *codebooks, marginal=marginal)
        return build_tree(table, candidates, anchor, chain, budget)
