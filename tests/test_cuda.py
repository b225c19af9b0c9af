"""CUDA-only checks (skipped on the CPU): graph replay == eager, fla == torch reference, DFlash2 == plain in bf16."""

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from blockspec.engine.engine import Engine
from blockspec.kernels.gdn import (
    fla_available,
    gated_delta_rule_fla,
    gated_delta_rule_reference,
    l2_normalize,
)
from helpers import run_pass

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tiny_drafter):
    target = tiny_checkpoint(seed=0, planted=True)
    return target, tiny_drafter(target)


def engine(directory, **kw):
    return Engine.load(directory, device="cuda", context_length=512, **kw)


@pytest.mark.skipif(not fla_available(), reason="fla-core not installed")
@pytest.mark.parametrize("t", [1, 8, 100])
def test_fla_matches_reference(t):
    gen = torch.Generator(device="cuda").manual_seed(t)
    h, dk, dv = 6, 32, 16
    q = l2_normalize(torch.randn(t, h, dk, device="cuda", generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(t, h, dk, device="cuda", generator=gen))
    v = torch.randn(t, h, dv, device="cuda", generator=gen)
    g = -torch.rand(t, h, device="cuda", generator=gen)
    beta = torch.rand(t, h, device="cuda", generator=gen)
    state = torch.randn(h, dk, dv, device="cuda", generator=gen)
    out_ref, final_ref = gated_delta_rule_reference(q, k, v, g, beta, state)
    out, final = gated_delta_rule_fla(q, k, v, g, beta, state)
    assert (out - out_ref).abs().max() < 2e-3 and (final - final_ref).abs().max() < 2e-3


@pytest.mark.parametrize("mode", ["none", "mtp", "dflash2"])
def test_graph_replay_equals_eager(pair, mode):
    target, drafter = pair
    kw = dict(mode=mode, compute_dtype="float32", dflash2_model=str(drafter) if mode == "dflash2" else None)
    eager, graphed = engine(target, compile_mode=-1, **kw), engine(target, **kw)  # graphs: the CUDA default
    assert (eager.execution, graphed.execution) == ("eager", "cuda-graphs")
    ids = eager.tokenizer.encode("hello world")
    a, b = eager.generate(ids, 120, stop_at_eos=False), graphed.generate(ids, 120, stop_at_eos=False)
    assert a.tokens == b.tokens
    assert (a.stats["execution"], b.stats["execution"]) == ("eager", "cuda-graphs")
    if mode != "none":
        assert a.stats["accepted_per_cycle"] == b.stats["accepted_per_cycle"]


def test_graphed_verifier_logits_equal_eager(pair):
    target, _ = pair
    e = engine(target, compute_dtype="float32", compile_mode=0, mode="mtp")
    ids = e.tokenizer.encode("hello there")
    list(e.stream(ids, 5, stop_at_eos=False))
    block = [5, 6, 7, 8]
    graphed_out, graphed_pred = e.target.verify(block)
    graphed_logits = graphed_out.logits.clone()
    e.state.discard()
    from blockspec.engine.target import EagerTarget
    eager_out, eager_pred = EagerTarget(e.model, e.state).verify(block)
    e.state.discard()
    assert graphed_pred == eager_pred
    assert (graphed_logits - eager_out.logits).abs().max() < 1e-4


@pytest.fixture(scope="module")
def wide_margin_pair(tiny_checkpoint, tiny_drafter):
    """bf16 greedy is not batch-invariant (a token's logits round differently in a 1-token and an 8-token pass),
    so bf16 equality is checked on a planted pair whose logit margins are wide: a less noisy target and a drafter
    whose codebook noise makes acceptance partial."""
    target = tiny_checkpoint(seed=1, planted=True, target_noise=1.0)
    return target, tiny_drafter(target, noise=0.5)


@pytest.mark.parametrize("compile_mode", [-1, 0])
def test_dflash2_equals_plain_bf16(wide_margin_pair, compile_mode):
    target, drafter = wide_margin_pair
    plain = engine(target, compute_dtype="bfloat16", compile_mode=compile_mode)
    spec = engine(target, compute_dtype="bfloat16", compile_mode=compile_mode, mode="dflash2",
                  dflash2_model=str(drafter))
    ids = plain.tokenizer.encode("hello world")
    a, b = plain.generate(ids, 200, stop_at_eos=False), spec.generate(ids, 200, stop_at_eos=False)
    print(f"bf16 compile_mode {compile_mode}: acceptance {b.stats['acceptance_rate']:.2f}")
    assert a.tokens == b.tokens
    assert 0.02 < b.stats["acceptance_rate"] < 0.98


@pytest.mark.parametrize("mode", ["mtp", "dflash2"])
@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_quantized_paths_on_gpu(wide_margin_pair, mode, quantization):
    """The int4 or FP8 target (the Triton W4A16 / W8A16 kernel, folded norms), int8 head and (dflash2) int8 drafter,
    packed, under CUDA graphs: speculative output == plain greedy output with the same weights, and graphed plain ==
    eager plain."""
    from blockspec.quant.fp8 import Fp8Linear
    from blockspec.quant.int4 import Int4Linear
    from blockspec.kernels.quant_matmul_triton import kernels_available

    assert kernels_available(torch.device("cuda"))
    target, drafter = wide_margin_pair
    kw = dict(compute_dtype="bfloat16", target_quantization=quantization, vocabulary_quantization="int8")
    plain_graphed, plain_eager = engine(target, compile_mode=0, **kw), engine(target, compile_mode=-1, **kw)
    spec = engine(target, compile_mode=0, mode=mode, **kw,
                  **(dict(dflash2_model=str(drafter), dflash2_quantization="int8") if mode == "dflash2" else {}))
    kind = Fp8Linear if quantization == "fp8" else Int4Linear
    assert isinstance(spec.model.layers[0].mlp.down_proj, kind) and spec.folded_norms > 0
    ids = spec.tokenizer.encode("hello world")
    a, b = plain_graphed.generate(ids, 160, stop_at_eos=False), spec.generate(ids, 160, stop_at_eos=False)
    assert a.tokens == plain_eager.generate(ids, 160, stop_at_eos=False).tokens
    print(f"{quantization} {mode}: acceptance {b.stats['acceptance_rate']:.2f}")
    assert a.tokens == b.tokens
    assert b.stats["acceptance_rate"] > 0.02


@pytest.mark.parametrize("t", [1, 2, 8, 16])
def test_triton_attention_matches_sdpa_on_gpu(t):
    """The decode / verification attention (split-KV Triton kernel) against SDPA, 27B head layout, bf16, whole
    cache given (as under a graph), garbage past the filled length."""
    from blockspec.kernels.attention import cached_attention_sdpa
    from blockspec.kernels.attention_triton import cached_attention_triton

    torch.manual_seed(0)
    k, v = (torch.randn(4096, 4, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(t, 24, 256, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(3000, 3000 + t, device="cuda")
    expected = cached_attention_sdpa(q, k, v, positions, 256 ** -0.5).float()
    k[3000 + t:] = float("nan")
    got = cached_attention_triton(q, k, v, positions, 256 ** -0.5).float()
    assert (got - expected).abs().max() < 1e-2


@pytest.mark.parametrize("mode", ["none", "dflash2"])
def test_fast_kernels_on_gpu_equal_cpu_reference(pair, mode):
    """float32: the GPU engine on its Triton kernels (DeltaNet conv and recurrence, norms, attention inputs,
    activations) generates what the CPU engine on the reference paths generates."""
    target, drafter = pair
    kw = dict(mode=mode, compute_dtype="float32", context_length=512,
              dflash2_model=str(drafter) if mode == "dflash2" else None)
    gpu, cpu = Engine.load(target, device="cuda", **kw), Engine.load(target, device="cpu", **kw)
    ids = cpu.tokenizer.encode("hello world")
    a, b = gpu.generate(ids, 60, stop_at_eos=False), cpu.generate(ids, 60, stop_at_eos=False)
    assert a.tokens == b.tokens


def test_small_kernels_bf16_on_gpu():
    """The small kernels at 27B shapes in bf16 against their references (bf16 rounding: a few ulps)."""
    from blockspec.kernels import activation_triton, gdn_triton, norm_triton
    from blockspec.kernels.activation import silu_mul_reference
    from blockspec.kernels.gdn import causal_conv1d_reference
    from blockspec.kernels.norm import add_rms_norm_reference, gated_rms_norm_reference

    def close(got, ref):  # bf16: a few ulps of the largest value (the reference rounds more often)
        return (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()

    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for t in (1, 8):
        x, delta, w = torch.randn(t, 5120, **bf), torch.randn(t, 5120, **bf), torch.randn(5120, **bf) * 0.1
        for got, ref in zip(norm_triton.add_rms_norm_rows(x, delta, w, 1e-6),
                            add_rms_norm_reference(x, delta, w, 1e-6)):
            assert close(got, ref)
        o, z = torch.randn(t, 48, 128, **bf), torch.randn(t, 48 * 128 + 64, **bf)[:, :6144].view(t, 48, 128)
        wn = torch.randn(128, **bf)
        ref = gated_rms_norm_reference(o, z, wn, 1e-6)
        assert close(norm_triton.gated_rms_norm_rows(o, z, wn, 1e-6), ref)
    for t in (1, 8, 1000):  # 1000: a prefill's, many token tiles
        qkv, hist, cw = torch.randn(t, 10240, **bf), torch.randn(3, 10240, **bf), torch.randn(10240, 1, 4, **bf)
        (got, window), (ref, ref_window) = gdn_triton.causal_conv1d(qkv, hist, cw), causal_conv1d_reference(qkv, hist,
                                                                                                            cw)
        assert close(got, ref) and torch.equal(window, ref_window)
    for t in (1, 8):
        gu = torch.randn(t, 2 * 17408, **bf)
        ref = silu_mul_reference(gu[:, :17408], gu[:, 17408:])
        assert close(activation_triton.gated(gu[:, 17408:], gu[:, :17408], "silu"), ref)


def test_folded_norms_on_gpu(wide_margin_pair):
    """INT4 on CUDA folds the norms and activations into the projections (layers/folded_norm.py): the epilogues at
    the 27B shapes against fp64 math or the two-launch path (row 0 of 8 rows == one row, bitwise), and a pass's
    logits with and without folding within bf16 rounding."""
    from blockspec.kernels.activation import silu_mul
    from blockspec.layers import folded_norm
    from blockspec.kernels import quant_matmul_triton as wq
    from blockspec.quant.int4 import Int4Linear

    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    down = Int4Linear.from_float(torch.randn(5120, 17408, device="cuda") * 17408 ** -0.5)
    gate_up = Int4Linear.from_float(torch.randn(34816, 5120, device="cuda") * 5120 ** -0.5)
    x, residual, w = torch.randn(8, 17408, **bf), torch.randn(8, 5120, **bf), 0.3 * torch.randn(5120, **bf)
    summed, rows, partials = wq.wq_matmul_add_norm(x, down.packed(), residual, w)
    y = wq.wq_matmul(rows, gate_up.packed(), rms=(partials, 1e-6))
    want = residual.double() + x.double() @ down.dequantize().double().t()
    normed = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    want_y = normed @ gate_up.dequantize().double().t()
    assert (summed.double() - want).abs().max() <= 0.01 * want.abs().max()
    assert (y.double() - want_y).abs().max() <= 0.02 * want_y.abs().max()
    one = wq.wq_matmul_add_norm(x[:1], down.packed(), residual[:1], w)
    assert torch.equal(one[0], summed[:1]) and torch.equal(one[1], rows[:1])
    assert torch.equal(wq.wq_matmul(one[1], gate_up.packed(), rms=(one[2], 1e-6)), y[:1])
    act = wq.wq_matmul_swiglu(rows, gate_up.packed(), rms=(partials, 1e-6))  # the activation in gate_up's launch
    two_launches = silu_mul(*y.split(17408, dim=-1))
    assert (act.float() - two_launches.float()).abs().max() <= 0.01 * two_launches.float().abs().max()
    assert torch.equal(wq.wq_matmul_swiglu(one[1], gate_up.packed(), rms=(one[2], 1e-6)), act[:1])

    target, _ = wide_margin_pair
    e = engine(target, compile_mode=-1, compute_dtype="bfloat16", target_quantization="int4",
               vocabulary_quantization="int8")
    assert e.folded_norms == 2 * len(e.model.layers) - 1 and all(m.mlp.fold_activation for m in e.model.layers)
    ids = torch.tensor(e.tokenizer.encode("hello world, folded")[:12], device="cuda")

    def logits():
        e.state.reset()
        out = run_pass(e.model, e.state, ids)
        e.state.discard()
        return out.logits.float()
    folded = logits()
    folded_norm.enable(e.model, False)
    plain = logits()
    assert (folded - plain).abs().max() <= 0.05 * plain.abs().max()


@pytest.mark.parametrize("rows", [1, 8, 17, 33, 64])
def test_dense_linear_kernel_bf16_on_gpu(rows):
    """The few-row Triton matmul at the 27B shapes it serves (kernels.linear's dispatch), against cuBLAS; and the
    DeltaNet mixer in one launch against its three launches."""
    from blockspec.kernels import linear_triton
    from blockspec.kernels.gdn_gates import GateProjections
    from blockspec.kernels.gdn_triton import causal_conv1d, gated_delta_short, short_pass
    from blockspec.kernels.linear import linear
    from blockspec.kernels.norm_triton import gated_rms_norm_rows

    torch.manual_seed(rows)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for n, k in [(5120, 17408), (34816, 5120), (16480, 5120), (5120, 6144)]:
        config = linear_triton.default_config(min(rows, 8), n, k)  # more rows: the 8-row configs, given
        if config is None:
            continue
        x, w = torch.randn(rows, k, **bf), torch.randn(n, k, **bf) * k ** -0.5
        ref = torch.nn.functional.linear(x, w).float()
        got = linear_triton.linear_rows(x, w, config)
        assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()
        if rows <= 8 and linear_triton.fits(config, rows, x.device):  # the dispatch takes the kernel
            assert torch.equal(linear(x, w), got)
    shape, channels = (16, 128, 48, 128), 10240
    proj = torch.randn(1, channels + 6144, **bf)
    x, z = proj[:, :channels], proj[:, channels:].view(1, 48, 128)
    hist, cw, nw = torch.randn(3, channels, **bf), torch.randn(channels, 1, 4, **bf) * 0.3, torch.randn(128, **bf)
    gates = GateProjections(torch.randn(1, 48, **bf), torch.randn(1, 48, **bf), torch.randn(48, device="cuda"),
                            torch.randn(48, device="cuda"))
    state = torch.randn(48, 128, 128, device="cuda") * 0.01
    final_one, final_three = torch.empty_like(state), torch.empty_like(state)
    one, window = short_pass(x, hist, cw, gates, state, final_one, shape, z, nw, 1e-6)
    mixed, window3 = causal_conv1d(x, hist, cw)
    three = gated_rms_norm_rows(gated_delta_short(mixed, state, final_three, shape, gates, out_dtype=torch.bfloat16),
                                z, nw, 1e-6)
    assert torch.equal(window, window3) and (one.float() - three.float()).abs().max() <= 0.02 * three.abs().max()
    assert (final_one - final_three).abs().max() <= 1e-5


@pytest.mark.parametrize("rows", [1, 8, 24])
def test_pdl_chain_in_graph_equals_serial_launches(rows):
    """Programmatic dependent launch (kernels.pdl) changes when kernels start, never what they compute: a chain of
    norm -> projection -> activation -> split-K projection -> norm -> two W4A16 projections at 27B shapes, captured
    in a CUDA graph with PDL and replayed on fresh inputs, is bitwise equal to the same kernels launched one after
    another without it (a kernel reading its input before the previous one wrote it would differ). At 24 rows the
    W4A16 projections are the warp-specialized kernel's (Hopper), the second reading the first's output."""
    from blockspec.kernels import activation_triton, norm_triton, pdl
    from blockspec.kernels.linear import linear
    from blockspec.kernels import KernelSettings, use
    from blockspec.kernels.quant_matmul import pack
    from blockspec.kernels.quant_matmul_triton import wq_matmul

    torch.manual_seed(rows)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w_up, w_down = torch.randn(34816, 5120, **bf) * 0.014, torch.randn(5120, 17408, **bf) * 0.008
    norm_w = torch.randn(5120, **bf) * 0.1
    packed = pack(torch.randint(0, 16, (6144, 5120), device="cuda"),
                  torch.rand(6144, 40, **bf) * 0.01, None, 4, 128)
    packed_back = pack(torch.randint(0, 16, (5120, 6144), device="cuda"),
                       torch.rand(5120, 48, **bf) * 0.01, None, 4, 128)

    def chain(x, delta):
        summed, h = norm_triton.add_rms_norm_rows(x, delta, norm_w, 1e-6)
        gate_up = linear(h, w_up)
        down = linear(activation_triton.gated(gate_up[:, 17408:], gate_up[:, :17408], "silu"), w_down)
        return wq_matmul(wq_matmul(norm_triton.add_rms_norm_rows(summed, down, norm_w, 1e-6)[1], packed),
                         packed_back)

    inputs = [(torch.randn(rows, 5120, **bf), torch.randn(rows, 5120, **bf)) for _ in range(3)]
    serial = [chain(*pair) for pair in inputs]  # the default settings: no PDL
    with use(KernelSettings(pdl_level=3)):
        assert pdl.enabled(w_up) == (torch.cuda.get_device_capability()[0] >= 9)
        x, delta = (t.clone() for t in inputs[0])
        chain(x, delta)  # compiles the PDL variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x, delta)
    for (xi, di), expected in zip(inputs[::-1], serial[::-1]):
        x.copy_(xi)
        delta.copy_(di)
        graph.replay()
        assert torch.equal(out, expected)


def test_draft_vocabulary_graphed_bf16(wide_margin_pair):
    """MTP drafting over a draft vocabulary (layers/draft_head.py) inside the captured observe-and-chain graph:
    output == plain greedy in bf16, and the stats name the set."""
    target, _ = wide_margin_pair
    plain = engine(target, compute_dtype="bfloat16", compile_mode=0)
    spec = engine(target, compute_dtype="bfloat16", compile_mode=0, mode="mtp", draft_vocabulary=128)
    ids = plain.tokenizer.encode("hello world")
    a, b = plain.generate(ids, 160, stop_at_eos=False), spec.generate(ids, 160, stop_at_eos=False)
    print(f"bf16 mtp, draft vocabulary 128: acceptance {b.stats['acceptance_rate']:.2f}")
    assert a.tokens == b.tokens
    assert b.stats["draft_vocabulary"] >= 128


def test_drafter_kernels_bf16_on_gpu():
    """The DFlash2 drafter's Triton kernels at the published drafter's shapes (5120 wide, 32 query heads over 8 KV
    heads of 128, a 2048-slot window + 8 block rows, conv groups of 16, selector rank 256 / top 16) against their
    references: bf16 within a few ulps; the selector walk exactly in float32."""
    from blockspec.kernels import drafter_conv_triton, drafter_selector_triton
    from blockspec.kernels.drafter_conv import grouped_dynamic_causal_conv_reference
    from blockspec.kernels.drafter_selector import greedy_walk_reference
    from blockspec.kernels import attention_inputs_triton, attention_triton
    from blockspec.kernels.attention import masked_attention_sdpa, prepare_attention_inputs_reference
    from blockspec.kernels.attention import rope_tables

    def close(got, ref):
        return (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()

    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, static = torch.randn(8, 5120, **bf), torch.randn(2, 5120, **bf)
    dynamic = torch.randn(8, 2, 2, 320, **bf)[:, 1]
    assert close(drafter_conv_triton.grouped_dynamic_causal_conv(x, dynamic, static, 16),
                 grouped_dynamic_causal_conv_reference(x.float(), dynamic.float(), static.float(), 16))
    q, k, v = torch.randn(8, 32, 128, **bf), torch.randn(2056, 8, 128, **bf), torch.randn(2056, 8, 128, **bf)
    visible = torch.rand(8, 2056, device="cuda") > 0.3
    visible[:, -8:] = True
    assert close(attention_triton.masked_attention_triton(q, k, v, visible, 128 ** -0.5),
                 masked_attention_sdpa(q.float(), k.float(), v.float(), visible, 128 ** -0.5))
    cos, sin = rope_tables(torch.arange(900, 908, device="cuda"), 128, 1e7, torch.bfloat16)
    qw, kw, slots = torch.randn(128, **bf), torch.randn(128, **bf), torch.arange(2048, 2056, device="cuda")
    caches = [[torch.zeros(2056, 8, 128, **bf) for _ in range(2)] for _ in range(2)]
    got = attention_inputs_triton.prepare_attention_inputs(q, k[:8], v[:8], qw, kw, 1e-6, cos, sin, slots,
                                                           *caches[0], zero_centred=False)
    ref = prepare_attention_inputs_reference(q, k[:8], v[:8], qw, kw, 1e-6, cos, sin, slots, *caches[1],
                                             zero_centred=False)
    assert close(got, ref) and close(caches[0][0][2048:], caches[1][0][2048:])
    assert torch.equal(caches[0][1], caches[1][1])
    f32 = dict(device="cuda", dtype=torch.float32)
    for trial in range(5):
        unary, projected = torch.randn(7, 16, **f32), torch.randn(7, 256, **f32)
        candidates = torch.randint(0, 248320, (7, 16), device="cuda")
        codebooks = torch.randn(248320, 256, **f32), torch.randn(248320, 256, **f32)
        anchor = torch.randint(0, 248320, (1,), device="cuda")
        args = (unary, candidates, projected, anchor, *codebooks)
        assert torch.equal(drafter_selector_triton.greedy_walk(*args), greedy_walk_reference(*args))


def test_graphs_record_no_compiled_region(pair):
    """A start traces nothing with torch.compile (so the drafter's graphs are ready in well under a second and a
    second start takes seconds): the target's and the drafter's graphs record Triton kernels only, so no `fused` op
    takes its compiled path while an engine loads, and re-captured drafter graphs still give plain greedy's output."""
    from blockspec import kernels
    from blockspec.kernels import use

    class Recording(dict):  # the compiled versions' cache, recording each compiled call's lookup
        def get(self, fn, default=None):
            compiled_calls.append(fn.__qualname__)
            return super().get(fn, default)

    compiled_calls = []
    target, drafter = pair
    with mock.patch.object(kernels, "COMPILED", Recording(kernels.COMPILED)):
        e = engine(target, compute_dtype="bfloat16", mode="dflash2", dflash2_model=str(drafter))
        assert compiled_calls == []
        ids = e.tokenizer.encode("hello world")
        first = e.generate(ids, 60, stop_at_eos=False).tokens
        with use(e.kernels):
            e.proposer.capture_graphs(e.target.pool)
        assert compiled_calls == []
    assert e.generate(ids, 60, stop_at_eos=False).tokens == first
    print(f"load times: {e.load_times}")


@pytest.mark.parametrize("mode", ["none", "mtp", "dflash2"])
def test_sampled_graph_replay_equals_eager(pair, mode):
    """Sampling's uniforms come from the host (engine/sampling.py): graphed and eager runs of one seed give the same
    tokens and acceptances, a replay repeats them, and a greedy request after sampled ones is still plain greedy."""
    target, drafter = pair
    kw = dict(mode=mode, compute_dtype="float32", dflash2_model=str(drafter) if mode == "dflash2" else None)
    eager, graphed = engine(target, compile_mode=-1, **kw), engine(target, **kw)
    ids = eager.tokenizer.encode("hello world")
    settings = dict(temperature=0.8, top_k=40, top_p=0.95, seed=5)
    a, b = eager.generate(ids, 120, stop_at_eos=False, **settings), graphed.generate(ids, 120, stop_at_eos=False,
                                                                                      **settings)
    assert a.tokens == b.tokens and a.stats.get("accepted_per_cycle") == b.stats.get("accepted_per_cycle")
    assert graphed.generate(ids, 120, stop_at_eos=False, **settings).tokens == b.tokens
    assert graphed.generate(ids, 120, stop_at_eos=False).tokens == eager.generate(ids, 120, stop_at_eos=False).tokens


@pytest.mark.parametrize("vocabulary_quantization", ["none", "int8"])
def test_head_returns_float32_sums_on_gpu(pair, vocabulary_quantization):
    """The bf16 head's product comes back in float32, unrounded (kernels/linear.py): a step's and an 8-token
    verification's logits of the same row agree far below bf16's step."""
    target, _ = pair
    e = engine(target, compute_dtype="bfloat16", vocabulary_quantization=vocabulary_quantization)
    x = torch.randn(8, e.model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    head = e.model.lm_head
    weight = head.dequantize(torch.float32) if vocabulary_quantization != "none" else head.weight.float()
    expected = x.float() @ weight.t()
    rows, row = e.model.logits(x), e.model.logits(x[:1])
    assert rows.dtype == row.dtype == torch.float32
    assert (rows - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert (rows[:1] - row).abs().max() <= 1e-4 * expected.abs().max()


def test_sampled_walk_on_gpu():
    """The selector's sampling walk (Triton) against its reference at the published drafter's shapes: the same picks
    and q; at temperature 0 the greedy walk's picks."""
    from blockspec.kernels import drafter_selector_triton
    from blockspec.kernels.drafter_selector import greedy_walk_reference, sampled_walk_reference

    torch.manual_seed(0)
    f32 = dict(device="cuda", dtype=torch.float32)
    for temperature in (1.0, 0.7, 0.0):
        unary, projected = torch.randn(7, 16, **f32), torch.randn(7, 256, **f32) * 0.05
        candidates = torch.randint(0, 248320, (7, 16), device="cuda")
        codebooks = torch.randn(248320, 256, **f32), torch.randn(248320, 256, **f32)
        anchor = torch.randint(0, 248320, (1,), device="cuda")
        uniforms = 1 - torch.rand(7, device="cuda", dtype=torch.float64)
        args = (unary, candidates, projected, anchor, *codebooks)
        got, q = drafter_selector_triton.sampled_walk(*args, torch.tensor(temperature, device="cuda"), uniforms)
        ref, ref_q = sampled_walk_reference(*args, torch.tensor(temperature, device="cuda"), uniforms)
        assert torch.equal(got, ref)
        if temperature > 0:
            assert (q - ref_q).abs().max() < 1e-6
        else:
            assert torch.equal(got, greedy_walk_reference(*args))


@pytest.mark.parametrize("mode", ["none", "mtp", "dflash2"])
def test_prefix_reuse_bf16_graphed(wide_margin_pair, mode):
    """Prefix reuse in bf16 with graphs: the conversation's greedy tokens equal an engine's that prefills every
    prompt whole. Restored states are copies, but the remaining prefill is chunked differently from a whole one, so
    this checks that the rounding it changes stays below the pair's margins."""
    from test_prefix_reuse import run

    target, drafter = wide_margin_pair
    kw = dict(compute_dtype="bfloat16", mode=mode, dflash2_model=str(drafter) if mode == "dflash2" else None)
    with_reuse, without = run(engine(target, **kw), {}), run(engine(target, prefix_reuse=False, **kw), {})
    assert [(label, tokens) for label, tokens, *_ in with_reuse] == [(label, tokens) for label, tokens, *_ in without]
    assert sum(cached for *_, cached, _ in with_reuse) > 0


def stamped_pair(monkeypatch, x, first, second):
    """wq_matmul(x, first), then its SwiGLU projection by `second`, eagerly and captured under bench/
    launch_timeline.py's `launch_timeline` (eager launches are not recorded) and replayed: (whether both graphed
    results equal the eager ones bit for bit, the stamped launches)."""
    from blockspec.kernels.quant_matmul_triton import wq_matmul, wq_matmul_swiglu

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from launch_timeline import launch_timeline

    with launch_timeline() as launches:
        plain = wq_matmul(x, first)
        act = wq_matmul_swiglu(plain, second)
        assert launches == []  # not capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            traced = wq_matmul(x, first)
            traced_act = wq_matmul_swiglu(traced, second)
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(traced, plain) and torch.equal(traced_act, act), launches


def test_launch_timeline_stamps_captured_launches(monkeypatch):
    """bench/launch_timeline.py's stamped variant of the W4A16 / W8A16 kernel, run for the launches captured under
    its `launch_timeline`, gives the production kernel's results and stamps every program: start <= main loop's end
    <= end on its SM's clock, start <= end on the global timer, an SM that exists; launches outside a capture run the
    production kernel and are not recorded."""
    from blockspec.kernels import sm_count
    from blockspec.quant.fp8 import Fp8Linear, quantize

    g = torch.Generator().manual_seed(0)
    packed = Fp8Linear.from_blocks(*quantize(torch.randn(5120, 6144, generator=g) * 0.01)).cuda().packed()
    gate_up = Fp8Linear.from_blocks(*quantize(torch.randn(2048, 5120, generator=g) * 0.01)).cuda().packed()
    x = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
    equal, launches = stamped_pair(monkeypatch, x, packed, gate_up)
    assert equal
    assert [(e["n"], e["k"], e["epilogue"], e["rms"]) for e in launches] == [(5120, 6144, 0, False),
                                                                             (2048, 5120, 2, False)]
    for entry in launches:
        t = entry["trace"].cpu()
        assert t.shape[0] > 1 and (t[:, 1] >= t[:, 0]).all() and (t[:, 0] > 0).all()
        assert (t[:, 3] >= t[:, 2]).all() and (t[:, 4] >= t[:, 3]).all()
        assert ((t[:, 5] >= 0) & (t[:, 5] < sm_count(x.device))).all()
        assert torch.equal(t[:, 6], t[:, 0]) and torch.equal(t[:, 7], t[:, 2])  # its wait: inside its main loop


def test_launch_timeline_stamps_warp_specialized_launches(monkeypatch):
    """Where the config takes the warp-specialized kernel (INT4, 1 and 8 rows, Hopper), bench/launch_timeline.py
    stamps its stamped copy of that kernel: the production kernel's results bit for bit under PDL 3, one row per
    program (an SM each), its wait's end between its start and end on both clocks."""
    from blockspec.kernels import quant_matmul_gluon as gk
    from blockspec.kernels import KernelSettings, sm_count, use
    from blockspec.kernels.quant_matmul_triton import default_config, warp_specialized
    from blockspec.quant.int4 import Int4Linear

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel runs on Hopper")
    g = torch.Generator().manual_seed(0)
    down = Int4Linear.from_float(torch.randn(5120, 17408, generator=g) * 0.01, 128, True,
                                 scale_dtype=torch.bfloat16).cuda().packed()
    gate_up = Int4Linear.from_float(torch.randn(34816, 5120, generator=g) * 0.01, 128, True,
                                    scale_dtype=torch.bfloat16).cuda().packed()
    for rows in (1, 8):
        x = torch.randn(rows, 17408, device="cuda", dtype=torch.bfloat16)
        assert warp_specialized(x, down, default_config(rows, down.n, down.k, 4, 128))
        with use(KernelSettings(pdl_level=3)):
            equal, launches = stamped_pair(monkeypatch, x, down, gate_up)
        assert equal, rows
        assert [(e["n"], e["epilogue"], e["schedule"][0]) for e in launches] == [
            (5120, 0, "warp-specialized"), (34816, 2, "warp-specialized")]
        assert gk._ws_kernel.__class__.__name__ != "_TracedLaunch"  # the production kernel back in place
        for entry in launches:
            t = entry["trace"].cpu()
            assert t.shape[0] == sm_count(x.device) and sorted(t[:, 5].tolist()) == list(range(t.shape[0]))
            assert ((t[:, 0] > 0) & (t[:, 0] <= t[:, 6]) & (t[:, 6] <= t[:, 1])).all()
            assert ((t[:, 2] <= t[:, 7]) & (t[:, 7] <= t[:, 3]) & (t[:, 3] <= t[:, 4])).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asm", [True, False])
def test_fp8_projections_on_gpu(dtype, asm):
    """FP8 projections (e4m3 codes in the q16 layout, PTX or plain unpacking) at 27B shapes, one part and packed
    parts off the 128-row grid, gate_up's whole and split tiles in one launch, at 1, 8 and 16 rows: the FP8
    reference's result to rounding; replayed in a CUDA graph they give what they give eagerly. Every finite e4m3
    byte (subnormals, both zeros) times one-hot rows: exactly its value times its block's scale."""
    from dataclasses import replace

    from blockspec.quant.fp8 import Fp8Linear, dequantize, quantize
    from blockspec.kernels.quant_matmul_triton import default_config, wq_matmul

    g = torch.Generator().manual_seed(0)
    for sizes, k in [([5120], 17408), ([10240, 48, 48], 5120), ([34816], 5120)]:  # the last: balanced schedule
        parts = [quantize(torch.randn(n, k, generator=g) * k ** -0.5) for n in sizes]
        packed = Fp8Linear.concat([Fp8Linear.from_blocks(*p) for p in parts]).cuda().packed()
        dense = torch.cat([dequantize(*p) for p in parts]).cuda()
        for rows in (1, 8, 16):
            config = replace(default_config(rows, packed.n, packed.k, 8, 128), asm=asm)
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            got = wq_matmul(x, packed, config, out_dtype=torch.float32)
            ref = x.float() @ dense.t()
            assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), (sizes, rows, asm)
            static, fresh = x.clone(), torch.randn_like(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = wq_matmul(static, packed, config)
            static.copy_(fresh)
            graph.replay()
            assert torch.equal(captured, wq_matmul(fresh, packed, config)), (sizes, rows, asm)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]
    weight = codes.view(torch.float8_e4m3fn).repeat(200, 1).T.contiguous()  # [254, 200]: byte j on output row j
    scale = torch.tensor([[0.5, 2.0], [3.0, 0.25]])
    packed = Fp8Linear.from_blocks(weight, scale).cuda().packed()
    for rows in (1, 8, 16):
        columns = torch.arange(rows) * 13
        x = torch.zeros(rows, 200, dtype=dtype)
        x[torch.arange(rows), columns] = 1.0
        got = wq_matmul(x.cuda(), packed, replace(default_config(rows, 254, 200, 8, 128), asm=asm),
                        out_dtype=torch.float32)
        assert torch.equal(got.cpu(), dequantize(weight, scale)[:, columns].T), (rows, asm)


def test_int4_tree_rows_on_gpu():
    """INT4 projections at a draft tree's 17 and 32 rows at the 27B's gate_up (whole tiles and the balanced split
    last round in one launch) and down (K split to ~3 waves): the dequantized reference's result to rounding; replayed
    in a CUDA graph they give what they give eagerly."""
    from blockspec.kernels.quant_matmul_triton import default_config, schedule, wq_matmul
    from blockspec.quant.int4 import Int4Linear

    g = torch.Generator().manual_seed(0)
    for n, k in [(34816, 5120), (5120, 17408)]:
        lin = Int4Linear.from_float(torch.randn(n, k, generator=g) * k ** -0.5).cuda()
        packed, dense = lin.packed(), lin.dequantize(torch.float32)
        for rows in (17, 32):
            assert schedule(default_config(rows, n, k), n, k // 512)[1] > 1  # both take split tiles
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            got = wq_matmul(x, packed, out_dtype=torch.float32)
            ref = x.float() @ dense.t()
            assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), (n, rows)
            static, fresh = x.clone(), torch.randn_like(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = wq_matmul(static, packed)
            static.copy_(fresh)
            graph.replay()
            assert torch.equal(captured, wq_matmul(fresh, packed)), (n, rows)


def test_warp_specialized_kernel_against_triton_kernel():
    """The Gluon warp-specialized kernel that the config table takes for INT4 at 1..8 and 17..32 rows (Hopper),
    against the Triton kernel's config on the same launches, every epilogue: store (fp32 sums; tiles cut between
    programs add their pieces in another order), residual add with the next norm begun, then SwiGLU scaled by that
    norm's 1 / rms; and its FP8 (e4m3) and int8 group-32 codes (the drafter's) against the Triton kernel's, with
    `overlap_dots` bit for bit the same (INT4: test_overlapped_dots_equal_the_default_bit_for_bit)."""
    from dataclasses import replace

    from blockspec.kernels import quant_matmul_gluon
    from blockspec.kernels.quant_matmul_triton import default_config, wq_matmul, wq_matmul_add_norm, wq_matmul_swiglu
    from blockspec.quant.fp8 import Fp8Linear, quantize
    from blockspec.quant.int4 import Int4Linear
    from blockspec.quant.int8 import Int8Linear

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel is Hopper's")
    g = torch.Generator().manual_seed(1)
    packed = {name: Int4Linear.from_float(torch.randn(n, k, generator=g) * k ** -0.5).cuda().packed()
              for name, (n, k) in {"gate_up": (34816, 5120), "down": (5120, 17408), "gdn_in": (16480, 5120)}.items()}

    def both(fn, name, rows, *args, **kw):
        cfg = default_config(rows, packed[name].n, packed[name].k)
        assert cfg.warp_specialized
        return fn(*args, config=cfg, **kw), fn(*args, config=replace(cfg, warp_specialized=0), **kw)

    def close(a, b, tol):
        a, b = a.float(), b.float()
        assert (a - b).abs().max() <= tol * b.abs().max(), float((a - b).abs().max() / b.abs().max())

    for rows in (17, 32):
        x = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (5120, 17408)}
        assert quant_matmul_gluon.usable(x[5120], packed["gate_up"])
        for name in packed:
            ws, tri = both(wq_matmul, name, rows, x[packed[name].k], packed[name], out_dtype=torch.float32)
            close(ws, tri, 1e-5)
        residual = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.randn(5120, device="cuda", dtype=torch.bfloat16) * 0.1
        (out, normed, parts), (out_t, normed_t, parts_t) = both(wq_matmul_add_norm, "down", rows, x[17408],
                                                                packed["down"], residual, norm_w)
        close(out, out_t, 1e-2)
        close(normed, normed_t, 1e-2)
        close(parts, parts_t, 1e-2)
        ws, tri = both(wq_matmul_swiglu, "gate_up", rows, normed_t, packed["gate_up"], rms=(parts_t, 1e-6))
        close(ws, tri, 1e-2)
        assert (ws == tri).float().mean() > 0.95  # the pieces' order moves a bf16 rounding only now and then
    # channels past the last whole tile group (SwiGLU: 2 x 1056, not a multiple of 64) and the rms with a plain
    # store
    odd = Int4Linear.from_float(torch.randn(2112, 5120, generator=g) * 5120 ** -0.5).cuda().packed()
    x = torch.randn(24, 5120, device="cuda", dtype=torch.bfloat16)
    cfg = default_config(24, 2112, 5120)
    close(wq_matmul_swiglu(x, odd, rms=(parts_t[:, :1].expand(-1, 24).contiguous(), 1e-6), config=cfg),
          wq_matmul_swiglu(x, odd, rms=(parts_t[:, :1].expand(-1, 24).contiguous(), 1e-6),
                           config=replace(cfg, warp_specialized=0)), 1e-2)
    close(wq_matmul(x, odd, config=cfg, rms=(parts_t[:, :1].expand(-1, 24).contiguous(), 1e-6)),
          wq_matmul(x, odd, config=replace(cfg, warp_specialized=0),
                    rms=(parts_t[:, :1].expand(-1, 24).contiguous(), 1e-6)), 1e-2)
    for rows in (1, 8):  # the engine's gate_up (SwiGLU), gdn in and down (add-norm) at 1..8 rows (lean); 3 consumers
        x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
        rms = (parts_t[:, :1].expand(-1, rows).contiguous(), 1e-6)
        ws, tri = both(wq_matmul_swiglu, "gate_up", rows, x, packed["gate_up"], rms=rms)
        close(ws, tri, 1e-2)
        close(wq_matmul_swiglu(x, packed["gate_up"], rms=rms,
                               config=replace(default_config(rows, 34816, 5120), warp_specialized=3)), tri, 1e-2)
        ws, tri = both(wq_matmul, "gdn_in", rows, x, packed["gdn_in"], rms=rms, out_dtype=torch.float32)
        close(ws, tri, 1e-5)
        h = torch.randn(rows, 17408, device="cuda", dtype=torch.bfloat16)
        for ws, tri in zip(*both(wq_matmul_add_norm, "down", rows, h, packed["down"], residual[:rows], norm_w)):
            close(ws, tri, 1e-2)
    # FP8 (e4m3) codes at 1, 8 (the config table's lean program) and 24 rows: 2 groups a K block
    fp8 = {name: Fp8Linear.from_blocks(*quantize(torch.randn(n, k, generator=g) * 0.01)).cuda().packed()
           for name, (n, k) in {"gate_up": (34816, 5120), "down": (5120, 17408)}.items()}
    for rows in (1, 8, 24):
        x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, 17408, device="cuda", dtype=torch.bfloat16)
        for name, inputs in (("gate_up", x), ("down", h)):
            cfg = default_config(rows, fp8[name].n, fp8[name].k, 8, 128)
            ws_cfg = replace(cfg, block_n=64, block_m=max(8, 1 << (rows - 1).bit_length()), warp_specialized=2)
            assert quant_matmul_gluon.usable(inputs, fp8[name], ws_cfg.block_m)
            got = wq_matmul(inputs, fp8[name], config=ws_cfg, out_dtype=torch.float32)
            triton = replace(cfg, warp_specialized=0)
            close(got, wq_matmul(inputs, fp8[name], config=triton, out_dtype=torch.float32), 1e-5)
            assert (ws_cfg == cfg) == (rows <= 8)  # the table's config at 1..8 rows: this lean program
            assert torch.equal(wq_matmul(inputs, fp8[name], config=replace(ws_cfg, overlap_dots=True),
                                         out_dtype=torch.float32), got)  # the dots in asynchronous pieces
        if rows <= 8:  # the FP8 engine's epilogues there: down's residual add with the next norm begun, SwiGLU
            def fp8_both(fn, name, *args, **kw):
                cfg = default_config(rows, fp8[name].n, fp8[name].k, 8, 128)
                return fn(*args, config=cfg, **kw), fn(*args, config=replace(cfg, warp_specialized=0), **kw)

            for ws, tri in zip(*fp8_both(wq_matmul_add_norm, "down", h, fp8["down"], residual[:rows], norm_w)):
                close(ws, tri, 1e-2)
            rms = (parts_t[:, :1].expand(-1, rows).contiguous(), 1e-6)
            close(*fp8_both(wq_matmul_swiglu, "gate_up", x, fp8["gate_up"], rms=rms), 1e-2)
    # int8 group-32 codes (the drafter's, 4 blocks a unit) at 1, 8, 16 and 24 rows, every projection (the config
    # table sends gate_up at 1..8 rows and all at 9..32 there): each epilogue, the lean program at 1..8 rows
    int8 = {name: Int8Linear.from_float(torch.randn(n, k, generator=g) * 0.01, 32).cuda().packed()
            for name, (n, k) in {"gate_up": (34816, 5120), "down": (5120, 17408), "qkv": (6144, 5120)}.items()}
    for rows in (1, 8, 16, 24):
        x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, 17408, device="cuda", dtype=torch.bfloat16)
        for name, inputs in (("gate_up", x), ("down", h), ("qkv", x)):
            cfg = replace(default_config(rows, int8[name].n, int8[name].k, 8, 32), warp_specialized=0)
            ws_cfg = replace(cfg, block_n=64, block_m=max(8, 1 << (rows - 1).bit_length()), warp_specialized=2)
            assert quant_matmul_gluon.usable(inputs, int8[name], ws_cfg.block_m)
            got = wq_matmul(inputs, int8[name], config=ws_cfg, out_dtype=torch.float32)
            want = wq_matmul(inputs, int8[name], config=cfg, out_dtype=torch.float32)
            close(got, want, 1e-5)
            assert torch.equal(wq_matmul(inputs, int8[name], config=replace(ws_cfg, overlap_dots=True),
                                         out_dtype=torch.float32), got)
        ws_out = wq_matmul_swiglu(x, int8["gate_up"], config=replace(
            default_config(rows, 34816, 5120, 8, 32), block_n=64, block_m=max(8, 1 << (rows - 1).bit_length()),
            warp_specialized=2))
        close(ws_out, wq_matmul_swiglu(x, int8["gate_up"], config=replace(
            default_config(rows, 34816, 5120, 8, 32), warp_specialized=0)), 1e-2)
        residual = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.randn(5120, device="cuda", dtype=torch.bfloat16) * 0.1
        down_cfg = replace(default_config(rows, 5120, 17408, 8, 32), warp_specialized=0)
        (out, normed, parts), (out_t, normed_t, parts_t) = (
            wq_matmul_add_norm(h, int8["down"], residual, norm_w, config=replace(
                down_cfg, block_n=64, block_m=max(8, 1 << (rows - 1).bit_length()), warp_specialized=2)),
            wq_matmul_add_norm(h, int8["down"], residual, norm_w, config=down_cfg))
        close(out, out_t, 1e-2)
        close(normed, normed_t, 1e-2)
        close(parts.sum(0), parts_t.sum(0), 1e-2)  # per-tile sums: tiles of 64 rows here, the config's there
    # the loader's L2 prefetch of the units after its ring's (under PDL) changes no bit
    from blockspec.kernels import KernelSettings, use
    with use(KernelSettings(pdl_level=3)):
        for rows in (1, 8):
            x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
            cfg = default_config(rows, packed["gdn_in"].n, 5120)
            assert torch.equal(wq_matmul(x, packed["gdn_in"], config=replace(cfg, l2_ahead=24)),
                               wq_matmul(x, packed["gdn_in"], config=cfg))
    assert not quant_matmul_gluon._BROKEN  # every launch above built: none fell back to the Triton kernel


def test_overlapped_dots_equal_the_default_bit_for_bit():
    """The warp-specialized kernel with `overlap_dots` (the group dots' wgmma issued asynchronously in pieces)
    against its default at the 27B's INT4 shapes under PDL 3, every epilogue, 1, 8 and 32 rows: the same bits, the
    dots being the same k16 steps, scaled and added in the same order; and over CUDA graph replays with new inputs
    (the counters left clean for the next launch)."""
    from dataclasses import replace

    from blockspec.kernels import KernelSettings, quant_matmul_gluon, use
    from blockspec.kernels.quant_matmul_triton import default_config, wq_matmul, wq_matmul_add_norm, wq_matmul_swiglu
    from blockspec.quant.int4 import Int4Linear

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel is Hopper's")
    g = torch.Generator().manual_seed(3)
    packed = {name: Int4Linear.from_float(torch.randn(n, k, generator=g) * k ** -0.5).cuda().packed()
              for name, (n, k) in {"gate_up": (34816, 5120), "down": (5120, 17408), "qkv": (14336, 5120)}.items()}
    norm_w = torch.randn(5120, device="cuda", dtype=torch.bfloat16) * 0.1
    with use(KernelSettings(pdl_level=3)):
        for rows in (1, 8, 32):
            x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(rows, 17408, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16)

            def launches(changed):
                cfg = {name: replace(default_config(rows, w.n, w.k), overlap_dots=changed)
                       for name, w in packed.items()}
                assert all(c.warp_specialized for c in cfg.values())
                out, normed, parts = wq_matmul_add_norm(h, packed["down"], residual, norm_w, config=cfg["down"])
                return (out, normed, parts, wq_matmul_swiglu(normed, packed["gate_up"], rms=(parts, 1e-6),
                                                            config=cfg["gate_up"]),
                        wq_matmul(x, packed["qkv"], config=cfg["qkv"], out_dtype=torch.float32))
            for got, want in zip(launches(True), launches(False)):
                assert torch.equal(got, want)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = launches(True)
            for _ in range(2):
                for t in (x, h, residual):
                    t.copy_(torch.randn_like(t))
                graph.replay()
                for got, want in zip(captured, launches(False)):
                    assert torch.equal(got, want)
    assert not quant_matmul_gluon._BROKEN


def test_mlp_in_one_launch_equals_two_launches():
    """The folded INT4 MLP in one warp-specialized launch (the persistent_mlp setting) against its two launches at
    the 27B's shapes under PDL level 3 (the INT4 engine's): out, rows and partials bit for bit at 1 and 8 rows,
    eagerly and over CUDA graph replays with new inputs (the launch leaves its counters clean for the next)."""
    from blockspec.kernels import KernelSettings, quant_matmul_gluon, use
    from blockspec.kernels.quant_matmul_triton import wq_matmul_add_norm, wq_matmul_swiglu, wq_mlp_add_norm
    from blockspec.quant.int4 import Int4Linear

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel is Hopper's")
    torch.manual_seed(0)
    gate_up = Int4Linear.from_float(torch.randn(34816, 5120, device="cuda") * 5120 ** -0.5).packed()
    down = Int4Linear.from_float(torch.randn(5120, 17408, device="cuda") * 17408 ** -0.5).packed()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    with use(KernelSettings(pdl_level=3)):
        for m in (1, 8):
            x, residual, w = torch.randn(m, 5120, **bf), torch.randn(m, 5120, **bf), 0.1 * torch.randn(5120, **bf)
            partials = torch.rand(80, m, device="cuda") * 128

            def two():
                return wq_matmul_add_norm(wq_matmul_swiglu(x, gate_up, (partials, 1e-6)), down, residual, w)

            def one():
                return wq_mlp_add_norm(x, gate_up, down, residual, w, (partials, 1e-6))
            assert quant_matmul_gluon.mlp_usable(x, gate_up, down)
            assert all(torch.equal(a, b) for a, b in zip(one(), two()))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = one()
            for _ in range(3):
                x.copy_(torch.randn(m, 5120, **bf))
                residual.copy_(torch.randn(m, 5120, **bf))
                graph.replay()
                torch.cuda.synchronize()
                assert all(torch.equal(a, b) for a, b in zip(captured, two()))
    assert not quant_matmul_gluon._MLP_BROKEN


# 31: a GPU's default budget (32 rows), 32: one row more; 31 with a lookup branch of 7 on a prompt that repeats
@pytest.mark.parametrize("budget,lookup", [(8, 0), (31, 0), (32, 0), (31, 7)])
def test_tree_graph_replay_equals_eager_and_plain(pair, budget, lookup):
    """Draft trees under CUDA graphs (the drafter's pass and tree, the lookup branch's graft, the tree pass, the path
    commits) against eager trees and plain greedy, float32; and sampled (the walk's graph of each ranking width),
    graphed == eager for one seed."""
    target, drafter = pair
    kw = dict(mode="dflash2", compute_dtype="float32", dflash2_model=str(drafter), dflash2_tree_budget=budget,
              dflash2_tree_lookup=lookup)
    eager, graphed = engine(target, compile_mode=-1, **kw), engine(target, **kw)
    assert graphed.target.tree_pass is not None and graphed.proposer.tree_graph is not None
    assert len(graphed.target.sampled_walks) == 2
    ids = eager.tokenizer.encode("the cat sat on the mat. " * 6 if lookup else "hello world")
    plain = engine(target, compute_dtype="float32").generate(ids, 150, stop_at_eos=False).tokens
    a, b = eager.generate(ids, 150, stop_at_eos=False), graphed.generate(ids, 150, stop_at_eos=False)
    assert a.tokens == b.tokens == plain
    assert a.stats["accepted_per_cycle"] == b.stats["accepted_per_cycle"]
    for settings in (dict(temperature=0.8, top_k=40, seed=5), dict(temperature=1.0, top_p=0.95, seed=6)):
        a, b = (e.generate(ids, 120, stop_at_eos=False, **settings) for e in (eager, graphed))
        assert a.tokens == b.tokens and a.stats["accepted_per_cycle"] == b.stats["accepted_per_cycle"], settings


@pytest.mark.parametrize("compile_mode", [-1, 0])
@pytest.mark.parametrize("budget", [16, 48])
def test_tree_equals_plain_bf16(wide_margin_pair, compile_mode, budget):
    target, drafter = wide_margin_pair
    plain = engine(target, compute_dtype="bfloat16", compile_mode=compile_mode)
    tree = engine(target, compute_dtype="bfloat16", compile_mode=compile_mode, mode="dflash2",
                  dflash2_model=str(drafter), dflash2_tree_budget=budget)
    ids = plain.tokenizer.encode("hello world")
    a, b = plain.generate(ids, 200, stop_at_eos=False), tree.generate(ids, 200, stop_at_eos=False)
    print(f"bf16 tree {budget} compile_mode {compile_mode}: mean accepted length {b.stats['mean_accepted_length']}")
    assert a.tokens == b.tokens


@pytest.mark.parametrize("style", ["transition", "ties", "masked"])
def test_tree_build_kernel_equals_reference_on_cuda(style):
    """kernels/drafter_tree_triton.py compiled for the GPU against build_tree_reference (the interpreter cannot check
    the GPU's tie-break and comparison semantics): every budget, equal trees."""
    from test_tree_build_kernel import inputs

    from blockspec.kernels import drafter_tree_triton
    from blockspec.layers.tree import DraftTree, build_tree
    from blockspec.kernels.drafter_tree import build_tree_reference
    for k, rows in ((16, 7), (8, 16), (4, 7)):
        table, candidates, anchor, chain = (x.cuda() for x in inputs(k, rows, style, seed=k + rows))
        for budget in (1, rows, 16, 33, 63):
            assert drafter_tree_triton.available(table, budget)
            got, expected = build_tree(table, candidates, anchor, chain, budget), \
                DraftTree(build_tree_reference(table, candidates, anchor, chain, budget))
            for field in ("tokens", "parents", "depth", "valid"):
                assert torch.equal(getattr(got, field), getattr(expected, field)), (style, k, rows, budget, field)


def test_graft_kernel_equals_reference_on_cuda():
    """The lookup branch's graft (kernels/drafter_tree_triton.py) compiled for the GPU against
    graft_branch_reference, the interpreter's cases."""
    from test_tree_build_kernel import GRAFTS, PADDED_BRANCH, PADDED_GRAFT, PADDED_TREE, graft_inputs

    from blockspec.kernels import drafter_tree_triton
    from blockspec.kernels.drafter_tree import graft_branch, graft_branch_reference
    assert torch.equal(graft_branch(PADDED_TREE.cuda(), PADDED_BRANCH.cuda()).cpu(), PADDED_GRAFT)
    for i, case in enumerate(GRAFTS):
        nodes, branch = (x.cuda() for x in graft_inputs(*case, seed=i))
        assert drafter_tree_triton.graft_available(nodes, branch)
        assert torch.equal(graft_branch(nodes, branch), graft_branch_reference(nodes, branch)), case


def test_transition_table_kernel_on_cuda():
    """kernels/drafter_tree_triton.py's transition table compiled for the GPU against transition_table_reference,
    with the engine's dtypes (bf16 codebooks and projection, float32 unary logits): the same log-probabilities to the
    bf16 rounding of a dot product."""
    from test_tree_build_kernel import TABLES, table_inputs

    from blockspec.kernels.drafter_tree import transition_table, transition_table_reference
    for i, (k, rows, rank) in enumerate(TABLES):
        unary, candidates, projected, anchor, predecessor, successor = (x.cuda() for x in table_inputs(k, rows, rank, i))
        args = unary, candidates, projected.bfloat16(), anchor, predecessor.bfloat16(), successor.bfloat16()
        # dot products of ~16 in bf16 (ulp 0.125): a rounding flips one score by an ulp or two
        torch.testing.assert_close(transition_table(*args), transition_table_reference(*args), rtol=0, atol=0.3)
        exact = transition_table(unary, candidates, projected, anchor, predecessor, successor)
        torch.testing.assert_close(exact, transition_table_reference(unary, candidates, projected, anchor,
                                                                     predecessor, successor), rtol=0, atol=0.02)


def test_block_sparse_training_attention_on_gpu():
    """A drafter training step's attention (train/block_attention.py): compiled flex_attention under the block
    mask equals scaled_dot_product_attention under the dense mask, forward and backward (float32, grouped heads,
    three sequences, anchors inside and past the window)."""
    from blockspec.train.block_attention import BlockLayout, attend

    torch.manual_seed(0)
    seq_len, block, window = 300, 8, 128
    anchors = torch.cat([s * seq_len + torch.randperm(seq_len - block)[:40].sort().values + 1 for s in range(3)])
    layout = BlockLayout(anchors.cuda(), block, 3 * seq_len, window, seq_len)
    q = torch.randn(1, 4, layout.rows, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 2, layout.length + layout.rows, 64, device="cuda", requires_grad=True) for _ in range(2))
    outputs, grads = [], []
    for mask in (layout.dense_mask(), layout.block_mask()):
        with torch.enable_grad():
            out = attend(q, k, v, mask, 0.125)
            out.square().sum().backward()
        outputs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
    for flex, dense in zip(*grads):
        torch.testing.assert_close(flex, dense, rtol=1e-3, atol=1e-3)


def test_graphed_training_features_equal_eager(tiny_checkpoint):
    """train-drafter's target pass over whole sequences (train/run.py TargetFeatures) replayed as one CUDA graph
    gives the eager pass's features, labels and hidden states, bitwise, for every sequence in turn."""
    from blockspec.models.checkpoint import load_target
    from blockspec.train.run import TargetFeatures

    model, _ = load_target(tiny_checkpoint(), "cuda", torch.bfloat16)
    for layers, hidden in (([1, 2], False), ((), True)):  # a DFlash2 drafter's features; the MTP head's hidden states
        eager = TargetFeatures(model, layers, 96, "cuda", torch.bfloat16, hidden=hidden)
        graphed = TargetFeatures(model, layers, 96, "cuda", torch.bfloat16, graphed=True, hidden=hidden)
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            ids = torch.randint(0, model.config.vocab_size, (96,), generator=generator).cuda()
            got, expected = graphed(ids), eager(ids)
            assert len(got) == 2 + hidden and (got[0] is None) == (not layers)
            assert all(torch.equal(a, b) for a, b in zip(got, expected) if b is not None)
        assert graphed.graph is not None


@pytest.mark.parametrize("kind", ["dflash2", "mtp"])
def test_train_drafter_on_gpu_compiles_and_evaluates_on_its_own_target(tmp_path, kind):
    """train-drafter on CUDA as users run it: the step through torch.compile (the default there; the block mask's
    flex_attention traced into it), the held-out evaluation on the frozen target in memory; the loss falls and the
    frozen target's weights are the ones evaluated."""
    import random

    from blockspec.fixtures.tiny import build_tiny_checkpoint
    from blockspec.train import run as training

    target = build_tiny_checkpoint(tmp_path / "target", seed=0, planted=True)
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old tree".split()
    for i in range(10):
        (data / f"part{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    compiled, shared = [], []
    real_compile, real_evaluate = torch.compile, training.evaluate

    def evaluate(run, out, heldout, device, **given):
        shared.append(given.get("target") is not None)
        return real_evaluate(run, out, heldout, device, **given)
    with mock.patch.object(torch, "compile", lambda m, **kw: compiled.append(type(m).__name__) or real_compile(m, **kw)), \
            mock.patch.object(training, "evaluate", evaluate):
        kw = {"replace_mtp": True, "batch_tokens": 192} if kind == "mtp" else {"batch_tokens": 128}
        summary = training.train(training.DrafterTraining(
            target=str(target), data=[str(data)], out=str(tmp_path / "out"), kind=kind, layers=1, window=32,
            seq_len=96, steps=12, lr=3e-3, selector_rank=16, selector_top_k=8, checkpoint_every=6, eval_cuts=8,
            eval_every=6, heldout=0.2, device="cuda", **kw), log=lambda *_: None)
    assert ("DrafterLoss" if kind == "dflash2" else "MTPModule") in compiled
    assert shared == [True, True]  # the evaluations at steps 6 and 12 (the last one also the final figure)
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    assert 1 <= summary["evaluation"]["mean_accepted_length"] <= 8


def test_trainer_on_gpu_keeps_the_cpu_history(tmp_path):
    """Trainer.fit on CUDA (AdamW fused; each step's figures read from a host copy once the next step is queued)
    records every step, in order, with the losses, figures and gradient norms of the same run on the CPU (foreach
    AdamW: equal within float32 rounding, which Adam's normalized updates grow to ~1e-3 over ten steps; a history
    shifted by one step lies outside that tolerance)."""
    from blockspec.train.loop import Trainer

    def history(device):
        torch.manual_seed(0)
        module = torch.nn.Linear(16, 4).to(device)
        x, y = torch.randn(64, 16).to(device), torch.randn(64, 4).to(device)

        def step_loss(rng):
            loss = torch.nn.functional.mse_loss(module(x), y)
            return loss, {"first_row_accuracy": loss.detach() / 2}, 64
        trainer = Trainer(module, tmp_path / device, 0.05, torch.device(device), lambda out: None, 4, 0, {})
        trainer.fit(10, step_loss)
        return trainer.history

    cpu, gpu = history("cpu"), history("cuda")
    assert [h["step"] for h in gpu] == list(range(1, 11)) == [h["step"] for h in cpu]
    for a, b in zip(cpu, gpu):
        assert b == pytest.approx(a, rel=3e-3, abs=1e-4)
    def figures(h):
        return {k: v for k, v in h.items() if k != "step"}
    assert all(figures(b) != pytest.approx(figures(a), rel=3e-3, abs=1e-4) for a, b in zip(cpu[1:], gpu))
    assert gpu[-1]["loss"] < gpu[0]["loss"]


def test_trainer_steps_never_wait_for_the_device(tmp_path):
    """A step of Trainer.fit on CUDA, its inputs copied by train/data.on_device, makes no call that waits for the
    device (torch.cuda's sync debug mode raises on one): the figures are read from a copy behind the step."""
    from blockspec.train.data import on_device
    from blockspec.train.loop import Trainer

    module = torch.nn.Linear(16, 4).cuda()
    device = torch.device("cuda")

    def step_loss(rng):
        x = on_device(np.asarray([[rng.random() for _ in range(16)] for _ in range(8)], np.float32), device)
        loss = module(x).square().mean()
        return loss, {"first_row_accuracy": loss.detach()}, 8
    trainer = Trainer(module, tmp_path, 0.01, device, lambda out: None, 1000, 0, {})
    trainer.fit(2, step_loss)
    trainer.checkpoint = lambda evaluate=None: None  # a checkpoint copies the weights to the host: not a step's
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.fit(6, step_loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [h["step"] for h in trainer.history] == list(range(1, 7))
