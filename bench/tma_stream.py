"""Does a bulk copy (TMA) feed the W4A16 kernel's weight stream faster than its per-thread loads? The engine's
kernel (kernels/quant_matmul_triton.py `_wq_kernel`) loads each [BN, G] tile of int16 codes through pointers, which
Triton's pipeliner turns into cp.async copies: every thread computes and issues its own 16-byte copies, and the
copies in flight per SM are bounded by the programs resident there and their stages. A tensor descriptor moves the
same tile with one TMA instruction into shared memory, so a program keeps more bytes in flight for fewer registers
and instructions; a persistent decoding kernel would stream its weights this way (docs/benchmarks.md, "What limits
each figure").

Variants, each at the engine's default config and schedule for the shape and rows (the same tiles, split-K and
summation order, so the results equal the engine's bit for bit):
  engine        `wq_matmul` as the engine launches it, and with programmatic dependent launch off (`pdl 0`), the
                setting the variants below run at (they do not wait on or release the next launch);
  tma           the codes through a tensor descriptor, the scales through pointers one block ahead (as the engine);
  tma scales    the scales through a second descriptor too ([blocks, N * 4]: a tile's 4 scales a row in one box);
  tma +1 stage  `tma` one pipeline stage deeper, and two (+2): shared memory holds stages - 1 tiles of codes in
                flight (sm_90 PTX compiled here: 1 at the 8-row config's 2 stages, 2 at the 16-row one's 3);
  tma ws        `tma` with Triton's warp specialization of the loop (a producer warp issues the copies), where it
                compiles;
  x once        `tma` with every block's dots reading the program's first x block (L1 keeps it): not the product's
                result, a bound on what x staged once per SM (in shared memory, a persistent kernel) would give, as
                every program of the engine reads its x rows over its K range from L2 (at 16 rows as many bytes as
                the int4 weights, at 32 twice as many).
The 27B's INT4 projections (gate_up, gdn in, down, o) at 1, 8, 16 and 32 rows; each timed as weight copies > 300 MB in
one CUDA graph (L2 never hits), median of replays (bench/timing.py); us per launch, GB/s and % of the machine's read
bandwidth (measured first), and each launched kernel's registers a thread and bytes spilled (65536 registers an SM
bound the programs resident there). A variant that fails to compile is recorded with its error, not fatal.

Prediction (H200, before measuring): the engine's launches reach 62-70 % of the read bandwidth on these shapes at 8
rows; if per-thread copies bound the stream, tma reaches >= 80 %; if the ramp and tail of each launch or HBM's
access pattern bound it, tma ties.

Usage (GPU, from bench/; ~1 minute): python tma_stream.py; JSON to $OUT/tma_stream.json.
CPU dry run (tiny shapes, untimed; descriptors in the interpreter): TRITON_INTERPRET=1 python tma_stream.py --dry-run
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from persistent_mlp import registers  # bench/persistent_mlp.py
from timing import dry_run, replay_ms  # bench/timing.py, beside this script
from triton.tools.tensor_descriptor import TensorDescriptor

from blockspec.bench import measure_read_bandwidth
from blockspec.kernels import KernelSettings, arrival_counters, launch_fitting, sm_count, use
from blockspec.kernels.quant_matmul_triton import (_cols, _group, _tile, _wq_kernel, default_config, finish,
                                                   launch_plan, schedule, wq_matmul)
from blockspec.kernels.unpack_ptx import unpack_asm
from blockspec.quant.int4 import Int4Linear

SHAPES = [("gate_up", 34816, 5120), ("gdn_in", 16480, 5120), ("down", 5120, 17408), ("o", 5120, 6144)]
ROWS, BYTES_TIMED = (1, 8, 16, 32), 300_000_000
ENGINE_PDL = 3  # the programmatic dependent launch level the engine launches an INT4 target's projections at
VARIANTS = {"tma": dict(), "tma scales": dict(scale_desc=True), "tma +1 stage": dict(extra_stages=1),
            "tma +2 stages": dict(extra_stages=2), "tma ws": dict(warp_specialize=True), "x once": dict(x_once=True)}
INEXACT = {"x once"}  # variants timed as bounds: their results are not the product's


@triton.jit
def _tma_kernel(x_ptr, q_desc, s_ptr, s_desc, out_ptr, ws_ptr, cnt_ptr, M, N, K, NBLK, WHOLE, REST, BPS, SPLIT,
                stride_xm, stride_om, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr,
                ASM: tl.constexpr, F32DOT: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
                U3: tl.constexpr, HALVES: tl.constexpr, SCALE_DESC: tl.constexpr, WS: tl.constexpr,
                X_ONCE: tl.constexpr):
    """`_wq_kernel` for int4 group-G codes without zero points, K a whole number of blocks and a plain store: the
    same tiles, the same per-group dots (HALVES 2: two of BM / 2 rows on one operand) and split-K total, the codes'
    tile [BN, G] through q_desc (and with SCALE_DESC the block's [BN, 4] scales through s_desc). X_ONCE: every
    block's dots read the program's first x block (a timing bound, not the product)."""
    pid_n, pid_k, whole, tile_split, offs_n, n_ok = _tile(WHOLE, REST, SPLIT, N, BN, 0)
    MB: tl.constexpr = BM // HALVES
    offs_m = tl.arange(0, MB)
    offs_c = tl.arange(0, G)
    sz_off = offs_n[:, None] * 4 + tl.arange(0, 4)[None, :]
    x_cols = x_ptr + offs_m[None, :] * stride_xm + offs_c[:, None]
    m_ok = (offs_m < M)[None, :]
    m_hi = (offs_m + MB < M)[None, :]
    hi = MB * stride_xm
    b_lo = pid_k * BPS
    b_hi = tl.where(whole, NBLK, tl.minimum(b_lo + BPS, NBLK))
    acc = tl.zeros([BN, MB], tl.float32)
    acc_hi = tl.zeros([BN, MB], tl.float32)
    for b in tl.range(b_lo, b_hi, num_stages=STAGES, warp_specialize=WS):
        if SCALE_DESC:
            s = tl.reshape(s_desc.load([b, pid_n * BN * 4]), [BN, 4])
        else:
            s = tl.load(s_ptr + b * N * 4 + sz_off, mask=n_ok[:, None], other=0.0)
        s0, s1, s2, s3 = _cols(s, BN, 4)
        h = q_desc.load([pid_n * BN, b * G])
        if X_ONCE:
            xb = x_cols + b_lo * (4 * G)
        else:
            xb = x_cols + b * (4 * G)
        acc, acc_hi = _group(acc, acc_hi, h, xb, m_ok, m_hi, hi, s0, s0, 0, 4, U0, BN, MB, False, ASM, F32DOT,
                             False, HALVES)
        acc, acc_hi = _group(acc, acc_hi, h, xb + G, m_ok, m_hi, hi, s1, s1, 1, 4, U1, BN, MB, False, ASM, F32DOT,
                             False, HALVES)
        acc, acc_hi = _group(acc, acc_hi, h, xb + 2 * G, m_ok, m_hi, hi, s2, s2, 2, 4, U2, BN, MB, False, ASM,
                             F32DOT, False, HALVES)
        acc, acc_hi = _group(acc, acc_hi, h, xb + 3 * G, m_ok, m_hi, hi, s3, s3, 3, 4, U3, BN, MB, False, ASM,
                             F32DOT, False, HALVES)
    if HALVES == 2:
        acc = tl.reshape(tl.permute(tl.join(acc, acc_hi), [0, 2, 1]), [BN, BM])
    finish(acc, tl.zeros([1, BM], tl.float32), out_ptr, ws_ptr, cnt_ptr, out_ptr, out_ptr, out_ptr, ws_ptr, M, N, K,
           WHOLE, REST, SPLIT, stride_om, 0.0, BN, BM, 0, 0, False)


def tma_matmul(x, pw, out, scale_desc=False, extra_stages=0, warp_specialize=False, x_once=False):
    """out [M, N] = x [M, K] @ dequant(W)^T through `_tma_kernel`, at the engine's default config and schedule;
    returns the launched kernel."""
    m, cuda = x.shape[0], x.is_cuda
    cfg = default_config(m, pw.n, pw.k, pw.bits, pw.group_size)
    assert pw.bits == 4 and pw.z is None and pw.k % (4 * pw.group_size) == 0
    nblk = pw.q.shape[1] // pw.group_size
    whole, split, bps = schedule(cfg, pw.n, nblk, sm_count(x.device))
    tiles = -(-pw.n // cfg.block_n)
    programs = whole + (tiles - whole) * split
    ws = torch.empty(split * m * pw.n if split > 1 else 1, dtype=torch.float32, device=x.device)
    q_desc = TensorDescriptor.from_tensor(pw.q, [cfg.block_n, pw.group_size])
    s_desc = TensorDescriptor.from_tensor(pw.s.view(nblk, pw.n * 4), [1, cfg.block_n * 4])
    unpack = [unpack_asm(4, i, x.dtype == torch.float16) for i in range(4)]
    counters = arrival_counters(x.device, tiles)
    return _tma_kernel[(programs,)](
        x, q_desc, pw.s, s_desc, out, ws, counters, m, pw.n, pw.k, nblk, whole, tiles - whole, bps, split,
        x.stride(0), out.stride(0), G=pw.group_size, BN=cfg.block_n, BM=cfg.block_m,
        STAGES=cfg.stages + extra_stages, ASM=cuda and cfg.asm, F32DOT=not cuda, U0=unpack[0], U1=unpack[1],
        U2=unpack[2], U3=unpack[3], HALVES=cfg.block_m // cfg.dot_rows if cfg.dot_rows else 1,
        SCALE_DESC=scale_desc, WS=warp_specialize, X_ONCE=x_once, num_warps=cfg.warps)


def packed_int4(n, k, device):
    w = torch.randn(n, k, device=device) * k ** -0.5
    return Int4Linear.from_float(w, 128, True, scale_dtype=torch.bfloat16).packed()


def main():
    global SHAPES, ROWS, BYTES_TIMED, VARIANTS
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if "--dry-run" in sys.argv:  # 3 and 17 K blocks of 512 (the last: down's two 8-row dots at 12 rows), 3 and 2
        # tiles of 64 outputs, the last one short; the interpreter ignores stages and warp specialization
        dev, dtype = dry_run(), torch.float32
        SHAPES, ROWS, BYTES_TIMED = [("tiny", 130, 1536, (1, 12)), ("tiny long", 70, 8704, (12,))], None, 0
        VARIANTS = {label: VARIANTS[label] for label in ("tma", "tma scales", "x once")}
    bandwidth = measure_read_bandwidth(dev) or 0.0  # none on the CPU
    print(f"read bandwidth {bandwidth:.0f} GB/s", flush=True)
    results = {"read_bandwidth_gb_s": round(bandwidth), "shapes": {}}
    for name, n, k, *rows in SHAPES:
        one = packed_int4(n, k, dev)
        copies = max(1, -(-BYTES_TIMED // one.nbytes()))
        weights = [one] + [packed_int4(n, k, dev) for _ in range(copies - 1)]
        shape = results["shapes"][name] = {"n": n, "k": k, "bytes": one.nbytes(), "copies": copies, "rows": {}}
        for m in rows[0] if rows else ROWS:
            x = torch.randn(m, k, device=dev).to(dtype)
            out = torch.zeros(m, n, device=dev, dtype=dtype)
            want = wq_matmul(x, one)
            plan = launch_plan(x, one, default_config(m, n, k), out)
            engine_kernel = launch_fitting(_wq_kernel, (plan.programs,), *plan.args, stages_key="STAGES", **plan.meta)
            row = shape["rows"][m] = {"config": default_config(m, n, k).short(),
                                      "engine registers": registers(engine_kernel)}

            def engine(level):
                with use(KernelSettings(pdl_level=level)):
                    for w in weights:
                        wq_matmul(x, w, out=out)
            timed = {"engine": lambda: engine(ENGINE_PDL), "engine pdl 0": lambda: engine(0)}
            for label, options in VARIANTS.items():
                try:
                    kernel = tma_matmul(x, one, out.zero_(), **options)
                except Exception as exc:  # noqa: BLE001  (a variant Triton cannot compile here: recorded)
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                    continue
                row[label] = {"registers": registers(kernel),
                              **({"bound": True} if label in INEXACT else {"equal": bool(torch.equal(out, want))})}
                timed[label] = lambda options=options: [tma_matmul(x, w, out, **options) for w in weights]
            for label, fn in timed.items():
                us = replay_ms(fn) * 1e3 / copies
                row.setdefault(label, {}).update(us=round(us, 2), gb_s=round(one.nbytes() / us / 1e3),
                                                 pct=round(one.nbytes() / us / 1e3 / bandwidth * 100, 1)
                                                 if bandwidth else None)
            print(f"{name} M={m} ({row['config']}): " + "; ".join(
                f"{label} " + (f"{v['us']:.1f} us ({v['pct']} %)" + ("" if v.get("equal", True) else " NOT EQUAL")
                               if "us" in v else f"FAILED {v['error'][:80]}") for label, v in row.items()
                if isinstance(v, dict) and ("us" in v or "error" in v)), flush=True)
            print("  registers a thread / bytes spilled: " + "; ".join(
                f"{label} {v['registers']['per_thread']} / {v['registers']['spilled_bytes']}"
                for label, v in {"engine": {"registers": row["engine registers"]}, **row}.items()
                if isinstance(v, dict) and v.get("registers")), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "tma_stream.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
