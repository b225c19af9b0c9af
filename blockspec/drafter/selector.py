"""Candidate selector: picks each proposal among the top-K tokens of its row, given the previous pick.

score(prev -> cand at row i) = logit_i[cand] + < predecessor[prev] * P h_i , successor[cand] >
The walk is greedy and starts from the anchor token (the last committed token).
"""

from __future__ import annotations

import torch
from torch import nn


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

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """hidden [n, H], logits [n, V], anchor [1] -> chosen tokens [n]. No host synchronisation."""
        # Unsorted, like the reference: candidate order decides exact score ties (common in bf16).
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        previous = anchor.reshape(1)
        chosen = []
        for row in range(hidden.shape[0]):
            scores = self.transition_scores(unary[row], candidates[row], previous, projected[row])
            previous = candidates[row, torch.argmax(scores).reshape(1)]
            chosen.append(previous)
        return torch.cat(chosen)
