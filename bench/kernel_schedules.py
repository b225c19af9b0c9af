"""How the W4A16 / W8A16 kernel's launch schedule (kernels/quant_matmul_triton.py: `schedule`) times on the 27B's
projections, FP8 (e4m3, 128 x 128 blocks) and INT4 (group 128), at 1 and 8 rows: the default config against the same
config without balancing (cfg.balance off) and, for FP8's wide outputs, against K split to ~2 waves (the schedule
before FP8 kept them unsplit). For each: us per launch, GB/s of the bytes read, (whole tiles, split, blocks per
split), and the largest difference from the default's float32 output (only the summation order changes). Weight
copies > 400 MB in one CUDA graph, median of replays (bench/timing.py). Also the time of gate_up-shaped FP8
launches of 2, 3 and 4 whole tiles per SM (16896, 25344, 33792 outputs): the slope is the streaming rate, the
intercept a launch's fixed cost. The machine's read bandwidth first (H200s of one pool differ by up to 15 %).

Usage (GPU, from bench/; ~1 minute on an H200): python kernel_schedules.py; JSON to $OUT/kernel_schedules.json.
CPU dry run (one tiny shape, untimed, no bandwidth): TRITON_INTERPRET=1 python kernel_schedules.py --dry-run
"""

import json
import os
import sys
from dataclasses import replace

import torch
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.bench import measure_read_bandwidth
from blockspec.quant.fp8 import Fp8Linear, quantize
from blockspec.quant.int4 import Int4Linear
from blockspec.kernels.quant_matmul_triton import default_config, schedule, sm_count, wq_matmul

SHAPES = {"gate_up": (34816, 5120), "gdn_in": (16480, 5120), "qkv": (14336, 5120), "down": (5120, 17408),
          "out": (5120, 6144)}
ROUND_SHAPES = (16896, 25344, 33792)  # gate_up-shaped FP8, 2 / 3 / 4 tiles of 64 rows per SM of 132
ROUND_K, BYTES_TIMED, ROWS = 5120, 400_000_000, (1, 8)


def weights(kind, n, k, device):
    w = torch.randn(n, k, device=device) * k ** -0.5
    copies = max(2, -(-BYTES_TIMED // (n * k // (1 if kind == "fp8" else 2))))
    if kind == "fp8":
        return [Fp8Linear.from_blocks(*quantize(w)).packed() for _ in range(copies)]
    return [Int4Linear.from_float(w, 128, True, scale_dtype=torch.bfloat16).packed() for _ in range(copies)]


def timed(x, packed, cfg):
    us = replay_ms(lambda: [wq_matmul(x, w, cfg) for w in packed]) * 1e3 / len(packed)
    nblk = packed[0].q.shape[1] // packed[0].group_size
    return {"us": round(us, 2), "gb_s": round(packed[0].nbytes() / us / 1e3),
            "schedule": schedule(cfg, packed[0].n, nblk, sm_count(x.device)), "config": cfg.short()}


def main():
    global SHAPES, ROUND_SHAPES, ROUND_K, BYTES_TIMED, ROWS
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if "--dry-run" in sys.argv:
        dev, dtype = dry_run(), torch.float32
        SHAPES, ROUND_SHAPES, ROUND_K, BYTES_TIMED, ROWS = {"tiny": (200, 640)}, (136,), 384, 0, (1,)
    bandwidth = measure_read_bandwidth(dev) or 0.0  # none on the CPU
    print(f"read bandwidth {bandwidth:.0f} GB/s", flush=True)
    results = [{"read_bandwidth_gb_s": round(bandwidth)}]
    for kind in ("fp8", "int4"):
        bits = 8 if kind == "fp8" else 4
        for name, (n, k) in SHAPES.items():
            packed = weights(kind, n, k, dev)
            for m in ROWS:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                base = default_config(m, n, k, bits)
                variants = {"default": base, "unbalanced": replace(base, balance=False)}
                if kind == "fp8" and base.waves == 1:
                    variants["split to ~2 waves"] = replace(base, balance=False, waves=2)
                reference = wq_matmul(x, packed[0], base, out_dtype=torch.float32)
                row = {"kind": kind, "shape": name, "rows": m}
                for label, cfg in variants.items():
                    row[label] = timed(x, packed, cfg)
                    row[label]["max_diff"] = float((wq_matmul(x, packed[0], cfg, out_dtype=torch.float32)
                                                    - reference).abs().max())
                results.append(row)
                print(f"{kind:4s} {name:8s} M={m}  " + "   ".join(
                    f"{label} {r['us']:6.2f} us {r['gb_s']:5d} GB/s {tuple(r['schedule'])}"
                    for label, r in row.items() if isinstance(r, dict)), flush=True)
            packed.clear()
    for n in ROUND_SHAPES:
        packed = weights("fp8", n, ROUND_K, dev)
        x = torch.randn(1, ROUND_K, device=dev, dtype=dtype)
        r = timed(x, packed, default_config(1, n, ROUND_K, 8))
        results.append({"kind": "fp8", "shape": f"gate_up rows {n}", "rows": 1, "default": r})
        print(f"fp8  {n} x {ROUND_K} M=1  {r['us']:6.2f} us {r['gb_s']:5d} GB/s {tuple(r['schedule'])}", flush=True)
        packed.clear()
    with open(os.path.join(os.environ.get("OUT", "."), "kernel_schedules.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
