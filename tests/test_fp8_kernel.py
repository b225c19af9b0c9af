"""Block-scaled FP8 projections: the Triton kernel (kernels/fp8_linear_triton.py) against its reference through the
Triton interpreter in a subprocess (split-K and not, partial blocks, packed parts of sizes off the 128-row blocks,
rows independent of the launch's row count), and Fp8Linear's quantization and packing on the reference path. The same
weights in the W4A16 kernel's q16 layout as e4m3 codes (quant/w4a16_triton.py: pack_e4m3): lossless, and the
kernel's plain unpacking of them against the same reference."""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec import kernels
from blockspec.kernels import fp8_linear_triton
from blockspec.kernels.fp8_linear import fp8_linear_reference
from blockspec.kernels.fp8_linear_triton import Fp8Config, fp8_matmul
from blockspec.quant.fp8 import Fp8Linear, quantize
from blockspec.quant.w4a16_triton import pack_e4m3, wq_matmul

CASES = [  # rows, part sizes (packed along the outputs), K, config (sms = 4: waves * 4 programs before K splits)
    (1, [200], 300, Fp8Config(64, waves=1)), (5, [128, 70, 4, 4], 256, Fp8Config(32, waves=4)),
    (16, [50], 520, Fp8Config(16, waves=8)), (8, [300], 128, Fp8Config(64, waves=2)),
]


def packed(sizes, k, seed):
    g = torch.Generator().manual_seed(seed)
    return Fp8Linear.concat([Fp8Linear.from_blocks(*quantize(torch.randn(n, k, generator=g) * 0.1)) for n in sizes])


def _run_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    patch_triton_interpreter()
    results = []
    for m, sizes, k, cfg in CASES:
        module = packed(sizes, k, m + k)
        x = torch.randn(m, k + 5, generator=torch.Generator().manual_seed(k))[:, :k]  # strided rows
        args = (module.weight, module.scale, module.scale_row)
        y = fp8_matmul(x, *args, config=cfg, sms=4)
        first = fp8_matmul(x[:1], *args, config=cfg, sms=4)
        split = fp8_linear_triton.split_blocks(-(-module.out_features // cfg.block_n), -(-k // 128),
                                               cfg.waves * 4)[0]
        reference = fp8_linear_reference(x, *args)
        q16 = pack_e4m3(*args)
        results.append({"case": [m, sizes, k], "err": float((y - reference).abs().max()),
                        "row_independent": torch.equal(first[0], y[0]), "split": split,
                        "counters_clean": int(kernels._COUNTERS[("cpu", None)].abs().sum()) == 0,
                        "q16_err": float((wq_matmul(x, q16) - reference).abs().max())})
    print("RESULTS " + json.dumps(results))


def test_fp8_kernel_matches_reference_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results) == len(CASES)
    for r in results:
        assert r["err"] < 1e-4 and r["q16_err"] < 1e-4 and r["row_independent"] and r["counters_clean"], r
    assert max(r["split"] for r in results) > 1 and min(r["split"] for r in results) == 1  # both paths exercised


def test_fp8_quantize_and_packing_on_the_reference_path():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    per_input = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert ((q.float() * per_input - w).abs() <= w.abs() / 16 + per_input * 2 ** -9).all()  # 3 mantissa bits
    parts = [Fp8Linear.from_blocks(*quantize(w[:70])), Fp8Linear.from_blocks(*quantize(w[70:]))]
    joined = Fp8Linear.concat(parts)  # the second part's blocks start at output 70, off the 128-row grid
    assert joined.scale.shape == (3, 3) and joined.scale_row.tolist() == [0] * 70 + [1] * 128 + [2] * 2
    x = torch.randn(3, 300)
    torch.testing.assert_close(joined(x), torch.cat([p(x) for p in parts], dim=1), rtol=1e-6, atol=1e-5)
    assert torch.equal(joined.dequantize(rows=torch.tensor([5, 150])), joined.dequantize()[[5, 150]])
    q16 = pack_e4m3(joined.weight, joined.scale, joined.scale_row)  # every e4m3 byte kept, the scales per row
    assert q16.codes == "e4m3" and torch.equal(q16.dequantize(), joined.dequantize())


def test_e4m3_codes_cover_every_byte():
    """All 254 finite e4m3 values (and both zeros) round-trip through the q16 layout exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()].repeat(2, 1)
    weight, scale = codes.view(torch.float8_e4m3fn), torch.tensor([[0.5, 2.0]])
    q16 = pack_e4m3(weight, scale, torch.zeros(2, dtype=torch.int32))
    expected = weight.float() * torch.where(torch.arange(weight.shape[1]) < 128, 0.5, 2.0)
    assert torch.equal(q16.dequantize(), expected)


if __name__ == "__main__":
    _run_cases()
