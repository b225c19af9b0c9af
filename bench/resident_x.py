"""Can a W4A16 launch at a draft tree's rows read its activation rows once per program? Today every program of
`wq_matmul` (kernels/quant_matmul_triton.py) reads its x rows over its K range for its one tile: at 16 rows as many
bytes of x as of int4 weights (from L2), at 32 twice as many, which is why a tree of 31 costs the INT4 target 1.43x
the chain's cycle on the H200 (docs/benchmarks.md, "Draft trees"). Here each program owns one K slice of BLOCKS
blocks (1024 input features), loads that slice of x once into registers, then streams the int4 weights of every
tile it is given over that slice (tiles spread over the programs of each slice), its partial sums finished by the
last program to arrive at each tile (split-K in a fixed order, as the engine's launches sum theirs). x read in all:
programs x rows x 1024 x 2 bytes (~8 MB at 16 rows against 92 MB for gate_up today); partials written and read: K
slices x rows x N x 4 bytes, through L2.

For the 27B's projections at 8, 16 and 32 rows (decode, a tree of 15, a tree of 31): us per launch of the engine's
default config and of the resident-x launch in each of VARIANTS (tile width, programs an SM), GB/s of the weights'
bytes and % of the machine's read bandwidth (measured first), and the resident results' relative error against the
engine's (both sum in float32; their K splits differ, so they agree to rounding). Weight copies > 400 MB in one
CUDA graph, median of replays (bench/timing.py).

Usage (GPU, from bench/; ~1 minute): python resident_x.py; JSON to $OUT/resident_x.json.
CPU dry run (tiny shapes, untimed): TRITON_INTERPRET=1 python resident_x.py --dry-run
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.bench import measure_read_bandwidth
from blockspec.kernels import arrival_counters, sm_count
from blockspec.kernels.linear_triton import split_k_total
from blockspec.kernels.quant_matmul_triton import _cols, unpack_asm, wq_matmul
from blockspec.quant.int4 import Int4Linear

SHAPES = {"gate_up": (34816, 5120), "gdn_in": (16480, 5120), "down": (5120, 17408), "o": (5120, 6144)}
ROWS, BYTES_TIMED = (8, 16, 32), 400_000_000
BLOCKS = 2                 # K blocks (4 groups of 128) of x each program holds: 1024 features
STAGES = 3
VARIANTS = {"n64 p2": (64, 2), "n64 p1": (64, 1), "n64 p3": (64, 3), "n128 p1": (128, 1)}  # (BN, programs per SM)


@triton.jit
def _group_dot(acc, h, xt, s, IDX: tl.constexpr, ASM: tl.constexpr, U: tl.constexpr):
    """acc += s * (code IDX of every halfword of h [BN, G], minus 8) @ xt [G, BM] (`_wq_kernel`'s `_group`)."""
    if ASM:
        a = tl.inline_asm_elementwise(U, "=r,r", [h], dtype=xt.dtype, is_pure=True, pack=2)
        return acc + tl.dot(a, xt, tl.zeros(acc.shape, tl.float32)) * s.to(tl.float32)[:, None]
    a = ((h >> (4 * IDX)) & 15).to(tl.float32) - 8  # the interpreter: fp32 dots
    return acc + tl.dot(a, xt.to(tl.float32), tl.zeros(acc.shape, tl.float32)) * s.to(tl.float32)[:, None]


@triton.jit
def _block_dot(acc, q_rows, s_ptr, sz, n_ok, N, b, x0, x1, x2, x3, G: tl.constexpr, BN: tl.constexpr,
               ASM: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, U3: tl.constexpr):
    """acc += the tile's int4 block b times the four x group tiles held in registers."""
    h = tl.load(q_rows + b * G, mask=n_ok[:, None], other=0)
    s0, s1, s2, s3 = _cols(tl.load(s_ptr + b * N * 4 + sz, mask=n_ok[:, None], other=0.0), BN, 4)
    acc = _group_dot(acc, h, x0, s0, 0, ASM, U0)
    acc = _group_dot(acc, h, x1, s1, 1, ASM, U1)
    acc = _group_dot(acc, h, x2, s2, 2, ASM, U2)
    return _group_dot(acc, h, x3, s3, 3, ASM, U3)


@triton.jit
def _resident_kernel(x_ptr, q_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, TILES, PER_SLICE,
                     SPLIT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     STAGES: tl.constexpr, ASM: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr,
                     U2: tl.constexpr, U3: tl.constexpr):
    """Program pid: K slice pid % SPLIT (blocks 2 * slice, 2 * slice + 1), tiles pid // SPLIT, + PER_SLICE, ..."""
    pid = tl.program_id(0)
    part = pid % SPLIT
    offs_m = tl.arange(0, BM)
    offs_c = tl.arange(0, G)
    m_ok = (offs_m < M)[None, :]
    xb = x_ptr + offs_m[None, :] * K + offs_c[:, None] + part * (8 * G)  # x^T group tiles [G, BM] of the slice
    x0 = tl.load(xb, mask=m_ok, other=0.0)
    x1 = tl.load(xb + G, mask=m_ok, other=0.0)
    x2 = tl.load(xb + 2 * G, mask=m_ok, other=0.0)
    x3 = tl.load(xb + 3 * G, mask=m_ok, other=0.0)
    x4 = tl.load(xb + 4 * G, mask=m_ok, other=0.0)
    x5 = tl.load(xb + 5 * G, mask=m_ok, other=0.0)
    x6 = tl.load(xb + 6 * G, mask=m_ok, other=0.0)
    x7 = tl.load(xb + 7 * G, mask=m_ok, other=0.0)
    for tile in tl.range(pid // SPLIT, TILES, PER_SLICE, num_stages=STAGES):
        rows = tile * BN + tl.arange(0, BN)
        n_ok = rows < N
        q_rows = q_ptr + rows[:, None].to(tl.int64) * (K // 4) + offs_c[None, :]
        sz = rows[:, None] * 4 + tl.arange(0, 4)[None, :]
        acc = tl.zeros([BN, BM], tl.float32)
        acc = _block_dot(acc, q_rows, s_ptr, sz, n_ok, N, 2 * part, x0, x1, x2, x3, G, BN, ASM, U0, U1, U2, U3)
        acc = _block_dot(acc, q_rows, s_ptr, sz, n_ok, N, 2 * part + 1, x4, x5, x6, x7, G, BN, ASM, U0, U1, U2, U3)
        total, done = split_k_total(acc, ws_ptr, cnt_ptr, rows, offs_m, M, N, tile, part, SPLIT)
        tl.store(out_ptr + offs_m[None, :] * N + rows[:, None], total.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & (offs_m < M)[None, :] & done)


def resident_matmul(x, packed, out, bn, programs_per_sm):
    """y = x @ dequant(W)^T for int4 group-128 weights without zero points, K a multiple of 1024: tiles of bn
    outputs, about programs_per_sm programs an SM."""
    m, k = x.shape
    split, rest = divmod(k, BLOCKS * 4 * packed.group_size)
    if rest or packed.z is not None:
        raise ValueError(f"resident_matmul takes K a multiple of {BLOCKS * 4 * packed.group_size} and no zero points")
    programs_per_slice = max(1, round(sm_count(x.device) * programs_per_sm / split)) if x.is_cuda else 2
    tiles = -(-packed.n // bn)
    ws = torch.empty(split * m * packed.n, dtype=torch.float32, device=x.device)
    unpack = [unpack_asm(4, i, False) for i in range(4)]
    _resident_kernel[(split * programs_per_slice,)](
        x, packed.q, packed.s, out, ws, arrival_counters(x.device, tiles), m, packed.n, k, tiles, programs_per_slice,
        SPLIT=split, G=packed.group_size, BN=bn, BM=max(8, triton.next_power_of_2(m)), STAGES=STAGES,
        ASM=x.is_cuda, U0=unpack[0], U1=unpack[1], U2=unpack[2], U3=unpack[3],
        num_warps=8 if m > 16 or bn > 64 else 4)
    return out


def timing(packed, us: float, bandwidth: float) -> dict:
    return {"us": round(us, 2), "gb_s": round(packed.nbytes() / us / 1e3),
            "pct": round(packed.nbytes() / us / 1e3 / bandwidth * 100, 1) if bandwidth else None}


def packed_int4(n, k, device):
    w = torch.randn(n, k, device=device) * k ** -0.5
    return Int4Linear.from_float(w, 128, True, scale_dtype=torch.bfloat16).packed()  # symmetric: no zero points


def main():
    global SHAPES, ROWS, BYTES_TIMED
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if "--dry-run" in sys.argv:
        dev, dtype = dry_run(), torch.float32
        SHAPES, ROWS, BYTES_TIMED = {"tiny": (200, 2048)}, (3, 12), 0
    bandwidth = measure_read_bandwidth(dev) or 0.0  # none on the CPU
    print(f"read bandwidth {bandwidth:.0f} GB/s", flush=True)
    results = {"read_bandwidth_gb_s": round(bandwidth), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        first = packed_int4(n, k, dev)
        copies = max(1, -(-BYTES_TIMED // first.nbytes()))
        packed = [first] + [packed_int4(n, k, dev) for _ in range(copies - 1)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev).to(dtype)
            out = torch.empty(m, n, device=dev, dtype=dtype)
            want = wq_matmul(x, first)
            us = replay_ms(lambda: [wq_matmul(x, w, out=out) for w in packed]) * 1e3 / copies
            row = {"k_slices": k // (BLOCKS * 4 * first.group_size), "engine": timing(first, us, bandwidth)}
            for label, (bn, per_sm) in VARIANTS.items():
                resident_matmul(x, first, out, bn, per_sm)
                err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
                us = replay_ms(lambda: [resident_matmul(x, w, out, bn, per_sm) for w in packed]) * 1e3 / copies
                resident_matmul(x, first, out, bn, per_sm)  # after the graph replays: still the engine's result
                after = float((out.float() - want.float()).abs().max() / want.float().abs().max())
                row[label] = {**timing(first, us, bandwidth), "rel_err": err, "rel_err_after": after}
            results["shapes"].setdefault(name, {})[m] = row
            print(f"{name} M={m} ({row['k_slices']} K slices): " + "; ".join(
                f"{label} {r['us']:.1f} us ({r['pct']} %)" for label, r in row.items() if isinstance(r, dict))
                + f"; rel err up to {max(r.get('rel_err', 0) for r in row.values() if isinstance(r, dict)):.1e}",
                flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "resident_x.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
