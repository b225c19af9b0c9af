"""Weight-only quantization: RTN error bounds, q16 packing, compressed-tensors loading, refusals, and the
Triton kernel against the reference (through the Triton interpreter, in a subprocess, when triton is installed)."""

import json
import os
from dataclasses import replace

import pytest
import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec import kernels
from blockspec.errors import BlockspecError
from blockspec.kernels import quant_matmul as qm
from blockspec.kernels import quant_matmul_triton as wq
from blockspec.quant import int4, int8
from blockspec.quant.int4 import Int4Linear, from_compressed_tensors
from blockspec.quant.int8 import Int8Linear


def _weight(n, k, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if outliers:
        w[0, 0] = 0.9
        w[n // 2, k - 1] = -1.3
        if k > 130:
            w[1, 128:] = 0.0  # an all-zero group
    return w


# ----------------------------------------------------------------------------------------------------------
# RTN quantization
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [256, 300, 130, 77])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_rtn_error_within_half_step(symmetric, k, scale_dtype):
    w = _weight(24, k)
    q, s, zp = int4.quantize(w, 128, symmetric, scale_dtype)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert s.dtype == scale_dtype and s.shape == (24, -(-k // 128))
    assert (zp is None) == symmetric
    if zp is not None:
        assert int(zp.min()) >= -8 and int(zp.max()) <= 7
    deq = int4.dequantize(q, s, zp, 128)
    half_step = s.float().repeat_interleave(128, dim=1)[:, :k] / 2
    assert bool(((deq - w).abs() <= half_step * (1 + 1e-6) + 1e-12).all())


def test_int4_rtn_conventions():
    # symmetric: scale = max|w| / 7.5; the extremes map to -8 / 7 (round half to even, clamp)
    w = torch.tensor([[1.5] + [0.0] * 127, [-1.5] + [0.2] * 127])
    q, s, _ = int4.quantize(w, 128, True, torch.float32)
    assert torch.allclose(s[:, 0], torch.tensor([0.2, 0.2]))
    assert int(q[0, 0]) == 7 and int(q[1, 0]) == -8 and int(q[1, 1]) == 1
    # asymmetric: range [min(w,0), max(w,0)] over 15 steps, zero point -8 - min/scale
    w = torch.linspace(0.5, 2.0, 128).view(1, 128)
    q, s, zp = int4.quantize(w, 128, False, torch.float32)
    assert torch.allclose(s, torch.tensor([[2.0 / 15]]))
    assert int(zp) == -8 and int(q.max()) == 7


@pytest.mark.parametrize("k", [64, 100, 96])
def test_int8_rtn_error_within_half_step(k):
    w = _weight(10, k, seed=3)
    q, s = int8.quantize(w, 32)
    assert int(q.abs().max()) <= 127
    deq = int8.dequantize(q, s, 32)
    half_step = s.float().repeat_interleave(32, dim=1)[:, :k] / 2
    assert bool(((deq - w).abs() <= half_step * (1 + 1e-6) + 1e-12).all())


# ----------------------------------------------------------------------------------------------------------
# q16 layout and modules
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,gs,k", [(4, 128, 300), (4, 128, 1024), (4, 64, 70), (4, 32, 33), (8, 32, 45),
                                       (8, 128, 260)])
def test_q16_pack_roundtrip_and_layout(bits, gs, k):
    g = torch.Generator().manual_seed(bits * 1000 + k)
    codes = torch.randint(0, 1 << bits, (5, k), generator=g, dtype=torch.int32)
    scales = torch.rand(5, -(-k // gs), generator=g).to(torch.bfloat16)
    zeros = torch.randint(0, 1 << bits, scales.shape, generator=g).float()
    pw = qm.pack(codes, scales, zeros, bits, gs)
    cph, blk = 16 // bits, qm.block_size(bits, gs)
    kp = -(-k // blk) * blk
    assert pw.q.dtype == torch.int16 and pw.q.shape == (5, kp // cph)
    assert pw.s.shape == pw.z.shape == (kp // blk, 5, cph) and pw.s.dtype == torch.bfloat16
    assert torch.equal(qm.unpack_codes(pw.q, bits, gs, k), codes)
    assert torch.equal(qm.unpack_groups(pw.s, k, gs), scales) and torch.equal(qm.unpack_groups(pw.z, k, gs), zeros)
    # the documented positions: bits [bits*i, bits*(i+1)) of halfword c of block b <-> k = b*C*G + i*G + c
    for kk in (0, 1, gs, k - 1):
        b, r = divmod(kk, blk)
        i, c = divmod(r, gs)
        half = int(pw.q[2, b * gs + c]) & 0xFFFF
        assert (half >> (bits * i)) & ((1 << bits) - 1) == int(codes[2, kk])
        assert float(pw.s[b, 2, i]) == float(scales[2, kk // gs])
    expect = (codes.float() - zeros.repeat_interleave(gs, 1)[:, :k]) * scales.float().repeat_interleave(gs, 1)[:, :k]
    assert torch.equal(pw.dequantize(), expect)
    assert torch.equal(pw.dequantize(rows=torch.tensor([3, 1])), expect[[3, 1]])


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linear_matches_dequantized_weight(symmetric):
    w = _weight(40, 300, seed=1)
    bias = torch.randn(40)
    lin = Int4Linear.from_float(w, 128, symmetric, bias=bias)
    q, s, zp = int4.quantize(w, 128, symmetric)
    assert torch.equal(lin.codes(), q)
    assert torch.equal(lin.dequantize(), int4.dequantize(q, s, zp, 128))
    x = torch.randn(3, 7, 300)
    y = lin(x)
    assert y.shape == (3, 7, 40)
    ref = x @ int4.dequantize(q, s, zp, 128).t() + bias
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    sd = lin.state_dict()
    assert set(sd) == ({"qweight", "scales", "bias"} | (set() if symmetric else {"zeros"}))


def test_int8_linear_matches_dequantized_weight():
    w = _weight(12, 96, seed=2)
    lin = Int8Linear.from_float(w, 32)
    q, s = int8.quantize(w, 32)
    assert torch.equal(lin.codes(), q)
    x = torch.randn(5, 96)
    torch.testing.assert_close(lin(x), x @ int8.dequantize(q, s, 32).t(), rtol=1e-5, atol=1e-5)
    assert lin.weight_bytes() == 12 * 128 + 12 * 4 * 2  # K padded to 128 (blocks of 2 groups): codes + bf16 scales


def test_invalid_settings_refused():
    w = torch.randn(8, 256)
    with pytest.raises(BlockspecError):
        Int4Linear.from_float(w, group_size=100)
    with pytest.raises(BlockspecError):
        Int4Linear.from_float(w.to(torch.int32))
    with pytest.raises(BlockspecError):
        Int8Linear.from_float(w, 32, symmetric=False)
    with pytest.raises(BlockspecError):
        Int8Linear.from_float(w, group_size=6)
    with pytest.raises(BlockspecError):
        int4.quantize(torch.randn(4, 4, 4))
    with pytest.raises(BlockspecError):  # codes out of range
        Int4Linear.from_quantized(torch.full((2, 128), 9, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(BlockspecError):  # scale shape mismatch
        Int4Linear.from_quantized(torch.zeros(2, 256, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(BlockspecError):
        Int8Linear.from_quantized(torch.full((2, 32), -128, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(ValueError):
        qm.check_format(3, 128)
    with pytest.raises(ValueError):
        Int4Linear.from_float(w)(torch.randn(2, 100))


# ----------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized (packed here independently, following the documented layout)
# ----------------------------------------------------------------------------------------------------------

def _ct_pack_rows(values_u, n_bits=4):
    """Unsigned codes [R, C] -> int32 [R, ceil(C/8)]: value c of a row goes to word c // 8, bits 4*(c % 8)."""
    r, c = values_u.shape
    out = []
    for row in values_u.tolist():
        words = []
        for w0 in range(0, c, 8):
            acc = 0
            for i, v in enumerate(row[w0:w0 + 8]):
                acc |= (int(v) & 0xF) << (n_bits * i)
            words.append(acc - (1 << 32) if acc >= 1 << 31 else acc)
        out.append(words)
    return torch.tensor(out, dtype=torch.int32)


def _ct_config(symmetric=True, group_size=128, fmt="pack-quantized", ignore=("lm_head",), strategy="group",
               method="compressed-tensors", num_bits=4, acts=None):
    return {"architectures": ["Qwen3_5ForCausalLM"], "quantization_config": {
        "quant_method": method, "format": fmt, "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                      "weights": {"num_bits": num_bits, "type": "int", "symmetric": symmetric,
                                                  "strategy": strategy, "group_size": group_size,
                                                  "dynamic": False, "actorder": None, "observer": "minmax"}}}}}


def _ct_tensors(n, k, symmetric, seed=0, prefix="model.layers.0.mlp.down_proj", scale_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 128)
    q = torch.randint(-8, 8, (n, k), generator=g)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(scale_dtype)
    t = {f"{prefix}.weight_packed": _ct_pack_rows(q + 8),
         f"{prefix}.weight_scale": scale,
         f"{prefix}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    zp = None
    if not symmetric:
        zp = torch.randint(-8, 8, (n, groups), generator=g)
        t[f"{prefix}.weight_zero_point"] = _ct_pack_rows((zp + 8).t().contiguous()).t().contiguous()
    dense = (q.float() - (0 if zp is None else zp.float().repeat_interleave(128, 1)[:, :k])) \
        * scale.float().repeat_interleave(128, 1)[:, :k]
    return t, dense


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k", [(24, 256), (13, 300), (9, 136)])
def test_compressed_tensors_load(tmp_path, symmetric, n, k):
    from safetensors.torch import load_file, save_file

    prefix = "model.layers.0.mlp.down_proj"
    tensors, dense = _ct_tensors(n, k, symmetric, seed=n + k)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_ct_config(symmetric)))
    config = json.loads((tmp_path / "config.json").read_text())
    lin = from_compressed_tensors(load_file(str(tmp_path / "model.safetensors")), prefix, config)
    assert isinstance(lin, Int4Linear) and lin.symmetric == symmetric
    assert (lin.in_features, lin.out_features) == (k, n)
    torch.testing.assert_close(lin.dequantize(), dense, rtol=0, atol=0)
    x = torch.randn(2, k)
    torch.testing.assert_close(lin(x), x @ dense.t(), rtol=1e-5, atol=1e-5)
    # accepts the bare quantization_config too
    lin2 = from_compressed_tensors(tensors, prefix, config["quantization_config"])
    assert torch.equal(lin2.qweight, lin.qweight)


def test_compressed_tensors_channel_strategy():
    n, k, prefix = 6, 256, "m.proj"
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (n, k), generator=g)
    scale = torch.rand(n, 1, generator=g) + 0.1
    t = {f"{prefix}.weight_packed": _ct_pack_rows(q + 8), f"{prefix}.weight_scale": scale,
         f"{prefix}.weight_shape": torch.tensor([n, k])}
    lin = from_compressed_tensors(t, prefix, _ct_config(strategy="channel", group_size=None))
    torch.testing.assert_close(lin.dequantize(), q.float() * scale, rtol=0, atol=0)


def test_compressed_tensors_refusals():
    prefix = "model.layers.0.mlp.down_proj"
    tensors, _ = _ct_tensors(16, 256, True)
    bad_configs = [
        _ct_config(group_size=64),
        _ct_config(fmt="int-quantized"),
        _ct_config(method="gptq"),
        _ct_config(num_bits=8),
        _ct_config(strategy="tensor"),
        _ct_config(ignore=[prefix]),
        _ct_config(ignore=["re:.*mlp.*"]),
        _ct_config(acts={"num_bits": 8, "type": "int"}),
        {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "config_groups": {"g": {"targets": ["re:.*self_attn.*"], "weights": {}}}}},
    ]
    for cfg in bad_configs:
        with pytest.raises(BlockspecError):
            from_compressed_tensors(tensors, prefix, cfg)
    assert int4.is_ignored("lm_head", _ct_config())
    assert not int4.is_ignored(prefix, _ct_config())
    cfg = _ct_config()
    for drop in ("weight_packed", "weight_scale", "weight_shape"):
        t = {k: v for k, v in tensors.items() if not k.endswith(drop)}
        with pytest.raises(BlockspecError):
            from_compressed_tensors(t, prefix, cfg)
    t = dict(tensors)
    t[f"{prefix}.weight_shape"] = torch.tensor([16, 300])  # inconsistent with the packed tensor
    with pytest.raises(BlockspecError):
        from_compressed_tensors(t, prefix, cfg)
    t = dict(tensors)
    t[f"{prefix}.weight_scale"] = tensors[f"{prefix}.weight_scale"][:, :1]
    with pytest.raises(BlockspecError):
        from_compressed_tensors(t, prefix, cfg)
    t = dict(tensors)
    t[f"{prefix}.weight_g_idx"] = torch.randperm(256).to(torch.int32) // 128
    with pytest.raises(BlockspecError):
        from_compressed_tensors(t, prefix, cfg)
    asym = _ct_config(symmetric=False)
    with pytest.raises(BlockspecError):  # asymmetric without zero points
        from_compressed_tensors(tensors, prefix, asym)


# ----------------------------------------------------------------------------------------------------------
# Kernel configurations (pure Python) and kernels through the interpreter
# ----------------------------------------------------------------------------------------------------------

SHAPES_27B = [(34816, 5120), (10240, 5120), (6144, 5120), (12288, 5120), (248320, 5120), (5120, 17408), (5120, 6144)]


def test_default_configs():
    for n, k in SHAPES_27B + [(33, 300)]:
        for bits, gs in ((4, 128), (8, 32), (8, 128)):
            for m in range(1, wq.MAX_KERNEL_ROWS + 1):  # every verification pass in one launch
                cfg = wq.default_config(m, n, k, bits, gs)
                assert cfg.block_m == max(8, 1 << (m - 1).bit_length()) and cfg.asm  # PTX unpacking: int4 and int8
                if m > 16 and (bits, gs) != (4, 128):  # a draft tree's pass: its x tile as tall as the pass
                    assert cfg == replace(wq.default_config(16, n, k, bits, gs), block_m=cfg.block_m)
                nblk = qm.padded_k(k, bits, gs) // qm.block_size(bits, gs)
                whole, split, bps = wq.schedule(cfg, n, nblk, 132)
                assert 1 <= split <= nblk and (split - 1) * bps < nblk <= split * bps  # no empty split
                assert 0 <= whole < -(-n // cfg.block_n) and (whole == 0 or split > 1)
    # the measured winners (H200, bench/quant_kernels.py --sweep): 64-row tiles, 2-3 stages, 16-row tiles from 9 rows
    cfg = wq.default_config(1, 34816, 5120)
    assert (cfg.block_n, cfg.stages, cfg.block_m) == (64, 3, 8)
    assert wq.default_config(8, 5120, 6144).stages == 2 and wq.default_config(4, 248320, 5120).stages == 3
    assert wq.schedule(wq.default_config(8, 5120, 17408), 5120, 34) == (0, 4, 9)
    cfg = wq.default_config(16, 248320, 5120)
    assert (cfg.block_n, cfg.stages, cfg.block_m) == (128, 3, 16)
    cfg = wq.default_config(16, 5120, 6144)  # mid-size rows at 9-16 rows: one wave of 3-stage programs
    assert (cfg.stages, cfg.block_m, wq.schedule(cfg, 5120, 12)) == (3, 16, (0, 2, 6))
    cfg = wq.default_config(16, 5120, 17408)  # down: the 8-row schedule, its 16-row tile as two 8-row dots
    assert cfg.dot_rows == 8 and cfg.stages == 3 and wq.schedule(cfg, 5120, 34) == wq.schedule(
        wq.default_config(8, 5120, 17408), 5120, 34)
    assert wq.default_config(16, 5120, 17408, 8, 128).dot_rows == 0  # 8-bit codes: one wgmma dot
    cfg = wq.default_config(16, 34816, 5120)  # gate_up: ~2 waves, the short last round balanced
    assert (cfg.waves, cfg.balance, cfg.dot_rows) == (2, True, 0)
    # a draft tree's 17..32 rows: 2 stages, down ~3 waves, o ~4, gate_up's last round balanced; 33..64 rows: 3
    # stages, one wave
    assert wq.schedule(wq.default_config(17, 5120, 17408), 5120, 34) == (0, 5, 7)
    assert wq.schedule(wq.default_config(32, 5120, 6144), 5120, 12) == (0, 6, 2)
    assert wq.schedule(wq.default_config(32, 34816, 5120), 34816, 10) == (528, 3, 4)
    assert wq.schedule(wq.default_config(32, 16480, 5120), 16480, 10) == (0, 1, 10)
    assert wq.default_config(17, 34816, 5120).stages == 2 and wq.default_config(33, 34816, 5120).stages == 3
    assert wq.default_config(33, 5120, 17408) == wq.KernelConfig(64, 64, 4, 3, 2, True, True, dot_rows=32)  # down
    assert wq.default_config(33, 34816, 5120).dot_rows == 0
    assert wq.default_config(33, 248320, 5120).block_n == 64 and wq.default_config(17, 248320, 5120).warps == 8


def test_balanced_schedule():
    # gate_up's 544 tiles of 64 rows over 132 SMs: 4 whole rounds, the last 16 tiles split into 5 ranges of 4 blocks
    # (e4m3: 20 blocks) or 3 of <= 4 (int4: 10): the busiest SM streams 84 (44) blocks instead of 100 (50)
    assert wq.schedule(wq.default_config(1, 34816, 5120, 8), 34816, 20) == (528, 5, 4)
    assert wq.schedule(wq.default_config(1, 34816, 5120), 34816, 10) == (528, 3, 4)
    assert wq.schedule(wq.default_config(1, 14336, 5120, 8), 14336, 20) == (0, 1, 20)  # FP8 qkv: a long last round
    assert wq.schedule(wq.default_config(1, 16480, 5120, 8), 16480, 20) == (0, 1, 20)  # 258 tiles: nothing to gain
    assert wq.schedule(wq.default_config(1, 33792, 5120, 8), 33792, 20) == (0, 1, 20)  # whole rounds only
    assert wq.schedule(wq.default_config(1, 248320, 5120, 8), 248320, 20) == (0, 1, 20)  # many rounds: dynamic
    unbalanced = wq.KernelConfig(64, 8, 4, 3, 1)
    assert wq.schedule(unbalanced, 34816, 20) == (0, 1, 20)
    assert wq.default_config(1, 34816, 5120, 8, 32).block_n == 64  # int8 drafter gate_up; its qkv: 128
    assert wq.default_config(1, 6144, 5120, 8, 32).block_n == 128


def _kernel_cases():
    """(name, m, n, k, bits, gs, symmetric, x dtype, config or None = default / chunked / dense path)."""
    K = wq.KernelConfig
    f32, bf16 = torch.float32, torch.bfloat16
    return [
        ("m1 split", 1, 37, 1100, 4, 128, True, f32, K(16, 8, 4, 2, 64)),
        ("m1 bf16 odd", 1, 40, 300, 4, 128, True, bf16, K(32, 8, 4, 3, 1)),
        ("m3 asym split", 3, 50, 1100, 4, 128, False, bf16, K(16, 8, 4, 2, 64)),
        ("m8 asym", 8, 19, 520, 4, 128, False, f32, K(16, 8, 4, 2, 1)),
        ("m16 split", 16, 70, 1030, 4, 128, True, bf16, K(32, 16, 4, 2, 64)),
        ("m12 asym g64", 12, 33, 200, 4, 64, False, f32, K(16, 16, 4, 2, 64)),
        # a 16-row tile as two 8-row dots (dot_rows 8): rows past 8 come from the second dot
        ("m16 two dots split", 16, 70, 1030, 4, 128, True, bf16, K(32, 16, 4, 2, 64, dot_rows=8)),
        ("m11 two dots asym odd", 11, 33, 200, 4, 64, False, f32, K(16, 16, 4, 2, 1, dot_rows=8)),
        ("int8 g32 m13 two dots", 13, 21, 100, 8, 32, True, f32, K(16, 16, 4, 2, 1, dot_rows=8)),
        ("int8 g32 m1 split", 1, 33, 260, 8, 32, True, bf16, K(16, 8, 4, 2, 64)),
        ("int8 g32 m16", 16, 21, 100, 8, 32, True, f32, K(16, 16, 4, 2, 1)),
        ("int8 g128 m3 split", 3, 24, 700, 8, 128, True, f32, K(16, 8, 4, 2, 64)),
        ("m17 asym split", 17, 30, 1100, 4, 128, False, bf16, K(16, 32, 4, 2, 64)),
        ("m33 g64", 33, 21, 200, 4, 64, True, f32, K(16, 64, 4, 2, 1)),
        ("m40 two 32-row dots split", 40, 30, 1100, 4, 128, False, bf16, K(16, 64, 4, 2, 64, dot_rows=32)),
        ("int8 g32 m64 split", 64, 19, 260, 8, 32, True, bf16, K(16, 64, 4, 2, 64)),
        # short groups' blocks 2 or 4 a step (blocks_per_step): 16 blocks of 64 inputs, split-K in whole steps
        ("int8 g32 m8 4 blocks a step", 8, 21, 1024, 8, 32, True, f32, K(16, 8, 4, 2, 1, blocks_per_step=4)),
        ("int8 g32 m3 4 blocks a step split", 3, 33, 1024, 8, 32, True, bf16, K(16, 8, 4, 2, 64, blocks_per_step=4)),
        ("int8 g32 m16 2 blocks a step", 16, 21, 1024, 8, 32, True, f32, K(16, 16, 4, 2, 1, blocks_per_step=2)),
        ("int4 g32 asym m5 4 blocks a step", 5, 19, 2048, 4, 32, False, f32, K(16, 8, 4, 2, 1, blocks_per_step=4)),
        ("int8 g32 m8 4 blocks a step unsplit", 8, 21, 1024, 8, 32, True, f32, K(16, 8, 4, 2, 0, blocks_per_step=4)),
        ("m40 default: one 64-row launch", 40, 20, 300, 4, 128, True, f32, None),
        ("m70 default: dequantize + linear", 70, 20, 300, 4, 128, True, f32, None),
        # 4 SMs (patched): 9 tiles of 16 rows, 8 blocks; 8 whole tiles, the 9th split in 2 ranges
        ("m2 balanced", 2, 144, 4096, 4, 128, False, bf16, K(16, 8, 4, 2, 1, True, True)),
    ]


def _run_kernel_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    patch_triton_interpreter()
    wq.sm_count = lambda device: 4  # so that a small shape has whole rounds of tiles and a rest to balance
    results = []
    for name, m, n, k, bits, gs, sym, xdt, cfg in _kernel_cases():
        g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
        w = torch.randn(n, k, generator=g) * 0.05
        lin = Int4Linear.from_float(w, gs, sym) if bits == 4 else Int8Linear.from_float(w, gs)
        pw = lin.packed()
        x = torch.randn(m, k, generator=g).to(xdt)
        ref = qm.reference_matmul(x.float(), pw)
        y = wq.wq_matmul(x, pw, cfg)
        y2 = wq.wq_matmul(x, pw, cfg)
        row0 = wq.wq_matmul(x[:1], pw, cfg)  # one row alone: the same config, so the same bits
        err = float((y.float() - ref).abs().max())
        scale = float(ref.abs().max())
        # bf16 output: the interpreter truncates fp32 -> bf16 (up to one ulp, 2**-7 relative; the GPU rounds)
        tol = (1e-5 if xdt == torch.float32 else 8e-3) * scale + 1e-5
        counters = kernels._COUNTERS.get(("cpu", None))
        # a wider step goes through the same blocks in the same order: bit for bit the one-block steps' result
        # where the schedule is the same (unsplit tiles)
        one_step = cfg is None or cfg.blocks_per_step == 1 or cfg.waves == 64 or \
            bool(torch.equal(y, wq.wq_matmul(x, pw, replace(cfg, blocks_per_step=1))))
        results.append({"name": name, "err": err, "tol": tol, "same": bool(torch.equal(y, y2)), "one_step": one_step,
                        "row0": cfg is None or bool(torch.equal(y[:1], row0)), "dtype": str(y.dtype),
                        "counters_clean": counters is None or int(counters.abs().sum()) == 0,
                        "whole": wq.schedule(cfg, n, pw.q.shape[1] // gs, 4)[0] if cfg else 0})
    print("RESULTS " + json.dumps(results))


def test_kernels_match_reference_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results) == len(_kernel_cases())
    for r in results:
        assert r["err"] <= r["tol"], r
        assert r["same"] and r["row0"], r  # deterministic, including split-K; a row does not depend on the others
        assert r["one_step"], r
        assert r["counters_clean"], r
    assert [r["whole"] for r in results if r["name"] == "m2 balanced"] == [8]  # whole tiles and split ones


def test_cpu_forward_does_not_need_triton_kernels():
    lin = Int4Linear.from_float(torch.randn(8, 128))
    assert not wq.kernels_available("cpu") or os.environ.get("TRITON_INTERPRET") == "1"
    assert lin(torch.randn(2, 128)).shape == (2, 8)


if __name__ == "__main__":
    _run_kernel_cases()
