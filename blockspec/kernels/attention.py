"""Causal attention of T new queries over a KV cache (grouped KV heads)."""

import torch
import torch.nn.functional as F


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at positions start..start+T-1; k, v: [start+T, Hkv, D] (cache incl. the new tokens).

    Query i sees keys 0..start+i. Returns [T, Hq, D].
    """
    t, total = q.shape[0], k.shape[0]
    visible = torch.arange(total, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
