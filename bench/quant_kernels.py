"""Check and time the W4A16 / W8A16 Triton kernel (kernels/quant_matmul_triton.py) on the 27B projections the engine
runs (packed: gate_up, GDN in_proj, attention qkv; down, o / out_proj, the vocabulary head).

One command on a GPU machine (repo root; ~2 minutes on an H200):   python bench/quant_kernels.py [--rows 8,17,33,64]
CPU dry run of the harness (tiny shapes, Triton interpreter):      TRITON_INTERPRET=1 python bench/quant_kernels.py

1. Checks (exit code 1 if any production check fails): every distinct default config of the timed row counts
   against the dequantized reference with zero points, odd N and K, bf16 and fp16 activations; Int4Linear /
   Int8Linear (RTN) at M = 1, 3, 12, 40 (one 64-row launch) and 100 (dequantize + F.linear); row 0 of an M = 8 launch
   == the M = 1 launch (bitwise); a CUDA-graph replay of a split-K launch == the eager result.
2. Timing: per (shape, M), C weight copies (> 200 MB together, so L2 never hits) run back to back in one CUDA
   graph, replayed 7 times between CUDA events, median / C; % of 3990 GB/s of packed bytes. Every timed config is
   first checked on 256 rows. int4 group 128: each shape at M = 1, 2, 4, 8, 16 against bf16 F.linear (its own 4x
   larger weight); M = 1 also with waves = 4. int8 (drafter group 32, vocabulary head group 128): M = 1 and 8, PTX
   (default) and plain-Triton unpacking. --rows: every shape at those row counts instead (e.g. a draft tree's
   passes: 8,17,33,64).
Writes $OUT/quant_kernels.json when OUT is set.
`--sweep` (~4 minutes): instead, tile width / pipeline depth / warps / K splits around the default config,
every int4 shape at M = 1, 8 and 16 and the int8 shapes at M = 1 and 8 (SWEEP_VARIANTS, INT8_SWEEP; SWEEP_SET=deep:
deeper pipelines with fewer splits, DEEP_VARIANTS; SWEEP_SET=tree: the int4 shapes at a draft tree's 17, 32 and 33
rows, TREE_VARIANTS; SWEEP_SET=16: the int4 shapes at 16 rows only, SWEEP_VARIANTS' and wider, deeper and balanced
tiles, ROWS16_VARIANTS; SWEEP_SET=ws: the int4 shapes at 17 and 32 rows, the default (on Hopper the warp-specialized
kernel) against the Triton kernel, WS_VARIANTS; SWEEP_SET=int8: the int8 shapes alone; SWEEP_SHAPES=o,down,...:
those int4 shapes only); each config
checked on 256 rows and once more after the timed graph replays (replayed output == an eager launch, bitwise).
`default_config` holds the winners of this sweep. Writes $OUT/quant_sweep.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from blockspec.kernels import quant_matmul as qm  # noqa: E402
from blockspec.kernels import quant_matmul_triton as wq  # noqa: E402
from blockspec.quant.int4 import Int4Linear  # noqa: E402
from blockspec.quant.int8 import Int8Linear  # noqa: E402
from timing import replay_ms  # noqa: E402  (bench/timing.py, beside this script)

DRY = os.environ.get("TRITON_INTERPRET", "0") == "1"
PEAK_GBS = 3990.0
MS = [1, 2, 4, 8, 16]
SHAPES = [("gate_up", 34816, 5120), ("gdn_in", 16480, 5120), ("attn_qkv", 14336, 5120), ("down", 5120, 17408),
          ("o", 5120, 6144), ("vocab", 248320, 5120)]
INT8_SHAPES = [("d_qkv", 6144, 5120, 32), ("d_gate_up", 34816, 5120, 32), ("d_down", 5120, 17408, 32),
               ("vocab", 248320, 5120, 128)]
if DRY:
    SHAPES, INT8_SHAPES, MS = [("tiny", 100, 1100)], [("tiny", 70, 512, 32)], [1, 16]  # both block_m
DEV = torch.device("cpu" if DRY else "cuda")
MAX_COPIES = 2 if DRY else 64


def time_graph(fn, reps=7) -> float:
    """Median ms of one replay of a CUDA graph that runs fn() once (dry run: wall time of one fn())."""
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return replay_ms(fn, reps)


def rel_err(y, ref) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-9))


def random_weight(n, k, bits, gs, zp=False) -> qm.PackedWeight:
    """Random codes (every int16 is valid), scales in [0.005, 0.02] (and zero points), in the q16 layout."""
    kp = qm.padded_k(k, bits, gs)
    q = torch.randint(-2 ** 15, 2 ** 15, (n, kp * bits // 16), dtype=torch.int16, device=DEV)
    shape = (kp // qm.block_size(bits, gs), n, 16 // bits)
    s = (torch.rand(shape, device=DEV) * 0.015 + 0.005).to(torch.bfloat16)
    z = torch.randint(0, 1 << bits, shape, device=DEV).to(torch.bfloat16) if zp else None
    return qm.PackedWeight(q, s, z, bits, gs, n, k)


def run_checks(checks: list, ms: list) -> None:
    def add(name, ok, **kw):
        checks.append(dict(check=name, ok=bool(ok), **kw))
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {kw}", flush=True)

    g = torch.Generator(device="cpu").manual_seed(0)
    cfgs = {(wq.default_config(m, n, k, bits, gs), bits, gs) for m in ms for _, n, k in SHAPES for bits, gs in
            ((4, 128), (8, 128))} | {(wq.default_config(m, n, k, 8, gs), 8, gs) for m in ms for _, n, k, gs in
                                      INT8_SHAPES}
    for cfg, bits, gs in sorted(cfgs, key=str):  # zero points, odd N and K, both activation dtypes
        pw = random_weight(37 if DRY else 1037, 1013 if DRY else 3013, bits, gs, zp=True)
        ref_w = pw.dequantize()
        for m in (1, cfg.block_m):
            for dt in (torch.bfloat16,) if DRY else (torch.bfloat16, torch.float16):
                x = torch.randn(m, pw.k, generator=g).to(dt).to(DEV)
                err = rel_err(wq.wq_matmul(x, pw, cfg), x.float() @ ref_w.t())
                add(f"int{bits} g{gs} {cfg.short()} zp odd M={m} {str(dt)[6:]}", err < 1e-2, rel_err=err)
    dt = torch.float32 if DRY else torch.bfloat16
    for cls, gs in ((Int4Linear, 128), (Int8Linear, 32), (Int8Linear, 128)):  # modules, all row-count paths
        lin = cls.from_float(torch.randn(300 if DRY else 3000, 5120, generator=g).to(DEV) * 0.02, gs)
        w = lin.dequantize()
        for m in (1, 3, 12, 40, 100):
            x = torch.randn(m, 5120, generator=g).to(dt).to(DEV)
            err = rel_err(lin(x), x.float() @ w.t())
            add(f"{cls.__name__} g{gs} M={m}", err < 1e-2, rel_err=err)
        x = torch.randn(8, 5120, generator=g).to(dt).to(DEV)
        if not DRY:  # (the dry run's module forward is the PyTorch reference)
            add(f"{cls.__name__} g{gs}: row 0 of M=8 == M=1 (bitwise)", torch.equal(lin(x)[:1], lin(x[:1])))
    pw = random_weight(*(70, 2048) if DRY else (5120, 17408), 4, 128)  # split K
    x = torch.randn(1, pw.k, generator=g).to(dt).to(DEV)
    y0 = wq.wq_matmul(x, pw)
    if not DRY:
        graph, out = torch.cuda.CUDAGraph(), torch.empty_like(y0)
        with torch.cuda.graph(graph):
            wq.wq_matmul(x, pw, out=out)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        add("CUDA graph replay of a split-K launch == eager (bitwise)", torch.equal(out, y0))


def time_shape(records, name, n, k, bits, gs, variants) -> None:
    """variants: (label, config function of m, list of M); each config is checked on 256 rows, then timed."""
    probe = random_weight(n, k, bits, gs)
    nb = probe.nbytes()
    copies = min(MAX_COPIES, max(1 if nb > 300e6 else 2, -(-int(200e6) // nb)))
    ws = [probe] + [random_weight(n, k, bits, gs) for _ in range(copies - 1)]
    rows = torch.cat([torch.randperm(n, device=DEV)[:255], torch.tensor([n - 1], device=DEV)])
    w_rows = probe.dequantize(rows=rows)
    print(f"\n[{name}] N={n} K={k} int{bits} g{gs}: {nb / 1e6:.1f} MB, {copies} copies", flush=True)
    for m in sorted({m for _, _, ms in variants for m in ms}):
        x = torch.randn(m, k, device=DEV).to(torch.float32 if DRY else torch.bfloat16)
        out = torch.empty(m, n, device=DEV, dtype=x.dtype)
        for label, cfg_of, ms in variants:
            if m not in ms:
                continue
            cfg = cfg_of(m)
            rec = dict(shape=name, n=n, k=k, m=m, bits=bits, group=gs, variant=label, copies=copies, bytes=nb,
                       cfg=asdict(cfg), cfg_str=cfg.short(), split=wq.schedule(cfg, n, probe.q.shape[1] // gs,
                                                                               wq.sm_count(DEV))[1])
            try:
                wq.wq_matmul(x, probe, cfg, out=out)
                rec["rel_err"] = rel_err(out[:, rows], x.float() @ w_rows.t())
                if not rec["rel_err"] < 1e-2:
                    raise RuntimeError(f"wrong result, rel err {rec['rel_err']:.3g}")
                rec["us"] = time_graph(lambda: [wq.wq_matmul(x, w, cfg, out=out) for w in ws]) * 1e3 / copies
                rec["graph_equal"] = bool(torch.equal(out, wq.wq_matmul(x, ws[-1], cfg)))  # replays left out = last
                rec.update(gbs=nb / rec["us"] / 1e3, pct=nb / rec["us"] / 1e3 / PEAK_GBS * 100)
            except Exception as exc:  # noqa: BLE001  (recorded; a production config failing fails the run)
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            records.append(rec)
            res = f"{rec['us']:8.1f} us {rec['pct']:5.1f}%" if "us" in rec else f"FAILED {rec['error'][:150]}"
            print(f"  M={m:2d} {label:10s} {cfg.short():28s} split {rec['split']:2d} {res} "
                  f"err {rec.get('rel_err', float('nan')):.1e}", flush=True)


def time_bf16(records, name, n, k, ms) -> None:
    nb = n * k * 2
    copies = max(1 if nb > 300e6 else 2, -(-int(200e6) // nb))
    ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        us = time_graph(lambda: [F.linear(x, w) for w in ws]) * 1e3 / copies
        records.append(dict(shape=name, n=n, k=k, m=m, variant="bf16", copies=copies, bytes=nb, us=us,
                            gbs=nb / us / 1e3, pct=nb / us / 1e3 / PEAK_GBS * 100))
        print(f"  M={m:2d} bf16 F.linear {us:8.1f} us {records[-1]['pct']:5.1f}% of its {nb / 1e6:.0f} MB", flush=True)


SWEEP_VARIANTS = {  # label: changes to the default config; by activation rows (<= 8, 16)
    8: {"n64 s3 wv2": dict(block_n=64, stages=3, waves=2), "n64 s3 wv3": dict(block_n=64, stages=3, waves=3),
        "n64 s3 wv4": dict(block_n=64, stages=3, waves=4), "n64 s2 wv2": dict(block_n=64, stages=2, waves=2),
        "n64 s2 wv4": dict(block_n=64, stages=2, waves=4), "n64 s2 wv6": dict(block_n=64, stages=2, waves=6),
        "n128 s2 wv2": dict(block_n=128, stages=2, waves=2), "n128 s2 wv4": dict(block_n=128, stages=2, waves=4)},
    16: {"n64 s3 wv4": dict(block_n=64, stages=3, waves=4), "n64 s2 wv4": dict(block_n=64, stages=2, waves=4),
         "n128 s3 wv4": dict(block_n=128, stages=3, waves=4), "n128 s2 wv4": dict(block_n=128, stages=2, waves=4),
         "n128 s4": dict(block_n=128, stages=4), "n128 s3 w8": dict(block_n=128, warps=8),
         "n256 s3 w8": dict(block_n=256, stages=3, warps=8),
         "n64 s3 wv2 bal": dict(block_n=64, stages=3, waves=2, balance=True),
         "n64 s3 wv2 bal d8": dict(block_n=64, stages=3, waves=2, balance=True, dot_rows=8),  # two 8-row dots
         "n64 s2 wv2 bal d8": dict(block_n=64, stages=2, waves=2, balance=True, dot_rows=8)},
}
# SWEEP_SET=deep: deeper pipelines with fewer K splits, so that a mid-size projection's programs all fit at once
DEEP_VARIANTS = {8: {f"n64 s{s} wv{w}": dict(block_n=64, stages=s, waves=w) for w in (0, 1, 2) for s in (3, 4, 6)},
                 16: {f"n64 s{s} wv{w}": dict(block_n=64, stages=s, waves=w)
                      for w in (0, 1, 2) for s in (3, 4, 6)}}
# SWEEP_SET=tree: a draft tree's passes (17, 32 and 33 rows: x tiles of 32 and 64 rows). Wider output tiles (fewer
# programs) read less x per weight byte; 2 programs an SM fit at 32 rows, so the launch's last round of tiles
# (balanced or not) and its K splits weigh more
TREE_VARIANTS = {f"n{n} s{s} w{w} wv{v}": dict(block_n=n, stages=s, warps=w, waves=v, warp_specialized=0)
                 for n, s, w, v in [(64, 2, 4, 1), (64, 3, 4, 1), (64, 2, 4, 3), (64, 2, 4, 4), (128, 2, 4, 1),
                                    (128, 2, 4, 2), (128, 3, 8, 1), (128, 2, 8, 4), (256, 2, 8, 1), (256, 3, 8, 1),
                                    (256, 2, 8, 2)]}
TREE_VARIANTS["n64 s2 wv1 bal"] = dict(block_n=64, stages=2, waves=1, balance=True, warp_specialized=0)
TREE_VARIANTS["n64 s3 wv2 bal d/2"] = dict(block_n=64, stages=3, waves=2, balance=True, warp_specialized=0,
                                           dot_rows=lambda cfg: cfg.block_m // 2)  # two dots on one operand
# SWEEP_SET=ws: the 17..32-row default (the warp-specialized Gluon kernel on Hopper) against the Triton kernel's config
WS_VARIANTS = {"triton kernel": dict(warp_specialized=0)}
TREE_ROWS = [17, 32, 33]
# SWEEP_SET=16: a tree of 15 (16 rows) where the weight stream is fast (H200): fewer, wider tiles cut the x traffic
ROWS16_VARIANTS = {**SWEEP_VARIANTS[16], **{
    f"n{n} s{s} w{w} wv{v}{' bal' if b else ''}{f' d{d}' if d else ''}":
        dict(block_n=n, stages=s, warps=w, waves=v, balance=b, dot_rows=d)
    for n, s, w, v, b, d in [(64, 4, 4, 2, True, 0), (64, 4, 4, 2, True, 8), (64, 3, 4, 1, False, 8),
                             (64, 3, 4, 4, False, 8), (128, 3, 4, 2, True, 0), (128, 2, 4, 2, True, 0),
                             (128, 3, 8, 2, True, 0), (128, 3, 4, 2, True, 8), (128, 3, 8, 2, True, 8),
                             (128, 4, 8, 1, False, 0), (256, 2, 8, 2, True, 0)]}}
INT8_SWEEP = {"s4": dict(stages=4), "s3": dict(stages=3), "n64 s4": dict(block_n=64, stages=4),
              "n64 s3": dict(block_n=64, stages=3),
              # 2 or 4 K blocks a step (blocks_per_step): group 32's blocks are 64 inputs, 4 KB of codes a 64-row tile
              "k2": dict(blocks_per_step=2), "k4": dict(blocks_per_step=4), "k4 s2": dict(blocks_per_step=4, stages=2),
              "k4 s4": dict(blocks_per_step=4, stages=4), "k4 n64 s2": dict(block_n=64, blocks_per_step=4, stages=2),
              "k4 n128 s2": dict(block_n=128, blocks_per_step=4, stages=2)}


def changed(cfg: wq.KernelConfig, changes: dict) -> wq.KernelConfig:
    """cfg with a variant's changes (a callable value: computed from cfg)."""
    return replace(cfg, **{key: value(cfg) if callable(value) else value for key, value in changes.items()})


