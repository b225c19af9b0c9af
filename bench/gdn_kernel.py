"""The short-pass DeltaNet kernel (blockspec/kernels/gdn_triton.py) on Qwen3.5-27B's shapes (16 key heads, 48 value
heads, 128 x 128 state per head, bf16 activations): microseconds per layer for each (BLOCK_V, num_warps) at 1 and 8
tokens (48 layers back to back in one CUDA graph, median of replays), against the state's bytes (read + write).
Usage (GPU): python bench/gdn_kernel.py; JSON to $OUT/gdn_kernel.json.
"""

import json
import os

import torch
from timing import replay_ms  # bench/timing.py, beside this script

from blockspec.kernels.gdn_triton import gated_delta_short

HK, DK, HV, DV, LAYERS = 16, 128, 48, 128, 48


def main():
    dev = torch.device("cuda")
    shape = (HK, DK, HV, DV)
    states = [torch.randn(HV, DK, DV, device=dev) * 0.01 for _ in range(LAYERS)]
    finals = [torch.empty_like(s) for s in states]
    a_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, device=dev)
    state_bytes = 2 * HV * DK * DV * 4
    results = {}
    for t in (1, 8):
        mixed = torch.randn(t, 2 * HK * DK + HV * DV, device=dev, dtype=torch.bfloat16)
        b, a = (torch.randn(t, HV, device=dev, dtype=torch.bfloat16) for _ in range(2))
        gates = ("ab", b, a, a_log, dt_bias)
        reference = gated_delta_short(mixed, states[0], finals[0], shape, gates, out_dtype=torch.bfloat16)
        for block_v in (8, 16, 32):
            for warps in (1, 2, 4):
                def run(bv=block_v, w=warps):
                    return [gated_delta_short(mixed, s, f, shape, gates, out_dtype=torch.bfloat16, block_v=bv,
                                              num_warps=w) for s, f in zip(states, finals)]
                err = (run()[0].float() - reference.float()).abs().max().item()
                us = replay_ms(run) * 1e3 / LAYERS
                key = f"T={t} BLOCK_V={block_v} warps={warps}"
                results[key] = {"us_per_layer": round(us, 2), "state_gb_s": round(state_bytes / us / 1e3, 1),
                                "max_err": err}
                print(f"{key:28s} {us:7.2f} us/layer  {state_bytes / us / 1e3:7.1f} GB/s of state  err {err:.1e}",
                      flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gdn_kernel.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
