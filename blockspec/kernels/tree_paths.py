"""Paths in a draft tree's pass (layers/tree.py says how a tree pass is laid out, engine/sampling.py's walk how it is
walked): `layout`, each node's ancestors and causal-conv window rows, `descend`, the accepted path given the token
the target chose at every node, and `stage`, what the kept path's commit and the drafter's context read. The ops, their
PyTorch references, and the dispatch to one Triton launch each (tree_paths_triton.py). Everything stays on the
device in fixed shapes: no host synchronisation, so a CUDA graph records it. The CPU, where no graph records
anything, walks the tree in a loop on the host (descend_host).

Nodes are numbered so that a parent comes before its children; node 0 is the root (its own parent, depth 0).
"""

from __future__ import annotations

import torch

from . import tree_paths_triton


def layout(parents: torch.Tensor, depth: torch.Tensor, conv_kernel: int, max_depth: int) -> tuple[torch.Tensor, ...]:
    """parents / depth [T] int64, no node deeper than max_depth -> (ancestors [T, T] bool: node j lies on node i's
    path, j == i included; window_rows [T, K] int64: the rows of [conv history (K - 1 rows); the nodes' inputs] node
    i's causal conv reads, oldest first, the node itself last). Where Triton runs, one program; else
    layout_reference."""
    if tree_paths_triton.available(parents):
        return tree_paths_triton.layout(parents, depth, conv_kernel, max_depth)
    return layout_reference(parents, depth, conv_kernel, max_depth)


def layout_reference(parents, depth, conv_kernel: int, max_depth: int):
    t = parents.shape[0]
    nodes = torch.arange(t, device=parents.device)
    ancestors = nodes[:, None] == nodes[None, :]
    jump = parents
    for _ in range(max(max_depth, 1).bit_length()):  # pointer doubling: paths of up to 2^steps nodes
        ancestors = ancestors | ancestors[jump]
        jump = jump[jump]
    # the ancestor of each node at each depth 0..deepest reachable by the conv (the node's depth - (K-1) ..)
    taps = torch.arange(conv_kernel, device=parents.device)
    wanted = depth[:, None] - (conv_kernel - 1) + taps[None, :]                    # [T, K] depth of each tap
    at_depth = ancestors[:, None, :] & (depth[None, None, :] == wanted[:, :, None])  # [T, K, T]
    ancestor = at_depth.to(torch.uint8).argmax(-1)                                  # node index (when wanted >= 0)
    return ancestors, (conv_kernel - 1) + torch.where(wanted >= 0, ancestor, wanted)


def descend(chosen: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
            valid: torch.Tensor, max_depth: int) -> torch.Tensor:
    """The walk from the root: from the node it stands on, to the valid child whose token is the one chosen at that
    node (the first such child by index: a forced tree's siblings may repeat a token), until none is. chosen /
    tokens / parents / depth [T] int64, valid [T] bool. Returns int64 [2 + 2 (max_depth + 1)]: accepted nodes n,
    the token chosen at the last (the bonus), the path's node indices (root first; entries past n + 1 are 0), the
    tokens of those nodes. Where Triton runs, one program; on the CPU, where no graph records the walk, a loop on the
    host (descend_host); else descend_reference."""
    if tree_paths_triton.available(chosen):
        return tree_paths_triton.descend(chosen, tokens, parents, depth, valid, max_depth)
    if chosen.device.type == "cpu":
        return descend_host(chosen, tokens, parents, depth, valid, max_depth)
    return descend_reference(chosen, tokens, parents, depth, valid, max_depth)


def descend_host(chosen, tokens, parents, depth, valid, max_depth: int):
    """descend_reference's result from a walk over the nodes' lists: a few steps where the reference's sync-free
    form runs ~4 tensor ops a level."""
    chosen, tokens, parents, depth, valid = (x.tolist() for x in (chosen, tokens, parents, depth, valid))
    children = [[] for _ in tokens]
    for node in range(1, len(tokens)):
        if valid[node] and depth[node] == depth[parents[node]] + 1:
            children[parents[node]].append(node)
    path = [0]
    while len(path) <= max_depth:
        node = path[-1]
        step = next((child for child in children[node] if tokens[child] == chosen[node]), None)
        if step is None:
            break
        path.append(step)
    accepted, bonus = len(path) - 1, chosen[path[-1]]
    path += [0] * (max_depth + 1 - len(path))
    return torch.tensor([accepted, bonus, *path, *(tokens[node] for node in path)], dtype=torch.long)


def descend_reference(chosen, tokens, parents, depth, valid, max_depth: int):
    on_path = depth == 0
    follows = valid & (tokens == chosen[parents])
    for level in range(1, max_depth + 1):
        steps = (depth == level) & follows & on_path[parents]
        on_path = on_path | (steps & (steps.cumsum(0) == 1))
    levels = torch.arange(max_depth + 1, device=chosen.device)
    path = (on_path[None, :] & (depth[None, :] == levels[:, None])).to(torch.uint8).argmax(-1)
    accepted = on_path.sum(0, keepdim=True) - 1
    bonus = chosen.index_select(0, path.index_select(0, accepted))
    return torch.cat([accepted, bonus, path, tokens[path]])


def stage(result: torch.Tensor, window_rows: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
          path_out: torch.Tensor, history_out: torch.Tensor, start_out: torch.Tensor) -> torch.Tensor:
    """From descend's result (n, bonus, path [L], tokens [L]; L = path_out's length): the path into path_out [L], the
    conv window rows after its last kept node (window_rows [T, K] at path[n], taps 1..K-1) into history_out [K - 1],
    start (a 0-dim tensor) into start_out; returns the feature rows [T, F] of the path's nodes in path order [L, F]
    (rows past the kept ones: the root's, as the path's entries there are 0). Where Triton runs, one launch; else
    stage_reference."""
    if tree_paths_triton.available(window_rows):
        return tree_paths_triton.stage(result, window_rows, features, start, path_out, history_out, start_out)
    return stage_reference(result, window_rows, features, start, path_out, history_out, start_out)


def stage_reference(result, window_rows, features, start, path_out, history_out, start_out):
    path = result[2:2 + path_out.shape[0]]
    last = result.gather(0, result[:1] + 2)
    path_out.copy_(path)
    history_out.copy_(window_rows.index_select(0, last)[0, 1:])
    start_out.copy_(start)
    return features.index_select(0, path)
