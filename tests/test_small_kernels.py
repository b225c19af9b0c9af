"""The small Triton kernels against their references, through the Triton interpreter in a subprocess: RMSNorm
(with and without the residual add), the DeltaNet gated norm, the attention inputs (q/k norm in both conventions,
RoPE, KV cache write; keys alone), the gated activations, the DeltaNet causal conv, and the DFlash2 drafter's
grouped dynamic convolution and selector walk."""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.kernels import (activation_triton, attention_inputs_triton, drafter_conv_triton, drafter_selector_triton,
                               gdn_triton, norm_triton)
from blockspec.kernels.activation import sigmoid_mul_reference, silu_mul_reference
from blockspec.kernels.attention import prepare_attention_inputs_reference
from blockspec.kernels.drafter_conv import grouped_dynamic_causal_conv_reference
from blockspec.kernels.drafter_selector import greedy_walk_reference, sampled_walk_reference
from blockspec.kernels.gdn import causal_conv1d_reference
from blockspec.kernels.norm import (add_rms_norm_reference, gated_rms_norm_reference, rms_norm_plain,
                                    rms_norm_reference)
from blockspec.kernels.attention import rope_tables

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
        plain = norm_triton.add_rms_norm_rows(x, None, w, 1e-6, zero_centred=False)
        out.append(max(float((summed - ref_sum).abs().max()), float((normed - ref_norm).abs().max()),
                       float((alone - rms_norm_reference(x, w, 1e-6)).abs().max()),
                       float((plain - rms_norm_plain(x, w, 1e-6)).abs().max())))
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
        cos, sin = rope_tables(positions, rot, 10000.0, torch.float32)
        for zero_centred in (True, False):  # the target's norms, the drafter's
            for q in (query, None):  # None: the drafter's context append writes keys and values alone
                caches = [[torch.zeros(40, kv_heads, d), torch.zeros(40, kv_heads, d)] for _ in range(2)]
                args = (key, value, qw, kw, 1e-6, cos, sin, positions % 37)
                ref = prepare_attention_inputs_reference(q, *args, *caches[0], zero_centred)
                got = attention_inputs_triton.prepare_attention_inputs(q, *args, *caches[1], zero_centred)
                errors = [(caches[0][i] - caches[1][i]).abs().max() for i in (0, 1)]
                if q is not None:
                    errors.append((got - ref).abs().max())
                elif got is not None:
                    errors.append(float("inf"))
                out.append(max(float(e) for e in errors))
    return out


def _gated_norm_errors():
    out = []
    for t, heads, d in [(1, 4, 16), (8, 6, 128), (3, 2, 20)]:
        g = torch.Generator().manual_seed(t * heads * d)
        x = torch.randn(t, heads, d, generator=g)
        z = torch.randn(t, heads * d + 7, generator=g)[:, 3:3 + heads * d].view(t, heads, d)  # strided, as a pack
        w = torch.randn(d, generator=g)
        got = norm_triton.gated_rms_norm_rows(x, z, w, 1e-6)
        out.append(float((got - gated_rms_norm_reference(x, z, w, 1e-6)).abs().max()))
    return out


def _activation_errors():
    out = []
    for rows, n in [(1, 96), (8, 3000)]:
        g = torch.Generator().manual_seed(rows * n)
        packed = torch.randn(rows, 2 * n + 5, generator=g)
        gate, up = packed[:, :n], packed[:, n:2 * n]  # the halves of a packed gate_up output
        out.append(float((activation_triton.gated(up, gate, "silu") - silu_mul_reference(gate, up)).abs().max()))
        out.append(float((activation_triton.gated(up, gate, "sigmoid") - sigmoid_mul_reference(up, gate)).abs().max()))
    for t, heads, d in [(1, 4, 32), (8, 24, 256)]:  # the attention gate: half of each head of a packed qkv output
        g = torch.Generator().manual_seed(t * heads)
        packed = torch.randn(t, heads * 2 * d + 3 * d, generator=g)
        gate = packed[:, :heads * 2 * d].view(t, heads, 2 * d).chunk(2, dim=-1)[1]
        attended = torch.randn(t, heads, d, generator=g)
        if not activation_triton.available(gate, attended):
            out.append(float("inf"))
            continue
        got = activation_triton.gated(attended, gate, "sigmoid")
        out.append(float((got - sigmoid_mul_reference(attended, gate)).abs().max()))
    return out


def _conv_errors():
    out = []
    for t, channels, taps in [(1, 40, 4), (8, 1030, 4), (70, 24, 3), (37, 24, 4)]:  # 70, 37: several token tiles
        g = torch.Generator().manual_seed(t * channels)
        x = torch.randn(t, channels + 9, generator=g)[:, :channels]  # strided rows
        history, weight = torch.randn(taps - 1, channels, generator=g), torch.randn(channels, 1, taps, generator=g)
        mixed, window = gdn_triton.causal_conv1d(x, history, weight)
        ref_mixed, ref_window = causal_conv1d_reference(x, history, weight)
        out.append(max(float((mixed - ref_mixed).abs().max()), float((window - ref_window).abs().max())))
    return out


