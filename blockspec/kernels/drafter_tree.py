"""A DFlash2 draft tree from the selector's scores (layers/tree.py says what the tree holds and why): the transition
table and the tree's best-first build, each op with its PyTorch reference and the dispatch to its Triton program
(drafter_tree_triton.py). Everything stays on the device, in fixed shapes: no host synchronisation, so a CUDA graph
records it. The CPU, where no graph records anything, builds the tree in a loop on the host (build_tree_host).
"""

from __future__ import annotations

import heapq
import math

import numpy
import torch

from . import drafter_tree_triton


def transition_table(unary, candidates, projected, anchor, predecessor, successor) -> torch.Tensor:
    """[R, K, K] float32: log q(candidate j of row r | the pick before it is candidate i of row r - 1), the selector's
    scores (drafter/model.py CandidateSelector) log-softmaxed over j; row 0's pick follows the anchor whatever i. unary /
    candidates [R, K], projected [R, rank], anchor [1]; codebooks [V, rank]. Where Triton runs, one launch
    (drafter_tree_triton.py) instead of ~10 small ops; else transition_table_reference."""
    if drafter_tree_triton.table_available(unary):
        return drafter_tree_triton.transition_table(unary, candidates, projected, anchor, predecessor, successor)
    return transition_table_reference(unary, candidates, projected, anchor, predecessor, successor)


def transition_table_reference(unary, candidates, projected, anchor, predecessor, successor):
    k = candidates.shape[1]
    before = torch.cat([anchor.reshape(1, 1).expand(1, k), candidates[:-1]])    # [R, K] the token before each pick
    query = predecessor[before] * projected[:, None, :]                           # [R, K(before), rank]
    scores = unary[:, None, :] + query @ successor[candidates].transpose(1, 2)    # [R, K(before), K]
    return torch.log_softmax(scores.float(), -1)


def build_tree(table: torch.Tensor, candidates: torch.Tensor, anchor: torch.Tensor, chain: torch.Tensor,
               budget: int) -> torch.Tensor:
    """The tree of `budget` nodes (layers/tree.py) from the transition table [R, K, K], the rows' candidate ids
    [R, K], the anchor [1] and the chain's tokens [R] (each among its row's candidates), as its nodes
    [4, budget + 1] int64: rows tokens, parents, depth, valid (1; 0 for padding). Where Triton runs, one program
    (drafter_tree_triton.py) instead of ~30 ops per node; on the CPU, where no graph records the build, a loop on the
    host (build_tree_host); else build_tree_reference."""
    if drafter_tree_triton.available(table, budget):
        return drafter_tree_triton.build_tree(table, candidates, anchor, chain, budget)
    if table.device.type == "cpu":
        return build_tree_host(table, candidates, anchor, chain, budget)
    return build_tree_reference(table, candidates, anchor, chain, budget)


