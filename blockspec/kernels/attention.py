"""Causal attention of T new queries over a KV cache (grouped KV heads).

Paths: flash-attn's KV-cache kernel (`flash_attn_with_kvcache`) when the package is installed and the inputs
are CUDA fp16/bf16: it reads only the filled part of the cache (the length is a device tensor, so a CUDA graph
replays it at any position). Otherwise PyTorch SDPA over the given cache prefix under a causal mask (the
reference; under a CUDA graph it reads the whole cache), except for verification-sized passes on CUDA
(2..16 queries): there SDPA's choice on the H200 (cuDNN) took 216-228 us per 27B layer against 39-56 us for a
plain grouped-head matmul-softmax-matmul (bench/attention_kernels.py, docs/h200/attention_kernels.json); at one
query SDPA is faster (23 vs 32 us) and keeps it.
"""

import functools

import torch
import torch.nn.functional as F


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at consecutive `positions` [T]; k, v: [L, Hkv, D], a prefix of the cache that holds every key
    up to the last position (entries past a query's position are masked). Returns [T, Hq, D]."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_with_kvcache() is not None:
        return cached_attention_flash(q, k, v, positions, scale)
    if q.is_cuda and 1 < q.shape[0] <= 16:
        return cached_attention_grouped(q, k, v, positions, scale)
    return cached_attention_sdpa(q, k, v, positions, scale)


def cached_attention_sdpa(q, k, v, positions, scale):
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def cached_attention_grouped(q, k, v, positions, scale):
    """The queries sharing a KV head are stacked into one matmul per KV head: scores in float32, softmax, then
    the weighted sum (for a few queries; the [Hkv, T * group, L] score matrix is materialised)."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    stacked = q.view(t, kv_heads, group, d).permute(1, 0, 2, 3).reshape(kv_heads, t * group, d)
    scores = torch.bmm(stacked, k.permute(1, 2, 0)).float().view(kv_heads, t, group, -1) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~visible[None, :, None, :], float("-inf")).softmax(-1).to(v.dtype)
    out = torch.bmm(probs.view(kv_heads, t * group, -1), v.permute(1, 0, 2))
    return out.view(kv_heads, t, group, d).permute(1, 0, 2, 3).reshape(t, heads, d)


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
