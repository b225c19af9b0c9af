"""The fast attention paths against the SDPA reference: the split-KV Triton kernel (through the Triton interpreter,
in a subprocess) and the flash-attn glue (cache_seqlens and causal alignment).

flash-attn is not installable on the CPU, so `cached_attention_flash` is driven by a stand-in written from the
library's documented contract for flash_attn_with_kvcache: q [B, Tq, Hq, D], caches [B, L, Hkv, D], keys past
cache_seqlens ignored, causal masks aligned to the bottom right (query i of Tq sees keys < seqlen - Tq + i + 1).
"""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.kernels.attention import cached_attention_flash, cached_attention_sdpa


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


def test_grouped_masked_attention_matches_sdpa():
    """The drafter's attention fast path (grouped heads, context and block chunks never concatenated) against SDPA
    over the concatenation."""
    from blockspec.kernels.attention import _grouped_masked_attention, masked_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 5, 16, generator=g)
    keys = (torch.randn(2, 30, 16, generator=g), torch.randn(2, 5, 16, generator=g))
    values = (torch.randn(2, 30, 16, generator=g), torch.randn(2, 5, 16, generator=g))
    visible = torch.rand(5, 35, generator=g) > 0.3
    visible[:, 30:] = True
    expected = masked_attention(q, keys, values, visible, 0.25)  # CPU: the SDPA reference
    got = _grouped_masked_attention.reference(q, keys, values, visible, 0.25)
    assert got.shape == expected.shape and (got - expected).abs().max() < 1e-5


TRITON_CASES = [  # (capacity, query heads, kv heads, head dim, start, queries)
    (40, 8, 2, 16, 0, 1), (40, 8, 2, 16, 13, 8), (300, 12, 4, 32, 0, 16), (300, 12, 4, 32, 131, 1),
    (300, 12, 4, 32, 250, 5), (1000, 6, 1, 64, 700, 3), (5000, 24, 4, 32, 4990, 8),  # 27B's grouping, many splits
]


def _run_triton_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    from blockspec.kernels import attention_triton

    patch_triton_interpreter()
    results = []
    for capacity, hq, hkv, d, start, t in TRITON_CASES:
        g = torch.Generator().manual_seed(capacity + t)
        k, v = torch.randn(capacity, hkv, d, generator=g), torch.randn(capacity, hkv, d, generator=g)
        q = torch.randn(t, hq, d, generator=g)
        positions = torch.arange(start, start + t)
        expected = cached_attention_sdpa(q, k[:start + t], v[:start + t], positions, d ** -0.5)
        poisoned = k.clone()
        poisoned[start + t:] = float("nan")  # past the filled length: must not be read
        got = attention_triton.cached_attention_triton(q, poisoned, v, positions, d ** -0.5)
        results.append({"case": [capacity, hq, hkv, d, start, t], "err": float((got - expected).abs().max()),
                        "splits": attention_triton.split_plan(capacity, 64)[0], "shape": list(got.shape) == [t, hq, d]})
    print("RESULTS " + json.dumps(results))


def test_triton_attention_matches_sdpa_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results) == len(TRITON_CASES)
    for r in results:
        assert r["shape"] and r["err"] < 1e-4, r
    assert max(r["splits"] for r in results) > 1  # the split merge is exercised


if __name__ == "__main__":
    _run_triton_cases()
