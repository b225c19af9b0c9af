"""The DFlash2 draft tree's transition table in one launch and its best-first build in one Triton program, the fast
paths of `transition_table` and `build_tree` (drafter_tree.py), whose references are `transition_table_reference`
and `build_tree_reference` there.

The table: one program a row computes the K x K scores of each candidate given each pick before it (the selector's
arithmetic, rounded as the reference: the query and the dot products to the codebooks' dtype, their sum with the
unary logits to the logits' dtype) and log-softmaxes them, where the reference takes ~10 small launches.

Why: the reference adds each node with ~30 tiny ops (1-element index tensors, so that a CUDA graph can record the
loop), hundreds of launches a tree inside the proposal graph (docs/benchmarks.md, "Draft trees"). One program keeps the frontier (the path score of each node's K children, -inf once
taken or past the last row) in registers, flattened in (node, child) order, and adds one node per step: the first
maximum of the frontier, then the scores of its children from the table. The table stays in global memory: each
step reads one row of K scores.

The same tree as the reference, bit for bit: each score is the parent's score + the table's entry in float32, as
the reference adds them; the maximum is torch.argmax's (the first in flattened order; NaN above everything; -0.0
equal to 0.0); padding nodes are the reference's (once the frontier is all -inf its first entry wins: root 0's
candidate 0 of row 0, invalid). The chain's candidate indices and path scores are found here too, as the reference
finds them (the first equal candidate; each score the one before plus its entry, from the first entry), in a loop
over its rows before the frontier is filled.
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


MAX_TABLE_K = 64
RANK_CHUNK = 32  # rank columns a step of the table's dot products takes: a [K, K, 32] product in registers


def table_available(unary: torch.Tensor) -> bool:
    return triton_runs_on(unary) and unary.shape[1] <= MAX_TABLE_K


def transition_table(unary, candidates, projected, anchor, predecessor, successor):
    """[R, K, K] float32 as transition_table_reference's (to rounding)."""
    rows, top_k = unary.shape
    rank = projected.shape[1]
    table = torch.empty(rows, top_k, top_k, dtype=torch.float32, device=unary.device)
    _table_kernel[(rows,)](unary.contiguous(), candidates.contiguous(), projected.contiguous(), anchor, predecessor,
                           predecessor.stride(0), successor, successor.stride(0), table, TOP_K=top_k, RANK=rank,
                           BLOCK_K=triton.next_power_of_2(top_k), CHUNK=min(RANK_CHUNK, triton.next_power_of_2(rank)),
                           num_warps=4, **pdl.options(unary))
    return table


def build_tree(table, candidates, anchor, chain, budget: int):
    """The tree's nodes [4, budget + 1] int64 (tokens, parents, depth, valid) as build_tree_reference's: table
    [R, K, K] float32, candidates [R, K], anchor [1], chain [R] (the chain's tokens)."""
    rows, top_k = candidates.shape
    size = budget + 1
    nodes = torch.empty(4, size, dtype=torch.long, device=table.device)
    _build_kernel[(1,)](table.contiguous(), candidates.contiguous(), anchor, chain.contiguous(), *nodes,
                        ROWS=rows, TOP_K=top_k, SIZE=size, LENGTH=min(budget, rows),
                        NODES=triton.next_power_of_2(size), BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
                        **pdl.options(table))
    return nodes


MAX_GRAFT_NODES = 1024  # a tree's nodes with its grafted branch, rounded up to a power of two


def graft_available(nodes: torch.Tensor, branch: torch.Tensor) -> bool:
    return triton_runs_on(nodes) and triton.next_power_of_2(nodes.shape[1] + branch.shape[0] - 1) <= MAX_GRAFT_NODES