def sweep() -> None:
    """Tile width, pipeline depth and K splits around the default config: every int4 shape at M = 1, 8 and 16,
    the int8 shapes at M = 1 and 8."""
    records = []
    chosen = os.environ.get("SWEEP_SET")
    deep, tree, rows16, ws = chosen == "deep", chosen == "tree", chosen == "16", chosen == "ws"
    int8_only = chosen == "int8"
    only = os.environ.get("SWEEP_SHAPES", "").split(",") if os.environ.get("SWEEP_SHAPES") else None
    tree_rows = [17, 32] if ws else TREE_ROWS
    all_rows = tree_rows if tree or ws else [16] if rows16 else [1, 8, 16]
    tables = {0: TREE_VARIANTS} if tree else {0: WS_VARIANTS} if ws else {16: ROWS16_VARIANTS} if rows16 else \
        DEEP_VARIANTS if deep else SWEEP_VARIANTS
    for sname, n, k in [s for s in SHAPES if (only is None or s[0] in only) and not int8_only]:
        variants = [("default", lambda m: wq.default_config(m, n, k), all_rows)]
        for bm, table in tables.items():
            variants += [(label, lambda m, v=v: changed(wq.default_config(m, n, k), v),
                          tree_rows if bm == 0 else [1, 8] if bm == 8 else [16]) for label, v in table.items()]
        time_shape(records, sname, n, k, 4, 128, variants)
        torch.cuda.empty_cache() if not DRY else None
    for sname, n, k, gs in [] if only or tree or rows16 or ws else INT8_SHAPES:
        variants = [("default", lambda m: wq.default_config(m, n, k, 8, gs), [1, 8])]
        variants += [(label, lambda m, v=v: replace(wq.default_config(m, n, k, 8, gs), **v), [1, 8])
                     for label, v in INT8_SWEEP.items()]
        time_shape(records, sname, n, k, 8, gs, variants)
        torch.cuda.empty_cache() if not DRY else None
    print("\nbest per shape and M (us, % of 3990 GB/s; default):")
    for sname in dict.fromkeys(r["shape"] + f" int{r['bits']}" for r in records):
        for m in [1, 8] if int8_only else all_rows:
            rs = [r for r in records if f"{r['shape']} int{r['bits']}" == sname and r["m"] == m and "us" in r]
            if rs:
                best, default = min(rs, key=lambda r: r["us"]), [r for r in rs if r["variant"] == "default"]
                d = f"{default[0]['us']:.1f} us {default[0]['pct']:.1f}%" if default else "-"
                print(f"  {sname:14s} M={m:2d} {best['variant']:16s} {best['us']:6.1f} us {best['pct']:5.1f}% "
                      f"(default {d})")
    bad = [f"{r['shape']} M={r['m']} {r['variant']}" for r in records if "error" in r or not r.get("graph_equal", 1)]
    print(f"failed or graph replay != eager: {bad or 'none'}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "quant_sweep.json").write_text(json.dumps(records, indent=1))


def main() -> None:
    if "--sweep" in sys.argv:
        if DRY:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from helpers import patch_triton_interpreter

            patch_triton_interpreter()
        return sweep()
    t0 = time.time()
    if DRY:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from helpers import patch_triton_interpreter  # numpy >= 2 vs the interpreter's program ids

        patch_triton_interpreter()
    name = "cpu (interpreter dry run)" if DRY else torch.cuda.get_device_name(DEV)
    print(f"device {name}; torch {torch.__version__}", flush=True)
    rows = [int(m) for m in sys.argv[sys.argv.index("--rows") + 1].split(",")] if "--rows" in sys.argv else None
    checks, records = [], []
    print("checks:", flush=True)
    run_checks(checks, rows or MS)
    for sname, n, k in SHAPES:
        time_shape(records, sname, n, k, 4, 128, [("default", lambda m: wq.default_config(m, n, k), rows or MS),
                                                  ("waves4", lambda m: replace(wq.default_config(m, n, k), waves=4),
                                                   [1])])
        if not DRY:
            time_bf16(records, sname, n, k, rows or MS)
            torch.cuda.empty_cache()
    for sname, n, k, gs in INT8_SHAPES:
        default = lambda m, n=n, k=k, gs=gs: wq.default_config(m, n, k, 8, gs)  # noqa: E731
        time_shape(records, sname, n, k, 8, gs, [("default", default, rows or [1, 8]),
                                                 ("triton", lambda m: replace(default(m), asm=False), rows or [1, 8])])
        if not DRY:
            torch.cuda.empty_cache()
    prod_fail = [c["check"] for c in checks if not c["ok"]] + \
        [f"{r['shape']} int{r['bits']} M={r['m']} {r['variant']}" for r in records if "error" in r
         and r["variant"] == "default"]
    alt_fail = [f"{r['shape']} int{r['bits']} M={r['m']} {r['variant']}" for r in records if "error" in r
                and r["variant"] != "default"]
    print("\nsummary: int4 % of 3990 GB/s, us (bf16 F.linear us); M=1 with waves=4; int8:")
    for r in records:
        b = [x["us"] for x in records if x["variant"] == "bf16" and x["shape"] == r["shape"] and x["m"] == r["m"]]
        if r["variant"] != "bf16":
            res = f"{r['pct']:5.1f}% {r['us']:7.1f} us" if "us" in r else "FAILED"
            print(f"  int{r['bits']} g{r['group']} {r['shape']:9s} M={r['m']:2d} {r['variant']:8s} {res}"
                  + (f" ({b[0]:.1f})" if b else ""))
    verdict = "PASS" if not prod_fail else f"FAIL: {prod_fail}"
    print(f"\nproduction configs: {verdict}; alternatives failed: {alt_fail or 'none'}; total {time.time() - t0:.0f}s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "quant_kernels.json").write_text(json.dumps(dict(
            device=name, torch=torch.__version__, peak_gbs=PEAK_GBS, checks=checks, records=records,
            production_failures=prod_fail, alternative_failures=alt_fail, total_s=time.time() - t0), indent=1))
    sys.exit(0 if not prod_fail else 1)


if __name__ == "__main__":
    main()
