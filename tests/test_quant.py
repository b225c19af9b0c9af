"""Weight-only quantization: RTN error bounds, planar packing, compressed-tensors loading, refusals, and the
Triton kernels against the reference (through the Triton interpreter, in a subprocess, when triton is installed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.errors import BlockspecError
from blockspec.quant import int4, int8
from blockspec.quant import w4a16_triton as wq
from blockspec.quant.int4 import Int4Linear, from_compressed_tensors
from blockspec.quant.int8 import Int8Linear

ROOT = Path(__file__).resolve().parent.parent


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
# Planar layout and modules
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,gs,k", [(4, 128, 300), (4, 128, 128), (4, 64, 70), (4, 32, 33), (8, 32, 45), (8, 128, 260)])
def test_planar_pack_roundtrip_and_layout(bits, gs, k):
    g = torch.Generator().manual_seed(bits * 1000 + k)
    codes = torch.randint(0, 1 << bits, (5, k), generator=g, dtype=torch.int32)
    words = wq.pack_planar(codes, bits, gs)
    planes, wb = wq.layout_geometry(bits, gs)
    assert words.dtype == torch.int32 and words.shape == (5, wq.padded_k(k, gs) // planes)
    assert torch.equal(wq.unpack_planar(words, bits, gs, k), codes)
    # the documented bit position of a few elements: bits [b*p, b*p+b) of word g*WB + j  <->  k = g*G + p*WB + j
    for kk in (0, 1, wb, k - 1):
        grp, r = divmod(kk, gs)
        p, j = divmod(r, wb)
        word = int(words[2, grp * wb + j]) & 0xFFFFFFFF
        assert (word >> (bits * p)) & ((1 << bits) - 1) == int(codes[2, kk])


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
    assert lin.weight_bytes() == 12 * 96 + 12 * 3 * 2


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
        wq.layout_geometry(3, 128)
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


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 100])
def test_configs_valid(m):
    for n, k in SHAPES_27B + [(33, 300)]:
        for bits, gs in ((4, 128), (8, 32)):
            cfgs = wq.candidate_configs(m, n, k, bits, gs, 132) + [wq.default_config(m, n, k, bits, gs, 132)]
            assert cfgs
            for cfg in cfgs:
                wq._check_config(cfg, m, bits, gs)
                assert cfg.split_k >= 1
                if cfg.kind == "fma":
                    assert cfg.block_m >= m or m > 4
    # small N with long K is split so the GPU fills up
    assert wq.default_config(1, 5120, 17408, 4, 128, 132).split_k > 1
    assert wq.default_config(1, 248320, 5120, 4, 128, 132).split_k == 1


def _kernel_cases():
    """(name, m, n, k, bits, gs, symmetric, x dtype, config) run under the interpreter."""
    K = wq.KernelConfig
    f32, bf16 = torch.float32, torch.bfloat16
    return [
        ("fma m1", 1, 40, 300, 4, 128, True, f32, K("fma", 1, 32, 32, 1)),
        ("fma m1 bf16 split", 1, 37, 520, 4, 128, True, bf16, K("fma", 1, 16, 16, 3)),
        ("fma m2 asym split", 2, 50, 1000, 4, 128, False, f32, K("fma", 2, 16, 32, 3)),
        ("fma m3 asym", 3, 19, 256, 4, 128, False, bf16, K("fma", 4, 16, 16, 1)),
        ("fma m4 two m-tiles", 7, 24, 384, 4, 128, True, f32, K("fma", 4, 16, 32, 2)),
        ("dot m5", 5, 40, 300, 4, 128, True, f32, K("dot", 16, 16, 16, 1)),
        ("dot m16 asym split", 16, 70, 520, 4, 128, False, bf16, K("dot", 16, 32, 16, 2)),
        ("dot m20 int8", 20, 33, 260, 8, 32, True, f32, K("dot", 16, 16, 8, 2)),
        ("fma m1 int8 split", 1, 33, 260, 8, 32, True, bf16, K("fma", 1, 16, 16, 2)),
        ("fma m4 g64", 4, 33, 200, 4, 64, True, f32, K("fma", 4, 16, 16, 1)),
    ]


def _run_kernel_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    import triton.runtime.interpreter as interp

    # numpy >= 2 refuses int() of a 1-element array; the interpreter's program ids are such arrays
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    results = []
    for name, m, n, k, bits, gs, sym, xdt, cfg in _kernel_cases():
        g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
        w = torch.randn(n, k, generator=g) * 0.05
        cls = Int4Linear if bits == 4 else Int8Linear
        lin = cls.from_float(w, gs, sym) if bits == 4 else cls.from_float(w, gs)
        pw = lin.packed()
        x = (torch.randn(m, k, generator=g)).to(xdt)
        ref = x.float() @ pw.dequantize(torch.float32).t()
        y = wq.wq_matmul(x, pw, cfg)
        y2 = wq.wq_matmul(x, pw, cfg)
        err = float((y.float() - ref).abs().max())
        scale = float(ref.abs().max())
        tol = (1e-5 if xdt == torch.float32 else 8e-3) * scale + 1e-5
        counters = wq._COUNTERS.get(("cpu", None))
        results.append({"name": name, "err": err, "tol": tol, "same": bool(torch.equal(y, y2)),
                        "dtype": str(y.dtype), "counters_clean": counters is None or int(counters.abs().sum()) == 0})
    print("RESULTS " + json.dumps(results))


def test_kernels_match_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, __file__], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    assert len(results) == len(_kernel_cases())
    for r in results:
        assert r["err"] <= r["tol"], r
        assert r["same"], r  # deterministic, including split-K
        assert r["counters_clean"], r


def test_cpu_forward_does_not_need_triton_kernels():
    lin = Int4Linear.from_float(torch.randn(8, 128))
    assert not wq.kernels_available("cpu") or os.environ.get("TRITON_INTERPRET") == "1"
    assert lin(torch.randn(2, 128)).shape == (2, 8)


if __name__ == "__main__":
    _run_kernel_cases()
