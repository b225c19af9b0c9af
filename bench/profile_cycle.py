"""Where a speculative cycle's time goes, on synthetic Qwen3.5-27B weights (H200 run behind docs/benchmarks.md).

For each target variant (projections as stored, then packed with fuse_kvq + fuse_gate), times each piece alone
with CUDA events (median of 20 after warm-up): the graphed 1-token step (and its share of the bandwidth roofline),
the graphed 4- and 8-token verification passes with their commits, the DFlash2 proposal graph, the graphed drafter
context append, and the graphed MTP observe + chain of 3 drafts. Then a kernel table of one graphed step and one
8-token verification (torch.profiler: which kernels take the time). Prints it all; JSON to $OUT/profile_cycle.json.

Usage (GPU, repo root): python bench/profile_cycle.py [--variants plain,packed] [--quant int4]
"""

import argparse
import json
import os
import time

import torch

from blockspec.bench import bytes_per_plain_step, measure_read_bandwidth
from blockspec.config import PredictConfig
from blockspec.engine.engine import Engine
from blockspec.synthetic import synthetic_target
from timing import event_ms  # bench/timing.py, beside this script


def kernel_table(fn, top=18, sequence=0):
    """The kernels of a few calls of fn, grouped by name: (name, calls per fn call, us per fn call); with
    `sequence`, also the first that many kernels of one call in launch order (what one layer runs)."""
    fn()
    torch.cuda.synchronize()
    reps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            calls, total = rows.get(e.name, (0, 0.0))
            rows[e.name] = (calls + 1, total + e.device_time)
    table = sorted(((n[:90], c / reps, t / reps) for n, (c, t) in rows.items()), key=lambda r: -r[2])
    total_us = sum(r[2] for r in table)
    kernels = sum(r[1] for r in table)
    ordered = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    return {"total_kernel_us": round(total_us, 1), "kernels_per_call": kernels,
            "top": [(n, c, round(t, 1)) for n, c, t in table[:top]],
            "sequence": [(e.name[:70], round(e.device_time, 1)) for e in ordered[:sequence]]}


def profile_engine(engine, mode_label, bandwidth, results, kernels):
    target, state = engine.target, engine.state
    model = engine.model
    prompt = torch.randint(0, model.config.vocab_size, (512,), device="cuda")
    state.reset()
    engine.proposer.reset()
    out = model(prompt, state, engine.proposer.capture_layers, all_logits=False)
    state.commit(512)
    if hasattr(engine.proposer, "drafter"):
        engine.proposer.drafter.append_context(out.features, 0)

    def step(t, n):
        target.verify(list(range(t)))
        target.commit(n)
        state.length -= n  # stay at the same position
    r = {}
    if 1 in target.passes:
        r["step_1_ms"] = event_ms(lambda: step(1, 1))
        step_bytes = bytes_per_plain_step(engine)
        r["step_bytes_gb"] = round(step_bytes / 1e9, 3)
        r["step_roofline_ms"] = round(step_bytes / (bandwidth * 1e9) * 1e3, 3)
        r["step_pct_roofline"] = round(100 * r["step_roofline_ms"] / r["step_1_ms"], 1)
        kernels[f"{mode_label} step_1"] = kernel_table(lambda: step(1, 1), sequence=70)
    for t in sorted(target.passes):
        if t > 1:
            r[f"verify_{t}_commit_{t}_ms"] = event_ms(lambda: step(t, t))
            r[f"verify_{t}_commit_1_ms"] = event_ms(lambda: step(t, 1))
            kernels[f"{mode_label} verify_{t}"] = kernel_table(lambda: step(t, t))
    proposer = engine.proposer
    if proposer.name == "dflash2":
        r["dflash2_propose_graph_ms"] = event_ms(lambda: proposer.propose(5, state.length, 7))
        kernels[f"{mode_label} dflash2 propose"] = kernel_table(lambda: proposer.propose(5, state.length, 7))
        features = out.features[:4]

        def append():
            proposer.observe(type(out)(None, None, features), state.length, [0] * 4, [0] * 4)
            proposer.drafter.context.length -= 4
        r["drafter_append_4_graph_ms"] = event_ms(append)
    if proposer.name == "mtp":
        hidden = type(out)(None, out.hidden[:4], None)

        def observe_and_propose():
            proposer.observe(hidden, 100, [0] * 4, [1, 2, 3, 4])
            return proposer.propose(4, 104, 3)
        r["mtp_observe_4_chain_3_graph_ms"] = event_ms(observe_and_propose)
        kernels[f"{mode_label} mtp observe+chain"] = kernel_table(observe_and_propose)
    r["lm_head_1_row_ms"] = event_ms(lambda: model.logits(out.hidden[:1]))
    results[mode_label] = {**engine.load_times, **r}
    for k, v in results[mode_label].items():
        print(f"{mode_label:24s} {k:32s} {v}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="plain,packed")
    ap.add_argument("--modes", default="dflash2,mtp")
    ap.add_argument("--quant", default="none", help="target_quantization (int4) for every variant")
    ap.add_argument("--vocab-quant", default="none")
    args = ap.parse_args()
    t0 = time.perf_counter()
    bandwidth = measure_read_bandwidth(torch.device("cuda"))  # GB/s
    model, head = synthetic_target("qwen3.5-27b", torch.device("cuda"), torch.bfloat16)
    mtp = {"mtp." + k: v for k, v in head.state_dict().items()}
    results = {"bandwidth_gbs": round(bandwidth, 1), "synthetic_s": round(time.perf_counter() - t0, 1),
               "quant": args.quant}
    kernels = {}
    variants = args.variants.split(",")
    for variant in variants:
        fuse = variant == "packed"  # packing is in place and cannot be undone: keep "plain" first
        modes = args.modes.split(",") if variant == variants[-1] else args.modes.split(",")[:1]
        for mode in modes:
            config = PredictConfig.build({"mode": mode, "device": "cuda", "compile_mode": 0, "context_length": 4096,
                                          "fuse_kvq": fuse, "fuse_gate": fuse, "target_quantization": args.quant,
                                          "vocabulary_quantization": args.vocab_quant})
            t1 = time.perf_counter()
            engine = Engine(config, model=model, mtp_tensors=mtp, tokenizer=object(), synthetic_drafter=0)
            engine.load_times["engine_s"] = round(time.perf_counter() - t1, 1)
            profile_engine(engine, f"{variant}/{mode}", bandwidth, results, kernels)
            del engine
            torch.cuda.empty_cache()
    for label, table in kernels.items():
        print(f"\n== {label}: {table['kernels_per_call']:.0f} kernels, {table['total_kernel_us']:.0f} us of kernels")
        for name, calls, us in table["top"]:
            print(f"  {us:9.1f} us {calls:6.1f}x  {name}")
        if table["sequence"]:
            print("  -- first kernels of one call, in order:")
            for name, us in table["sequence"]:
                print(f"  {us:9.1f} us  {name}")
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "profile_cycle.json"), "w") as f:
        json.dump({"results": results, "kernels": kernels}, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
