"""Where the nodes of a draft tree sit in one target pass, as the layers read it.

A tree pass runs T nodes at once: node 0 is the root (the last committed token), every other node continues its
parent's path by one token, and nodes are numbered so that a parent comes before its children. Each node attends
to the committed context and to its own path only, and each DeltaNet layer convolves and recurs along that path,
never across branches. The layout says so in tensors built on the device from the parents alone (no host
synchronisation, so a CUDA graph records it):
  positions    committed length + depth: the position a node's token would take if its path were kept (RoPE)
  slots        committed length + node index: the cache entry a node's key and value are written to (a kept path
               is moved to contiguous positions at commit, engine/state.py)
  ancestors    [T, T] bool: node j lies on node i's path (j == i included)
  window_rows  [T, K]: the rows of [conv history (K-1 rows); the nodes' inputs] a node's causal conv reads, oldest
               first, the node itself last
  parents      [T]: each node's parent (the root its own)
  max_depth    no node lies deeper below the root (a Python int: the DeltaNet kernel's closed form needs no more)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import tree_paths


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
