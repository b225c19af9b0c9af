"""The residual add + RMSNorm kernel (blockspec/kernels/norm_triton.py) at the 27B width (5120, bf16): microseconds
per call for each num_warps at 1 and 8 rows (129 calls back to back in one CUDA graph, as in one decode step;
median of replays). Usage (GPU; ~20 s on an H200): python bench/norm_kernel.py; JSON to $OUT/norm_kernel.json.
CPU dry run (tiny width, 2 calls, untimed): TRITON_INTERPRET=1 python bench/norm_kernel.py --dry-run
"""

import json
import os
import sys

import torch
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.kernels.norm_triton import add_rms_norm_rows, norm_warps

WIDTH, CALLS = 5120, 129


def main():
    global WIDTH, CALLS
    dev, dtype, warp_counts = torch.device("cuda"), torch.bfloat16, (1, 2, 4, 8, 16)
    if "--dry-run" in sys.argv:
        dev, dtype, warp_counts = dry_run(), torch.float32, (1, 16)
        WIDTH, CALLS = 64, 2
    weight = torch.randn(WIDTH, device=dev, dtype=dtype) * 0.1
    results = {}
    for rows in (1, 8):
        xs = [torch.randn(rows, WIDTH, device=dev, dtype=dtype) for _ in range(CALLS)]
        deltas = [torch.randn_like(x) for x in xs]
        for warps in warp_counts:
            def run(w=warps):
                return [add_rms_norm_rows(x, d, weight, 1e-6, num_warps=w) for x, d in zip(xs, deltas)]
            us = replay_ms(run) * 1e3 / CALLS
            key = f"rows={rows} warps={warps}{' (default)' if warps == norm_warps(8192) else ''}"
            results[key] = round(us, 2)
            print(f"{key:28s} {us:6.2f} us/call", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "norm_kernel.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
