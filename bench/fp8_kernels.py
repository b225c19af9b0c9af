"""FP8 projections (quant/fp8.py: e4m3 codes in the W4A16 / W8A16 kernel's q16 layout, kernels/quant_matmul.py)
on the 27B's packed projection shapes at 1, 8 and 16 rows, against cuBLAS bf16 (F.linear) of the same shape: error
against the float32 reference, us per launch and GB/s of the bytes read (e4m3 codes + a float32 scale per output and
128 inputs; bf16: 2 bytes per weight), with the PTX unpacking (the engine's) and the plain Triton one. Weight copies
> 400 MB in one CUDA graph (no L2 reuse), median of replays. --sweep: tile widths and pipeline depths around the
default config at 1 and 16 rows. Usage (GPU; ~1 minute on an H200): python bench/fp8_kernels.py [--sweep]; JSON to
$OUT/fp8_kernels.json. CPU dry run (one tiny shape at 1 and 16 rows, untimed):
TRITON_INTERPRET=1 python bench/fp8_kernels.py --dry-run
"""

import itertools
import json
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.quant.fp8 import Fp8Linear, dequantize, quantize
from blockspec.kernels.quant_matmul_triton import default_config, wq_matmul

SHAPES = {"vocabulary head": (248320, 5120), "mlp gate_up": (34816, 5120), "gdn in (packed)": (16480, 5120),
          "mlp down": (5120, 17408), "attn qkv (packed)": (14336, 5120), "gdn out / attn o": (5120, 6144)}


def configs(m, n, k, sweep):
    base = default_config(m, n, k, 8, 128)
    yield base
    if sweep:
        # waves 8: the only way to split K for the 34816-output gate_up (544 tiles of 64 rows > 4 waves of 132)
        for bn, stages, waves in itertools.product((32, 64, 128), (2, 3, 4), (1, 2, 4, 8)):
            cfg = replace(base, block_n=bn, stages=stages, waves=waves)
            if cfg != base:
                yield cfg


def timed(x, weights, cfg):
    return replay_ms(lambda: [wq_matmul(x, w, cfg) for w in weights]) * 1e3 / len(weights)


def main(sweep=False, dry=False):
    dev, dtype, shapes, bytes_timed, rows = torch.device("cuda"), torch.bfloat16, SHAPES, 400_000_000, (1, 8, 16)
    if dry:  # the rows of both block_m
        dev, dtype, shapes, bytes_timed, rows = dry_run(), torch.float32, {"tiny": (200, 384)}, 0, (1, 16)
    results = {}
    for name, (n, k) in shapes.items():
        copies = max(2, -(-bytes_timed // (n * k)))
        blocks = quantize(torch.randn(n, k, device=dev) * k ** -0.5)
        weights = [Fp8Linear.from_blocks(*blocks).packed() for _ in range(copies)]
        reference = dequantize(*blocks)
        del blocks
        dense = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(max(2, copies // 2))]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = x.float() @ reference.t()
            cublas = replay_ms(lambda: [F.linear(x, d) for d in dense]) * 1e3 / len(dense)
            row = {"cublas_bf16_us": round(cublas, 2), "cublas_bf16_gb_s": round(n * k * 2 / cublas / 1e3)}
            text = f"{name:18s} M={m:2d}  cuBLAS bf16 {cublas:7.2f} us {row['cublas_bf16_gb_s']:5d} GB/s"
            for key, asm in (("fp8", True), ("fp8_plain", False)):
                if key == "fp8_plain" and sweep:
                    continue
                best = None
                for cfg in configs(m, n, k, sweep and asm and m in (1, 16)):
                    cfg = replace(cfg, asm=asm)
                    try:
                        err = float((wq_matmul(x, weights[0], cfg, out_dtype=torch.float32) - ref).abs().max()
                                    / ref.abs().max())
                        us = timed(x, weights, cfg)
                    except Exception as e:  # a config the compiler refuses (shared memory, tile shape)
                        print(f"  {name} M={m} {cfg.short()}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg, err)
                us, cfg, err = best
                row.update({f"{key}_us": round(us, 2), f"{key}_gb_s": round(weights[0].nbytes() / us / 1e3),
                            f"{key}_relative_err": err, f"{key}_config": cfg.short()})
                text += f"   {key} {us:7.2f} us {row[f'{key}_gb_s']:5d} GB/s [{cfg.short()}] err {err:.1e}"
            results[f"{name} M={m}"] = row
            print(text, flush=True)
        weights.clear()
        dense.clear()
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_kernels.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main("--sweep" in sys.argv, "--dry-run" in sys.argv)
