"""The one-launch layer tail (blockspec/quant/w4a16_triton.py: `wq_layer_tail`: out projection with the post-mixer
norm begun, SwiGLU gate_up, down projection with the next norm begun) against its three launches, on the 27B's
shapes, FP8 (e4m3, 128 x 128 blocks) and INT4 (group 128), at 1 and 8 rows, without and with PDL (level 3, the
engine's default for quantized targets), and for FP8 at one row the L2 prefetch budget between phases. LAYERS
distinct layers' weights back to back in one CUDA graph (so none stays in L2), median of replays (bench/timing.py):
us per layer, GB/s of the bytes read, whether both give the same bits. The machine's read bandwidth first.

Usage (GPU, from bench/; ~1 minute on an H200): python layer_tail.py; JSON to $OUT/layer_tail.json.
"""

import json
import os

import torch
from timing import replay_ms  # bench/timing.py, beside this script

from blockspec.bench import measure_read_bandwidth
from blockspec.kernels import KernelSettings, use
from blockspec.quant import w4a16_triton as wq
from blockspec.quant.fp8 import Fp8Linear, quantize
from blockspec.quant.int4 import Int4Linear

LAYERS = 6
HIDDEN, INTER, MIXED = 5120, 17408, 6144  # DeltaNet out projection: 6144 inputs


def packed(kind, n, k, device):
    w = torch.randn(n, k, device=device) * k ** -0.5
    if kind == "fp8":
        return Fp8Linear.from_blocks(*quantize(w)).packed()
    return Int4Linear.from_float(w, 128, True, scale_dtype=torch.bfloat16).packed()


def main():
    dev = torch.device("cuda")
    bandwidth = measure_read_bandwidth(dev)
    print(f"read bandwidth {bandwidth:.0f} GB/s", flush=True)
    results = [{"read_bandwidth_gb_s": round(bandwidth)}]
    norm = [0.3 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    for kind in ("fp8", "int4"):
        layers = [(packed(kind, HIDDEN, MIXED, dev), packed(kind, 2 * INTER, HIDDEN, dev),
                   packed(kind, HIDDEN, INTER, dev)) for _ in range(LAYERS)]
        layer_bytes = sum(p.nbytes() for p in layers[0])

        def three(x, res):
            for o, gu, d in layers:
                summed, rows, partials = wq.wq_matmul_add_norm(x, o, res, norm[0])
                out = wq.wq_matmul_add_norm(wq.wq_matmul_swiglu(rows, gu, rms=(partials, 1e-6)), d, summed, norm[1])
            return out

        def one(x, res):
            for o, gu, d in layers:
                out = wq.wq_layer_tail(x, o, res, norm[0], 1e-6, gu, d, norm[1])
            return out
        for level in (0, 3):
            with use(KernelSettings(pdl_level=level)):
                for m in (1, 8):
                    x = torch.randn(m, MIXED, device=dev, dtype=torch.bfloat16)
                    res = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
                    same = all(torch.equal(a, b) for a, b in zip(three(x, res), one(x, res)))
                    budgets = (0.0, 4.0, 16.0, 32.0) if (kind, m) == ("fp8", 1) else (wq.CHAIN_PREFETCH_MB,)
                    row = {"kind": kind, "rows": m, "pdl_level": level, "same_bits": same,
                           "three_launches_us": round(replay_ms(lambda: three(x, res)) * 1e3 / LAYERS, 2)}
                    default = wq.CHAIN_PREFETCH_MB
                    for mb in budgets:
                        wq.CHAIN_PREFETCH_MB = mb
                        row[f"one_launch_us prefetch {mb:g} MB"] = round(replay_ms(lambda: one(x, res)) * 1e3 / LAYERS, 2)
                    wq.CHAIN_PREFETCH_MB = default
                    row["programs"] = sorted(set(wq._RESIDENT.values()))
                    row["gb_s"] = {k: round(layer_bytes / v / 1e3) for k, v in row.items() if k.endswith("us")
                                   or "us prefetch" in k}
                    results.append(row)
                    print(json.dumps(row), flush=True)
        layers.clear()
    with open(os.path.join(os.environ.get("OUT", "."), "layer_tail.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
