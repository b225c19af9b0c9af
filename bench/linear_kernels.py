"""Few-row bf16 matmuls on the 27B's projection shapes: cuBLAS (F.linear) against the Triton kernel of
blockspec/kernels/linear_triton.py for a sweep of configs, at 1 and 8 rows (--rows: those row counts, e.g. a draft
tree's 17, 33, 64). Weight copies > 400 MB in one CUDA graph (no L2 reuse), median of replays; GB/s of weight bytes.
Usage (GPU; ~2 minutes on an H200, --quick ~20 s; about as long per two row counts):
python bench/linear_kernels.py [--quick: the configs default_config chooses only] [--rows 1,8,17,33,64];
JSON to $OUT/linear_kernels.json.
CPU dry run (one tiny shape, the first two configs of the sweep, untimed):
TRITON_INTERPRET=1 python bench/linear_kernels.py --dry-run
"""

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.kernels.linear_triton import LinearConfig, default_config, fits, linear_rows

SHAPES = {"mlp down": (5120, 17408), "gdn out / attn o": (5120, 6144), "mlp gate_up": (34816, 5120),
          "gdn in (packed)": (16480, 5120), "attn qkv (packed)": (14336, 5120)}


def configs(m, n, k, quick, device):
    if quick:  # the table's choice only
        yield from filter(None, [default_config(m, n, k)])
        return
    if m > 8:  # a tree's rows: taller x tiles, on wgmma (whose tile is 64 weight rows a warp group)
        space = itertools.product((64, 128), (128, 256), (1, 2, 4), (3, 4))
        candidates = (LinearConfig(bn, bk, True, 4, stages, waves) for bn, bk, waves, stages in space)
        yield from (c for c in candidates if fits(c, m, device))
        return
    for bn, bk, waves, stages in itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (3, 5)):
        yield LinearConfig(bn, bk, True, 4, stages, waves)
        if m == 1:
            yield LinearConfig(bn, bk, False, 4, stages, waves)


def main(quick=False, rows=(1, 8), dry=False):
    dev, dtype, shapes, bytes_timed, sweep = torch.device("cuda"), torch.bfloat16, SHAPES, 400_000_000, None
    if dry:
        dev, dtype, shapes, bytes_timed, sweep = dry_run(), torch.float32, {"tiny": (96, 640)}, 0, 2
    results = {}
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, -(-bytes_timed // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = F.linear(x, weights[0]).float()
            base = replay_ms(lambda: [F.linear(x, w) for w in weights]) * 1e3 / copies
            row = {"cublas_us": round(base, 2), "cublas_gb_s": round(nbytes / base / 1e3)}
            best, by_kind = None, {}  # by_kind: the best of each multiply (fma, or MMA: "dot")
            for cfg in itertools.islice(configs(m, n, k, quick, dev), sweep):
                try:
                    err = (linear_rows(x, weights[0], cfg).float() - ref).abs().max().item()
                    us = replay_ms(lambda c=cfg: [linear_rows(x, w, c) for w in weights]) * 1e3 / copies
                except Exception as e:  # a config the compiler refuses (shared memory, tile shape)
                    print(f"  {name} M={m} {cfg.short()}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg, err)
                kind = cfg.short().split()[2]
                by_kind[kind] = min(by_kind.get(kind, us), us)
            if best:
                row.update(triton_us=round(best[0], 2), triton_gb_s=round(nbytes / best[0] / 1e3),
                           config=best[1].short(), max_err=best[2], best_us_by_kind=by_kind)
            results[f"{name} M={m}"] = row
            print(f"{name:18s} M={m:<2d} cuBLAS {base:7.2f} us {nbytes / base / 1e3:6.0f} GB/s   "
                  f"triton {row.get('triton_us', 0):7.2f} us {row.get('triton_gb_s', 0):6.0f} GB/s "
                  f"[{row.get('config')}] err {row.get('max_err', 0):.1e} "
                  + " ".join(f"{kind} {us:.2f}" for kind, us in by_kind.items()), flush=True)
        weights.clear()  # free before the next shape
    with open(os.path.join(os.environ.get("OUT", "."), "linear_kernels.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the configs default_config chooses only")
    parser.add_argument("--rows", default="1,8", help="comma-separated row counts (default 1,8)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, Triton interpreter: a tiny shape, the sweep's first two configs, untimed")
    args = parser.parse_args()
    with torch.no_grad():
        main(args.quick, [int(m) for m in args.rows.split(",")], args.dry_run)
