"""The flash-attn glue (cache_seqlens and causal alignment) against the SDPA reference.

flash-attn is not installable on the CPU, so `cached_attention_flash` is driven by a stand-in written from the
library's documented contract for flash_attn_with_kvcache: q [B, Tq, Hq, D], caches [B, L, Hkv, D], keys past
cache_seqlens ignored, causal masks aligned to the bottom right (query i of Tq sees keys < seqlen - Tq + i + 1).
"""

import torch

from blockspec.kernels.attention import cached_attention_flash, cached_attention_grouped, cached_attention_sdpa


def documented_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal):
    assert causal and cache_seqlens.dtype == torch.int32 and q.dim() == 4 and k_cache.dim() == 4
    tq, length = q.shape[1], int(cache_seqlens[0])
    keys = torch.arange(k_cache.shape[1])
    visible = (keys[None, :] < length) & (keys[None, :] <= (length - tq + torch.arange(tq))[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=visible,
        scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def test_flash_glue_matches_sdpa_over_the_whole_cache_and_a_prefix():
    torch.manual_seed(0)
    capacity, hq, hkv, d = 40, 8, 2, 16
    k, v = torch.randn(capacity, hkv, d), torch.randn(capacity, hkv, d)
    for start, t in [(0, 1), (0, 5), (13, 1), (13, 8), (32, 8)]:
        q = torch.randn(t, hq, d)
        positions = torch.arange(start, start + t)
        expected = cached_attention_sdpa(q, k[:start + t], v[:start + t], positions, d ** -0.5)
        for visible in (capacity, start + t):  # graph capture passes the whole cache, eager the filled prefix
            got = cached_attention_flash(q, k[:visible], v[:visible], positions, d ** -0.5,
                                         kernel=documented_flash_attn_with_kvcache)
            assert got.shape == expected.shape
            assert (got - expected).abs().max() < 1e-5


def test_grouped_matmul_attention_matches_sdpa():
    torch.manual_seed(1)
    capacity, hq, hkv, d = 48, 12, 4, 32
    k, v = torch.randn(capacity, hkv, d), torch.randn(capacity, hkv, d)
    for start, t in [(0, 2), (7, 4), (20, 8), (32, 16)]:
        q = torch.randn(t, hq, d)
        positions = torch.arange(start, start + t)
        expected = cached_attention_sdpa(q, k[:start + t], v[:start + t], positions, d ** -0.5)
        for visible in (capacity, start + t):
            got = cached_attention_grouped(q, k[:visible], v[:visible], positions, d ** -0.5)
            assert (got - expected).abs().max() < 1e-5
