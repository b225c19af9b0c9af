"""The short-pass DeltaNet kernels (blockspec/kernels/gdn_triton.py) on Qwen3.5-27B's shapes (16 key heads, 48 value
heads, 128 x 128 state per head, bf16 activations), microseconds per layer at 1 and 8 tokens (48 layers back to back
in one CUDA graph, median of replays):
  - the recurrence alone for each (BLOCK_V, num_warps), against the state's bytes (read + write);
  - the layer's mixer as three launches (conv, recurrence, gated norm) against one (`short_pass`) per config;
  - the conv kernel alone for each channel block (BLOCK_C) and num_warps;
  - the draft-tree mixer (`tree_pass`: conv, then the closed-form recurrence + norm) at 9 nodes (the drafter's
    chain), 17, 33 and 64 (the closed form's matrices cover the T - 1 nodes below the root, padded to 16, 32, 64):
    the drafter's shape (its chain to depth 8, then nodes hanging best first, shallow ones first) and the comb (a
    spine of T/2 + 1 nodes with a leaf on each: as deep as a tree of T nodes with leaves gets), for each config
    (BV, warps, precision, key channels a load); each against the reference (max abs error of layer 0's output);
    then `keep_path` committing the root alone and the path to the deepest node from the pass's deltas (max abs
    error of the state against keep_path_reference), one launch a layer and every layer's in one launch (their
    buffers stacked), each (BV, warps) of PATH_CONFIGS at 17 drafted nodes.
Usage (GPU; under a minute on an H200 either way): python bench/gdn_kernel.py [--parts recurrence,mixer,conv] or
--parts tree; JSON to $OUT/gdn_kernel.json.
CPU dry run of the first three parts (tiny heads, one layer, each sweep's first config, untimed):
TRITON_INTERPRET=1 python bench/gdn_kernel.py --dry-run (the tree part's: tests/test_tree_gdn_kernel.py)
"""

import itertools
import json
import os
import sys

import torch
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.kernels import gdn
from blockspec.kernels.gdn_gates import GateProjections, deltanet_gates
from blockspec.kernels.gdn_triton import MAX_PATH, causal_conv1d, gated_delta_short, keep_path, short_pass, tree_pass
from blockspec.kernels.norm import gated_rms_norm_reference
from blockspec.kernels.norm_triton import gated_rms_norm_rows
from blockspec.layers.tree import TreeLayout

HK, DK, HV, DV, LAYERS, TAPS = 16, 128, 48, 128, 48, 4
CHANNELS = 2 * HK * DK + HV * DV
TREE_SIZES = (9, 17, 33, 64)
# (BV, warps, tl.dot's precision, key channels a load); tree_pass's default first
TREE_CONFIGS = ((64, 8, "tf32x3", 32), (64, 4, "tf32x3", 32), (128, 8, "tf32x3", 32), (32, 4, "tf32x3", 32),
                (64, 8, "tf32", 32), (128, 8, "tf32", 32), (64, 8, "tf32", 64), (64, 8, "tf32", 128),
                (64, 4, "tf32", 64), (32, 4, "tf32", 64), (32, 4, "tf32", 128))
# keep_path's (BV, warps), its default first; all at 17 drafted nodes, the default elsewhere
PATH_CONFIGS = ((16, 2), (16, 1), (32, 4), (32, 2), (64, 4), (16, 4), (64, 8), (128, 8))


