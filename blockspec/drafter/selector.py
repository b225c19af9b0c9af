"""Candidate selector: picks each proposal among the top-K tokens of its row, given the previous pick.

score(prev -> cand at row i) = logit_i[cand] + < predecessor[prev] * P h_i , successor[cand] >
The walk is greedy and starts from the anchor token (the last committed token).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.drafter import selector_triton


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
             vocabulary: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, H], logits [n, V], anchor [1] -> chosen tokens [n]. No host synchronisation. With a draft
        vocabulary, logits column j is token vocabulary[j] (layers/draft_head.py)."""
        # Unsorted, like the reference: candidate order decides exact score ties (common in bf16).
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        if vocabulary is not None:
            candidates = vocabulary[candidates]
        return greedy_walk(unary, candidates, self.hidden_projection(hidden), anchor.reshape(1),
                           self.predecessor_codebook.weight, self.successor_codebook.weight)


def greedy_walk(unary, candidates, projected, anchor, predecessor, successor):
    """From the anchor, pick in each row the candidate with the best unary + transition score given the pick
    before it (the same arithmetic as CandidateSelector.transition_scores). On CUDA one Triton program
    (selector_triton.py) instead of ~6 ops per step; else greedy_walk_reference."""
    if selector_triton.available(unary):
        return selector_triton.greedy_walk(unary, candidates, projected, anchor, predecessor, successor)
    return greedy_walk_reference(unary, candidates, projected, anchor, predecessor, successor)


def greedy_walk_reference(unary, candidates, projected, anchor, predecessor, successor):
    previous = anchor
    chosen = []
    for row in range(unary.shape[0]):
        query = predecessor[previous][0] * projected[row]
        scores = unary[row] + successor[candidates[row]] @ query
        previous = candidates[row, torch.argmax(scores).reshape(1)]
        chosen.append(previous)
    return torch.cat(chosen)
