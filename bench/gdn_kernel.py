"""The short-pass DeltaNet kernels (blockspec/kernels/gdn_triton.py) on Qwen3.5-27B's shapes (16 key heads, 48 value
heads, 128 x 128 state per head, bf16 activations), microseconds per layer at 1 and 8 tokens (48 layers back to back
in one CUDA graph, median of replays):
  - the recurrence alone for each (BLOCK_V, num_warps), against the state's bytes (read + write);
  - the layer's mixer as three launches (conv, recurrence, gated norm) against one (`short_pass`) per config;
  - the conv kernel alone for each channel block (BLOCK_C) and num_warps.
Usage (GPU; under a minute on an H200): python bench/gdn_kernel.py [--parts recurrence,mixer,conv]; JSON to
$OUT/gdn_kernel.json.
"""

import json
import os
import sys

import torch
from timing import replay_ms  # bench/timing.py, beside this script

from blockspec.kernels.gdn_triton import causal_conv1d, gated_delta_short, short_pass
from blockspec.kernels.norm_triton import gated_rms_norm_rows

HK, DK, HV, DV, LAYERS, TAPS = 16, 128, 48, 128, 48, 4
CHANNELS = 2 * HK * DK + HV * DV


def main(parts):
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    shape = (HK, DK, HV, DV)
    states = [torch.randn(HV, DK, DV, device=dev) * 0.01 for _ in range(LAYERS)]
    finals = [torch.empty_like(s) for s in states]
    histories = [torch.randn(TAPS - 1, CHANNELS, device=dev, dtype=bf16) for _ in range(LAYERS)]
    conv_w = torch.randn(CHANNELS, 1, TAPS, device=dev, dtype=bf16) * 0.3
    norm_w = torch.randn(DV, device=dev, dtype=bf16)
    a_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, device=dev)
    state_bytes = 2 * HV * DK * DV * 4
    results = {}

    def report(key, us, err, extra=""):
        results[key] = {"us_per_layer": round(us, 2), "max_err": err}
        print(f"{key:40s} {us:7.2f} us/layer  {extra}err {err:.1e}", flush=True)

    for t in (1, 8):
        proj = torch.randn(t, CHANNELS + 2 * HV * DV, device=dev, dtype=bf16)  # qkv | z | (b, a) as in the pack
        x, z = proj[:, :CHANNELS], proj[:, CHANNELS:CHANNELS + HV * DV].view(t, HV, DV)
        b, a = proj[:, -2 * HV:-HV], proj[:, -HV:]
        gates = ("ab", b, a, a_log, dt_bias)
        windows = [torch.empty(TAPS - 1 + t, CHANNELS, device=dev, dtype=bf16) for _ in range(LAYERS)]
        mixeds = [torch.empty(t, CHANNELS, device=dev, dtype=bf16) for _ in range(LAYERS)]
        mixed = causal_conv1d(x, histories[0], conv_w)[0]
        reference = gated_delta_short(mixed, states[0], finals[0], shape, gates, out_dtype=bf16)
        for block_c in (64, 128, 256, 512) if "conv" in parts else ():
            for warps in (1, 2, 4):
                def conv(bc=block_c, w=warps):
                    return [causal_conv1d(x, histories[i], conv_w, windows[i], mixeds[i], bc, w)[0]
                            for i in range(LAYERS)]
                err = (conv()[0].float() - mixed.float()).abs().max().item()
                report(f"T={t} conv BLOCK_C={block_c} warps={warps}", replay_ms(conv) * 1e3 / LAYERS, err)
        for block_v in (8, 16, 32) if "recurrence" in parts else ():
            for warps in (1, 2, 4):
                def run(bv=block_v, w=warps):
                    return [gated_delta_short(mixed, s, f, shape, gates, out_dtype=bf16, block_v=bv, num_warps=w)
                            for s, f in zip(states, finals)]
                err = (run()[0].float() - reference.float()).abs().max().item()
                us = replay_ms(run) * 1e3 / LAYERS
                report(f"T={t} recurrence BLOCK_V={block_v} warps={warps}", us, err,
                       f"{state_bytes / us / 1e3:7.1f} GB/s of state  ")

        def three(layers=range(LAYERS)):
            outs = []
            for i in layers:
                m, _ = causal_conv1d(x, histories[i], conv_w, windows[i], mixeds[i])
                o = gated_delta_short(m, states[i], finals[i], shape, gates, out_dtype=bf16)
                outs.append(gated_rms_norm_rows(o, z, norm_w, 1e-6))
            return outs
        if "mixer" not in parts:
            continue
        mixer_ref = three()[0].float()
        report(f"T={t} mixer, three launches", replay_ms(three) * 1e3 / LAYERS, 0.0)
        for block_v in (8, 16, 32):
            for warps in (1, 2, 4):
                def one(bv=block_v, w=warps):
                    return [short_pass(x, histories[i], conv_w, gates, states[i], finals[i], shape, z, norm_w, 1e-6,
                                       windows[i], mixeds[i], block_v=bv, num_warps=w)[0] for i in range(LAYERS)]
                err = (one()[0].float() - mixer_ref).abs().max().item()
                report(f"T={t} mixer, one launch BLOCK_V={block_v} warps={warps}", replay_ms(one) * 1e3 / LAYERS, err)
    with open(os.path.join(os.environ.get("OUT", "."), "gdn_kernel.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main(sys.argv[sys.argv.index("--parts") + 1] if "--parts" in sys.argv else "recurrence,mixer,conv")
