"""Block-scaled FP8 projections (quant/fp8.py): the e4m3 bytes as codes of the W4A16 / W8A16 kernel's q16 layout
(kernels/quant_matmul.pack_e4m3), lossless for every byte; Fp8Linear's quantization and packing against the format's
reference (`dequantize`), including packed parts of sizes off the 128-row blocks; and the kernel on such packed
projections in the Triton interpreter (a subprocess) against that reference, split-K and not, rows independent of
the launch's row count."""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.quant.fp8 import Fp8Linear, dequantize, quantize
from blockspec.kernels.quant_matmul import pack_e4m3
from blockspec.kernels.quant_matmul_triton import KernelConfig, wq_matmul

CASES = [  # rows, part sizes (packed along the outputs), K, config
    (1, [200], 300, KernelConfig(64, 8, 4, 2, 1, False)),
    (5, [128, 70, 4, 4], 256, KernelConfig(32, 8, 4, 2, 8, False)),
    (16, [50], 520, KernelConfig(16, 16, 4, 2, 8, False)),
    (2, [144], 2048, KernelConfig(16, 8, 4, 2, 1, False, True)),  # 4 SMs (patched): 8 whole tiles, 1 split
    (4, [72], 2048, KernelConfig(32, 8, 4, 2, 2, False, blocks_per_step=2)),  # 2 blocks a step, 2 steps a program
]


def parts_of(sizes, k, seed):
    g = torch.Generator().manual_seed(seed)
    return [quantize(torch.randn(n, k, generator=g) * 0.1) for n in sizes]


def reference(x, parts):
    return torch.cat([x.float() @ dequantize(*p).t() for p in parts], dim=-1)


def _run_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    patch_triton_interpreter()
    from blockspec.kernels import quant_matmul_triton
    quant_matmul_triton.sm_count = lambda device: 4  # the balanced case: 9 tiles over 4 SMs
    results = []
    for m, sizes, k, cfg in CASES:
        parts = parts_of(sizes, k, m + k)
        module = Fp8Linear.concat([Fp8Linear.from_blocks(*p) for p in parts])
        x = torch.randn(m, k + 5, generator=torch.Generator().manual_seed(k))[:, :k]  # strided rows
        y = wq_matmul(x, module.packed(), cfg)
        first = wq_matmul(x[:1], module.packed(), cfg)
        whole, split, _ = quant_matmul_triton.schedule(cfg, module.out_features, module.qweight.shape[1] // 128, 4)
        results.append({"case": [m, sizes, k], "err": float((y - reference(x, parts)).abs().max()),
                        "row_independent": torch.equal(first[0], y[0]), "split": split, "whole": whole})
    print("RESULTS " + json.dumps(results))


def test_fp8_projections_in_the_q16_kernel_match_the_reference_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results) == len(CASES)
    for r in results:
        assert r["err"] < 1e-4 and r["row_independent"], r
    assert max(r["split"] for r in results) > 1 and min(r["split"] for r in results) == 1  # both paths exercised
    assert results[3]["whole"] == 8 and results[3]["split"] == 2  # whole tiles and split ones in one launch


def test_fp8_quantize_and_packing_on_the_reference_path():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    per_input = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert ((q.float() * per_input - w).abs() <= w.abs() / 16 + per_input * 2 ** -9).all()  # 3 mantissa bits
    parts = [quantize(w[:70]), quantize(w[70:])]
    joined = Fp8Linear.concat([Fp8Linear.from_blocks(*p) for p in parts])  # the second part starts off the grid
    assert torch.equal(joined.dequantize(), torch.cat([dequantize(*p) for p in parts]))
    assert torch.equal(joined.codes().view(torch.uint8), torch.cat([p[0] for p in parts]).view(torch.uint8))
    x = torch.randn(3, 300)
    torch.testing.assert_close(joined(x), reference(x, parts), rtol=1e-6, atol=1e-5)
    assert torch.equal(joined.dequantize(rows=torch.tensor([5, 150])), joined.dequantize()[[5, 150]])
    assert joined.weight_bytes() == 200 * 512 + 4 * 200 * 4  # K padded to 512 (2 blocks of 256), a scale per 128


def test_e4m3_codes_cover_every_byte():
    """All 254 finite e4m3 values (and both zeros) round-trip through the q16 layout exactly, with their block's
    scale."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()].repeat(130, 1)
    weight, scale = codes.view(torch.float8_e4m3fn), torch.tensor([[0.5, 2.0], [4.0, 0.25]])
    expected = dequantize(weight, scale)
    assert torch.equal(pack_e4m3(weight, scale).dequantize(), expected)
    assert torch.equal(Fp8Linear.from_blocks(weight, scale).dequantize(), expected)


if __name__ == "__main__":
    _run_cases()