def _drafter_conv_errors():
    out = []
    for t, channels, group, taps in [(8, 5120, 16, 2), (5, 300, 4, 3), (1, 64, 8, 2)]:
        g = torch.Generator().manual_seed(t * channels)
        x = torch.randn(t, channels, generator=g)
        # the dynamic taps as the module slices them out of its projection: a strided view
        dynamic = torch.randn(t, 2, taps, channels // group, generator=g)[:, 1]
        static = torch.randn(taps, channels, generator=g)
        got = drafter_conv_triton.grouped_dynamic_causal_conv(x, dynamic, static, group)
        out.append(float((got - grouped_dynamic_causal_conv_reference(x, dynamic, static, group)).abs().max()))
    return out


def _walk_mismatches():
    """Chosen ids that differ from the reference walk (0 expected), over random selectors with repeated candidates."""
    out = []
    for rows, top_k, rank, vocab in [(7, 16, 256, 1000), (3, 5, 20, 50), (1, 8, 16, 9)]:
        g = torch.Generator().manual_seed(rows * rank)
        unary = torch.randn(rows, top_k, generator=g)
        candidates = torch.randint(0, vocab, (rows, top_k), generator=g)
        projected = torch.randn(rows, rank, generator=g)
        anchor = torch.randint(0, vocab, (1,), generator=g)
        codebooks = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g)
        got = drafter_selector_triton.greedy_walk(unary, candidates, projected, anchor, *codebooks)
        ref = greedy_walk_reference(unary, candidates, projected, anchor, *codebooks)
        out.append(int((got != ref).sum()) if got.shape == ref.shape and got.dtype == ref.dtype else -1)
    return out


def _sampled_walk_mismatches():
    """Per case: (chosen ids that differ from the reference's, the largest difference of q); temperature 0 is the
    greedy walk."""
    out = []
    for rows, top_k, rank, vocab, temperature in [(7, 16, 256, 1000, 1.0), (3, 5, 20, 50, 0.7), (7, 16, 64, 300, 0.0),
                                                  (1, 8, 16, 9, 2.0)]:
        g = torch.Generator().manual_seed(rows * rank + top_k)
        unary = torch.randn(rows, top_k, generator=g)
        candidates = torch.randint(0, vocab, (rows, top_k), generator=g)
        projected = torch.randn(rows, rank, generator=g) * 0.1
        anchor = torch.randint(0, vocab, (1,), generator=g)
        codebooks = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g)
        uniforms = 1 - torch.rand(rows, generator=g, dtype=torch.float64)
        args = (unary, candidates, projected, anchor, *codebooks, torch.tensor(temperature), uniforms)
        got, got_q = drafter_selector_triton.sampled_walk(*args)
        ref, ref_q = sampled_walk_reference(*args)
        q_error = float((got_q - ref_q).abs().max()) if temperature > 0 else 0.0
        out.append([int((got != ref).sum()), q_error])
    return out


def test_kernels_match_references_in_interpreter():
    assert not norm_triton.available(torch.zeros(2, 8))  # outside the interpreter the CPU takes the reference
    results = run_in_triton_interpreter(__file__)
    walk = results.pop("walk")
    assert walk == [0, 0, 0], walk
    sampled = results.pop("sampled_walk")
    assert [chosen for chosen, _ in sampled] == [0, 0, 0, 0] and max(q for _, q in sampled) < 1e-6, sampled
    assert [len(results[k]) for k in ("norm", "gated_norm", "conv", "drafter_conv")] == [3, 3, 4, 3], results
    assert len(results["activation"]) == 6 and len(results["attention"]) == 12
    assert max(max(v) for v in results.values()) < 1e-5, results


if __name__ == "__main__":
    patch_triton_interpreter()
    print("RESULTS " + json.dumps({"norm": _norm_errors(), "attention": _attention_input_errors(),
                                   "gated_norm": _gated_norm_errors(), "activation": _activation_errors(),
                                   "conv": _conv_errors(), "drafter_conv": _drafter_conv_errors(),
                                   "walk": _walk_mismatches(), "sampled_walk": _sampled_walk_mismatches()}))


def test_launch_fitting_lowers_pipeline_depth_until_shared_memory_suffices():
    """A config tuned on the H200 that a smaller GPU refuses (Triton's OutOfResources) runs with fewer stages; the
    depth that fits is remembered; a kernel that fits nowhere still fails loudly."""
    import pytest

    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from blockspec.kernels import launch_fitting

    class FakeKernel:  # needs 40 KB per stage; the "GPU" has 100 KB
        def __init__(self, per_stage):
            self.per_stage, self.tried = per_stage, []

        def __getitem__(self, grid):
            def run(*args, STAGES, **meta):
                self.tried.append(STAGES)
                if STAGES * self.per_stage > 100:
                    raise OutOfResources(STAGES * self.per_stage, 100, "shared memory")
                return args, STAGES, meta
            return run

    kernel = FakeKernel(40)
    assert launch_fitting(kernel, (1,), "x", stages_key="STAGES", STAGES=4, BN=64) == (("x",), 2, {"BN": 64})
    assert kernel.tried == [4, 3, 2]
    launch_fitting(kernel, (1,), "x", stages_key="STAGES", STAGES=4, BN=64)
    assert kernel.tried == [4, 3, 2, 2]  # remembered
    with pytest.raises(OutOfResources):
        launch_fitting(FakeKernel(200), (1,), stages_key="STAGES", STAGES=3)
