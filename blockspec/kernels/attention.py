"""Causal attention of T new queries over a KV cache (grouped KV heads).

Paths: flash-attn's KV-cache kernel (`flash_attn_with_kvcache`) when the package is installed and the inputs
are CUDA fp16/bf16; else, for 1..16 queries (decode, verification), the split-KV Triton kernel of
attention_triton.py. Both read only the filled part of the cache, the length being a device tensor, so a CUDA
graph replays them at any position. Otherwise (prefill, CPU, no Triton) PyTorch SDPA over the given cache prefix
under a causal mask: the reference.
"""

import functools

import torch
import torch.nn.functional as F

from . import attention_triton


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at consecutive `positions` [T]; k, v: [L, Hkv, D], a prefix of the cache that holds every key
    up to the last position (entries past a query's position are masked). Returns [T, Hq, D]."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_with_kvcache() is not None:
        return cached_attention_flash(q, k, v, positions, scale)
    if attention_triton.available(q):
        return attention_triton.cached_attention_triton(q, k, v, positions, scale)
    return cached_attention_sdpa(q, k, v, positions, scale)


def cached_attention_sdpa(q, k, v, positions, scale):
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@functools.cache
def flash_attn_with_kvcache():
    try:
        from flash_attn import flash_attn_with_kvcache as kernel
    except ImportError:
        return None
    return kernel


def cached_attention_flash(q, k, v, positions, scale, kernel=None):
    """flash-attn with cache_seqlens = last position + 1; causal=True aligns the T queries to the end of that
    prefix, so query i sees keys 0..positions[i]."""
    kernel = kernel or flash_attn_with_kvcache()
    seqlens = (positions[-1:] + 1).to(torch.int32)
    return kernel(q[None], k[None], v[None], cache_seqlens=seqlens, softmax_scale=scale, causal=True)[0]