def chain_choices(candidates: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """[R] int64: each chain token's candidate index in its row (the first equal; 0 where none is)."""
    return (candidates == chain[:, None]).to(torch.uint8).argmax(-1)


def chain_scores(table: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """[n] float32: the path scores of the chain's first n nodes, whose candidate indices in rows 0 .. n - 1 are
    `picked` (row 0's pick follows the anchor: its table row 0), each the one before plus its table entry in
    float32, from the first entry (no 0.0 before it, which would turn a -0.0 into 0.0)."""
    steps = torch.arange(picked.shape[0], device=picked.device)
    entries = table[steps, torch.cat([picked.new_zeros(1), picked[:-1]]), picked]
    scores = [entries[:1]]
    for i in range(1, picked.shape[0]):
        scores.append(scores[-1] + entries[i:i + 1])
    return torch.cat(scores)


def build_tree_host(table: torch.Tensor, candidates: torch.Tensor, anchor: torch.Tensor, chain: torch.Tensor,
                    budget: int) -> torch.Tensor:
    """build_tree_reference's tree, node for node, from a heap of the frontier: each node costs a pop and K pushes
    where the reference's sync-free form runs ~12 tensor ops over the whole frontier. The same float32 sums (numpy
    float32 scalars), the same order: the highest score first, a NaN before any number (as argmax takes it), ties to
    the lowest frontier index (node * K + j); once nothing above -inf is left, every node is index 0's, invalid."""
    rows, k = candidates.shape
    length = min(budget, rows)
    table = table.float().numpy()
    ids = candidates.tolist()
    picked = [row.index(token) if token in row else 0 for row, token in zip(ids, chain[:length].tolist())]
    tokens, parents, depth = [int(anchor.reshape(-1)[0])], [0], [0]
    valid, score = [1], [numpy.float32(0.0)]
    frontier = []  # (0, index) for a NaN, else (1, -score, index): heapq pops the reference's argmax first

    def expand(node: int, row: int, choice: int, skip: int = -1):
        if row < rows:
            for j, value in enumerate((score[node] + table[row, choice]).tolist()):
                if j != skip and value != -math.inf:
                    heapq.heappush(frontier, (0, node * k + j) if value != value else (1, -value, node * k + j))

    for i, j in enumerate(picked):  # the chain: node i + 1 is node i's child j (chain_choices, chain_scores)
        tokens.append(ids[i][j])
        parents.append(i)
        depth.append(i + 1)
        valid.append(1)
        entry = table[i, picked[i - 1] if i else 0, j]
        score.append(score[-1] + entry if i else entry)
    for node in range(length + 1):
        expand(node, depth[node], 0 if node == 0 else picked[node - 1], picked[node] if node < length else -1)
    for node in range(length + 1, budget + 1):
        if frontier:
            entry = heapq.heappop(frontier)
            best, value = entry[-1], (numpy.float32(-entry[1]) if entry[0] else numpy.float32(math.nan))
        else:
            best, value = 0, numpy.float32(-math.inf)
        parent, j = divmod(best, k)
        row = depth[parent]
        tokens.append(ids[min(row, rows - 1)][j])
        parents.append(parent)
        depth.append(row + 1)
        valid.append(int(value > -math.inf))
        score.append(value)
        if valid[-1]:
            expand(node, row + 1, j)
    return torch.tensor([tokens, parents, depth, valid], dtype=torch.long)


def build_tree_reference(table: torch.Tensor, candidates: torch.Tensor, anchor: torch.Tensor, chain: torch.Tensor,
                         budget: int) -> torch.Tensor:
    rows, k = candidates.shape
    device = candidates.device
    size = budget + 1
    length = min(budget, rows)  # chain nodes 1..length
    tokens = torch.zeros(size, dtype=torch.long, device=device)
    parents = torch.zeros_like(tokens)
    depth = torch.zeros_like(tokens)
    choice = torch.zeros_like(tokens)           # each node's candidate index in its row
    score = torch.zeros(size, device=device)    # each node's path log-probability
    valid = torch.ones(size, dtype=torch.bool, device=device)
    tokens[:1] = anchor.reshape(1)
    steps = torch.arange(length, device=device)
    picked = chain_choices(candidates, chain)[:length]
    tokens[1:length + 1] = candidates[steps, picked]
    parents[1:length + 1] = steps
    depth[1:length + 1] = steps + 1
    choice[1:length + 1] = picked
    score[1:length + 1] = chain_scores(table, picked)
    # frontier[n, j]: the score of node n's child j (row depth[n]'s candidate j), -inf once taken or past the rows
    flat_table = table.reshape(rows * k, k)
    frontier = torch.full((size, k), float("-inf"), device=device)
    chain_nodes = torch.arange(length + 1, device=device)
    has_children = depth[:length + 1] < rows
    children = score[:length + 1, None] + flat_table[depth[:length + 1].clamp(max=rows - 1) * k + choice[:length + 1]]
    frontier[:length + 1] = torch.where(has_children[:, None], children, float("-inf"))
    flat, flat_candidates = frontier.view(-1), candidates.reshape(-1)
    flat.index_fill_(0, chain_nodes[:length] * k + picked, float("-inf"))  # the chain's children are nodes already
    for node in range(length + 1, size):  # 1-element index tensors throughout: no host synchronisation
        best = flat.argmax().reshape(1)
        value = flat.index_select(0, best)
        parent, j = best // k, best % k
        row = depth.index_select(0, parent)  # the child's row: its depth - 1
        tokens[node:node + 1] = flat_candidates.index_select(0, row.clamp(max=rows - 1) * k + j)
        parents[node:node + 1], depth[node:node + 1], choice[node:node + 1] = parent, row + 1, j
        score[node:node + 1] = value
        valid[node:node + 1] = value > float("-inf")
        flat.index_fill_(0, best, float("-inf"))
        below = flat_table.index_select(0, (row + 1).clamp(max=rows - 1) * k + j)[0]
        frontier[node] = torch.where((row + 1 < rows) & (value > float("-inf")), value + below, float("-inf"))
    return torch.stack([tokens, parents, depth, valid.long()])


def graft_branch(nodes: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """The tree's nodes [4, S] with a branch from the root grafted on, as nodes [4, S + W]: branch [W + 1] int64
    holds W tokens, then how many of them are the branch (the rest padding). Each branch token is its path's child
    holding it where the tree has one (the first such valid node), else a new node in the next of the W slots
    appended; slots left over are invalid padding (the anchor's token, parent 0, depth 1). Where Triton runs, one
    program (drafter_tree_triton.py); on the CPU a loop on the host (graft_branch_host); else graft_branch_reference,
    whose ~10 ops a token record in a CUDA graph."""
    if drafter_tree_triton.graft_available(nodes, branch):
        return drafter_tree_triton.graft_branch(nodes, branch)
    if nodes.device.type == "cpu":
        return graft_branch_host(nodes, branch)
    return graft_branch_reference(nodes, branch)


def graft_branch_host(nodes: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    width = branch.shape[0] - 1
    tokens, parents, depth, valid = nodes.tolist()
    size = len(tokens)
    *ids, count = branch.tolist()
    children = {}  # (parent, token) -> the first valid node holding it
    for node in range(size - 1, 0, -1):
        if valid[node]:
            children[parents[node], tokens[node]] = node
    tokens += [tokens[0]] * width
    parents += [0] * width
    depth += [1] * width
    valid += [0] * width
    at = 0
    for i, token in enumerate(ids[:count]):
        child = children.get((at, token))
        if child is None:
            child = size + i
            tokens[child], parents[child], depth[child], valid[child] = token, at, depth[at] + 1, 1
        at = child
    return torch.tensor([tokens, parents, depth, valid], dtype=torch.long)


def graft_branch_reference(nodes: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    width = branch.shape[0] - 1
    size = nodes.shape[1]
    pad = torch.stack([nodes[0, :1].expand(width), *(torch.full_like(nodes[0, :width], v) for v in (0, 1, 0))])
    out = torch.cat([nodes, pad], 1)
    tokens, parents, depth, valid = out[0], out[1], out[2], out[3]
    index = torch.arange(size + width, device=nodes.device)
    at = torch.zeros(1, dtype=torch.long, device=nodes.device)
    for i in range(width):  # 1-element tensors throughout: no host synchronisation
        token = branch[i:i + 1]
        live = branch[width:] > i
        match = (parents == at) & (tokens == token) & (valid != 0) & (index > 0) & (index < size + i)
        found = match.any().reshape(1)
        first = match.to(torch.uint8).argmax().reshape(1)  # the first True
        new = live & ~found
        slot = size + i
        tokens[slot:slot + 1] = torch.where(new, token, tokens[slot:slot + 1])
        depth[slot:slot + 1] = torch.where(new, depth.index_select(0, at) + 1, depth[slot:slot + 1])
        parents[slot:slot + 1] = torch.where(new, at, parents[slot:slot + 1])
        valid[slot:slot + 1] = new.long()
        at = torch.where(live, torch.where(found, first, torch.full_like(at, slot)), at)
    return out
