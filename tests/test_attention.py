"""The fast attention paths against the SDPA reference: the split-KV Triton kernel (through the Triton interpreter,
in a subprocess), causal and in the DFlash2 drafter's mask mode, and the flash-attn glue (cache_seqlens and causal
alignment).

flash-attn is not installable on the CPU, so `cached_attention_flash` is driven by a stand-in written from the
library's documented contract for flash_attn_with_kvcache: q [B, Tq, Hq, D], caches [B, L, Hkv, D], keys past
cache_seqlens ignored, causal masks aligned to the bottom right (query i of Tq sees keys < seqlen - Tq + i + 1).
"""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.kernels.attention import cached_attention_flash, cached_attention_sdpa, masked_attention_sdpa


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


TRITON_CASES = [  # (capacity, query heads, kv heads, head dim, start, queries)
    (40, 8, 2, 16, 0, 1), (40, 8, 2, 16, 13, 8), (300, 12, 4, 32, 0, 16), (300, 12, 4, 32, 131, 1),
    (300, 12, 4, 32, 250, 5), (1000, 6, 1, 64, 700, 3), (5000, 24, 4, 32, 4990, 8),  # 27B's grouping, many splits
    (5000, 24, 4, 32, 200, 16),  # a short fill of a long cache: its keys shared out among the splits
    (5000, 32, 8, 32, 3000, 4),  # 8 KV heads: the filled keys go to the 16 splits of one wave (132 SMs), not 40
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
    print("RESULTS " + json.dumps({"causal": results, "masked": _masked_errors(attention_triton)}))


MASKED_CASES = [(30, 8, 2, 16, 5), (2056, 32, 8, 128, 8), (300, 6, 6, 32, 1)]  # keys, q heads, kv heads, dim, rows


def _masked_errors(attention_triton):
    """The drafter's shapes among them: a 2048-slot window plus its 8 block rows, 32 query heads over 8 KV heads."""
    out = []
    for length, hq, hkv, d, t in MASKED_CASES:
        g = torch.Generator().manual_seed(length + hq)
        q = torch.randn(t, hq, d, generator=g)
        k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
        visible = torch.rand(t, length, generator=g) > 0.4
        visible[:, -t:] = torch.ones(t, t).tril().bool()  # each row sees itself at least
        visible[0, :length - t] = False  # a row seeing nothing of the context (every split but the last empty)
        expected = masked_attention_sdpa(q, k, v, visible, d ** -0.5)
        got = attention_triton.masked_attention_triton(q, k, v, visible, d ** -0.5)
        out.append(float((got - expected).abs().max()) if got.shape == expected.shape else float("inf"))
    return out


def test_triton_attention_matches_sdpa_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    causal = results["causal"]
    assert len(causal) == len(TRITON_CASES)
    for r in causal:
        assert r["shape"] and r["err"] < 1e-4, r
    assert max(r["splits"] for r in causal) > 1  # the split merge is exercised
    assert len(results["masked"]) == len(MASKED_CASES) and max(results["masked"]) < 1e-4, results["masked"]


if __name__ == "__main__":
    _run_triton_cases()
