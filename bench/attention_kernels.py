"""Attention of T new queries over the static KV cache of one Qwen3.5-27B attention layer (24 query heads, 4 KV
heads, head_dim 256, bf16), as a CUDA-graphed pass reads it (the whole cache is passed, the position is data):
SDPA under PyTorch's backend choice (the reference path, it must read the whole cache under a mask) against the
split-KV Triton kernel blockspec uses for 1..16 queries (reads only the filled prefix). Two capacities, two fills.
Then draft trees of 16 and 32 nodes (tree_attention_triton: the chain of 8 and branches off it) with the engine's
rows per program, and with programs of at most TREE_ROW_BLOCK rows at every tree size (variant "row blocks").
Prints microseconds per layer (16 layers back-to-back in one CUDA graph, median of replays); JSON to $OUT.
Usage (GPU; under a minute on an H200): python bench/attention_kernels.py
CPU dry run (tiny shapes, one capacity and fill, untimed):
TRITON_INTERPRET=1 python bench/attention_kernels.py --dry-run
"""

import json
import os
import sys

import torch
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.kernels import attention_triton
from blockspec.kernels.attention import cached_attention_sdpa, tree_attention_sdpa
from blockspec.kernels.attention_triton import cached_attention_triton, tree_attention_triton

HQ, HKV, D, LAYERS = 24, 4, 256, 16
CAPACITIES, FILLS, QUERIES, TREE_NODES = (4096, 32768), (1000, 4000), (1, 8, 16), (16, 32)


def main():
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if "--dry-run" in sys.argv:
        global HQ, HKV, D, LAYERS, CAPACITIES, FILLS, QUERIES, TREE_NODES
        dev, dtype = dry_run(), torch.float32
        HQ, HKV, D, LAYERS, CAPACITIES, FILLS, QUERIES, TREE_NODES = 4, 2, 16, 1, (128,), (100,), (1, 8), (16, 24)
    results = {}
    for capacity in CAPACITIES:
        caches = [(torch.randn(capacity, HKV, D, device=dev, dtype=dtype),
                   torch.randn(capacity, HKV, D, device=dev, dtype=dtype)) for _ in range(LAYERS)]
        for filled in FILLS:
            for t in QUERIES:
                q = torch.randn(t, HQ, D, device=dev, dtype=dtype)
                positions = torch.arange(filled - t, filled, device=dev)
                ref = cached_attention_sdpa(q, *caches[0], positions, D ** -0.5).float()
                for name, fn in (("sdpa", cached_attention_sdpa), ("triton", cached_attention_triton)):
                    def run(q=q, p=positions, fn=fn):
                        return [fn(q, k, v, p, D ** -0.5) for k, v in caches]
                    err = (run()[0].float() - ref).abs().max().item()
                    us = replay_ms(run) * 1e3 / LAYERS
                    key = f"capacity={capacity} filled={filled} T={t} {name}"
                    results[key] = {"us_per_layer": round(us, 1), "max_err": err}
                    print(f"{key:42s} {us:8.1f} us/layer  err {err:.1e}", flush=True)
            for t in TREE_NODES:
                results.update(measure_tree(caches, capacity, filled, t, dev, dtype))
        caches = None  # free before the next capacity
    with open(os.path.join(os.environ.get("OUT", "."), "attention_kernels.json"), "w") as f:
        json.dump(results, f, indent=2)


def tree_ancestors(t: int, device) -> torch.Tensor:
    """[t, t] bool of a drafted tree's shape: the root and the chain's 7 nodes, the rest branching off the chain."""
    parents = [max(i - 1, 0) if i < 8 else (i * 3) % 8 for i in range(t)]
    ancestors = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        ancestors[i] |= ancestors[parents[i]]
    return ancestors.to(device)


def measure_tree(caches, capacity: int, filled: int, t: int, dev, dtype) -> dict:
    """tree_attention_triton over t nodes after `filled` committed keys: the engine's launch, then row blocks."""
    results = {}
    q = torch.randn(t, HQ, D, device=dev, dtype=dtype)
    slots = torch.arange(filled, filled + t, device=dev)
    ancestors = tree_ancestors(t, dev)
    ref = tree_attention_sdpa(q, *caches[0], slots, ancestors, D ** -0.5).float()
    engine_limit = attention_triton.MAX_QUERIES
    for name, limit in (("triton", engine_limit), ("triton row blocks", 0)):
        attention_triton.MAX_QUERIES = limit  # launch_plan: trees above it take TREE_ROW_BLOCK rows a program
        try:
            def run(q=q):
                return [tree_attention_triton(q, k, v, slots, ancestors, D ** -0.5) for k, v in caches]
            err = (run()[0].float() - ref).abs().max().item()
            us = replay_ms(run) * 1e3 / LAYERS
        finally:
            attention_triton.MAX_QUERIES = engine_limit
        key = f"capacity={capacity} filled={filled} tree={t} {name}"
        results[key] = {"us_per_layer": round(us, 1), "max_err": err}
        print(f"{key:42s} {us:8.1f} us/layer  err {err:.1e}", flush=True)
    return results


if __name__ == "__main__":
    with torch.no_grad():
        main()
