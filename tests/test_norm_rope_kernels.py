"""The RMSNorm kernel (with and without the residual add) and the attention-input kernel (q/k norm, RoPE, KV
cache write) against their references, through the Triton interpreter in a subprocess."""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.kernels import attention_inputs_triton, norm_triton
from blockspec.kernels.attention import prepare_attention_inputs_reference
from blockspec.kernels.norm import add_rms_norm_reference, rms_norm_reference
from blockspec.kernels.rope import rope_tables

NORM_CASES = [(1, 64), (3, 100), (8, 5120)]               # rows, width
ATTENTION_CASES = [(1, 4, 2, 32, 8), (5, 6, 2, 64, 16), (8, 24, 4, 256, 64)]  # tokens, heads, kv heads, dim, rotary


def _norm_errors():
    out = []
    for rows, width in NORM_CASES:
        g = torch.Generator().manual_seed(rows * width)
        x, delta = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
        w = torch.randn(width, generator=g) * 0.1
        summed, normed = norm_triton.add_rms_norm_rows(x, delta, w, 1e-6)
        ref_sum, ref_norm = add_rms_norm_reference(x, delta, w, 1e-6)
        alone = norm_triton.add_rms_norm_rows(x, None, w, 1e-6)
        out.append(max(float((summed - ref_sum).abs().max()), float((normed - ref_norm).abs().max()),
                       float((alone - rms_norm_reference(x, w, 1e-6)).abs().max())))
    return out


def _attention_input_errors():
    out = []
    for t, heads, kv_heads, d, rot in ATTENTION_CASES:
        g = torch.Generator().manual_seed(t * d)
        packed = torch.randn(t, heads * 2 * d + 2 * kv_heads * d, generator=g)  # strided views, as the layer's
        query = packed[:, :heads * 2 * d].view(t, heads, 2 * d)[..., :d]
        key = packed[:, heads * 2 * d:(heads * 2 + kv_heads) * d].view(t, kv_heads, d)
        value = packed[:, (heads * 2 + kv_heads) * d:].view(t, kv_heads, d)
        qw, kw = torch.randn(d, generator=g) * 0.1, torch.randn(d, generator=g) * 0.1
        positions = torch.arange(9, 9 + t)
        cos, sin = rope_tables.reference(positions, rot, 10000.0, torch.float32)
        caches = [[torch.zeros(40, kv_heads, d), torch.zeros(40, kv_heads, d)] for _ in range(2)]
        ref = prepare_attention_inputs_reference(query, key, value, qw, kw, 1e-6, cos, sin, positions, *caches[0])
        got = attention_inputs_triton.prepare_attention_inputs(query, key, value, qw, kw, 1e-6, cos, sin,
                                                               positions, *caches[1])
        out.append(max(float((got - ref).abs().max()), float((caches[0][0] - caches[1][0]).abs().max()),
                       float((caches[0][1] - caches[1][1]).abs().max())))
    return out


def test_kernels_match_references_in_interpreter():
    assert not norm_triton.available(torch.zeros(2, 8))  # outside the interpreter the CPU takes the reference
    results = run_in_triton_interpreter(__file__)
    assert len(results["norm"]) == len(NORM_CASES) and len(results["attention"]) == len(ATTENTION_CASES)
    assert max(results["norm"] + results["attention"]) < 1e-5, results


if __name__ == "__main__":
    patch_triton_interpreter()
    print("RESULTS " + json.dumps({"norm": _norm_errors(), "attention": _attention_input_errors()}))
