"""What limits the W4A16 projections of the 27B layers (16-92 MB) at 1-16 rows? Experiments behind
docs/benchmarks.md ("Session 9"), GPU only (inline PTX).

`--experiment parts` (default): an empty kernel's launch, then o / q rows with K cut to 1-12 blocks, split-K on and off
(the fixed cost of a launch and the per-block cost of a program's loop).

`--experiment barrier`: per phase of a few MB, one launch per phase (a graph) against one persistent launch with
a grid-wide barrier between phases, the next phase's weights loaded before the barrier or after it.

`--experiment l2`:
Per 27B projection shape and row count, CUDA graphs of C launches over C weight copies (> 200 MB, as
bench/quant_kernels.py times them), median of 7 replays / C:
  cold       kernel(w_i)                                   the usual figure: every byte from HBM
  hot        kernel(w_0) C times                           weights L2-resident where they fit (50 MB L2)
  spin       spin(S us)                                    a stand-in for a small kernel that leaves HBM idle
  spin_cold  spin, kernel(w_i)
  spin_pf    prefetch(w_i), spin, kernel(w_i)              the weights streamed into L2 while HBM is idle
  next_pf<f> prefetch(first f of w_{i+1}), kernel(w_i)     the next weights streamed in under the current kernel
The prefetch kernel issues `cp.async.bulk.prefetch.L2` (one instruction per CHUNK bytes: the copy engine does the
rest) or, as `lines`, one `prefetch.global.L2` per 128-byte line. (spin_pf - spin) against cold says how much faster
a projection runs from L2; next_pf against cold says whether the next weights can be streamed in under a kernel.

Usage (GPU, repo root): python bench/w4a16_latency.py [--experiment parts|barrier|l2] [--shapes o,q,...] [--ms 1,8]
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from blockspec.quant import w4a16_triton as wq  # noqa: E402
from quant_kernels import SHAPES, random_weight  # noqa: E402
from timing import replay_ms  # noqa: E402

CHUNK = 16384


@triton.jit
def _bulk_prefetch(base, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Program p: chunks [p * PER, +PER) of CHUNK bytes of [base, base + nbytes) into L2 (nbytes % 16 == 0)."""
    offs = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.b32 $0, 0; }", "=r,l,r", [base + tl.where(size > 0, offs, 0), size],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch(base, nbytes, PER: tl.constexpr):
    offs = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * 128
    ok = offs < nbytes
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [base + tl.where(ok, offs, 0), ok.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _spin(ns):
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, fraction: float, how: str) -> None:
    flat = t.view(-1).view(torch.uint8)
    nbytes = int(flat.numel() * fraction) // 16 * 16
    if nbytes == 0:
        return
    if how == "bulk":
        per = 32
        _bulk_prefetch[(triton.cdiv(nbytes, CHUNK * per),)](flat, nbytes, CHUNK=CHUNK, PER=per, num_warps=1)
    else:
        per = 1024
        _line_prefetch[(triton.cdiv(nbytes, 128 * per),)](flat, nbytes, PER=per, num_warps=4)


def prefetch_weight(w: wq.PackedWeight, fraction: float, how: str) -> None:
    prefetch(w.q, fraction, how)
    prefetch(w.s, fraction, how)