def main(parts, dry=False):
    dev, bf16, shape, layers, sweep = torch.device("cuda"), torch.bfloat16, (HK, DK, HV, DV), LAYERS, None
    if dry:  # the interpreter: tiny heads, one layer, each sweep's first config, float32 (its bf16 is numpy's gap)
        dev, bf16, shape, layers, sweep = dry_run(), torch.float32, (2, 16, 4, 16), 1, 1
    hk, dk, hv, dv = shape
    channels = 2 * hk * dk + hv * dv
    states = [torch.randn(hv, dk, dv, device=dev) * 0.01 for _ in range(layers)]
    finals = [torch.empty_like(s) for s in states]
    histories = [torch.randn(TAPS - 1, channels, device=dev, dtype=bf16) for _ in range(layers)]
    conv_w = torch.randn(channels, 1, TAPS, device=dev, dtype=bf16) * 0.3
    norm_w = torch.randn(dv, device=dev, dtype=bf16)
    a_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
    state_bytes = 2 * hv * dk * dv * 4
    results = {}

    def report(key, us, err, extra=""):
        results[key] = {"us_per_layer": round(us, 2), "max_err": err}
        print(f"{key:40s} {us:7.2f} us/layer  {extra}err {err:.1e}", flush=True)

    for t in (1, 8) if any(part in parts for part in ("recurrence", "mixer", "conv")) else ():
        proj = torch.randn(t, channels + 2 * hv * dv, device=dev, dtype=bf16)  # qkv | z | (b, a) as in the pack
        x, z = proj[:, :channels], proj[:, channels:channels + hv * dv].view(t, hv, dv)
        b, a = proj[:, -2 * hv:-hv], proj[:, -hv:]
        gates = GateProjections(b, a, a_log, dt_bias)
        windows = [torch.empty(TAPS - 1 + t, channels, device=dev, dtype=bf16) for _ in range(layers)]
        mixeds = [torch.empty(t, channels, device=dev, dtype=bf16) for _ in range(layers)]
        mixed = causal_conv1d(x, histories[0], conv_w)[0]
        reference = gated_delta_short(mixed, states[0], finals[0], shape, gates, out_dtype=bf16)
        conv_configs = itertools.product((64, 128, 256, 512), (1, 2, 4)) if "conv" in parts else ()
        for block_c, warps in itertools.islice(conv_configs, sweep):
            def conv(bc=block_c, w=warps):
                return [causal_conv1d(x, histories[i], conv_w, windows[i], mixeds[i], bc, w)[0]
                        for i in range(layers)]
            err = (conv()[0].float() - mixed.float()).abs().max().item()
            report(f"T={t} conv BLOCK_C={block_c} warps={warps}", replay_ms(conv) * 1e3 / layers, err)
        recurrence_configs = itertools.product((8, 16, 32), (1, 2, 4)) if "recurrence" in parts else ()
        for block_v, warps in itertools.islice(recurrence_configs, sweep):
            def run(bv=block_v, w=warps):
                return [gated_delta_short(mixed, s, f, shape, gates, out_dtype=bf16, block_v=bv, num_warps=w)
                        for s, f in zip(states, finals)]
            err = (run()[0].float() - reference.float()).abs().max().item()
            us = replay_ms(run) * 1e3 / layers
            report(f"T={t} recurrence BLOCK_V={block_v} warps={warps}", us, err,
                   f"{state_bytes / us / 1e3:7.1f} GB/s of state  ")

        def three():
            outs = []
            for i in range(layers):
                m, _ = causal_conv1d(x, histories[i], conv_w, windows[i], mixeds[i])
                o = gated_delta_short(m, states[i], finals[i], shape, gates, out_dtype=bf16)
                outs.append(gated_rms_norm_rows(o, z, norm_w, 1e-6))
            return outs
        if "mixer" not in parts:
            continue
        mixer_ref = three()[0].float()
        report(f"T={t} mixer, three launches", replay_ms(three) * 1e3 / layers, 0.0)
        for block_v, warps in itertools.islice(itertools.product((8, 16, 32), (1, 2, 4)), sweep):
            def one(bv=block_v, w=warps):
                return [short_pass(x, histories[i], conv_w, gates, states[i], finals[i], shape, z, norm_w, 1e-6,
                                   windows[i], mixeds[i], block_v=bv, num_warps=w)[0] for i in range(layers)]
            err = (one()[0].float() - mixer_ref).abs().max().item()
            report(f"T={t} mixer, one launch BLOCK_V={block_v} warps={warps}", replay_ms(one) * 1e3 / layers, err)
    if "tree" in parts:  # its dry run: tests/test_tree_gdn_kernel.py
        trees(report, dev, bf16)
    with open(os.path.join(os.environ.get("OUT", "."), "gdn_kernel.json"), "w") as f:
        json.dump(results, f, indent=2)


