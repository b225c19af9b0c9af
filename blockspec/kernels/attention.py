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

from . import FUSION, attention_inputs_triton, attention_triton, fused
from .norm import rms_norm_reference
from .rope import apply_rope


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at consecutive `positions` [T]; k, v: [L, Hkv, D], a prefix of the cache that holds every key
    up to the last position (entries past a query's position are masked). Returns [T, Hq, D]."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_with_kvcache() is not None:
        return cached_attention_flash(q, k, v, positions, scale)
    if attention_triton.available(q):
        return attention_triton.cached_attention_triton(q, k, v, positions, scale)
    return cached_attention_sdpa(q, k, v, positions, scale)


def prepare_attention_inputs(query, key, value, q_weight, k_weight, eps: float, cos, sin, positions, cache_k,
                             cache_v):
    """query [T, Hq, D], key / value [T, Hkv, D] (rows may be strided): per-head zero-centred RMSNorm then RoPE of
    query and key; key and value written into the cache [capacity, Hkv, D] at `positions`. Returns the query."""
    args = (query, key, value, q_weight, k_weight, eps, cos, sin, positions, cache_k, cache_v)
    if attention_inputs_triton.available(query):
        return attention_inputs_triton.prepare_attention_inputs(*args)
    return prepare_attention_inputs_reference(*args)


def prepare_attention_inputs_reference(query, key, value, q_weight, k_weight, eps, cos, sin, positions, cache_k,
                                       cache_v):
    query, key = qk_norm_rope(query, key, q_weight, k_weight, eps, cos, sin)
    cache_k.index_copy_(0, positions, key)
    cache_v.index_copy_(0, positions, value)
    return query


@fused
def qk_norm_rope(query, key, q_weight, k_weight, eps: float, cos, sin):
    return (apply_rope.reference(rms_norm_reference(query, q_weight, eps), cos, sin),
            apply_rope.reference(rms_norm_reference(key, k_weight, eps), cos, sin))


def cached_attention_sdpa(q, k, v, positions, scale):
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def masked_attention(q, keys, values, visible, scale: float):
    """Attention under an explicit mask (the DFlash2 drafter's block over its context window): q [Hq, T, D], keys /
    values: sequences of [Hkv, L_i, D] chunks (the context buffer, then the block's own), visible [T, sum L_i]
    bool -> [Hq, T, D]. SDPA over the concatenation is the reference; on CUDA with fusion on, a compiled
    grouped-head matmul-softmax-matmul per chunk that never copies the context (SDPA's cuDNN choice took 48 us per
    drafter layer at 8 queries on the H200, and the concatenation copied 8 MB per layer)."""
    if q.is_cuda and FUSION["enabled"]:
        return _grouped_masked_attention(q, tuple(keys), tuple(values), visible, scale)
    k, v = torch.cat(list(keys), dim=1), torch.cat(list(values), dim=1)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=scale,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0]


@fused
def _grouped_masked_attention(q, keys, values, visible, scale: float):
    """The query heads sharing a KV head are stacked into one matmul per KV head; scores in float32."""
    heads, t, d = q.shape
    kv_heads = keys[0].shape[0]
    group = heads // kv_heads
    stacked = q.reshape(kv_heads, group * t, d)
    scores = torch.cat([torch.bmm(stacked, k.transpose(1, 2)) for k in keys], dim=-1).float()
    scores = scores.view(kv_heads, group, t, -1) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(values[0].dtype).view(kv_heads, group * t, -1)
    parts = probs.split([v.shape[1] for v in values], dim=-1)
    out = sum(torch.bmm(p, v) for p, v in zip(parts, values))
    return out.view(heads, t, d)


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
