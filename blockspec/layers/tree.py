"""A draft tree: which of one DFlash2 proposal pass's candidates it holds, and where its nodes sit in a target pass.

The tree. The drafter's pass scores the top-K candidates of each of its R rows, and the candidate selector
(drafter/model.py CandidateSelector) gives the probability of each candidate given the pick before it:
q(c | prev) = softmax over the row's candidates of unary[c] + < predecessor[prev] * P h_row, successor[c] >. A path's
score is the sum of its log q. The tree holds the root (the anchor), the chain the selector's walk proposes (greedy,
or drawn from q under sampling: so a cycle never accepts less than the chain would; engine/sampling.py walk), then,
best first, the highest-scoring children of the nodes already in it, until `budget` nodes. A path's score only falls
as it grows, so best-first order always takes a parent before its children: node indices are topological, as the
layout needs. With `marginal` the rows' own distributions (softmax of unary) replace the transition model. A budget
the candidates cannot fill (K + K^2 + ... nodes) is padded with invalid nodes, which the acceptance walk never
enters.

The lookup branch (prompt lookup). With `dflash2_tree_lookup: W` the last W of the budget's nodes hold the tokens
that followed the latest earlier occurrence of the context's last tokens (ContextLookup: its longest suffix of up to
LONGEST tokens, ending at the anchor, that occurred before; where that continuation reaches the anchor, it goes on
repeating with the period between the two), from the root (`graft`): each of its tokens joins the
path's node holding it where the tree has one, else takes one of the W slots; slots left over are invalid. Why:
generations repeat what they have read or written (code quotes names, signatures and whole lines), and the drafter,
which sees the context only through its features, misses many of those repeats. The branch is verified as exactly as
the drafter's nodes (off the chain: the sampled walk draws from p there). The host keeps the context's ids in one
array, written as positions commit; a query compares the anchor with the whole context once, then narrows those
matches by the tokens before it: one pass over the ids a cycle (~5 us at 4k tokens, ~30 us at 128k).

The layout. A tree pass runs T nodes at once: node 0 is the root (the last committed token), every other node
continues its parent's path by one token. Each node attends to the committed context and to its own path only, and
each DeltaNet layer convolves and recurs along that path, never across branches. The layout says so in tensors:
  positions    committed length + depth: the position a node's token would take if its path were kept (RoPE)
  slots        committed length + node index: the cache entry a node's key and value are written to (a kept path
               is moved to contiguous positions at commit, engine/state.py)
  ancestors    [T, T] bool: node j lies on node i's path (j == i included)
  window_rows  [T, K]: the rows of [conv history (K-1 rows); the nodes' inputs] a node's causal conv reads, oldest
               first, the node itself last
  parents      [T]: each node's parent (the root its own)
  max_depth    no node lies deeper below the root (a Python int: the DeltaNet kernel's closed form needs no more)

Tree and layout are built on the device, in fixed shapes, from the pass's candidates and the nodes' parents: no host
synchronisation, so a CUDA graph records them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from ..kernels import drafter_tree, tree_paths


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


def graft(tree: DraftTree, branch: torch.Tensor) -> DraftTree:
    """The tree with a branch from the root grafted on (module docstring): branch [W + 1] int64, W tokens then how
    many of them are the branch; W more nodes (kernels/drafter_tree.py)."""
    return DraftTree(drafter_tree.graft_branch(tree.nodes, branch))


@dataclass
class TreeLayout:
    positions: torch.Tensor
    slots: torch.Tensor
    ancestors: torch.Tensor
    window_rows: torch.Tensor
    parents: torch.Tensor
    max_depth: int

    @classmethod
    def build(cls, parents: torch.Tensor, depth: torch.Tensor, start, conv_kernel: int,
              max_depth: int | None = None) -> TreeLayout:
        """parents / depth [T] (int64, the root's parent 0); start: the committed length (an int, or a 0-dim device
        tensor under CUDA graphs); max_depth: a bound on depth (default T - 1)."""
        t = parents.shape[0]
        max_depth = t - 1 if max_depth is None else min(max_depth, t - 1)
        ancestors, window_rows = tree_paths.layout(parents, depth, conv_kernel, max_depth)
        nodes = torch.arange(t, device=parents.device)
        return cls(start + depth, start + nodes, ancestors, window_rows, parents, max_depth)


LONGEST = 4  # tokens of the context's suffix that a match needs at most: the longest match wins, then the latest


class ContextLookup:
    def __init__(self, tokens: list[int]):
        """`tokens`: the committed context (a request's prompt)."""
        self.ids = numpy.zeros(max(2 * len(tokens), 1024), dtype=numpy.int64)
        self.length = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]):
        """`tokens` committed after the context."""
        end = self.length + len(tokens)
        if end + 1 > self.ids.shape[0]:  # room for the root a query appends
            grown = numpy.zeros(2 * (end + 1), dtype=numpy.int64)
            grown[:self.length] = self.ids[:self.length]
            self.ids = grown
        self.ids[self.length:end] = tokens
        self.length = end

    def branch(self, root: int, width: int) -> list[int]:
        """`width` tokens predicted to follow context + [root]: those after the latest earlier occurrence of its
        longest suffix (up to LONGEST tokens, at least the root) that occurred before, past the root repeating with
        the distance between the two (a loop goes on looping); [] where the root never occurred."""
        text = self.ids[:self.length + 1]
        text[-1] = root
        last = self.length  # the root's position
        ends = numpy.flatnonzero(text[:last] == root)  # where an earlier occurrence of the suffix ends
        if not ends.size:
            return []
        best = ends[-1]
        for back in range(1, min(LONGEST, last + 1)):  # the suffix one token longer: the matches it keeps
            ends = ends[ends >= back]
            ends = ends[text[ends - back] == text[last - back]]
            if not ends.size:
                break
            best = ends[-1]
        # past the root the match's continuation repeats with the distance between them (a loop goes on looping)
        return text[best + 1 + numpy.arange(width) % (last - best)].tolist()