def tree_parents(kind: str, t: int, gen) -> list:
    """parents (the root's 0): "drafted", the drafter's chain 0..8, then parents of depth < 8 drawn with weight
    2^-depth (best first takes the likelier, shallower alternatives first); "comb", a spine 0..T//2 with a leaf on
    each spine node in order."""
    if kind == "comb":
        spine = t // 2 + 1
        return [max(i - 1, 0) for i in range(spine)] + list(range(t - spine))
    parents = [max(i - 1, 0) for i in range(min(t, 9))]
    depth = list(range(len(parents)))
    while len(parents) < t:
        weights = torch.tensor([0.5 ** d if d < 8 else 0.0 for d in depth])
        parents.append(int(torch.multinomial(weights, 1, generator=gen)))
        depth.append(depth[parents[-1]] + 1)
    return parents


def trees(report, dev, dtype, shape=(HK, DK, HV, DV), layers=LAYERS, sizes=TREE_SIZES, configs=TREE_CONFIGS,
          path_configs=PATH_CONFIGS, timed=True):
    """The tree part (module docstring): each tree's inputs as a layer passes them, each config's tree_pass over
    `layers` layers (timed: in one CUDA graph). Untimed (the interpreter's dry run on the CPU), correctness only."""
    hk, dk, hv, dv = shape
    channels = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(hv, dk, dv, generator=gen).to(dev) * 0.01 for _ in range(layers)]
    histories = [torch.randn(TAPS - 1, channels, generator=gen).to(dev, dtype) for _ in range(layers)]
    conv_w = (torch.randn(channels, 1, TAPS, generator=gen) * 0.3).to(dev, dtype)
    norm_w = torch.randn(dv, generator=gen).to(dev, dtype)
    a_log, dt_bias = torch.randn(hv, generator=gen).to(dev), torch.randn(hv, generator=gen).to(dev)
    for t in sizes:
        for kind in ("drafted",) if t <= 9 else ("drafted", "comb"):
            parents = tree_parents(kind, t, gen)
            depth = [0] * t
            for i in range(1, t):
                depth[i] = depth[parents[i]] + 1
            children = [parents[1:].count(i) for i in range(t)]
            print(f"T={t} {kind}: depth {max(depth)}, {children.count(0)} leaves, "
                  f"{sum(c > 1 for c in children)} branching nodes", flush=True)
            parents = torch.tensor(parents, device=dev)
            tree = TreeLayout.build(parents, torch.tensor(depth, device=dev), 0, TAPS, max(depth))
            proj = torch.randn(t, channels + 2 * hv * dv, generator=gen).to(dev, dtype)  # qkv | z | (b, a)
            x, z = proj[:, :channels], proj[:, channels:channels + hv * dv].view(t, hv, dv)
            gates = GateProjections(proj[:, -2 * hv:-hv], proj[:, -hv:], a_log, dt_bias)
            windows = [torch.empty(TAPS - 1 + t, channels, device=dev, dtype=dtype) for _ in range(layers)]
            mixeds = [torch.empty(t, channels, device=dev, dtype=dtype) for _ in range(layers)]
            gate_bufs = [(torch.empty(t, hv, device=dev), torch.empty(t, hv, device=dev)) for _ in range(layers)]
            mixed, _ = gdn.causal_conv1d_tree_reference(x, histories[0], conv_w, tree.window_rows)
            g, beta = deltanet_gates.reference(gates.b, gates.a, gates.A_log, gates.dt_bias)
            reference, ref_deltas = gdn.gated_delta_tree_reference(*gdn.deltanet_qkv.reference(mixed, *shape), g, beta,
                                                                   states[0], parents)
            reference = gated_rms_norm_reference.reference(reference.to(dtype), z, norm_w, 1e-6).float()
            deltas = [torch.empty(t, hv, dv, device=dev) for _ in range(layers)]
            for block_v, warps, precision, block_k in configs:
                def run(bv=block_v, w=warps, p=precision, bk=block_k):
                    return [tree_pass(x, histories[i], conv_w, gates, states[i], shape, z, norm_w, 1e-6,
                                      tree.window_rows, tree.ancestors, tree.max_depth, windows[i], mixeds[i],
                                      gate_bufs[i], deltas[i], block_v=bv, num_warps=w, precision=p, block_k=bk)[0]
                            for i in range(layers)]
                err = (run()[0].float() - reference).abs().max().item()
                us = replay_ms(run) * 1e3 / layers if timed else float("nan")
                report(f"T={t} {kind} tree BLOCK_V={block_v} warps={warps} {precision} BLOCK_K={block_k}", us, err)
            deepest = max(range(t), key=depth.__getitem__)
            path = [deepest]
            while path[-1]:
                path.append(parents[path[-1]].item())
            for kept in ([0], path[::-1][:MAX_PATH]):  # a kept root, the deepest path (as much as a commit keeps)
                history_rows = tree.window_rows[kept[-1], 1:]
                kept = torch.tensor(kept, device=dev)
                want = states[0].clone()
                gdn.keep_path_reference(mixeds[0], gate_bufs[0][0], want, shape, kept, deltas[0], windows[0],
                                        history_rows, torch.empty_like(histories[0]))
                for block_v, warps in path_configs if (t, kind) == (17, "drafted") else path_configs[:1]:
                    copies = [s.clone() for s in states]
                    history_copies = [h.clone() for h in histories]
                    keep_path(mixeds[0], gate_bufs[0][0], copies[0], shape, kept, deltas[0], windows[0],
                              history_rows, history_copies[0], block_v, warps)
                    err = (copies[0] - want).abs().max().item()

                    def commit(n=kept, bv=block_v, w=warps):
                        for i in range(layers):
                            keep_path(mixeds[i], gate_bufs[i][0], copies[i], shape, n, deltas[i], windows[i],
                                      history_rows, history_copies[i], bv, w)
                    us = replay_ms(commit) * 1e3 / layers if timed else float("nan")
                    report(f"T={t} {kind} keep_path of {kept.shape[0]} nodes BLOCK_V={block_v} warps={warps}", us,
                           err)
                # the layers' buffers stacked (DecodeState's GDNStack): every layer's commit in one launch
                stacked = [torch.stack(b) for b in (mixeds, [gb[0] for gb in gate_bufs], states, deltas, windows,
                                                     histories)]
                for block_v, warps in path_configs if (t, kind) == (17, "drafted") else path_configs[:1]:
                    stacked[2].copy_(torch.stack(states))
                    keep_path(*stacked[:3], shape, kept, *stacked[3:5], history_rows, stacked[5], block_v, warps)
                    err = (stacked[2][0] - want).abs().max().item()
                    us = replay_ms(lambda n=kept, bv=block_v, w=warps: keep_path(
                        *stacked[:3], shape, n, *stacked[3:5], history_rows, stacked[5], bv, w)) * 1e3 / layers \
                        if timed else float("nan")
                    report(f"T={t} {kind} keep_path of {kept.shape[0]} nodes, the {layers} layers in one launch "
                           f"BLOCK_V={block_v} warps={warps}", us, err)

if __name__ == "__main__":
    with torch.no_grad():
        main(sys.argv[sys.argv.index("--parts") + 1] if "--parts" in sys.argv else "recurrence,mixer,conv",
             "--dry-run" in sys.argv)
