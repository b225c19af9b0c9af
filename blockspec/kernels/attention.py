"""Causal attention of T new queries over a KV cache (grouped KV heads)."""

import torch
import torch.nn.functional as F


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at `positions` [T]; k, v: [L, Hkv, D], a prefix of the cache that holds every key up to the
    last position (entries past a query's position are masked). Returns [T, Hq, D]."""
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
