"""A draft tree from one DFlash2 proposal pass: the selector's chain, then the drafter's likeliest other continuations.

The drafter's pass scores the top-K candidates of each of its R rows, and the candidate selector (selector.py)
gives the probability of each candidate given the pick before it: q(c | prev) = softmax over the row's candidates of
unary[c] + < predecessor[prev] * P h_row, successor[c] >. A path's score is the sum of its log q. The tree holds the
root (the anchor), the chain the selector's walk proposes (greedy, or drawn from q under sampling: so a cycle never
accepts less than the chain would; engine/tree.py), then, best first, the highest-scoring children of the nodes
already in it, until `budget` nodes. A path's score only falls as it grows, so best-first order always takes a parent
before its children: node indices are topological, as layers/tree.py needs. With `marginal` the rows' own
distributions (softmax of unary) replace the transition model.

Everything stays on the device, in fixed shapes: no host synchronisation, so a CUDA graph records it. A budget the
candidates cannot fill (K + K^2 + ... nodes) is padded with invalid nodes, which the acceptance walk never enters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.kernels import drafter_tree


@dataclass
class DraftTree:
    """nodes [4, T] int64, one tensor (a pass copies a tree in with one copy), its rows:
    tokens   the root (the anchor), then the nodes
    parents  each node's parent (the root's 0)
    depth    tokens after the root
    valid    1; 0 for padding"""
    nodes: torch.Tensor

    @classmethod
    def of(cls, tokens, parents, depth, valid) -> DraftTree:
        return cls(torch.stack([tokens, parents, depth, valid.long()]))

    @property
    def size(self) -> int:
        return self.nodes.shape[1]

    @property
    def tokens(self) -> torch.Tensor:
        return self.nodes[0]

    @property
    def parents(self) -> torch.Tensor:
        return self.nodes[1]

    @property
    def depth(self) -> torch.Tensor:
        return self.nodes[2]

    @property
    def valid(self) -> torch.Tensor:
        """[T] bool"""
        return self.nodes[3] != 0


def transition_log_probs(unary, candidates, projected, anchor, predecessor, successor, marginal: bool = False):
    """[R, K, K] float32: log q(candidate j of row r | the pick before it is candidate i of row r - 1); row 0's pick
    follows the anchor whatever i. unary / candidates [R, K], projected [R, rank], anchor [1]; codebooks [V, rank]
    (kernels/drafter_tree.py)."""
    rows, k = candidates.shape
    if marginal:
        return torch.log_softmax(unary.float(), -1)[:, None, :].expand(rows, k, k).contiguous()
    return drafter_tree.transition_table(unary, candidates, projected, anchor, predecessor, successor)


def build_tree(table: torch.Tensor, candidates: torch.Tensor, anchor: torch.Tensor, chain: torch.Tensor,
               budget: int) -> DraftTree:
    """The tree of `budget` nodes (module docstring) from the transition table [R, K, K] (transition_log_probs), the
    rows' candidate ids [R, K], the anchor [1] and the chain's tokens [R], each among its row's candidates
    (kernels/drafter_tree.py)."""
    return DraftTree(drafter_tree.build_tree(table, candidates, anchor, chain, budget))
