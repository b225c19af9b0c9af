"""Does one persistent launch keep the weight stream going across an op boundary? The 27B's INT4 MLP (gate_up with
SwiGLU, then down: 137.9 MB of int4 codes and scales a layer) at 1, 8 and 16 rows (decode, a chain's verification, a
tree of 15's), three ways:
  engine       the engine's two launches (kernels/quant_matmul_triton.py: `wq_matmul_swiglu`, then `wq_matmul`,
               default configs, programmatic dependent launch as the engine sets it);
  persistent   one launch of SMs x PROGRAMS_PER_SM programs taking work items from a queue (an atomic counter):
               first the gate_up tiles (BN_GATE_UP outputs, every K block; silu(gate) * up stored), then the down
               items (BN_DOWN outputs over one of DOWN_SPLIT K slices of gate_up's output; the last slice of a tile
               to finish adds the slices' sums in slice order). A program that takes a down item loads its first
               weight block into registers and prefetches the next ones into L2, then waits until every gate_up tile
               of its K slice is stored (a counter per slice; the down items come slice by slice, so the first
               slices' items wait least), and the weight stream runs on while the last gate_up tiles finish;
  stream-only  the same launch without that wait (down reads whatever the buffer holds): the stream's own rate,
               what the wait costs;
and the persistent launch with down in OTHER_SPLITS K slices (1: a down tile streams all of K alone; with 160 such
tiles of 32 outputs at 5120 outputs, fewer items than programs), and with gate_up in tiles of SMALL_GATE_TILE rows.
Each timed as weight copies > 400 MB in one CUDA graph (L2 never hits), median of replays (bench/timing.py); us per
MLP, GB/s of its bytes and % of the machine's read bandwidth (measured first); then one persistent launch with each
work item's times on the GPU's global timer (`timeline`: where the boundary falls, how long the down tiles wait).
The persistent results are checked against the engine's (relative error: both sum in float32, the engine's launches
over K ranges that their schedule may split, so the two agree to rounding, not bit for bit).

The question it answers for a persistent decoding kernel (docs/benchmarks.md, "What limits each figure"): how near the
read bandwidth one launch over two ops streams (137.9 MB a layer: ~33 us at the H200's measured ~4.2 TB/s), and
how much of the gap to the engine's launches the wait between the ops gives back. An earlier persistent layer tail
(static phases behind grid-wide barriers, the next phase's weights prefetched into L2 only) measured slower than its
launches; here the queue keeps every program busy until the boundary, and the next op's first weights are already
in registers when it is crossed.

Usage (GPU, from bench/; ~1 minute): python persistent_mlp.py; JSON to $OUT/persistent_mlp.json.
CPU dry run (tiny shapes, untimed; the interpreter runs the programs one after another, so program 0 takes every item
in the queue's order and the waits pass): TRITON_INTERPRET=1 python persistent_mlp.py --dry-run
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from launch_timeline import _stamp  # bench/launch_timeline.py: a read of the GPU's global timer
from timing import dry_run, replay_ms  # bench/timing.py, beside this script

from blockspec.bench import measure_read_bandwidth
from blockspec.kernels import KernelSettings, pdl, sm_count, use
from blockspec.kernels.quant_matmul_triton import _cols, _swiglu_epilogue, wq_matmul, wq_matmul_swiglu
from blockspec.kernels.unpack_ptx import unpack_asm
from blockspec.quant.int4 import Int4Linear

HIDDEN, INTERMEDIATE = 5120, 17408  # Qwen3.5-27B
ENGINE_KERNELS = KernelSettings(pdl_level=3)  # what the engine launches an INT4 target's projections with
ROWS, BYTES_TIMED = (1, 8, 16), 400_000_000
BN_GATE_UP, BN_DOWN, PROGRAMS_PER_SM, WARPS, STAGES = 64, 32, 4, 4, 2
SMALL_GATE_TILE = 32  # gate_up's tile also timed at this height: fewer registers a thread, more programs an SM (on
# an H100: 158 -> 128 at 1-8 rows, 254 -> 168 at 16)
DOWN_SPLIT = 4  # a down tile's K in this many slices, each a work item of its own (the last one in sums them)
OTHER_SPLITS = (1, 8)  # the persistent launch also timed with down split so
PREFETCH_BLOCKS = 2  # K blocks of its weight rows (after the first, held in registers) a down tile prefetches into
# L2 before it waits


@triton.jit
def _block_sum(acc, h, scales, xb, m_ok, BN: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr, U0: tl.constexpr,
               U1: tl.constexpr, U2: tl.constexpr, U3: tl.constexpr, FRESH: tl.constexpr):
    """acc [BN, BM] += one K block: h [BN, G] int16 codes (4 groups, one a nibble of each halfword), scales [BN, 4],
    x^T group tiles at xb (FRESH: loaded past L1, as another program of this launch wrote x)."""
    s0, s1, s2, s3 = _cols(scales, BN, 4)
    for i in tl.static_range(4):
        if FRESH:
            xt = tl.load(xb + i * G, mask=m_ok, other=0.0, cache_modifier=".cg")
        else:
            xt = tl.load(xb + i * G, mask=m_ok, other=0.0)
        if ASM:
            if i == 0:
                a = tl.inline_asm_elementwise(U0, "=r,r", [h], dtype=xt.dtype, is_pure=True, pack=2)
            elif i == 1:
                a = tl.inline_asm_elementwise(U1, "=r,r", [h], dtype=xt.dtype, is_pure=True, pack=2)
            elif i == 2:
                a = tl.inline_asm_elementwise(U2, "=r,r", [h], dtype=xt.dtype, is_pure=True, pack=2)
            else:
                a = tl.inline_asm_elementwise(U3, "=r,r", [h], dtype=xt.dtype, is_pure=True, pack=2)
        else:  # the interpreter: fp32 dots
            a = ((h >> (4 * i)) & 15).to(tl.float32) - 8
            xt = xt.to(tl.float32)
        if i == 0:
            s = s0
        elif i == 1:
            s = s1
        elif i == 2:
            s = s2
        else:
            s = s3
        acc += tl.dot(a.to(xt.dtype), xt, tl.zeros(acc.shape, tl.float32)) * s.to(tl.float32)[:, None]
    return acc


@triton.jit
def _tile_sum(acc, x_ptr, stride_x, q_ptr, s_ptr, rows, n_ok, M, N, KH, FIRST, NBLK, G: tl.constexpr,
              BM: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr,
              U2: tl.constexpr, U3: tl.constexpr, FRESH: tl.constexpr):
    """acc [rows, BM] fp32 + dequant(W[rows]) @ x^T over K blocks FIRST.., int4 group G (no zero points): the main
    loop of `_wq_kernel` for one tile."""
    offs_m = tl.arange(0, BM)
    offs_c = tl.arange(0, G)
    q_rows = q_ptr + rows[:, None].to(tl.int64) * KH + offs_c[None, :]
    sz = rows[:, None] * 4 + tl.arange(0, 4)[None, :]
    x_cols = x_ptr + offs_m[None, :] * stride_x + offs_c[:, None]
    m_ok = (offs_m < M)[None, :]
    for b in tl.range(FIRST, NBLK, num_stages=STAGES):
        scales = tl.load(s_ptr + b * N * 4 + sz, mask=n_ok[:, None], other=0.0)
        h = tl.load(q_rows + b * G, mask=n_ok[:, None], other=0)
        acc = _block_sum(acc, h, scales, x_cols + b * (4 * G), m_ok, rows.shape[0], G, ASM, U0, U1, U2, U3, FRESH)
    return acc


@triton.jit
def _mlp_kernel(x_ptr, gq, gs, dq, ds, h_ptr, out_ptr, partial_ptr, sync, stamps, M, GATE_TILES, DOWN_TILES,
                PROGRAMS, H: tl.constexpr, I: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN_G: tl.constexpr,
                BN_D: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, U0: tl.constexpr,
                U1: tl.constexpr, U2: tl.constexpr, U3: tl.constexpr, WAIT: tl.constexpr, PREFETCH: tl.constexpr,
                STAMPS: tl.constexpr):
    """sync [4 + DOWN_TILES / SPLIT + SPLIT] int32, zero before the first launch and left zero by the last program
    to exit: the queue, programs exited, then per down tile its K slices summed (SPLIT > 1; their fp32 sums in
    partial [SPLIT, M, H], added in slice order by the last slice in, so the result does not depend on the order
    the slices finish), then per K slice of down the gate_up tiles stored whose outputs it reads. Down items come
    slice by slice: an item waits only for its own slice's gate_up tiles, which the queue handed out first.
    STAMPS: per work item, stamps [item] = (program, start, end of the wait, end), the times on the GPU's global
    timer (ns)."""
    NB: tl.constexpr = I // (4 * G)  # down's K blocks
    TILES = DOWN_TILES // SPLIT
    queue, exited, slices_in, stored = sync, sync + 2, sync + 4, sync + 4 + TILES
    offs_m = tl.arange(0, BM)
    item = tl.atomic_add(queue, 1)
    while item < GATE_TILES + DOWN_TILES:
        if STAMPS:
            tl.store(stamps + item * 4, tl.program_id(0).to(tl.int64))
            tl.store(stamps + item * 4 + 1, _stamp(item, True))
        if item < GATE_TILES:  # BN_G / 2 gate channels and the same channels' up rows (`_tile`'s EPI 2 layout)
            half = tl.arange(0, BN_G) % (BN_G // 2)
            channels = item * (BN_G // 2) + half
            n_ok = channels < I
            rows = tl.where(n_ok, channels + (tl.arange(0, BN_G) >= BN_G // 2).to(tl.int32) * I, 2 * I)
            acc = _tile_sum(tl.zeros([BN_G, BM], tl.float32), x_ptr, H, gq, gs, rows, n_ok, M, 2 * I, H // 4, 0,
                            H // (4 * G), G, BM, STAGES, ASM, U0, U1, U2, U3, False)
            _swiglu_epilogue(acc, item == item, h_ptr, I, item, offs_m, M, 2 * I, BN_G, BM)
            tl.debug_barrier()
            block = item * (BN_G // 2) // (4 * G)  # the down K block, and so the slice, that reads these outputs
            tl.atomic_add(stored + ((block + 1) * SPLIT - 1) // NB, 1, sem="release")
        else:
            tile = (item - GATE_TILES) % TILES  # (names of their own: Triton types a name alike in both branches)
            part = (item - GATE_TILES) // TILES
            first_block = part * NB // SPLIT
            end_block = (part + 1) * NB // SPLIT
            needed = (end_block - first_block) * (4 * G) // (BN_G // 2)
            outputs = tile * BN_D + tl.arange(0, BN_D)
            out_ok = outputs < H
            # while the last gate_up tiles finish: its first weight block into registers, the next ones into L2
            # (PDL 1: the prefetch helper's gate only)
            first_codes = tl.load(dq + outputs[:, None].to(tl.int64) * (I // 4) + first_block * G
                                  + tl.arange(0, G)[None, :], mask=out_ok[:, None], other=0)
            first_scales = tl.load(ds + first_block * H * 4 + outputs[:, None] * 4 + tl.arange(0, 4)[None, :],
                                   mask=out_ok[:, None], other=0.0)
            pdl.prefetch_rows(dq, outputs, I // 4, (first_block + 1) * G, H, I // 4, PREFETCH * G, 64, 1)
            if WAIT:
                seen = tl.atomic_add(stored + part, 0, sem="acquire")
                while seen < needed:
                    if ASM:  # back off between polls: the SM's other program still streams gate_up tiles
                        seen = tl.inline_asm_elementwise("nanosleep.u32 256; mov.b32 $0, $1;", "=r,r", [seen],
                                                         dtype=tl.int32, is_pure=False, pack=1)
                    seen = tl.atomic_add(stored + part, 0, sem="acquire")
                if STAMPS:
                    tl.store(stamps + item * 4 + 2, _stamp(seen, True))
            x_first = h_ptr + offs_m[None, :] * I + first_block * (4 * G) + tl.arange(0, G)[:, None]
            total = _block_sum(tl.zeros([BN_D, BM], tl.float32), first_codes, first_scales, x_first,
                               (offs_m < M)[None, :], BN_D, G, ASM, U0, U1, U2, U3, True)
            total = _tile_sum(total, h_ptr, I, dq, ds, outputs, out_ok, M, H, I // 4, first_block + 1, end_block, G,
                              BM, STAGES, ASM, U0, U1, U2, U3, True)
            out_mask = out_ok[:, None] & (offs_m < M)[None, :]
            if SPLIT == 1:
                tl.store(out_ptr + offs_m[None, :] * H + outputs[:, None], total.to(out_ptr.dtype.element_ty),
                         mask=out_mask)
            else:
                at = offs_m[None, :] * H + outputs[:, None]
                tl.store(partial_ptr + part * M * H + at, total, mask=out_mask)
                tl.debug_barrier()
                if tl.atomic_add(slices_in + tile, 1, sem="acq_rel") == SPLIT - 1:
                    total = tl.zeros([BN_D, BM], tl.float32)
                    for p in tl.static_range(SPLIT):
                        total += tl.load(partial_ptr + p * M * H + at, mask=out_mask, other=0.0,
                                         cache_modifier=".cg")
                    tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                    tl.atomic_xchg(slices_in + tile, 0)
        if STAMPS:
            tl.debug_barrier()
            tl.store(stamps + item * 4 + 3, _stamp(item, True))
        item = tl.atomic_add(queue, 1)
    if tl.atomic_add(exited, 1, sem="acq_rel") == PROGRAMS - 1:  # the last one out: clean for the next launch
        tl.atomic_xchg(queue, 0)
        for p in tl.static_range(SPLIT):
            tl.atomic_xchg(stored + p, 0)
        tl.atomic_xchg(exited, 0)


def persistent_mlp(x, gate_up, down, h, out, partial, sync, programs, wait=True, stamps=None, split=DOWN_SPLIT,
                   gate_tile=BN_GATE_UP):
    """silu(gate) * up of x through gate_up ([gate; up] packed int4 [2I, H]) into h [M, I] in tiles of `gate_tile`
    rows, then h @ down^T into out [M, H], down's K in `split` slices (fp32 sums in partial [>= split, M, H]), in one
    launch of `programs` programs; sync: int32 [4 + down tiles + split], zeros; with `stamps` (int64 [items, 4],
    CUDA), each work item's program and times (`_mlp_kernel`). Returns the launched kernel (its registers:
    `registers`)."""
    cuda = x.is_cuda
    unpack = [unpack_asm(4, i, False) for i in range(4)]
    gate_tiles = -(-gate_up.n // gate_tile)
    down_tiles = -(-down.n // BN_DOWN)
    assert split <= down.k // (4 * down.group_size) and (8 * down.group_size) % gate_tile == 0
    assert partial.shape[0] >= split and sync.numel() >= 4 + down_tiles + split
    return _mlp_kernel[(programs,)](x, gate_up.q, gate_up.s, down.q, down.s, h, out, partial, sync,
                                    sync if stamps is None else stamps, x.shape[0], gate_tiles,
                                    down_tiles * split, programs, H=down.n, I=gate_up.n // 2, G=gate_up.group_size,
                                    BM=max(8, triton.next_power_of_2(x.shape[0])), BN_G=gate_tile, BN_D=BN_DOWN,
                                    SPLIT=split, STAGES=STAGES, ASM=cuda, U0=unpack[0], U1=unpack[1], U2=unpack[2],
                                    U3=unpack[3], WAIT=wait, PREFETCH=PREFETCH_BLOCKS if cuda else 0,
                                    STAMPS=stamps is not None, num_warps=WARPS)


def registers(kernel) -> dict | None:
    """Registers a thread and bytes spilled of a launched kernel (what bounds the programs resident an SM: 65536
    registers); None in the interpreter."""
    if getattr(kernel, "n_regs", None) is None:
        return None
    return {"per_thread": kernel.n_regs, "spilled_bytes": kernel.n_spills}


def timeline(x, layer, h, out, partial, sync, programs) -> dict:
    """One stamped launch (not timed): us from the first item's start to the last gate_up tile's end (the
    boundary) and to the last item's end; the down tiles' waits (median, largest) and how many started before the
    boundary; items' median time (gate_up, down after its wait)."""
    gate_up, down = layer
    items = -(-gate_up.n // BN_GATE_UP) + -(-down.n // BN_DOWN) * DOWN_SPLIT
    stamps = torch.zeros(items, 4, dtype=torch.int64, device=x.device)
    persistent_mlp(x, gate_up, down, h, out, partial, sync, programs, stamps=stamps)
    t = stamps.cpu().double()
    gate = -(-gate_up.n // BN_GATE_UP)
    zero = t[:, 1].min()
    boundary = float(t[:gate, 3].max() - zero) / 1e3
    waits = (t[gate:, 2] - t[gate:, 1]) / 1e3
    return {"boundary_us": round(boundary, 2), "end_us": round(float(t[:, 3].max() - zero) / 1e3, 2),
            "down_wait_median_us": round(float(waits.median()), 2), "down_wait_max_us": round(float(waits.max()), 2),
            "down_started_before_boundary": int((t[gate:, 1] - zero < boundary * 1e3).sum()),
            "gate_up_item_median_us": round(float((t[:gate, 3] - t[:gate, 1]).median()) / 1e3, 2),
            "down_item_after_wait_median_us": round(float((t[gate:, 3] - t[gate:, 2]).median()) / 1e3, 2)}


def packed_int4(n, k, device):
    w = torch.randn(n, k, device=device) * k ** -0.5
    return Int4Linear.from_float(w, 128, True, scale_dtype=torch.bfloat16).packed()


def main():
    global HIDDEN, INTERMEDIATE, ROWS, BYTES_TIMED, DOWN_SPLIT, OTHER_SPLITS
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if "--dry-run" in sys.argv:  # down's K: 3 blocks of 512; 12 rows of a 16-row tile (the masked ones)
        dev, dtype = dry_run(), torch.float32
        HIDDEN, INTERMEDIATE, ROWS, BYTES_TIMED, DOWN_SPLIT, OTHER_SPLITS = 512, 1536, (12,), 0, 2, (1, 3)
    bandwidth = measure_read_bandwidth(dev) or 0.0  # none on the CPU
    print(f"read bandwidth {bandwidth:.0f} GB/s", flush=True)
    one = (packed_int4(2 * INTERMEDIATE, HIDDEN, dev), packed_int4(HIDDEN, INTERMEDIATE, dev))
    mlp_bytes = one[0].nbytes() + one[1].nbytes()
    copies = max(1, -(-BYTES_TIMED // mlp_bytes))
    layers = [one] + [(packed_int4(2 * INTERMEDIATE, HIDDEN, dev), packed_int4(HIDDEN, INTERMEDIATE, dev))
                      for _ in range(copies - 1)]
    programs = sm_count(dev) * PROGRAMS_PER_SM if dev.type == "cuda" else 3
    sync = torch.zeros(4 + -(-HIDDEN // BN_DOWN) + max(DOWN_SPLIT, *OTHER_SPLITS), dtype=torch.int32, device=dev)
    results = {"read_bandwidth_gb_s": round(bandwidth), "mlp_bytes": mlp_bytes, "copies": copies,
               "programs": programs, "rows": {}}
    for m in ROWS:
        x = torch.randn(m, HIDDEN, device=dev).to(dtype)
        h = torch.zeros(m, INTERMEDIATE, device=dev, dtype=dtype)
        out = torch.zeros(m, HIDDEN, device=dev, dtype=dtype)
        partial = torch.zeros(max(DOWN_SPLIT, *OTHER_SPLITS), m, HIDDEN, device=dev)
        want = wq_matmul(wq_matmul_swiglu(x, one[0]), one[1])

        def error(split=DOWN_SPLIT, gate_tile=BN_GATE_UP):
            """(relative error against the engine, the launched kernel's registers)"""
            out.zero_()
            kernel = persistent_mlp(x, *one, h, out, partial, sync, programs, split=split, gate_tile=gate_tile)
            return float((out.float() - want.float()).abs().max() / want.float().abs().max()), registers(kernel)
        checked = [error(split) for split in OTHER_SPLITS]
        checked += [error(), error(gate_tile=SMALL_GATE_TILE)]
        err = max(e for e, _ in checked)
        row = {"persistent_rel_err": err, "sync_left_zero": bool((sync == 0).all()),
               "registers": checked[-2][1], "registers_small_gate_tile": checked[-1][1]}

        def engine():
            with use(ENGINE_KERNELS):
                for gate_up, down in layers:
                    wq_matmul(wq_matmul_swiglu(x, gate_up), down, out=out)

        def persistent(wait=True, split=DOWN_SPLIT, gate_tile=BN_GATE_UP):
            for gate_up, down in layers:
                persistent_mlp(x, gate_up, down, h, out, partial, sync, programs, wait, split=split,
                               gate_tile=gate_tile)
        for name, fn in (("engine", engine), ("persistent", persistent),
                         ("stream-only", lambda: persistent(wait=False)),
                         *((f"persistent, down in {n}", lambda n=n: persistent(split=n)) for n in OTHER_SPLITS),
                         (f"persistent, gate_up tiles of {SMALL_GATE_TILE}",
                          lambda: persistent(gate_tile=SMALL_GATE_TILE))):
            us = replay_ms(fn) * 1e3 / copies
            row[name] = {"us": round(us, 2), "gb_s": round(mlp_bytes / us / 1e3),
                         "pct": round(mlp_bytes / us / 1e3 / bandwidth * 100, 1) if bandwidth else None}
        if dev.type == "cuda":
            row["timeline"] = timeline(x, one, h, out, partial, sync, programs)
        row["persistent_rel_err_after"] = error()[0]  # after the timed replays: still the engine's result
        results["rows"][m] = row
        print(f"M={m}: " + "; ".join(f"{k} {v['us']:.1f} us {v['gb_s']} GB/s ({v['pct']} %)"
                                     for k, v in row.items() if isinstance(v, dict) and "us" in v)
              + f"; rel err {err:.1e} / {row['persistent_rel_err_after']:.1e}, sync clean {row['sync_left_zero']}"
              + f"; registers {row['registers']} ({SMALL_GATE_TILE}-row gate_up tiles: "
              + f"{row['registers_small_gate_tile']})"
              + (f"\n  one persistent launch's stamps: {row['timeline']}" if "timeline" in row else ""), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "persistent_mlp.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
