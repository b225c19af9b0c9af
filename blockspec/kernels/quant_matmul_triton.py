"""Weight-only quantized matmul for few activation rows (decode, speculative verification), in Triton: y = x @
dequant(W)^T for W in the q16 layout of quant_matmul.py (4- or 8-bit codes, or e4m3 bytes), whose plain PyTorch
functions are the CPU path and the tests' oracle.

Kernel (tensor cores, exact numerics)
-------------------------------------
  Program (pid_n, pid_k): BN output rows, a range of blocks (split-K when N alone does not fill the GPU, or for the
  tiles of a short last round over the SMs: `schedule`). Each step loads one [BN, G] int16 tile (Triton's pipeliner:
  cp.async into shared memory, num_stages deep) and the block's scales (prefetched one block ahead by hand), or 2 or
  4 blocks' tiles as one (`blocks_per_step`: group 32's blocks are 64 inputs, 4 KB of codes a 64-row tile); then per
  block and group i: A = (u_i - z) in x's dtype, exact;
  part[BN, BM] = A @ x_i^T (one MMA chain, fp32), acc += part * s_i (fp32). M <= 8 uses BM = 8, which Triton
  compiles to mma.sync, more rows BM = 16, 32 or 64 (the next power of two), which it compiles to Hopper's wgmma,
  or, with `dot_rows` 8, a 16-row tile as two 8-row dots on the same operand, mma.sync again
  (tests/test_linear_kernel.py checks these in the sm_90 PTX, compiled on the CPU): one launch serves
  every verification pass (up to MAX_PASS_TOKENS rows), streaming the weights once. Under split-K the last program
  to arrive at a tile adds the fp32 partials in a fixed order (kernels/linear_triton.split_k_total; no memset).
  Results are deterministic and a row does not depend on the other rows (row 0 of an M = 8 launch == the M = 1
  launch), but the config (through BM and the split) sets the summation order: M <= 8 and more rows may differ in
  the last bits.
  The counters are shared per device: launches on one stream at a time.
  Epilogues (`wq_matmul_add_norm`, `wq_matmul(rms=...)`, `wq_matmul_swiglu`; why: layers/folded_norm.py): the
  program holding a finished tile may add it to the residual stream, write rows * (1 + w) and the tile's per-row
  sums of squares; scale it by each row's 1 / rms from such sums; or store silu(gate) * up of a [gate; up]
  projection (its programs then take BN / 2 gate rows and the same up rows). The main loop is the same in every case.
  Group i of a block is an elementwise function of the loaded int16 tile (nibble / byte i of every halfword), so the
  MMA operand's layout conversion happens at the load and a PTX block per 32-bit register makes the A fragment in
  place (`asm`; int8 too, the default), with no shared-memory round trip of a dequantized tile. Why, with the
  figures and the alternatives measured slower: docs/benchmarks.md, "Per-kernel figures".
e4m3 (FP8 checkpoints): the PTX unpacking moves each byte's bits into a bf16 / fp16 and scales it by a power of two
(`unpack_asm`), exact, on any sm_80+ GPU; the configs are int8 group 128's.

Configs: `default_config`, a fixed table (no autotuning: a timing-based choice would vary between runs, and with
it the summation order, i.e. the numerics), the H200 winners of bench/quant_kernels.py --sweep (docs/benchmarks.md;
the 9..16-row gate_up and down entries: H100 winners, with the whole tree pass timed there):
  M <= 8:  n64 m8 w4, split-K to ~2 waves of the SMs; 3 stages above 80M weights, else 2; unsplit tiles with a
           short last round balanced over the SMs (`schedule`); int4 layer projections (outputs below the
           vocabulary's) on Hopper with bf16 activations: the warp-specialized kernel, 2 consumers in its lean
           footprint (docs/benchmarks.md, "The lean program at 1..8 rows")
  M 9..16: wgmma; vocabulary (N >= 131072) n128 s3, ~4 waves; gate_up n64 s3, ~2 waves balanced; other mid-size
           outputs n64 s3, ~1 wave; int4 K > 8192 (down): the M <= 8 schedule with 3 stages and the 16-row tile as
           two 8-row dots (`dot_rows`, mma.sync); 8-bit K > 8192 n64 s2, ~4 waves
  M 17..32 (int4): on Hopper with bf16 activations the warp-specialized Gluon kernel (quant_matmul_gluon.py; 13-24 %
           less time per launch on an H100, qkv even); elsewhere n64 s2 wgmma; narrow outputs (N <= 8192) split to ~3
           waves (down) or ~4 (o), others ~1 wave, gate_up's short last round balanced (the H100 winners at 32
           rows); vocabulary n128 w8 s3 (the Triton kernel everywhere)
  M 33..64 (int4): n64 s3 wgmma, ~1 wave; K > 8192 (down): ~2 waves balanced, two 32-row dots (an H100 winner);
           8-bit codes: the M 9..16 entry with BM 32 / 64 (not measured)
  int8 group 32 (the drafter's): M <= 8 n64 (N >= 16384) or n128, s3; M 9..16 n64 m16 s6 wgmma (not swept);
           on Hopper the warp-specialized kernel for N >= 16384 or K > 8192 at 1..8 rows (gate_up, down; lean) and
           every projection at 9..32 rows (docs/benchmarks.md, "int8 group 32 in the warp-specialized program")
  8-bit group 128 (e4m3, the int8 head): M <= 8 n64 s3, ~4 waves when N < 64 * 132 (down, o), else unsplit, a short
           last round balanced; layer projections on Hopper with bf16 activations: the warp-specialized kernel's
           lean program, as int4's (docs/benchmarks.md, "8-bit codes in the warp-specialized program")
Every program reads its x rows over its K range: at 17-64 rows that traffic grows with the rows.
M > MAX_PASS_TOKENS (prefill): each slice of <= 16M weights is dequantized to x's dtype and multiplied with F.linear
(the kernel's numerics are not kept there).
The kernel runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (fp32 dots, no PTX).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..config import MAX_PASS_TOKENS
from . import arrival_counters, launch_fitting, pdl, quant_matmul_gluon, sm_count
from .linear_triton import split_blocks
from .quant_matmul import PackedWeight, block_size
from .unpack_ptx import unpack_asm

try:  # triton is optional: CPU-only installs use the plain PyTorch reference paths
    import triton
    import triton.language as tl

    from .linear_triton import split_k_total
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

MAX_KERNEL_ROWS = MAX_PASS_TOKENS  # rows of one launch; beyond (prefill): dequantize + F.linear


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _cols(v, BN: tl.constexpr, C: tl.constexpr):
        """[BN, C] -> its C columns (C = 2: returned twice)."""
        if C == 4:
            v02, v13 = tl.split(tl.reshape(v, [BN, 2, 2]))
            v0, v2 = tl.split(v02)
            v1, v3 = tl.split(v13)
        else:
            v0, v1 = tl.split(v)
            v2, v3 = v0, v1
        return v0, v1, v2, v3

    @triton.jit
    def _group(acc, acc_hi, h, xp, xm, xm_hi, stride_hi, s, zc, IDX: tl.constexpr, BITS: tl.constexpr,
               UNPACK: tl.constexpr, BN: tl.constexpr, MB: tl.constexpr, HAS_ZP: tl.constexpr,
               USE_ASM: tl.constexpr, F32DOT: tl.constexpr, E4M3: tl.constexpr, HALVES: tl.constexpr):
        """acc[BN, MB] += s * ((u - z) of code IDX of every halfword of h [BN, G]) @ x^T tile [G, MB] (E4M3: the
        float8_e4m3fn value of byte IDX, no zero point); with HALVES 2 also acc_hi += the same weights @ the next MB
        x rows (at xp + stride_hi): one dequantized operand, two dots."""
        xt = tl.load(xp, mask=xm, other=0.0)
        if USE_ASM:  # one input and one output register per PTX block: the MMA layout is hoisted to the load
            a = tl.inline_asm_elementwise(UNPACK, "=r,r", [h], dtype=xt.dtype, is_pure=True, pack=2)
        elif E4M3:  # the byte's bits moved into an fp32 (the value times 2**-120), times 2**120: exact
            top = ((h >> (8 * IDX)) & 0xFF).to(tl.int32) << 24
            a = ((top >> 4) & -2014314496).to(tl.float32, bitcast=True) * 1.329227995784916e36
        else:
            a = ((h >> (BITS * IDX)) & ((1 << BITS) - 1)).to(tl.float32) - (1 << (BITS - 1))
        if F32DOT:  # interpreter: its bf16 dot is broken; every value here is exact in fp32
            if HAS_ZP:
                a = a.to(tl.float32) - zc.to(tl.float32)[:, None]
            a = a.to(tl.float32)
            xt = xt.to(tl.float32)
        else:
            a = a.to(xt.dtype)
            if HAS_ZP:
                a = a - zc.to(xt.dtype)[:, None]  # z - 2**(bits-1): a small integer, exact
        acc = acc + tl.dot(a, xt, tl.zeros([BN, MB], tl.float32)) * s.to(tl.float32)[:, None]
        if HALVES == 2:
            xt_hi = tl.load(xp + stride_hi, mask=xm_hi, other=0.0).to(xt.dtype)
            acc_hi = acc_hi + tl.dot(a, xt_hi, tl.zeros([BN, MB], tl.float32)) * s.to(tl.float32)[:, None]
        return acc, acc_hi

    @triton.jit
    def _block(acc, acc_hi, h, s, b, x_cols, z_ptr, z_off, n_ok, m_ok, m_hi, stride_hi, N, K, BITS: tl.constexpr,
               G: tl.constexpr, BN: tl.constexpr, MB: tl.constexpr, HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr,
               USE_ASM: tl.constexpr, F32DOT: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
               U3: tl.constexpr, E4M3: tl.constexpr, HALVES: tl.constexpr):
        """Block b's C groups in order (`_group`): h [BN, G] its int16 codes, s [BN, C] its scales."""
        C: tl.constexpr = 16 // BITS
        ZB: tl.constexpr = 1 << (BITS - 1)
        s0, s1, s2, s3 = _cols(s, BN, C)
        if HAS_ZP:
            zc = tl.load(z_ptr + b * N * C + z_off, mask=n_ok[:, None], other=ZB).to(tl.float32) - ZB
            z0, z1, z2, z3 = _cols(zc, BN, C)
        else:
            z0, z1, z2, z3 = s0, s1, s2, s3  # unused
        xb = x_cols + b * (C * G)
        if EVEN_K:
            x0m, x1m, x2m, x3m = m_ok, m_ok, m_ok, m_ok
            x0h, x1h, x2h, x3h = m_hi, m_hi, m_hi, m_hi
        else:
            kk = b * (C * G) + tl.arange(0, G)
            k0, k1, k2, k3 = (kk < K)[:, None], (kk + G < K)[:, None], (kk + 2 * G < K)[:, None], \
                (kk + 3 * G < K)[:, None]
            x0m, x1m, x2m, x3m = m_ok & k0, m_ok & k1, m_ok & k2, m_ok & k3
            x0h, x1h, x2h, x3h = m_hi & k0, m_hi & k1, m_hi & k2, m_hi & k3
        acc, acc_hi = _group(acc, acc_hi, h, xb, x0m, x0h, stride_hi, s0, z0, 0, BITS, U0, BN, MB, HAS_ZP,
                             USE_ASM, F32DOT, E4M3, HALVES)
        acc, acc_hi = _group(acc, acc_hi, h, xb + G, x1m, x1h, stride_hi, s1, z1, 1, BITS, U1, BN, MB, HAS_ZP,
                             USE_ASM, F32DOT, E4M3, HALVES)
        if C == 4:
            acc, acc_hi = _group(acc, acc_hi, h, xb + 2 * G, x2m, x2h, stride_hi, s2, z2, 2, BITS, U2, BN, MB,
                                 HAS_ZP, USE_ASM, F32DOT, E4M3, HALVES)
            acc, acc_hi = _group(acc, acc_hi, h, xb + 3 * G, x3m, x3h, stride_hi, s3, z3, 3, BITS, U3, BN, MB,
                                 HAS_ZP, USE_ASM, F32DOT, E4M3, HALVES)
        return acc, acc_hi

    @triton.jit
    def _halves(v, BN: tl.constexpr, W: tl.constexpr):
        """[BN, W] -> its first and last W / 2 columns."""
        return tl.split(tl.permute(tl.reshape(v, [BN, 2, W // 2]), [0, 2, 1]))

    @triton.jit
    def _tile(WHOLE, REST, SPLIT, N, BN: tl.constexpr, EPI: tl.constexpr):
        """This program's tile (`schedule`): program pid < WHOLE takes tile pid and every block, the others
        (pid_n, pid_k) of the REST tiles after them take rows [pid_n*BN, +BN) and blocks [pid_k*BPS, +BPS).
        Returns (pid_n, pid_k, whole, the tile's split, its output rows offs_n [BN], n_ok); with EPI 2 the rows
        are BN / 2 gate channels, then the same channels' up rows."""
        pid = tl.program_id(0)
        whole = pid < WHOLE
        piece = tl.maximum(pid - WHOLE, 0)  # tile-major: the split parts of one tile are REST programs apart
        rest = tl.maximum(REST, 1)
        pid_n = tl.where(whole, pid, WHOLE + piece % rest)
        pid_k = tl.where(whole, 0, piece // rest)
        tile_split = tl.where(whole, 1, SPLIT)
        if EPI == 2:
            HALF: tl.constexpr = BN // 2
            tile_rows = tl.arange(0, BN)
            channels = pid_n * HALF + tile_rows % HALF
            n_ok = channels < N // 2
            # rows past the last channel point past N, so that no store (split-K partials included) lands on the
            # up rows of the first channels, which a gate row index >= N // 2 would otherwise address
            offs_n = tl.where(n_ok, channels + (tile_rows >= HALF).to(tl.int32) * (N // 2), N)
        else:
            offs_n = pid_n * BN + tl.arange(0, BN)
            n_ok = offs_n < N
        return pid_n, pid_k, whole, tile_split, offs_n, n_ok

    @triton.jit
    def main_loop(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, M, N, K, KH, NBLK, WHOLE, REST, BPS, SPLIT, PARTS, stride_xm,
                  BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr,
                  HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, F32DOT: tl.constexpr,
                  U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, U3: tl.constexpr, PREFETCH: tl.constexpr,
                  PDL: tl.constexpr, EPI: tl.constexpr, RMS: tl.constexpr, PBLOCK: tl.constexpr,
                  E4M3: tl.constexpr, HALVES: tl.constexpr, WIDE: tl.constexpr):
        """`_wq_kernel`'s first part, the program's tile over its blocks, WIDE blocks (C groups each) a step, as one
        [BN, WIDE * G] load of codes and one of their scales (the schedule's ranges are whole steps): returns (acc
        [BN, BM] fp32, its partial y^T; sums [PBLOCK, BM], with RMS the input rows' sums of squares from part_ptr,
        else zeros)."""
        C: tl.constexpr = 16 // BITS
        pid_n, pid_k, whole, tile_split, offs_n, n_ok = _tile(WHOLE, REST, SPLIT, N, BN, EPI)
        MB: tl.constexpr = BM // HALVES  # x rows per dot
        offs_m = tl.arange(0, MB)
        offs_c = tl.arange(0, G)
        z_off = offs_n[:, None] * C + tl.arange(0, C)[None, :]  # [BN, C]: one block's scales or zero points
        if WIDE == 1:
            q_rows = q_ptr + offs_n[:, None].to(tl.int64) * KH + offs_c[None, :]
            sz_off = z_off
        else:  # a step's codes [BN, WIDE * G] and scales [BN, WIDE * C] (column j: block j // C's group j % C)
            q_rows = q_ptr + offs_n[:, None].to(tl.int64) * KH + tl.arange(0, WIDE * G)[None, :]
            offs_s = tl.arange(0, WIDE * C)
            sz_off = offs_n[:, None] * C + (offs_s // C * (N * C) + offs_s % C)[None, :]
        x_cols = x_ptr + offs_m[None, :] * stride_xm + offs_c[:, None]  # x^T tile [G, MB]
        m_ok = (offs_m < M)[None, :]
        m_hi = (offs_m + MB < M)[None, :]
        stride_hi = MB * stride_xm
        b_lo = pid_k * BPS
        b_hi = tl.where(whole, NBLK, tl.minimum(b_lo + BPS, NBLK))
        acc = tl.zeros([BN, MB], tl.float32)
        acc_hi = tl.zeros([BN, MB], tl.float32)
        pdl.prefetch_rows(q_ptr, offs_n, KH, b_lo * G, N, KH, PREFETCH * G, 64, PDL)  # int16 codes: 64 per line
        pdl.wait(PDL)
        sums = tl.zeros([PBLOCK, BM], tl.float32)
        if RMS:  # issued before the loop, summed after it: its latency hides behind the weights
            p_rows = tl.arange(0, PBLOCK)
            all_m = tl.arange(0, BM)
            sums = tl.load(part_ptr + p_rows[:, None] * M + all_m[None, :],
                           mask=(p_rows < PARTS)[:, None] & (all_m < M)[None, :], other=0.0)
        s_next = tl.load(s_ptr + b_lo * N * C + sz_off, mask=n_ok[:, None], other=0.0)
        for b in tl.range(b_lo, b_hi, WIDE, num_stages=STAGES):
            s = s_next  # prefetched one step ahead by hand (not in the dot's operand chain: not pipelined)
            s_next = tl.load(s_ptr + (b + WIDE) * N * C + sz_off, mask=n_ok[:, None] & (b + WIDE < b_hi), other=0.0)
            h = tl.load(q_rows + b * G, mask=n_ok[:, None], other=0)
            if WIDE == 1:
                acc, acc_hi = _block(acc, acc_hi, h, s, b, x_cols, z_ptr, z_off, n_ok, m_ok, m_hi, stride_hi, N, K,
                                     BITS, G, BN, MB, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1, U2, U3, E4M3, HALVES)
            else:  # WIDE 2 or 4: the step's blocks split off its tiles in order
                h0, h1 = _halves(h, BN, WIDE * G)
                s0, s1 = _halves(s, BN, WIDE * C)
                if WIDE == 4:
                    h2, h3 = _halves(h1, BN, 2 * G)
                    h0, h1 = _halves(h0, BN, 2 * G)
                    s2, s3 = _halves(s1, BN, 2 * C)
                    s0, s1 = _halves(s0, BN, 2 * C)
                acc, acc_hi = _block(acc, acc_hi, h0, s0, b, x_cols, z_ptr, z_off, n_ok, m_ok, m_hi, stride_hi, N, K,
                                     BITS, G, BN, MB, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1, U2, U3, E4M3, HALVES)
                acc, acc_hi = _block(acc, acc_hi, h1, s1, b + 1, x_cols, z_ptr, z_off, n_ok, m_ok, m_hi, stride_hi,
                                     N, K, BITS, G, BN, MB, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1, U2, U3, E4M3,
                                     HALVES)
                if WIDE == 4:
                    acc, acc_hi = _block(acc, acc_hi, h2, s2, b + 2, x_cols, z_ptr, z_off, n_ok, m_ok, m_hi,
                                         stride_hi, N, K, BITS, G, BN, MB, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1,
                                         U2, U3, E4M3, HALVES)
                    acc, acc_hi = _block(acc, acc_hi, h3, s3, b + 3, x_cols, z_ptr, z_off, n_ok, m_ok, m_hi,
                                         stride_hi, N, K, BITS, G, BN, MB, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1,
                                         U2, U3, E4M3, HALVES)
        if HALVES == 2:  # [BN, MB] twice -> [BN, BM]: rows 0..MB-1, then the next MB
            acc = tl.reshape(tl.permute(tl.join(acc, acc_hi), [0, 2, 1]), [BN, BM])
        return acc, sums

    @triton.jit
    def finish(acc, sums, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, M, N, K, WHOLE, REST, SPLIT,
               stride_om, eps, BN: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr, EPI: tl.constexpr,
               RMS: tl.constexpr):
        """`_wq_kernel`'s second part: releases the next launch (PDL), sums the tile's split-K partials (the last
        program to arrive holds the total) and stores the finished tile through the epilogue; returns the total."""
        pid_n, pid_k, _, tile_split, offs_n, n_ok = _tile(WHOLE, REST, SPLIT, N, BN, EPI)
        offs_m = tl.arange(0, BM)
        pdl.release(PDL)
        total, done = split_k_total(acc, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, pid_n, pid_k, tile_split)
        ok = n_ok[:, None] & (offs_m < M)[None, :] & done
        if RMS:
            total = total * tl.rsqrt(tl.sum(sums, 0) / K + eps)[None, :]
        if EPI == 1:
            _add_norm_epilogue(total, ok, done, res_ptr, nw_ptr, rows_ptr, part_ptr, out_ptr, offs_n, offs_m, M, N,
                               pid_n)
        elif EPI == 2:
            _swiglu_epilogue(total, done, out_ptr, stride_om, pid_n, offs_m, M, N, BN, BM)
        else:
            o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)
        return total

    @triton.jit(do_not_specialize=["M", "WHOLE", "REST", "BPS", "SPLIT"])
    def _wq_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, KH, NBLK, WHOLE, REST, BPS, SPLIT,
                   stride_xm, stride_om, res_ptr, nw_ptr, rows_ptr, part_ptr, PARTS, eps,
                   BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                   STAGES: tl.constexpr, HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
                   F32DOT: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr,
                   U2: tl.constexpr, U3: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                   EPI: tl.constexpr, RMS: tl.constexpr, PBLOCK: tl.constexpr, E4M3: tl.constexpr,
                   HALVES: tl.constexpr, WIDE: tl.constexpr):
        """One program per tile, or per part of a split tile (`_tile`): `main_loop`, then `finish`, two jit
        functions so that a variant can run between and around them (bench/launch_timeline.py stamps the times).
        RMS: the finished tile
        is first scaled by its rows' 1 / rms (the input is the rows of an EPI 1 launch, whose partials give the rms).
        EPI: then stored as is (0), added to a residual stream with the next norm begun (1, `_add_norm_epilogue`),
        or, for a [gate; up] projection, silu(gate) * up stored (2, `_swiglu_epilogue`: a program's first BN / 2
        rows are gate rows, its last BN / 2 the up rows of the same channels)."""
        acc, sums = main_loop(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, M, N, K, KH, NBLK, WHOLE, REST, BPS, SPLIT, PARTS,
                              stride_xm, BITS, G, BN, BM, STAGES, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1, U2, U3,
                              PREFETCH, PDL, EPI, RMS, PBLOCK, E4M3, HALVES, WIDE)
        finish(acc, sums, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, M, N, K, WHOLE, REST, SPLIT,
               stride_om, eps, BN, BM, PDL, EPI, RMS)

    @triton.jit
    def _swiglu_epilogue(total, done, out_ptr, stride_om, pid_n, offs_m, M, N, BN: tl.constexpr, BM: tl.constexpr):
        """A finished tile of a [gate; up] projection (rows: BN / 2 gate channels, then the same up channels) ->
        silu(gate) * up [BN / 2 channels, BM], rounded as the activation kernel of two launches does."""
        HALF: tl.constexpr = BN // 2
        dtype = out_ptr.dtype.element_ty
        halves = tl.permute(tl.reshape(total.to(dtype).to(tl.float32), [2, HALF, BM]), [1, 2, 0])
        gate, up = tl.split(halves)
        channels = pid_n * HALF + tl.arange(0, HALF)
        ok = (channels < N // 2)[:, None] & (offs_m < M)[None, :] & done
        tl.store(out_ptr + offs_m[None, :] * stride_om + channels[:, None],
                 (up * (gate * tl.sigmoid(gate))).to(dtype), mask=ok)

    @triton.jit
    def _add_norm_epilogue(total, ok, done, res_ptr, nw_ptr, rows_ptr, part_ptr, out_ptr, offs_n, offs_m, M, N, pid_n):
        """A finished tile y [BN, BM] of a projection whose output joins the residual stream: out = r + y (rounded
        as the plain add), rows = out * (1 + w) for the next zero-centred RMSNorm's projections, and this tile's
        sum of out^2 per row into part [tiles, M] (`_wq_kernel` with RMS turns the sums into 1 / rms)."""
        off = offs_m[None, :] * N + offs_n[:, None]
        dtype = out_ptr.dtype.element_ty
        res = tl.load(res_ptr + off, mask=ok, other=0.0).to(tl.float32)
        summed = (res + total.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + off, summed, mask=ok)
        v = summed.to(tl.float32)
        tl.store(part_ptr + pid_n * M + offs_m, tl.sum(v * v, 0), mask=(offs_m < M) & done)
        w = tl.load(nw_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(rows_ptr + off, (v * (1.0 + w)[:, None]).to(dtype), mask=ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_available(device: torch.device | str) -> bool:
    """True where `wq_matmul` can run: CUDA with triton (no interpreter), or CPU under TRITON_INTERPRET=1."""
    device = torch.device(device)
    if triton is None:
        return False
    return (not _interpreting()) if device.type == "cuda" else device.type == "cpu" and _interpreting()


# ----------------------------------------------------------------------------------------------------------
# Configurations and launch
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    block_n: int          # output rows per program
    block_m: int          # activation rows per program: 8 (M <= 8), else M's next power of two
    warps: int
    stages: int           # cp.async pipeline depth
    waves: int = 2        # split K until about waves * SMs programs
    asm: bool = True      # PTX unpacking on CUDA (the interpreter always takes the plain path)
    balance: bool = False  # unsplit tiles beyond the last full round of SMs: split so each SM streams ~as much
    # x rows per tensor-core dot: 0, the whole tile in one; 8, a 16-row tile as two 8-row dots on one dequantized
    # operand, which Triton compiles to mma.sync where one 16-row dot compiles to wgmma
    dot_rows: int = 0
    # > 0: the warp-specialized Gluon kernel (quant_matmul_gluon) with that many consumer warpgroups and x blocks of
    # block_m rows, where it serves the launch (Hopper, bf16, 4- or 8-bit group 128 or int8 group 32 codes: its
    # `usable`); the fields above are the Triton kernel's config elsewhere
    warp_specialized: int = 0
    # the warp-specialized kernel's units after its ring's first stages that its loader fetches into L2 before its
    # PDL wait (0: none), so that the weight stream goes on while the kernel before it runs
    l2_ahead: int = 0
    # the warp-specialized kernel: each group's wgmma issued asynchronously and the next group's codes unpacked while
    # it runs, so that the consumers' unpacking does not wait out the tensor cores' latency
    overlap_dots: bool = False
    # K blocks a main-loop step loads as one tile of codes and one of scales (1, 2 or 4; it must divide the
    # weight's blocks): short groups' blocks (int8 group 32: 64 inputs, 4 KB of codes a 64-row tile) in wider steps
    blocks_per_step: int = 1

    def short(self) -> str:
        return (f"n{self.block_n} m{self.block_m} w{self.warps} s{self.stages} "
                f"wv{self.waves}{' bal' if self.balance else ''}{'' if self.asm else ' noasm'}"
                f"{f' d{self.dot_rows}' if self.dot_rows else ''}"
                f"{f' ws{self.warp_specialized}' if self.warp_specialized else ''}"
                f"{f' l2+{self.l2_ahead}' if self.l2_ahead else ''}"
                f"{' ovl' if self.overlap_dots else ''}"
                f"{f' k{self.blocks_per_step}' if self.blocks_per_step > 1 else ''}")


GATE_UP_WEIGHTS = 150_000_000  # weights of a projection at least gate_up's size (178M): its schedule is balanced
VOCABULARY_OUTPUTS = 131072  # outputs of a vocabulary-sized projection (the head) and more; every layer's are fewer


def default_config(m: int, n: int, k: int, bits: int = 4, group_size: int = 128) -> KernelConfig:
    """The config table of the module docstring (H200 winners of bench/quant_kernels.py --sweep)."""
    if m > 16 and bits == 4 and group_size == 128:  # a draft tree's pass: wgmma, x tiles of 32 or 64 rows
        if m > 32:  # down (K > 8192): ~2 waves balanced, the 64-row tile as two 32-row dots
            return KernelConfig(64, 64, 4, 3, 2, True, True, 32) if k > 8192 else KernelConfig(64, 64, 4, 3, 1)
        if n >= VOCABULARY_OUTPUTS:
            return KernelConfig(128, 32, 8, 3, 1)
        if n <= 8192:  # narrow outputs: K splits to ~3 waves (down) or ~4 (o, gdn out)
            return KernelConfig(64, 32, 4, 2, 3 if k > 8192 else 4, warp_specialized=quant_matmul_gluon.CONSUMERS)
        # gate_up's short last round balanced
        return KernelConfig(64, 32, 4, 2, 1, True, n * k > GATE_UP_WEIGHTS,
                            warp_specialized=quant_matmul_gluon.CONSUMERS)
    if m > 16:  # 8-bit codes: the 9..16-row entry with a taller x tile (not measured)
        return replace(default_config(16, n, k, bits, group_size), block_m=1 << (m - 1).bit_length())
    asm = True  # int8 too: the PTX unpacking is the faster (docs/benchmarks.md, "W4A16 / W8A16")
    if group_size < 128:  # short groups (int8 g32: 64 B per row and step): 3 stages, 64-row tiles for wide outputs;
        # on Hopper the warp-specialized kernel (4 blocks a unit) for those, long rows (down) and at 9..32 rows
        if m <= 8:
            wide = n >= 16384
            return KernelConfig(64 if wide else 128, 8, 4, 3, 2, asm,
                                warp_specialized=quant_matmul_gluon.CONSUMERS if wide or k > 8192 else 0)
        return KernelConfig(64, 16, 4, 6, 4, asm, warp_specialized=quant_matmul_gluon.CONSUMERS)
    if m <= 8:  # 64-row tiles, shallow pipelines: more programs resident per SM hide more latency than deeper ones;
        # on Hopper the layers' projections (not the vocabulary's) take the warp-specialized kernel's lean program
        ws = quant_matmul_gluon.CONSUMERS if n < VOCABULARY_OUTPUTS else 0
        if bits == 8:  # e4m3 / int8 g128 (2x int4's bytes per tile): 3 stages; narrow outputs split to ~4 waves
            return KernelConfig(64, 8, 4, 3, 4 if n < 64 * 132 else 1, asm, True, warp_specialized=ws)
        return KernelConfig(64, 8, 4, 3 if n * k > 80_000_000 else 2, 2, asm, True, warp_specialized=ws)
    if n >= VOCABULARY_OUTPUTS:
        return KernelConfig(128, 16, 4, 3, 4, asm)
    if k > 8192 and bits == 4:  # long rows (down): the 8-row schedule, two 8-row dots (mma.sync) on each operand
        return replace(default_config(8, n, k, bits, group_size), block_m=16, stages=3, dot_rows=8,
                       warp_specialized=0)
    if k > 8192:
        return KernelConfig(64, 16, 4, 2, 4, asm)  # K splits to ~4 waves
    if n * k > GATE_UP_WEIGHTS:  # gate_up: ~2 waves, the short last round balanced (`schedule`)
        return KernelConfig(64, 16, 4, 3, 2, asm, True)
    return KernelConfig(64, 16, 4, 3, 1, asm)  # one wave of 3-stage programs: faster than ~4 waves


MIN_PIECE = 4        # blocks: a shorter split part costs more in its pipeline's start than it balances
BALANCED_ROUNDS = 4  # whole tiles per SM up to which `schedule` balances (all resident at once, finishing together)
SHORT_ROUND = 4      # a last round of tiles on at most 1 / SHORT_ROUND of the SMs is split (a longer one loses)


def schedule(cfg: KernelConfig, n: int, nblk: int, sms: int = 132) -> tuple[int, int, int]:
    """(whole, split, blocks per split) of a launch over `nblk` K blocks: the first `whole` tiles of BN rows are one
    program each over every block, each later tile is split into `split` ranges of `bps` blocks (no empty range).
    By default every tile is split alike, until about cfg.waves * sms programs. With cfg.balance, when that leaves
    tiles unsplit and a short last round (gate_up's 544 over 132: 16 SMs would stream a fifth tile while 116 idle),
    the tiles of the full rounds stay whole and the remaining ones are split so that the most blocks any SM streams
    is least (ties: fewer programs), pieces of at least MIN_PIECE blocks (docs/benchmarks.md, "W4A16 / W8A16 launch
    schedules")."""
    if cfg.blocks_per_step > 1:  # ranges of whole steps
        wide = cfg.blocks_per_step
        whole, split, steps = schedule(replace(cfg, blocks_per_step=1), n, nblk // wide, sms)
        return whole, split, steps * wide
    tiles = -(-n // cfg.block_n)
    split, bps = split_blocks(tiles, nblk, cfg.waves * sms)
    rounds, rest = divmod(tiles, sms)
    if not cfg.balance or split > 1 or rest == 0 or rest * SHORT_ROUND > sms or rounds > BALANCED_ROUNDS:
        return 0, split, bps

    def busiest_sm(parts: int) -> tuple[int, int, int]:
        per = -(-nblk // parts)
        parts = -(-nblk // per)
        return rounds * nblk + -(-rest * parts // sms) * per, parts, per

    _, split, bps = min(busiest_sm(p) for p in range(1, nblk + 1) if -(-nblk // p) >= min(MIN_PIECE, nblk))
    return (tiles - rest, split, bps) if split > 1 else (0, 1, nblk)


@dataclass
class Epilogue:
    """What a launch does with its finished tiles besides storing them (`_wq_kernel`'s RMS and EPI)."""
    kind: int = 0                           # EPI: 0 store, 1 add_norm, 2 swiglu
    partials: torch.Tensor | None = None    # fp32 [tiles of the EPI 1 launch, M]: its output (1) or the rms (rms)
    rms: bool = False                       # scale by 1 / rms from `partials` first
    eps: float = 0.0                        # rms: the norm's epsilon
    residual: torch.Tensor | None = None    # EPI 1: [M, N], the residual stream the output joins
    weight: torch.Tensor | None = None      # EPI 1: the next zero-centred norm's weight [N]
    rows: torch.Tensor | None = None        # EPI 1: [M, N], out * (1 + weight): the next projections' input


@dataclass
class LaunchPlan:
    """One launch of `_wq_kernel`: grid (programs,), the `schedule` (whole, split, blocks per split) it follows, and
    the arguments and constants launch_fitting passes the kernel (STAGES the tuned depth)."""
    programs: int
    schedule: tuple[int, int, int]
    args: tuple
    meta: dict


def launch_plan(x2: torch.Tensor, pw: PackedWeight, cfg: KernelConfig, out: torch.Tensor,
                epilogue: Epilogue | None = None) -> LaunchPlan:
    """The launch of x2 [M, K] (contiguous rows) @ W^T into out under cfg; its split-K buffer is allocated here."""
    m, cuda = x2.shape[0], x2.device.type == "cuda"
    if not kernels_available(x2.device):
        raise RuntimeError(f"the Triton kernel cannot run on {x2.device} here (CPU tensors need TRITON_INTERPRET=1)")
    if cuda and x2.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"on CUDA the kernel takes bf16 or fp16 activations, got {x2.dtype}")
    if m > cfg.block_m or cfg.block_m < 8 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"config {cfg.short()} takes a power-of-two block_m >= 8 and at most block_m rows, got {m}")
    if cfg.dot_rows not in (0, cfg.block_m, cfg.block_m // 2) or cfg.dot_rows and cfg.dot_rows < 8:
        raise ValueError(f"config {cfg.short()}: dot_rows is 0, block_m or block_m / 2 (at least 8)")
    nblk, wide = pw.q.shape[1] // pw.group_size, cfg.blocks_per_step
    if wide not in (1, 2, 4) or nblk % wide:
        raise ValueError(f"config {cfg.short()}: blocks_per_step is 1, 2 or 4 and divides the weight's {nblk} blocks")
    whole, split, bps = schedule(cfg, pw.n, nblk, sm_count(x2.device))
    n_tiles = -(-pw.n // cfg.block_n)
    programs = whole + (n_tiles - whole) * split
    ws = torch.empty(split * m * pw.n if split > 1 else 1, dtype=torch.float32, device=x2.device)
    cnt = arrival_counters(x2.device, n_tiles)
    fp16 = x2.dtype == torch.float16
    e4m3 = pw.codes == "e4m3"
    unpack = [unpack_asm(pw.bits, i, fp16, e4m3) if i < 16 // pw.bits else "" for i in range(4)]
    epi = epilogue or Epilogue()
    parts = ws if epi.partials is None else epi.partials  # (EPI 2 with an even N: as many tiles, of BN / 2 channels)
    args = (x2, pw.q, pw.s, pw.s if pw.z is None else pw.z, out, ws, cnt, m, pw.n, pw.k, pw.q.shape[1], nblk, whole,
            n_tiles - whole, bps, split, x2.stride(0), out.stride(0),
            *(out if t is None else t for t in (epi.residual, epi.weight, epi.rows)), parts, parts.shape[0], epi.eps)
    meta = dict(BITS=pw.bits, G=pw.group_size, BN=cfg.block_n, BM=cfg.block_m, STAGES=cfg.stages,
                HAS_ZP=pw.z is not None, EVEN_K=pw.k % block_size(pw.bits, pw.group_size) == 0,
                USE_ASM=cuda and cfg.asm, F32DOT=not cuda, U0=unpack[0], U1=unpack[1],
                U2=unpack[2], U3=unpack[3], num_warps=cfg.warps, **pdl.options(x2),
                PREFETCH=pdl.prefetch_blocks(cfg.block_n * pw.group_size * 2, programs, bps, x2.device),
                EPI=epi.kind, RMS=epi.rms, PBLOCK=triton.next_power_of_2(parts.shape[0]) if epi.rms else 1,
                E4M3=e4m3, HALVES=cfg.block_m // cfg.dot_rows if cfg.dot_rows else 1, WIDE=wide)
    return LaunchPlan(programs, (whole, split, bps), args, meta)


def warp_specialized(x2: torch.Tensor, pw: PackedWeight, cfg: KernelConfig) -> bool:
    """Whether `cfg` takes the warp-specialized Gluon kernel for x2 @ W^T (where it builds)."""
    return bool(cfg.warp_specialized) and quant_matmul_gluon.usable(x2, pw, cfg.block_m, cfg.warp_specialized)


def tile_rows(x2: torch.Tensor, pw: PackedWeight, cfg: KernelConfig) -> int:
    """Output rows of a tile of the kernel that runs the launch: an add-norm launch's partials hold one row a tile
    (the Gluon kernel's tiles are 64 rows, the Triton kernel's block_n)."""
    return quant_matmul_gluon.BN if warp_specialized(x2, pw, cfg) else cfg.block_n


def _launch(x2: torch.Tensor, pw: PackedWeight, cfg: KernelConfig, out: torch.Tensor,
            epilogue: Epilogue | None = None) -> None:
    if warp_specialized(x2, pw, cfg):
        if quant_matmul_gluon.launch(x2, pw, out, epilogue or Epilogue(), cfg.warp_specialized, cfg.block_m,
                                     cfg.l2_ahead, cfg.overlap_dots):
            return
        cfg = replace(cfg, block_n=quant_matmul_gluon.BN)  # it did not build: tiles of its rows, as sized for it
    plan = launch_plan(x2, pw, cfg, out, epilogue)
    launch_fitting(_wq_kernel, (plan.programs,), *plan.args, stages_key="STAGES", **plan.meta)


def _rows(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    if x.shape[-1] != pw.k:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {pw.k}")
    x2 = x.reshape(-1, pw.k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _one_launch(x2: torch.Tensor, pw: PackedWeight, config: KernelConfig | None, what: str) -> KernelConfig:
    if x2.shape[0] > MAX_KERNEL_ROWS:
        raise ValueError(f"{what} takes at most {MAX_KERNEL_ROWS} rows (one launch), got {x2.shape[0]}")
    return config or default_config(x2.shape[0], pw.n, pw.k, pw.bits, pw.group_size)


def wq_matmul_add_norm(x: torch.Tensor, pw: PackedWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                       config: KernelConfig | None = None):
    """A projection whose output joins the residual stream, with the next zero-centred RMSNorm begun in the same
    launch (up to MAX_KERNEL_ROWS rows): returns (out = residual + x @ W^T rounded as the plain add, rows = out *
    (1 + w) in out's dtype, partials fp32 [tiles, M]: each output tile's sum of out^2 per row). `wq_matmul(rows, W2,
    rms=(partials, eps))` then completes the norm: it scales its result by each row's 1 / rms."""
    x2 = _rows(x, pw)
    cfg = _one_launch(x2, pw, config, "wq_matmul_add_norm")
    m = x2.shape[0]
    if tuple(residual.shape) != (m, pw.n) or tuple(norm_weight.shape) != (pw.n,):
        raise ValueError(f"residual {tuple(residual.shape)} / norm weight {tuple(norm_weight.shape)} do not match "
                         f"the output [{m}, {pw.n}]")
    out = torch.empty(m, pw.n, dtype=x.dtype, device=x.device)
    rows = torch.empty_like(out)
    partials = torch.empty(-(-pw.n // tile_rows(x2, pw, cfg)), m, dtype=torch.float32, device=x.device)
    _launch(x2, pw, cfg, out, Epilogue(1, partials, residual=residual.contiguous(), weight=norm_weight, rows=rows))
    return out, rows, partials


def wq_mlp_add_norm(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, residual: torch.Tensor,
                    norm_weight: torch.Tensor, rms: tuple[torch.Tensor, float] | None = None):
    """A SwiGLU MLP whose output joins the residual stream, the next norm begun: wq_matmul_add_norm(
    wq_matmul_swiglu(x, gate_up, rms), down, residual, norm_weight), the same (out, rows, partials) bit for bit. Where
    the warp-specialized kernel serves both projections (INT4 at 1..8 rows on Hopper:
    quant_matmul_gluon.mlp_usable), one launch streams both, down's first codes while gate_up's last tiles finish;
    elsewhere the two launches."""
    x2 = _rows(x, gate_up)
    m = x2.shape[0]
    _rms(rms, m)  # partials of m rows, else the error
    cfg = default_config(m, down.n, down.k, down.bits, down.group_size)
    if (cfg.warp_specialized and cfg.block_m == 8 and quant_matmul_gluon.mlp_usable(x2, gate_up, down)
            and tuple(residual.shape) == (m, down.n) and tuple(norm_weight.shape) == (down.n,)):
        h = torch.empty(m, down.k, dtype=x.dtype, device=x.device)
        out = torch.empty(m, down.n, dtype=x.dtype, device=x.device)
        rows = torch.empty_like(out)
        partials = torch.empty(-(-down.n // quant_matmul_gluon.BN), m, dtype=torch.float32, device=x.device)
        if quant_matmul_gluon.launch_mlp(x2, gate_up, down, h, out, rms, residual.contiguous(), norm_weight, rows,
                                         partials):
            return out, rows, partials
    return wq_matmul_add_norm(wq_matmul_swiglu(x2, gate_up, rms), down, residual, norm_weight)


def _rms(rms: tuple[torch.Tensor, float] | None, m: int) -> dict:
    if rms is None:
        return {}
    if rms[0].dim() != 2 or rms[0].shape[1] != m:
        raise ValueError(f"rms partials {tuple(rms[0].shape)} do not match {m} rows")
    return dict(partials=rms[0], rms=True, eps=float(rms[1]))


def wq_matmul_swiglu(x: torch.Tensor, pw: PackedWeight, rms: tuple[torch.Tensor, float] | None = None,
                     config: KernelConfig | None = None) -> torch.Tensor:
    """silu(gate) * up [M, N / 2] of a packed [gate; up] projection (W's first N / 2 rows gate, the rest up) in one
    launch (up to MAX_KERNEL_ROWS rows), rounded as two launches (projection, then activation) round it; `rms` as in
    wq_matmul."""
    x2 = _rows(x, pw)
    cfg = _one_launch(x2, pw, config, "wq_matmul_swiglu")
    if pw.n % 2:
        raise ValueError(f"a [gate; up] projection has an even number of outputs, got {pw.n}")
    out = torch.empty(x2.shape[0], pw.n // 2, dtype=x.dtype, device=x.device)
    _launch(x2, pw, cfg, out, Epilogue(2, **_rms(rms, x2.shape[0])))
    return out.reshape(*x.shape[:-1], pw.n // 2)


def wq_matmul(x: torch.Tensor, pw: PackedWeight, config: KernelConfig | None = None,
              out: torch.Tensor | None = None, rms: tuple[torch.Tensor, float] | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for x [..., K] (bf16/fp16 on CUDA; any float dtype under the interpreter), in
    `out_dtype` (default x's; float32 keeps the kernel's float32 sums unrounded).

    Up to MAX_KERNEL_ROWS rows: one launch (`config`, default `default_config`); more: dequantize slices of the
    weight to x's dtype and F.linear (prefill; the kernel's numerics are not kept there).
    `rms` (partials, eps) of `wq_matmul_add_norm` (one launch): y is scaled by each row's 1 / rms.
    """
    lead = x.shape[:-1]
    x2 = _rows(x, pw)
    m = x2.shape[0]
    if out is None:
        out = torch.empty(m, pw.n, dtype=out_dtype or x.dtype, device=x.device)
    if m > MAX_KERNEL_ROWS and config is None and rms is None:
        step = max(1, (1 << 24) // (pw.q.shape[1] * 16 // pw.bits))  # rows of <= 16M weights per slice
        for r0 in range(0, pw.n, step):
            out[:, r0:r0 + step] = F.linear(x2, pw.dequantize(x2.dtype, rows=slice(r0, r0 + step)))
    else:
        _launch(x2, pw, _one_launch(x2, pw, config, "wq_matmul"), out, Epilogue(0, **_rms(rms, m)))
    return out.reshape(*lead, pw.n)


__all__ = ["KernelConfig", "MAX_KERNEL_ROWS", "Epilogue", "LaunchPlan", "kernels_available",
           "default_config", "schedule", "launch_plan", "wq_matmul", "wq_matmul_add_norm", "wq_matmul_swiglu",
           "wq_mlp_add_norm"]