def weights(n, k):
    probe = random_weight(n, k, 4, 128)
    copies = max(2, -(-int(200e6) // probe.nbytes()))
    return [probe] + [random_weight(n, k, 4, 128) for _ in range(copies)], copies  # one spare: w_{i+1} of the last


@triton.jit
def _phase(w, out, ph, P, TILE: tl.constexpr):
    """One phase as its own launch: program p sums its TILE int32 of phase ph."""
    pid = tl.program_id(0)
    v = tl.load(w + (ph * P + pid).to(tl.int64) * TILE + tl.arange(0, TILE))
    tl.store(out + pid, tl.sum(v, 0))


@triton.jit
def _grid_barrier(counter, target):
    tl.debug_barrier()  # this program's work of the phase is done
    tl.atomic_add(counter, 1, sem="release")
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")


@triton.jit
def _persistent_phases(w, out, counter, P, PHASES, TILE: tl.constexpr, AHEAD: tl.constexpr):
    """PHASES phases in one launch, a grid-wide barrier (atomic count, spin) after each; AHEAD: the next phase's
    tile is loaded before the barrier (weights do not depend on the previous phase's output)."""
    pid = tl.program_id(0)
    acc = tl.zeros([TILE], tl.int32)
    nxt = tl.load(w + pid.to(tl.int64) * TILE + tl.arange(0, TILE))
    for ph in range(PHASES):
        if AHEAD:
            v = nxt
            nxt = tl.load(w + ((ph + 1) % PHASES * P + pid).to(tl.int64) * TILE + tl.arange(0, TILE))
        else:
            v = tl.load(w + (ph * P + pid).to(tl.int64) * TILE + tl.arange(0, TILE))
        acc += v
        tl.store(out + pid, tl.sum(acc, 0))
        _grid_barrier(counter, (ph + 1) * P)
    tl.store(out + pid, tl.sum(acc + nxt * 0, 0))


def barrier_experiment(args):
    """What a persistent kernel over several projections would save: per phase (every program reads one TILE of
    int32 weights), PHASES launches in a graph against one launch with a grid-wide barrier after each phase, with
    and without the next phase's tile loaded before the barrier."""
    dev, records, phases = torch.device("cuda"), [], 20
    out = torch.empty(4096, device=dev, dtype=torch.int32)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    for programs, tile in ((132, 4096), (264, 4096), (264, 1024), (528, 1024)):
        w = torch.randint(0, 100, (phases * programs * tile,), device=dev, dtype=torch.int32)
        row = dict(programs=programs, tile_kb=tile * 4 // 1024, mb_per_phase=round(programs * tile * 4 / 1e6, 2))
        row["launches_us"] = replay_ms(lambda: [_phase[(programs,)](w, out, ph, programs, TILE=tile, num_warps=4)
                                                for ph in range(phases)], reps=7) * 1e3 / phases
        for ahead in (0, 1):
            def persistent():
                counter.zero_()
                _persistent_phases[(programs,)](w, out, counter, programs, phases, TILE=tile, AHEAD=ahead,
                                                num_warps=4)
            row[f"barrier_ahead{ahead}_us"] = replay_ms(persistent, reps=7) * 1e3 / phases
        records.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(records[-1]), flush=True)
    return records


@triton.jit
def _empty(out):
    tl.store(out + tl.program_id(0), 0)


def parts_experiment(args):
    """Where a mid-size launch's time goes: an empty kernel on the same grid, then the o / q projections' rows with
    K cut to 1-12 blocks of 512 inputs, split-K off (waves 0) and default, cold; the slope over K is the per-block
    cost of a program's serial loop, the intercept the launch's fixed cost."""
    dev, records = torch.device("cuda"), []
    flag = torch.empty(1 << 16, device=dev, dtype=torch.int32)
    for programs in (80, 240, 528):
        us = replay_ms(lambda: [_empty[(programs,)](flag) for _ in range(50)], reps=7) * 1e3 / 50
        records.append(dict(what="empty", programs=programs, us=round(us, 2)))
        print(f"empty kernel, {programs} programs: {us:.2f} us per launch", flush=True)
    for name, n in (("o", 5120), ("q", 12288)):
        for blocks in (1, 2, 4, 8, 12):
            k = 512 * blocks
            ws, copies = weights(n, k)
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(1, n, device=dev, dtype=x.dtype)
            base = wq.default_config(1, n, k)
            for label, cfg in (("default", base), ("split1", replace(base, waves=0))):
                split = wq.split_k(cfg, n, k // 512)[0]
                us = replay_ms(lambda: [wq.wq_matmul(x, ws[i], cfg, out=out) for i in range(copies)], reps=7) * 1e3 \
                    / copies
                records.append(dict(what=name, n=n, k=k, blocks=blocks, cfg=label, split=split, us=round(us, 2),
                                    mb=round(ws[0].nbytes() / 1e6, 2)))
                print(f"{name} N={n} K={k:5d} ({blocks:2d} blocks) {label:8s} split {split}: {us:6.2f} us "
                      f"({ws[0].nbytes() / 1e6:5.1f} MB)", flush=True)
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", default="parts")
    ap.add_argument("--shapes", default="o,gdn_qkv,down,gate_up")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--spin-us", type=float, default=10.0)
    ap.add_argument("--how", default="bulk,lines")
    args = ap.parse_args()
    if args.experiment in ("parts", "barrier"):
        records = (parts_experiment if args.experiment == "parts" else barrier_experiment)(args)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"w4a16_{args.experiment}.json").write_text(json.dumps(records, indent=1))
        return
    dev = torch.device("cuda")
    spin_ns = int(args.spin_us * 1000)
    records = []
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        ws, copies = weights(n, k)
        probe, nb = ws[0], ws[0].nbytes()
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=x.dtype)
            ref = wq.wq_matmul(x, probe).clone()

            def kern(w):
                wq.wq_matmul(x, w, out=out)
            variants = {
                "cold": lambda: [kern(ws[i]) for i in range(copies)],
                "hot": lambda: [kern(ws[0]) for _ in range(copies)],
                "spin": lambda: [_spin[(1,)](spin_ns) for _ in range(copies)],
                "spin_cold": lambda: [(_spin[(1,)](spin_ns), kern(ws[i])) for i in range(copies)],
            }
            for how in args.how.split(","):
                variants[f"spin_pf_{how}"] = lambda how=how: [
                    (prefetch_weight(ws[i], 1.0, how), _spin[(1,)](spin_ns), kern(ws[i])) for i in range(copies)]
                for f in (0.25, 0.5, 1.0):
                    variants[f"next_pf{f}_{how}"] = lambda f=f, how=how: [
                        (prefetch_weight(ws[i + 1], f, how), kern(ws[i])) for i in range(copies)]
            row = dict(shape=name, n=n, k=k, m=m, mb=round(nb / 1e6, 1), copies=copies)
            for label, fn in variants.items():
                row[label] = round(replay_ms(fn, reps=7) * 1e3 / copies, 2)
            kern(probe)
            row["ok"] = bool(torch.equal(out, ref))
            row["spin_pf_bulk_net"] = round(row.get("spin_pf_bulk", 0) - row["spin"], 2)
            records.append(row)
            print(json.dumps(row), flush=True)
    print("\nus per launch (net = with the spin's time taken off); % of 3990 GB/s for cold / hot / net")
    for r in records:
        pct = {key: r["mb"] / r[key] / 3.99 * 100 for key in ("cold", "hot")}
        print(f"{r['shape']:8s} M={r['m']:2d} {r['mb']:6.1f} MB  cold {r['cold']:6.2f} ({pct['cold']:4.1f}%)  "
              f"hot {r['hot']:6.2f} ({pct['hot']:4.1f}%)  spin {r['spin']:5.2f}  spin_cold-spin "
              f"{r['spin_cold'] - r['spin']:6.2f}  " + "  ".join(
                  f"{key} {r[key]:6.2f}" for key in r if key.startswith(("spin_pf", "next_pf"))) + f"  ok {r['ok']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w4a16_l2.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
