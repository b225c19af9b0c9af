"""What one GPU, or several, do with `blockspec train-drafter` on a big target: the DFlash2 training step (frozen target pass
over one sequence, then every anchor block of it through the drafter, backward, AdamW) on a synthetic target of real
shapes (default: Qwen3.5-27B in bf16) with the published drafter's layout (5 layers, hidden 5120, fp32 master
weights, bf16 autocast). Random weights: the figures are speed and memory, not learning.

Bytes and flops of one step (27B, 4096 block rows: 2 sequences of 2048 tokens, 256 anchors each): the target passes
read 54 GB of weights each and do ~2 x 27e9 x 4096 = 220 TFLOP (prefills: compute-bound, ~8k tokens/s measured for
inference, so ~0.5 s); the drafter (1.9e9 parameters, 4096 block rows + 4096 context rows through its projections)
~6 x 1.9e9 x 8192 = 93 TFLOP forward and backward (~0.2 s at a few hundred TFLOP/s); AdamW touches 16 bytes per
drafter parameter (30 GB, ~10 ms). Prediction: ~0.7-0.8 s per step, ~5k block tokens/s; memory ~54 GB target +
30 GB drafter state + ~15 GB activations. Measured (H200): 0.778 s per step, 5266 block tokens/s, 111 GB allocated
at the peak.

Under torchrun (one process a GPU) the step's sequences are shared between the ranks as train-drafter shares them,
the drafter under DistributedDataParallel, the target whole on every GPU or (--target-sharding fsdp) its layers
sharded across them with FSDP2; block tokens/s count every rank's rows, peak memory is each GPU's.
Prediction for 2 GPUs, the same 4096 rows (one sequence a rank): half of each pass (~0.39 s) plus the gradients'
all-reduce (7.7 GB of fp32, ~40-50 ms over NVLink, partly hidden under the backward pass) and the whole AdamW step on
each rank: ~0.43 s, 90 % scaling efficiency. Sharded, each rank gathers the other half of the 49 GB of layers once a
sequence (hidden under the layers' compute), and holds ~30 GB of target (its half of the layers, the 5 GB embedding and
head whole), 31 GB of drafter state and half the activations: ~75 GB.

Usage (GPU, repo root): python bench/drafter_training.py [--preset qwen3.5-27b] [--steps 10] [--seq-len 2048]
  [--batch-tokens 4096] [--window N] [--attention dense|block-sparse] [--profile N] [--compile] [--json-out FILE]
  or torchrun --standalone --nproc-per-node N bench/drafter_training.py ... [--target-sharding replicate|fsdp|replicate,fsdp]
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockspec.fixtures.synthetic import synthetic_drafter_config, synthetic_target  # noqa: E402
from blockspec.train import dflash2  # noqa: E402
from blockspec.train.data import Sequence  # noqa: E402
from blockspec.train.dflash2 import dflash2_step, new_drafter  # noqa: E402
from blockspec.train.ranks import process_group, rank_device  # noqa: E402
from blockspec.train.run import TargetFeatures, compiles  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-27b", help="synthetic target preset (qwen3.5-27b or tiny)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per training sequence")
    p.add_argument("--batch-tokens", type=int, default=4096, help="block rows per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--window", type=int, help="the drafter's sliding window (default: the preset drafter's)")
    p.add_argument("--attention", choices=["dense", "block-sparse"],
                   help="the step's attention: flex_attention's block-sparse kernel or scaled_dot_product_attention "
                   "under a dense mask (default: train-drafter's, block-sparse on CUDA, dense on the CPU)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile one more step and print its N costliest operators")
    p.add_argument("--target-sharding", default="replicate",
                   help="under torchrun: the target whole on every GPU (replicate), its layers sharded across them "
                   "(fsdp, FSDP2), or replicate,fsdp: both in turn, the target built once")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the drafter's step through torch.compile (train-drafter's default: on CUDA)")
    p.add_argument("--json-out", help="write the figures as JSON")
    args = p.parse_args()
    device = rank_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with process_group(device) as ranks:
        measure(args, device, ranks)


def measure(args, device, ranks):
    say = print if ranks.main else (lambda *a, **k: None)
    args.attention = args.attention or ("block-sparse" if device.type == "cuda" else "dense")
    if args.attention == "block-sparse" and device.type != "cuda":
        sys.exit("--attention block-sparse needs CUDA (flex_attention has no backward on the CPU)")
    placements = args.target_sharding.split(",")
    if set(placements) - {"replicate", "fsdp"} or placements.count("fsdp") > 1 or placements[-1:] == ["replicate"] \
            and "fsdp" in placements:
        sys.exit(f"--target-sharding: replicate, fsdp or replicate,fsdp (got {args.target_sharding!r})")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    model, _ = synthetic_target(args.preset, device, dtype, mtp_head=False)
    say(f"synthetic target built in {time.perf_counter() - start:.1f} s", flush=True)  # a slot's cost is visible
    config = dict(synthetic_drafter_config(model.config), num_target_layers=model.config.num_hidden_layers)
    if args.window:
        config["sliding_window"] = args.window
    block_sparse = args.attention == "block-sparse"  # the mask of every step (which is otherwise the same)
    dflash2.step_mask = lambda layout, _: layout.block_mask() if block_sparse else layout.dense_mask()
    drafter = new_drafter(config, seed=0, device=device, dtype=torch.float32)
    layer_ids = config["dflash_config"]["target_layer_ids"]
    # the target's pass a CUDA graph, as train-drafter's, unless the layers are to be sharded (the graph would hold
    # the whole weights' addresses)
    features = TargetFeatures(model, layer_ids, args.seq_len, device, dtype,
                              graphed="fsdp" not in placements or ranks.world == 1)
    run = SimpleNamespace(batch_tokens=args.batch_tokens, block_size=config["dflash_config"]["block_size"],
                          seq_len=args.seq_len, loss_decay=4.0, compile=compiles(args.compile, device))
    rng = random.Random(0)
    sequences = [Sequence([rng.randrange(model.config.vocab_size) for _ in range(args.seq_len)], [True] * args.seq_len)
                 for _ in range(4)]  # text: every label trained
    step_loss = dflash2_step(drafter, model, features, sequences, run, ranks)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _, rows = step_loss(rng)
        optimizer.zero_grad(set_to_none=True)
        (loss * ranks.world).backward()  # DistributedDataParallel averages: the gradient is the whole step's
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        return int(ranks.total(torch.tensor(rows, device=device)))  # every rank's rows

    results = []
    for placement in placements:
        if placement == "fsdp" and ranks.world > 1:  # the whole target built on each GPU, then each keeps its shards
            ranks.shard_layers(model, device)  # (train-drafter loads it on the CPU instead)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if ranks.world > 1:
            say(f"target whole on each of {ranks.world} processes" if placement == "replicate" else
                f"the target's layers sharded across {ranks.world} processes (FSDP2)", flush=True)
        figures = timed(step, args, device, ranks, say)
        results.append({"preset": args.preset, "attention": args.attention, "window": config["sliding_window"],
                        "drafter_parameters": sum(p.numel() for p in drafter.parameters()), "seq_len": args.seq_len,
                        "processes": ranks.world, "target_sharding": placement if ranks.world > 1 else "replicate",
                        **figures})
        say(json.dumps(results[-1], indent=2))
    if args.json_out and ranks.main:
        Path(args.json_out).write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2))


def timed(step, args, device, ranks, say) -> dict:
    """Two warm-up steps, then args.steps timed ones: their figures, each GPU's peak memory, and with --profile the
    costliest operators of one more step."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(2):
        start = time.perf_counter()
        step()
        sync()
        say(f"warm-up step {i}: {time.perf_counter() - start:.2f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, rows = time.perf_counter(), 0
    for i in range(args.steps):
        rows += step()
        sync()  # the per-step line is a real duration (the total is timed the same way)
        say(f"step {i}: {rows} block rows, {time.perf_counter() - start:.2f} s", flush=True)
    elapsed = time.perf_counter() - start
    figures = {"block_rows_per_step": rows // args.steps, "steps": args.steps,
               "step_s": round(elapsed / args.steps, 4), "block_tokens_per_s": round(rows / elapsed, 1),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if device.type == "cuda":  # each GPU's, in rank order
        free, total = torch.cuda.mem_get_info()
        mine = [round(torch.cuda.max_memory_allocated() / 1e9, 2), round((total - free) / 1e9, 2)]
        every = [mine] * ranks.world
        if ranks.world > 1:
            torch.distributed.all_gather_object(every, mine)
        figures["peak_allocated_gb"], figures["process_held_gb"] = [m[0] for m in every], [m[1] for m in every]
    if args.profile:  # one more step under the profiler: where a step's time goes, by operator
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync()
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        say(prof.key_averages().table(sort_by=key, row_limit=args.profile))
    return figures


if __name__ == "__main__":
    main()
