"""The small Triton kernels against their references, through the Triton interpreter in a subprocess: RMSNorm
(with and without the residual add), the DeltaNet gated norm, the attention inputs (q/k norm, RoPE, KV cache
write), the gated activations, the DeltaNet causal conv."""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.kernels import activation_triton, attention_inputs_triton, gdn_triton, norm_triton
from blockspec.kernels.activation import sigmoid_mul_reference, silu_mul_reference
from blockspec.kernels.attention import prepare_attention_inputs_reference
from blockspec.kernels.gdn import causal_conv1d_reference
from blockspec.kernels.norm import (add_rms_norm_reference, gated_rms_norm_reference, rms_norm_plain,
                                    rms_norm_reference)
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
        caches = [[torch.zeros(40, kv_heads, d), torch.zeros(40, kv_heads, d)] for _ in range(2)]
        ref = prepare_attention_inputs_reference(query, key, value, qw, kw, 1e-6, cos, sin, positions, *caches[0])
        got = attention_inputs_triton.prepare_attention_inputs(query, key, value, qw, kw, 1e-6, cos, sin,
                                                               positions, *caches[1])
        out.append(max(float((got - ref).abs().max()), float((caches[0][0] - caches[1][0]).abs().max()),
                       float((caches[0][1] - caches[1][1]).abs().max())))
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
    return out


def _conv_errors():
    out = []
    for t, channels, taps in [(1, 40, 4), (8, 1030, 4), (70, 24, 3)]:
        g = torch.Generator().manual_seed(t * channels)
        x = torch.randn(t, channels + 9, generator=g)[:, :channels]  # strided rows
        history, weight = torch.randn(taps - 1, channels, generator=g), torch.randn(channels, 1, taps, generator=g)
        mixed, window = gdn_triton.causal_conv1d(x, history, weight)
        ref_mixed, ref_window = causal_conv1d_reference(x, history, weight)
        out.append(max(float((mixed - ref_mixed).abs().max()), float((window - ref_window).abs().max())))
    return out


def test_kernels_match_references_in_interpreter():
    assert not norm_triton.available(torch.zeros(2, 8))  # outside the interpreter the CPU takes the reference
    results = run_in_triton_interpreter(__file__)
    assert [len(results[k]) for k in ("norm", "attention", "gated_norm", "conv")] == [3, 3, 3, 3], results
    assert len(results["activation"]) == 4
    assert max(max(v) for v in results.values()) < 1e-5, results


if __name__ == "__main__":
    patch_triton_interpreter()
    print("RESULTS " + json.dumps({"norm": _norm_errors(), "attention": _attention_input_errors(),
                                   "gated_norm": _gated_norm_errors(), "activation": _activation_errors(),
                                   "conv": _conv_errors()}))


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
