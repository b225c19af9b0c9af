"""The attention of a drafter training step: every anchor block of the step in one call over the target's context
features and the blocks (train/dflash2.py `drafter_hidden`).

Query row r belongs to block r // block, anchored at position a of a stream of sequences of `seq_len` tokens laid end
to end (`length` in all); it stands at position a + r % block. It sees context position p of the same sequence when
p < a and a + r % block - p < window (what the drafter reads at inference: committed features inside its window),
and every row of its own block (DFlash2's block is not causal), no other block. Keys are [context (length); blocks].

Two forms of the same predicate (`sees`): a dense boolean mask for scaled_dot_product_attention (the reference, and
train-drafter's path on the CPU, where flex_attention has no backward), and a flex_attention block mask (compiled;
train-drafter's path on CUDA): a row's keys span at most window + block of the step's length + n * block, so the
block-sparse kernel skips the rest, where the dense mask computes it all. H200, the demo pair's step (8192 block
rows over 8192 context keys): 0.0394 s a step against the dense mask's 0.0432 (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BlockLayout:
    anchors: torch.Tensor  # [n] anchor positions in the stream
    block: int
    length: int            # context positions in the stream
    window: int
    seq_len: int

    @property
    def rows(self) -> int:
        return self.anchors.shape[0] * self.block

    def sees(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        owner = q_idx // self.block
        anchor = self.anchors[owner]
        first = anchor // self.seq_len * self.seq_len  # where the anchor's sequence begins
        context = (kv_idx < self.length) & (kv_idx >= first) & (kv_idx < anchor) & (
            anchor + q_idx % self.block - kv_idx < self.window)
        return context | ((kv_idx >= self.length) & ((kv_idx - self.length) // self.block == owner))

    def dense_mask(self) -> torch.Tensor:
        """Bool [rows, length + rows]."""
        device = self.anchors.device
        return self.sees(torch.arange(self.rows, device=device)[:, None],
                         torch.arange(self.length + self.rows, device=device)[None, :])

    def block_mask(self, tile: int = 128):
        """flex_attention's BlockMask, built from the rows' key ranges rather than by evaluating `sees` over every
        query-key pair: query tile t (rows t * tile ..) reads the context tiles from the lowest position any of its
        rows sees to its last anchor, then the tiles of its own blocks' keys; `sees` masks inside them. Anchors
        ascend (sequence by sequence), so each range is one run of tiles."""
        from torch.nn.attention.flex_attention import BlockMask

        device, n = self.anchors.device, self.anchors.shape[0]
        tiles = -(-self.rows // tile)
        first_row = torch.arange(tiles, device=device) * tile
        last_row = torch.clamp(first_row + tile, max=self.rows) - 1
        first_anchor = self.anchors[first_row // self.block]
        last_anchor = self.anchors[last_row // self.block]
        start = first_anchor // self.seq_len * self.seq_len  # the first row's sequence; later rows start no lower
        context_lo = torch.maximum(start, first_anchor - self.window + 1) // tile
        context_hi = (last_anchor - 1) // tile  # the last context position any row of the tile sees
        own_lo = (self.length + first_row // self.block * self.block) // tile
        own_hi = (self.length + torch.clamp((last_row // self.block + 1) * self.block, max=n * self.block) - 1) // tile
        own_lo = torch.maximum(own_lo, context_hi + 1)  # a tile shared by context and blocks is listed once
        n_context, n_own = context_hi - context_lo + 1, (own_hi - own_lo + 1).clamp_min(0)
        slot = torch.arange(-(-(self.length + self.rows) // tile), device=device)[None]  # one per key tile
        indices = torch.where(slot < n_context[:, None], context_lo[:, None] + slot,
                              own_lo[:, None] + slot - n_context[:, None])
        indices = torch.where(slot < (n_context + n_own)[:, None], indices, 0)
        return BlockMask.from_kv_blocks((n_context + n_own)[None, None].int(), indices[None, None].int(),
                                        BLOCK_SIZE=tile, mask_mod=lambda b, h, q, kv: self.sees(q, kv),
                                        seq_lengths=(self.rows, self.length + self.rows))


def step_mask(layout: BlockLayout, block_sparse: bool):
    """The mask of a step, built once for every layer: a flex_attention BlockMask, or the dense boolean one."""
    return layout.block_mask() if block_sparse else layout.dense_mask()


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [1, Hq, rows, D], k and v [1, Hkv, length + rows, D] (grouped heads):
    flex_attention under a BlockMask (compiled on CUDA: the fused block-sparse kernel), or
    scaled_dot_product_attention under a dense boolean mask (`step_mask`)."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    # on CUDA the fused kernel: compiled here, or traced into the caller's compilation (train-drafter's default);
    # the CPU runs it unfused (tests)
    flex = compiled_flex_attention() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    dtype = v.dtype  # under autocast the projections' outputs may differ in dtype; the kernel takes one
    # the main kernel always: below 128 query rows inductor would pick its decoding kernel, which has no backward
    # and, for some head shapes, no configuration at all
    return flex(q.to(dtype), k.to(dtype), v, block_mask=mask, scale=scale, enable_gqa=True,
                kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
