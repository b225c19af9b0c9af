"""The DFlash2 draft tree's best-first build in one Triton program, the fast path of `build_tree`
(drafter_tree.py), whose reference is `build_tree_reference` there.

Why: the reference adds each node with ~30 tiny ops (1-element index tensors, so that a CUDA graph can record the
loop), hundreds of launches a tree inside the proposal graph (docs/benchmarks.md, "Draft trees"). One program keeps the frontier (the path score of each node's K children, -inf once
taken or past the last row) in registers, flattened in (node, child) order, and adds one node per step: the first
maximum of the frontier, then the scores of its children from the table. The table stays in global memory: each
step reads one row of K scores.

The same tree as the reference, bit for bit: each score is the parent's score + the table's entry in float32, as
the reference adds them; the maximum is torch.argmax's (the first in flattened order; NaN above everything; -0.0
equal to 0.0); padding nodes are the reference's (once the frontier is all -inf its first entry wins: root 0's
candidate 0 of row 0, invalid). The chain's scores come in as the reference computes them (a cumsum, which the CPU
accumulates in float64), so that its nodes' children start from the same sums.
"""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

MAX_FRONTIER = 4096  # (budget + 1) x K, each rounded up to a power of two: 64 nodes of 64 candidates


def available(table: torch.Tensor, budget: int) -> bool:
    return (triton_runs_on(table) and table.dtype == torch.float32
            and triton.next_power_of_2(budget + 1) * triton.next_power_of_2(table.shape[-1]) <= MAX_FRONTIER)


def build_tree(table, candidates, anchor, chain, chain_scores, budget: int):
    """The tree's nodes [4, budget + 1] int64 (tokens, parents, depth, valid) as build_tree_reference's: table
    [R, K, K] float32, candidates [R, K], anchor [1], chain [R] (candidate indices), chain_scores [min(budget, R)]
    (the chain nodes' path scores)."""
    rows, top_k = candidates.shape
    size = budget + 1
    nodes = torch.empty(4, size, dtype=torch.long, device=table.device)
    _build_kernel[(1,)](table.contiguous(), candidates.contiguous(), anchor, chain.contiguous(), chain_scores,
                        *nodes, ROWS=rows, TOP_K=top_k, SIZE=size,
                        LENGTH=min(budget, rows), NODES=triton.next_power_of_2(size),
                        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl.options(table))
    return nodes


if triton is not None:
    @triton.jit
    def _order(x):
        """int32 keys that order float32 values as torch.argmax compares them: NaN above everything (all NaNs
        equal), -0.0 equal to 0.0 (a float's bits, the negatives' magnitude bits flipped)."""
        bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
        return tl.where(x != x, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))

    @triton.jit
    def _value(key):
        """The float32 value of an _order key (a NaN for NaN's key)."""
        return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _build_kernel(table, candidates, anchor, chain, chain_scores, tokens, parents, depth, valid,
                      ROWS: tl.constexpr, TOP_K: tl.constexpr, SIZE: tl.constexpr, LENGTH: tl.constexpr,
                      NODES: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        # the root and the chain: nodes 0 .. LENGTH, node n at depth n, in row n - 1
        nodes = tl.arange(0, NODES)
        on_chain = (nodes >= 1) & (nodes <= LENGTH)
        picked = tl.load(chain + nodes - 1, mask=on_chain, other=0)
        token = tl.load(candidates + (nodes - 1) * TOP_K + picked, mask=on_chain, other=0)
        token = tl.where(nodes == 0, tl.load(anchor).to(tl.int64), token)
        written = nodes <= LENGTH
        tl.store(tokens + nodes, token, mask=written)
        tl.store(parents + nodes, tl.maximum(nodes - 1, 0).to(tl.int64), mask=written)
        tl.store(depth + nodes, nodes.to(tl.int64), mask=written)
        tl.store(valid + nodes, tl.full([NODES], 1, tl.int64), mask=written)
        node_depth = tl.where(written, nodes, 0)

        # frontier lane = node * BLOCK_K + j: the score of the node's child j (its row's candidate j)
        lanes = tl.arange(0, NODES * BLOCK_K)
        owner, j = lanes // BLOCK_K, lanes % BLOCK_K
        grows = (owner <= LENGTH) & (owner < ROWS) & (j < TOP_K)
        from_chain = grows & (owner >= 1)
        choice = tl.load(chain + owner - 1, mask=from_chain, other=0)
        score = tl.load(chain_scores + owner - 1, mask=from_chain, other=0.0)  # the root's: 0
        below = tl.load(table + (owner * TOP_K + choice) * TOP_K + j, mask=grows, other=0.0)
        next_on_chain = tl.load(chain + owner, mask=owner < LENGTH, other=-1)  # already a node
        frontier = tl.where(grows & (j != next_on_chain), score + below, float("-inf"))

        for node in range(LENGTH + 1, SIZE):
            key, best = tl.max(_order(frontier), 0, return_indices=True, return_indices_tie_break_left=True)
            value = _value(key)
            found = value > float("-inf")
            parent, child = best // BLOCK_K, best % BLOCK_K
            row = tl.sum(tl.where(nodes == parent, node_depth, 0), 0)  # the child's row: the parent's depth
            tl.store(tokens + node, tl.load(candidates + tl.minimum(row, ROWS - 1) * TOP_K + child))
            tl.store(parents + node, parent.to(tl.int64))
            tl.store(depth + node, (row + 1).to(tl.int64))
            tl.store(valid + node, found.to(tl.int64))
            node_depth = tl.where(nodes == node, row + 1, node_depth)
            mine = (owner == node) & (j < TOP_K)
            below = tl.load(table + (tl.minimum(row + 1, ROWS - 1) * TOP_K + child) * TOP_K + j, mask=mine, other=0.0)
            grow = found & (row + 1 < ROWS)
            frontier = tl.where(mine, tl.where(grow, value + below, float("-inf")), frontier)
            frontier = tl.where(lanes == best, float("-inf"), frontier)