def graft_branch(nodes, branch):
    """graft_branch_reference's nodes [4, S + W] (drafter_tree.py): nodes [4, S] int64, branch [W + 1] int64."""
    size, width = nodes.shape[1], branch.shape[0] - 1
    out = torch.empty(4, size + width, dtype=torch.long, device=nodes.device)
    _graft_kernel[(1,)](nodes.contiguous(), branch.contiguous(), out, SIZE=size, WIDTH=width,
                        NODES=triton.next_power_of_2(size + width), num_warps=1, **pdl.options(nodes))
    return out


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
    def _table_kernel(unary, candidates, projected, anchor, predecessor, s_pred, successor, s_succ, table,
                      TOP_K: tl.constexpr, RANK: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                      PDL: tl.constexpr):
        pdl.begin(PDL)
        row = tl.program_id(0)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < TOP_K
        dtype = successor.dtype.element_ty
        # the token before each pick (i): row 0's follow the anchor, row r's the candidates of row r - 1
        before = tl.load(candidates + (row - 1) * TOP_K + ks, mask=k_ok & (row > 0), other=0).to(tl.int64)
        before = tl.where(row > 0, before, tl.load(anchor + ks * 0).to(tl.int64))
        cand = tl.load(candidates + row * TOP_K + ks, mask=k_ok, other=0).to(tl.int64)
        dots = tl.zeros([BLOCK_K, BLOCK_K], tl.float32)
        for start in tl.static_range(0, RANK, CHUNK):
            rs = start + tl.arange(0, CHUNK)
            r_ok = rs < RANK
            code = tl.load(predecessor + before[:, None] * s_pred + rs[None, :], mask=k_ok[:, None] & r_ok[None, :],
                           other=0.0).to(tl.float32)
            query = (code * tl.load(projected + row * RANK + rs, mask=r_ok, other=0.0).to(tl.float32)[None, :])
            query = query.to(dtype).to(tl.float32)
            codes = tl.load(successor + cand[:, None] * s_succ + rs[None, :], mask=k_ok[:, None] & r_ok[None, :],
                            other=0.0).to(tl.float32)
            dots += tl.sum(query[:, None, :] * codes[None, :, :], 2)
        scores = (tl.load(unary + row * TOP_K + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                  + dots.to(dtype).to(tl.float32)).to(unary.dtype.element_ty).to(tl.float32)
        scores = tl.where(k_ok[None, :], scores, float("-inf"))
        shifted = scores - tl.max(scores, 1)[:, None]
        out = shifted - tl.log(tl.sum(tl.exp(shifted), 1))[:, None]
        tl.store(table + (row * TOP_K + ks[:, None]) * TOP_K + ks[None, :], out, mask=k_ok[:, None] & k_ok[None, :])

    @triton.jit
    def _build_kernel(table, candidates, anchor, chain, tokens, parents, depth, valid,
                      ROWS: tl.constexpr, TOP_K: tl.constexpr, SIZE: tl.constexpr, LENGTH: tl.constexpr,
                      NODES: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        nodes = tl.arange(0, NODES)
        # frontier lane = node * BLOCK_K + j: the score of the node's child j (its row's candidate j)
        lanes = tl.arange(0, NODES * BLOCK_K)
        owner, j = lanes // BLOCK_K, lanes % BLOCK_K
        ks = tl.arange(0, BLOCK_K)
        # the chain, row by row: chain node n = r + 1 picks candidate p of row r; per lane, its owner's pick (choice),
        # its owner's path score and the pick of the row below its owner (that child is a chain node already)
        choice = tl.zeros([NODES * BLOCK_K], tl.int32)
        score = tl.zeros([NODES * BLOCK_K], tl.float32)  # the root's: 0
        next_on_chain = tl.full([NODES * BLOCK_K], -1, tl.int32)
        previous = 0  # row 0's pick follows the anchor: its table row 0
        path_score = 0.0
        for r in tl.static_range(LENGTH):
            offered = tl.load(candidates + r * TOP_K + ks, mask=ks < TOP_K, other=0)
            token = tl.load(chain + r)
            first = tl.min(tl.where((offered == token) & (ks < TOP_K), ks, BLOCK_K), 0)
            pick = tl.where(first == BLOCK_K, 0, first)
            entry = tl.load(table + (r * TOP_K + previous) * TOP_K + pick)
            if r == 0:
                path_score = entry
            else:
                path_score = path_score + entry
            tl.store(tokens + r + 1, tl.load(candidates + r * TOP_K + pick).to(tl.int64))
            choice = tl.where(owner == r + 1, pick, choice)
            score = tl.where(owner == r + 1, path_score, score)
            next_on_chain = tl.where(owner == r, pick, next_on_chain)
            previous = pick
        written = nodes <= LENGTH
        tl.store(tokens + nodes, tl.load(anchor + nodes * 0).to(tl.int64), mask=nodes == 0)
        tl.store(parents + nodes, tl.maximum(nodes - 1, 0).to(tl.int64), mask=written)
        tl.store(depth + nodes, nodes.to(tl.int64), mask=written)
        tl.store(valid + nodes, tl.full([NODES], 1, tl.int64), mask=written)
        node_depth = tl.where(written, nodes, 0)

        grows = (owner <= LENGTH) & (owner < ROWS) & (j < TOP_K)
        below = tl.load(table + (owner * TOP_K + choice) * TOP_K + j, mask=grows, other=0.0)
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

    @triton.jit
    def _graft_kernel(nodes, branch, out, SIZE: tl.constexpr, WIDTH: tl.constexpr, NODES: tl.constexpr,
                      PDL: tl.constexpr):
        """The tree's rows in registers, one lane a node (the branch's slots past the tree's); each branch token
        finds its path's first valid child holding it or takes its slot."""
        pdl.begin(PDL)
        nodes_at = tl.arange(0, NODES)
        inside = nodes_at < SIZE
        tokens = tl.load(nodes + nodes_at, mask=inside, other=0)
        tokens = tl.where(inside, tokens, tl.load(nodes + nodes_at * 0))  # padding holds the anchor's token
        parents = tl.load(nodes + SIZE + nodes_at, mask=inside, other=0)
        depth = tl.load(nodes + 2 * SIZE + nodes_at, mask=inside, other=1)
        valid = tl.load(nodes + 3 * SIZE + nodes_at, mask=inside, other=0)
        count = tl.load(branch + WIDTH)
        at = 0
        for i in tl.static_range(WIDTH):
            token = tl.load(branch + i)
            match = (parents == at) & (tokens == token) & (valid != 0) & (nodes_at > 0) & (nodes_at < SIZE + i)
            first = tl.min(tl.where(match, nodes_at, NODES), 0)
            live = count > i
            new = live & (first == NODES)
            slot = nodes_at == SIZE + i
            at_depth = tl.sum(tl.where(nodes_at == at, depth, 0), 0)
            tokens = tl.where(slot & new, token, tokens)
            parents = tl.where(slot & new, at, parents)
            depth = tl.where(slot & new, at_depth + 1, depth)
            valid = tl.where(slot, new.to(tl.int64), valid)
            at = tl.where(live, tl.where(first == NODES, SIZE + i, first), at)
        kept = nodes_at < SIZE + WIDTH
        tl.store(out + nodes_at, tokens, mask=kept)
        tl.store(out + (SIZE + WIDTH) + nodes_at, parents.to(tl.int64), mask=kept)
        tl.store(out + 2 * (SIZE + WIDTH) + nodes_at, depth.to(tl.int64), mask=kept)
        tl.store(out + 3 * (SIZE + WIDTH) + nodes_at, valid.to(tl.int64), mask=kept)
