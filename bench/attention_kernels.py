"""Attention of T new queries over the static 4096-slot KV cache of one Qwen3.5-27B attention layer (24 query
heads, 4 KV heads, head_dim 256, bf16), as a CUDA-graphed pass reads it: SDPA under PyTorch's backend choice
(blockspec's reference path), SDPA pinned to each backend, and the grouped-head matmul-softmax-matmul that
blockspec now uses for 2..16 queries (the H200 run measured this same computation as a local copy).
Prints microseconds per layer (16 layers back-to-back in one CUDA graph, median of replays); JSON to $OUT.
Usage (GPU): python bench/attention_kernels.py
"""

import json
import os
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from blockspec.kernels.attention import cached_attention_grouped, cached_attention_sdpa
from timing import replay_ms  # bench/timing.py, beside this script

HQ, HKV, D, CAP, LAYERS = 24, 4, 256, 4096, 16


def timed_graph(fn):
    return replay_ms(fn) * 1e3 / LAYERS  # us per layer


def main():
    dev = torch.device("cuda")
    caches = [(torch.randn(CAP, HKV, D, device=dev, dtype=torch.bfloat16),
               torch.randn(CAP, HKV, D, device=dev, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    results = {}
    for t in (1, 4, 8, 16):
        q = torch.randn(t, HQ, D, device=dev, dtype=torch.bfloat16)
        positions = torch.arange(3000, 3000 + t, device=dev)
        ref = cached_attention_sdpa(q, *caches[0], positions, D ** -0.5).float()
        variants = {"sdpa (default choice)": lambda q=q, p=positions: [cached_attention_sdpa(q, k, v, p, D ** -0.5)
                                                                      for k, v in caches],
                    "grouped matmul": lambda q=q, p=positions: [cached_attention_grouped(q, k, v, p, D ** -0.5)
                                                               for k, v in caches]}
        for name, backend in [("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa math", SDPBackend.MATH),
                              ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)]:
            def run(q=q, p=positions, backend=backend):
                with sdpa_kernel(backend):
                    return [cached_attention_sdpa(q, k, v, p, D ** -0.5) for k, v in caches]
            variants[name] = run
        for name, fn in variants.items():
            try:
                err = (fn()[0].float() - ref).abs().max().item()
                us = timed_graph(fn)
                results[f"T={t} {name}"] = {"us_per_layer": round(us, 1), "max_err": err}
                print(f"T={t:2d} {name:24s} {us:8.1f} us/layer  err {err:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a backend may refuse these inputs
                print(f"T={t:2d} {name:24s} unavailable: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "attention_kernels.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
