"""Weight-only quantized GEMM for few activation rows (decode and verification), in Triton.

y[M, N] = x[M, K] @ dequant(W)[N, K]^T with 4-bit (or 8-bit) weights in groups along K, bf16/fp16 activations,
fp32 accumulation. Built for M = 1..16 (batch-one decode and speculative verification), where the weights are
read from HBM exactly once for all M rows; larger M is served by the tensor-core kernel tiled over M.

Packed layout ("planar", chosen for these kernels; `pack_planar` builds it, `unpack_planar` inverts it)
-----------------------------------------------------------------------------------------------------
  bits B in {4, 8}; P = 32 // B values per int32 word ("planes"); group size G (one scale per G consecutive k);
  WB = G // P words per group. K is padded up to Kp = ceil(K / G) * G.
  qweight: int32 [N, Kp // P]. For output row n and group g, words g*WB .. g*WB+WB-1 hold the group's G values:
      bits [B*p, B*p + B) of word g*WB + j  =  unsigned code u of k = g*G + p*WB + j      (0 <= p < P, 0 <= j < WB)
  i.e. plane p of the group's words covers the contiguous run of WB inputs starting at g*G + p*WB.
  scales:  [Kp // G, N] (group-major, so one program's scales for its N tile are contiguous), fp16/bf16/fp32.
  zeros:   optional [Kp // G, N], the unsigned zero point z as a float (same dtype as scales); absent = 2**(B-1).
  dequant: w[n, k] = (u - z) * s      (int4 symmetric: z = 8, so u - 8 is the signed code in [-8, 7]).

Why planar: a plane of a [rows, words] tile is a [rows, words] tensor of codes for *contiguous* k, so the
kernels never interleave nibbles across registers.

Kernels
-------
  dot: tensor-core kernel (tl.dot -> wgmma on sm_90), 16 (or 64) activation rows per program, one group per K
       step: part[BN, BM] = C[BN, G] @ xg[G, BM], acc += part * scale. On GPU with int4, one PTX block turns each
       word into eight exact 16-bit floats u - 8 ((u | 0x4300) as bf16 is 128 + u; 3 SHF + 4 LOP3 + 4 packed SUB
       per word), laid out so each 32-bit register is already a column pair of C. About 2.9 SASS instructions per
       weight (sm_90a, BN=128), the same for every M <= 16.
  fma: CUDA-core kernel for M in {1, 2} (also 4): plane p is masked in place into a float mantissa
       (bits | 0x4B000000 = 2**23 + u * 2**shift, one LOP3) minus a constant (one FADD), times x / 2**shift;
       no int->float conversions and one register layout throughout. ~4.1 instructions per weight at M = 1.
  Zero points (asymmetric) are applied per group as -(z - 2**(bits-1)) * sum(x over the group).
Both split K across programs when there are too few N tiles to fill the GPU; the last program of a tile
(a per-tile arrival counter) adds the partial sums in a fixed order, so one launch gives a deterministic result.
Split-K shares one counter buffer per device: kernels on one stream run one at a time, which is what it needs.
Weights and scales for the next K step are loaded before the current step's math (register double buffering).

A small autotuner (`tune`) times a handful of configurations per (bits, group, M bucket, N, K) on the real
weights, checks each result against a dequantized reference, and caches the winner; configurations that fail
to compile or compute wrong values are skipped. Without tuning, `default_config` is used.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

try:  # triton is optional: CPU-only installs use the plain PyTorch reference paths
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_SUPPORTED_BITS = (4, 8)


# ----------------------------------------------------------------------------------------------------------
# Layout (pure PyTorch)
# ----------------------------------------------------------------------------------------------------------

def layout_geometry(bits: int, group_size: int) -> tuple[int, int]:
    """(planes, words_per_group) of the planar layout; raises ValueError for unsupported settings."""
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"planar layout supports {_SUPPORTED_BITS}-bit codes, got {bits}")
    planes = 32 // bits
    if group_size <= 0 or group_size % planes or (group_size // planes) & (group_size // planes - 1):
        raise ValueError(f"group size {group_size} must be {planes} times a power of two for {bits}-bit codes")
    return planes, group_size // planes


def padded_k(k: int, group_size: int) -> int:
    return -(-k // group_size) * group_size


def pack_planar(codes: torch.Tensor, bits: int, group_size: int, pad_code: int | None = None,
                chunk_rows: int = 2048) -> torch.Tensor:
    """Unsigned codes [N, K] (integers in [0, 2**bits)) -> int32 words [N, Kp * bits // 32] in the planar layout."""
    planes, wb = layout_geometry(bits, group_size)
    n, k = codes.shape
    kp = padded_k(k, group_size)
    groups = kp // group_size
    pad = (1 << (bits - 1)) if pad_code is None else pad_code
    out = torch.empty(n, groups * wb, dtype=torch.int32, device=codes.device)
    shifts = (torch.arange(planes, device=codes.device, dtype=torch.int64) * bits).view(1, 1, planes, 1)
    for r0 in range(0, n, chunk_rows):
        c = codes[r0:r0 + chunk_rows].to(torch.int64)
        if kp != k:
            c = torch.nn.functional.pad(c, (0, kp - k), value=pad)
        c = c.view(c.shape[0], groups, planes, wb)
        words = (c << shifts).sum(dim=2)  # disjoint bit fields: sum == bitwise or
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
        out[r0:r0 + chunk_rows] = words.view(c.shape[0], groups * wb).to(torch.int32)
    return out


def unpack_planar(words: torch.Tensor, bits: int, group_size: int, k: int) -> torch.Tensor:
    """Inverse of `pack_planar`: int32 [N, Kp*bits/32] -> unsigned codes int32 [N, k]."""
    planes, wb = layout_geometry(bits, group_size)
    n = words.shape[0]
    groups = words.shape[1] // wb
    w = words.view(n, groups, 1, wb)
    shifts = (torch.arange(planes, device=words.device, dtype=torch.int32) * bits).view(1, 1, planes, 1)
    codes = (w >> shifts) & ((1 << bits) - 1)  # arithmetic shift is fine: the mask drops the sign copies
    return codes.reshape(n, groups * planes * wb)[:, :k]


def dequantize_planar(words, scales_t, zeros_t, bits, group_size, k, dtype=torch.float32):
    """Full weight [N, k] from the planar layout (reference; materialises N*k floats)."""
    codes = unpack_planar(words, bits, group_size, k).to(torch.float32)
    n = codes.shape[0]
    groups = scales_t.shape[0]
    s = scales_t.to(torch.float32).t().repeat_interleave(group_size, dim=1)[:, :k]
    if zeros_t is None:
        z = float(1 << (bits - 1))
    else:
        z = zeros_t.to(torch.float32).t().repeat_interleave(group_size, dim=1)[:, :k]
    assert s.shape == (n, k) and groups * group_size >= k
    return ((codes - z) * s).to(dtype)


@dataclass
class PackedWeight:
    """A quantized weight in the planar layout plus what the kernels need to know about it."""
    qweight: torch.Tensor          # int32 [N, Kp*bits/32]
    scales: torch.Tensor           # [Kp/group, N]
    zeros: torch.Tensor | None     # [Kp/group, N] float unsigned zero points, or None (= 2**(bits-1))
    bits: int
    group_size: int
    n: int
    k: int

    def dequantize(self, dtype=torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None:
            return dequantize_planar(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.k, dtype)
        z = None if self.zeros is None else self.zeros[:, rows]
        return dequantize_planar(self.qweight[rows], self.scales[:, rows], z, self.bits, self.group_size, self.k, dtype)

    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: packed codes + scales (+ zeros)."""
        total = self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            total += self.zeros.numel() * self.zeros.element_size()
        return total


def reference_matmul(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T in float32, returned in x's dtype (the CPU path and the tests' oracle)."""
    w = pw.dequantize(torch.float32)
    y = x.reshape(-1, pw.k).to(torch.float32) @ w.t()
    return y.to(x.dtype).reshape(*x.shape[:-1], pw.n)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _load_words(q_ptr, offs_n, n_mask, offs_w, b0, b_end, KW, WB: tl.constexpr):
        """Words [BN, W] of groups b0, b0+1, ... (masked from group b_end on)."""
        blk = b0 + offs_w // WB
        m2 = n_mask[:, None] & (blk < b_end)[None, :]
        return tl.load(q_ptr + offs_n[:, None].to(tl.int64) * KW + (b0 * WB + offs_w)[None, :], mask=m2, other=0)

    @triton.jit
    def _load_group_meta(s_ptr, z_ptr, offs_n, n_mask, offs_g, b0, b_end, N, HAS_ZP: tl.constexpr, ZP_BIAS):
        """Scales and signed zero points (z - 2**(bits-1)) [BN, NG] of groups b0 + offs_g, as float32."""
        g = b0 + offs_g
        m2 = n_mask[:, None] & (g < b_end)[None, :]
        idx = g[None, :] * N + offs_n[:, None]
        s = tl.load(s_ptr + idx, mask=m2, other=0.0).to(tl.float32)
        if HAS_ZP:
            zc = tl.load(z_ptr + idx, mask=m2, other=ZP_BIAS).to(tl.float32) - ZP_BIAS
        else:
            zc = s
        return s, zc

    @triton.jit
    def _plane(words, words_hi, P: tl.constexpr, BITS: tl.constexpr, P_LO: tl.constexpr, HI_SHIFT: tl.constexpr,
               USE_ASM: tl.constexpr):
        """Plane P of a word tile as float32 (u - 2**(BITS-1)) * 2**SHIFT, exact, SHIFT = BITS*P or BITS*P - HI_SHIFT.

        The code is masked in place into the low mantissa of the float 2**23 (bits | 0x4B000000), then the
        offset 2**23 + 2**(BITS-1) * 2**SHIFT is subtracted: one AND+OR (LOP3) and one FADD, no conversion.
        """
        SHIFT = BITS * P - HI_SHIFT * (P >= P_LO)
        if P >= P_LO:
            src = words_hi
        else:
            src = words
        MASK = ((1 << BITS) - 1) << SHIFT
        if USE_ASM:  # one LOP3 ((a & b) | c, lut 0xEA); plain and/or with two immediates costs two
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                             [src, tl.full(src.shape, MASK, tl.int32),
                                              tl.full(src.shape, 0x4B000000, tl.int32)],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = (src & MASK) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)) * (1 << SHIFT))

    _PLANES16_ASM = """
            {
            .reg .b32 t0, t1, t2, t3, s, k;
            mov.b32 k, BIAS;
            lop3.b32 t0, $8, 0x000F000F, MAGIC, 0xEA;
            shr.u32 s, $8, 4;
            lop3.b32 t1, s, 0x000F000F, MAGIC, 0xEA;
            shr.u32 s, $8, 8;
            lop3.b32 t2, s, 0x000F000F, MAGIC, 0xEA;
            shr.u32 s, $8, 12;
            lop3.b32 t3, s, 0x000F000F, MAGIC, 0xEA;
            sub.rn.TYPE t0, t0, k;
            sub.rn.TYPE t1, t1, k;
            sub.rn.TYPE t2, t2, k;
            sub.rn.TYPE t3, t3, k;
            mov.b32 {$0, $4}, t0;
            mov.b32 {$1, $5}, t1;
            mov.b32 {$2, $6}, t2;
            mov.b32 {$3, $7}, t3;
            }
            """
    # (u | 0x4300) as bf16 = 128 + u and (u | 0x6400) as fp16 = 1024 + u, exactly; minus 136 / 1032 -> u - 8
    _PLANES16_BF16 = tl.constexpr(
        _PLANES16_ASM.replace("BIAS", "0x43084308").replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
    _PLANES16_FP16 = tl.constexpr(
        _PLANES16_ASM.replace("BIAS", "0x64086408").replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))

    @triton.jit
    def _int4_planes16(words, IS_FP16: tl.constexpr):
        """Eight 16-bit float tensors (u - 8) of planes 0..7 of int32 words, exact, from one PTX block per word:
        each 32-bit register of the result pairs planes i and i + 4 (3 SHF + 4 LOP3 + 4 packed SUB per word)."""
        if IS_FP16:
            return tl.inline_asm_elementwise(
                _PLANES16_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                _PLANES16_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                       tl.bfloat16), is_pure=True, pack=1)

    @triton.jit
    def _join2(a, b):
        """Interleave two [R, C] tensors along columns: result[:, 2c] = a[:, c], result[:, 2c + 1] = b[:, c]."""
        return tl.reshape(tl.join(a, b), [a.shape[0], 2 * a.shape[1]])

    @triton.jit
    def _finish(acc, out_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, tile, pid_k, SPLIT_K,
                SPLIT: tl.constexpr):
        """acc [BN, BM] fp32 partial sums -> out (directly, or via workspace + arrival counter under split-K)."""
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        out_off = offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT:
            ws_off = (pid_k * M + offs_m[None, :]) * N + offs_n[:, None]
            tl.store(ws_ptr + ws_off, acc, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # last program of this tile: reduce in a fixed order
                total = tl.zeros(acc.shape, tl.float32)
                for s in range(0, SPLIT_K):
                    total += tl.load(ws_ptr + (s * M + offs_m[None, :]) * N + offs_n[:, None], mask=mask,
                                     other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
        else:
            tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fma_row(t, xs, f, xb, kx, xm, INV, HAS_ZP: tl.constexpr):
        x = tl.load(xb + kx, mask=xm, other=0.0).to(tl.float32)
        if HAS_ZP:
            xs += x
        t += f * (x * INV)[None, :]
        return t, xs

    @triton.jit
    def _fma_group_sum(t, xs, s, zc, BLOCK_N: tl.constexpr, NB: tl.constexpr, WB: tl.constexpr,
                       HAS_ZP: tl.constexpr):
        """[BN, NB*WB] per-word partial sums -> per-group sums [BN, NB], zero point corrected, times the scales."""
        part = tl.sum(tl.reshape(t, [BLOCK_N, NB, WB]), axis=2)
        if HAS_ZP:
            part -= zc * tl.sum(tl.reshape(xs, [NB, WB]), axis=1)[None, :]
        return part * s

    @triton.jit
    def _wq_fma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, KW, NBLK, BPS, SPLIT_K, stride_xm, stride_om,
                       BITS: tl.constexpr, WB: tl.constexpr, P_LO: tl.constexpr, HI_SHIFT: tl.constexpr,
                       HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr,
                       SPLIT: tl.constexpr, USE_ASM: tl.constexpr):
        """CUDA-core kernel for BLOCK_M in {1, 2, 4} rows; the weight tile is read once for all rows."""
        PLANES: tl.constexpr = 32 // BITS
        GS: tl.constexpr = WB * PLANES
        NB: tl.constexpr = W // WB
        ZP_BIAS: tl.constexpr = 1 << (BITS - 1)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_w = tl.arange(0, W)
        offs_g = tl.arange(0, NB)
        w_blk = offs_w // WB
        w_j = offs_w % WB
        b_start = pid_k * BPS
        b_end = tl.minimum(b_start + BPS, NBLK)
        row0 = pid_m * BLOCK_M
        xb = x_ptr + row0 * stride_xm
        ok1 = row0 + 1 < M
        ok2 = row0 + 2 < M
        ok3 = row0 + 3 < M
        acc0 = tl.zeros([BLOCK_N, NB], tl.float32)
        acc1 = tl.zeros([BLOCK_N, NB], tl.float32)
        acc2 = tl.zeros([BLOCK_N, NB], tl.float32)
        acc3 = tl.zeros([BLOCK_N, NB], tl.float32)
        words = _load_words(q_ptr, offs_n, n_mask, offs_w, b_start, b_end, KW, WB)
        s, zc = _load_group_meta(s_ptr, z_ptr, offs_n, n_mask, offs_g, b_start, b_end, N, HAS_ZP, ZP_BIAS)
        for b0 in range(b_start, b_end, NB):
            # issue the next step's loads before this step's math (register double buffering)
            nwords = _load_words(q_ptr, offs_n, n_mask, offs_w, b0 + NB, b_end, KW, WB)
            ns, nzc = _load_group_meta(s_ptr, z_ptr, offs_n, n_mask, offs_g, b0 + NB, b_end, N, HAS_ZP, ZP_BIAS)
            words_hi = words >> HI_SHIFT
            blk = b0 + w_blk
            kvalid = blk < b_end
            t0 = tl.zeros([BLOCK_N, W], tl.float32)
            t1 = tl.zeros([BLOCK_N, W], tl.float32)
            t2 = tl.zeros([BLOCK_N, W], tl.float32)
            t3 = tl.zeros([BLOCK_N, W], tl.float32)
            xs0 = tl.zeros([W], tl.float32)
            xs1 = tl.zeros([W], tl.float32)
            xs2 = tl.zeros([W], tl.float32)
            xs3 = tl.zeros([W], tl.float32)
            for P in tl.static_range(PLANES):
                INV = 1.0 / (1 << (BITS * P - HI_SHIFT * (P >= P_LO)))
                f = _plane(words, words_hi, P, BITS, P_LO, HI_SHIFT, USE_ASM)
                kx = blk * GS + P * WB + w_j
                xm = kvalid & (kx < K)
                t0, xs0 = _fma_row(t0, xs0, f, xb, kx, xm, INV, HAS_ZP)
                if BLOCK_M > 1:
                    t1, xs1 = _fma_row(t1, xs1, f, xb + stride_xm, kx, xm & ok1, INV, HAS_ZP)
                if BLOCK_M > 2:
                    t2, xs2 = _fma_row(t2, xs2, f, xb + 2 * stride_xm, kx, xm & ok2, INV, HAS_ZP)
                    t3, xs3 = _fma_row(t3, xs3, f, xb + 3 * stride_xm, kx, xm & ok3, INV, HAS_ZP)
            acc0 += _fma_group_sum(t0, xs0, s, zc, BLOCK_N, NB, WB, HAS_ZP)
            if BLOCK_M > 1:
                acc1 += _fma_group_sum(t1, xs1, s, zc, BLOCK_N, NB, WB, HAS_ZP)
            if BLOCK_M > 2:
                acc2 += _fma_group_sum(t2, xs2, s, zc, BLOCK_N, NB, WB, HAS_ZP)
                acc3 += _fma_group_sum(t3, xs3, s, zc, BLOCK_N, NB, WB, HAS_ZP)
            words = nwords
            s = ns
            zc = nzc
        o0 = tl.sum(acc0, axis=1)
        if BLOCK_M == 1:
            acc = o0[:, None]
        elif BLOCK_M == 2:
            acc = _join2(o0[:, None], tl.sum(acc1, axis=1)[:, None])
        else:
            a02 = _join2(o0[:, None], tl.sum(acc2, axis=1)[:, None])
            a13 = _join2(tl.sum(acc1, axis=1)[:, None], tl.sum(acc3, axis=1)[:, None])
            acc = _join2(a02, a13)  # columns: rows 0, 1, 2, 3
        offs_m = row0 + tl.arange(0, BLOCK_M)
        tile = pid_m * tl.num_programs(0) + pid_n
        _finish(acc, out_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, tile, pid_k, SPLIT_K, SPLIT)

    @triton.jit
    def _wq_dot_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, KW, NBLK, BPS, SPLIT_K, stride_xm, stride_om,
                       BITS: tl.constexpr, WB: tl.constexpr, P_LO: tl.constexpr, HI_SHIFT: tl.constexpr,
                       HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr,
                       SPLIT: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
                       PLANES16: tl.constexpr):
        """Tensor-core kernel, one group per K step: part[BN, BM] = C[BN, G] @ xg[G, BM]; acc += part * s.

        C holds the group's codes minus 2**(bits-1), times per-plane powers of two (exact in bf16/fp16), in
        plane-interleaved column order c = PLANES * word + plane; xg is x gathered in the same order and divided
        by the same powers of two. The zero point correction uses the group's sum of x.
        """
        PLANES: tl.constexpr = 32 // BITS
        GS: tl.constexpr = WB * PLANES
        ZP_BIAS: tl.constexpr = 1 << (BITS - 1)
        tl.static_assert(W == WB, "dot kernel takes one group per K step")
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_w = tl.arange(0, W)
        offs_g = tl.arange(0, 1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        offs_c = tl.arange(0, GS)
        c_w = offs_c // PLANES
        if PLANES == 8:  # column 8w + 2i + h holds plane i + 4h (see the join tree below)
            c_p = (offs_c % 8) // 2 + 4 * (offs_c % 2)
        else:  # column 4w + p holds plane p
            c_p = offs_c % PLANES
        c_koff = c_p * WB + c_w
        c_shift = tl.where(c_p >= P_LO, BITS * c_p - HI_SHIFT, BITS * c_p)
        c_inv = ((127 - c_shift) << 23).to(tl.float32, bitcast=True)  # 2**-shift
        xdt = x_ptr.dtype.element_ty
        if DOT_F32:
            dt = tl.float32
        else:
            dt = xdt
        b_start = pid_k * BPS
        b_end = tl.minimum(b_start + BPS, NBLK)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        words = _load_words(q_ptr, offs_n, n_mask, offs_w, b_start, b_end, KW, WB)
        s, zc = _load_group_meta(s_ptr, z_ptr, offs_n, n_mask, offs_g, b_start, b_end, N, HAS_ZP, ZP_BIAS)
        for b0 in range(b_start, b_end):
            nwords = _load_words(q_ptr, offs_n, n_mask, offs_w, b0 + 1, b_end, KW, WB)
            ns, nzc = _load_group_meta(s_ptr, z_ptr, offs_n, n_mask, offs_g, b0 + 1, b_end, N, HAS_ZP, ZP_BIAS)
            kx = b0 * GS + c_koff
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kx[:, None], mask=(kx < K)[:, None] & m_mask[None, :],
                         other=0.0).to(tl.float32)
            if PLANES16:  # int4 on GPU: exact (u - 8) planes straight from PTX in x's dtype; x unscaled
                xg = xt.to(xdt)
                c0, c1, c2, c3, c4, c5, c6, c7 = _int4_planes16(words, xdt == tl.float16)
            else:
                xg = (xt * c_inv[:, None]).to(xdt).to(dt)
                words_hi = words >> HI_SHIFT
                c0 = _plane(words, words_hi, 0, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                c1 = _plane(words, words_hi, 1, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                c2 = _plane(words, words_hi, 2, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                c3 = _plane(words, words_hi, 3, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                if PLANES == 8:
                    c4 = _plane(words, words_hi, 4, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                    c5 = _plane(words, words_hi, 5, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                    c6 = _plane(words, words_hi, 6, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
                    c7 = _plane(words, words_hi, 7, BITS, P_LO, HI_SHIFT, USE_ASM).to(xdt).to(dt)
            if PLANES == 8:
                # column 8w + 2i + h <- plane i + 4h: planes i and i + 4 (one 32-bit register of the PTX
                # unpacking) land in adjacent columns, so the bf16 pairs need no repacking
                a = _join2(_join2(_join2(c0, c2), _join2(c1, c3)), _join2(_join2(c4, c6), _join2(c5, c7)))
            else:
                a = _join2(_join2(c0, c2), _join2(c1, c3))  # column 4w + p
            if DOT_F32:
                part = tl.dot(a, xg, input_precision="ieee")
            else:
                part = tl.dot(a, xg)
            if HAS_ZP:
                part -= zc * tl.sum(xt, axis=0)[None, :]
            acc += part * s
            words = nwords
            s = ns
            zc = nzc
        tile = pid_m * tl.num_programs(0) + pid_n
        _finish(acc, out_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, tile, pid_k, SPLIT_K, SPLIT)


def _kernel_module(device: torch.device):
    """This module, after checking its kernels can run on `device`.

    Triton decides at import time whether kernels are compiled or interpreted (TRITON_INTERPRET=1 must be set
    before triton is first imported), so CUDA tensors need a normal process and CPU tensors an interpreter one.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if device.type == "cuda" and _interpreting():
        raise RuntimeError("TRITON_INTERPRET=1 is set but the tensors are on CUDA")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return sys.modules[__name__]


def kernels_available(device: torch.device | str) -> bool:
    """True where `wq_matmul` can run: CUDA with triton (and no interpreter), or CPU with the interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    if device.type == "cuda":
        return not _interpreting()
    return device.type == "cpu" and _interpreting()


# ----------------------------------------------------------------------------------------------------------
# Configurations, launch, tuning
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    kind: str          # "fma" or "dot"
    block_m: int       # activation rows per program (fma: 1, 2, 4; dot: 16, 32 or 64)
    block_n: int       # output features per program
    words: int         # int32 words per row per K step (a multiple of the words per group)
    split_k: int       # K ranges (programs) per N tile
    num_warps: int = 4
    num_stages: int = 1
    asm: bool = True   # inline PTX for the unpacking (GPU only; the interpreter always takes the plain path)


def m_bucket(m: int) -> int:
    for b in (1, 2, 4, 8, 16):
        if m <= b:
            return b
    return 64


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _split_for(n_tiles: int, steps: int, target_programs: int) -> int:
    """Smallest K split giving about `target_programs` programs, keeping >= 2 K steps per program."""
    if n_tiles >= target_programs or steps < 4:
        return 1
    split = -(-target_programs // n_tiles)
    return max(1, min(split, steps // 2, 64))


def _fit_words(words: int, wb: int) -> int:
    return max(words, wb)


def default_config(m: int, n: int, k: int, bits: int, group_size: int, sm_count: int = 132) -> KernelConfig:
    """Heuristic configuration used before (or without) tuning: the tensor-core kernel (fewest instructions per
    weight in the sm_90 SASS: ~2.9 with the PTX unpacking, vs ~4.1 for the CUDA-core kernel at M=1)."""
    planes, wb = layout_geometry(bits, group_size)
    groups = padded_k(k, group_size) // group_size
    bm, bn = (16, 128) if m <= 16 else (64, 128)
    split = _split_for(-(-n // bn), groups, 3 * sm_count) if m <= 16 else 1
    return KernelConfig("dot", bm, bn, wb, split, 4)


def candidate_configs(m: int, n: int, k: int, bits: int, group_size: int, sm_count: int = 132) -> list[KernelConfig]:
    """The short list the tuner times for one problem shape (chosen from instruction counts of the sm_90 SASS)."""
    planes, wb = layout_geometry(bits, group_size)
    groups = padded_k(k, group_size) // group_size
    out: list[KernelConfig] = []

    def add(kind, bm, bn, words, warps):
        words = _fit_words(words, wb)
        steps = -(-groups * wb // words)
        n_tiles = -(-n // bn)
        splits = {_split_for(n_tiles, steps, 2 * sm_count), _split_for(n_tiles, steps, 4 * sm_count)}
        for sp in sorted(splits):
            cfg = KernelConfig(kind, bm, bn, words, sp, warps)
            if cfg not in out:
                out.append(cfg)

    if m == 1:
        add("fma", 1, 128, 32, 4)
        add("fma", 1, 256, 32, 8)
    elif m == 2:
        add("fma", 2, 128, 32, 4)
    if m <= 16:
        for bn, warps in ((128, 4), (256, 8), (64, 4), (128, 8)):
            add("dot", 16, bn, wb, warps)
    else:
        add("dot", 64, 128, wb, 4)
        add("dot", 64, 128, wb, 8)
    return out


_COUNTERS: dict = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _check_config(cfg: KernelConfig, m: int, bits: int, group_size: int) -> None:
    planes, wb = layout_geometry(bits, group_size)
    p2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if cfg.kind not in ("fma", "dot"):
        raise ValueError(f"unknown kernel kind {cfg.kind!r}")
    if cfg.kind == "fma" and cfg.block_m not in (1, 2, 4):
        raise ValueError("fma kernel takes block_m 1, 2 or 4")
    if cfg.kind == "dot" and (cfg.block_m < 16 or not p2(cfg.block_m) or cfg.block_n < 16):
        raise ValueError("dot kernel takes block_m and block_n >= 16 (powers of two)")
    if not (p2(cfg.block_n) and p2(cfg.words) and cfg.words % wb == 0 and cfg.split_k >= 1):
        raise ValueError(f"bad kernel configuration {cfg}")
    if cfg.kind == "dot" and cfg.words != wb:
        raise ValueError(f"dot kernel takes one group ({wb} words) per K step, not {cfg.words}")


def wq_matmul(x: torch.Tensor, pw: PackedWeight, config: KernelConfig | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for x [..., K] (bf16/fp16; fp32 allowed under the interpreter) with the Triton kernels."""
    if x.shape[-1] != pw.k:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {pw.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, pw.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty(m, pw.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, pw.n)
    if config is None:
        config = lookup_config(x2, pw)
    _launch(x2, pw, config, out)
    return out.reshape(*lead, pw.n)


def _launch(x2: torch.Tensor, pw: PackedWeight, cfg: KernelConfig, out: torch.Tensor) -> None:
    mod = _kernel_module(x2.device)
    bits, gs = pw.bits, pw.group_size
    _check_config(cfg, x2.shape[0], bits, gs)
    planes, wb = layout_geometry(bits, gs)
    m, n, k = x2.shape[0], pw.n, pw.k
    groups = pw.qweight.shape[1] // wb
    nb = cfg.words // wb
    bps = -(-groups // cfg.split_k)
    bps = -(-bps // nb) * nb              # whole K steps per split
    split = -(-groups // bps)              # no empty splits
    n_tiles = -(-n // cfg.block_n)
    m_tiles = -(-m // cfg.block_m)
    grid = (n_tiles, split, m_tiles)
    if split > 1:
        ws = torch.empty(split * m * n, dtype=torch.float32, device=x2.device)
        cnt = _counters(x2.device, n_tiles * m_tiles)
    else:
        ws = out
        cnt = pw.qweight  # unused
    zeros = pw.zeros if pw.zeros is not None else pw.scales
    p_lo, hi_shift = (5, 12) if bits == 4 else (2, 16)
    common = dict(BITS=bits, WB=wb, P_LO=p_lo, HI_SHIFT=hi_shift, HAS_ZP=pw.zeros is not None,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, W=cfg.words, SPLIT=split > 1,
                  USE_ASM=cfg.asm and x2.device.type == "cuda",
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x2, pw.qweight, pw.scales, zeros, out, ws, cnt, m, n, k, pw.qweight.shape[1], groups, bps, split,
            x2.stride(0), out.stride(0))
    if cfg.kind == "fma":
        mod._wq_fma_kernel[grid](*args, **common)
    else:
        planes16 = cfg.asm and bits == 4 and x2.device.type == "cuda" and x2.dtype in (torch.bfloat16, torch.float16)
        # without the PTX unpacking, int4 planes carry factors up to 2**16, beyond fp16: use fp32 then
        dot_f32 = x2.device.type == "cpu" or x2.dtype == torch.float32 or (
            bits == 4 and x2.dtype == torch.float16 and not planes16)
        mod._wq_dot_kernel[grid](*args, DOT_F32=dot_f32, PLANES16=planes16, **common)


# --- tuning cache -------------------------------------------------------------------------------------------

_TUNED: dict[str, KernelConfig] = {}
_TUNE_FILE_LOADED = False


def _key(x2: torch.Tensor, pw: PackedWeight) -> str:
    dev = torch.cuda.get_device_name(x2.device) if x2.device.type == "cuda" else "cpu"
    return "|".join(str(v) for v in (dev, pw.bits, pw.group_size, pw.zeros is not None, str(x2.dtype),
                                      m_bucket(x2.shape[0]), pw.n, pw.k))


def _load_tune_file() -> None:
    global _TUNE_FILE_LOADED
    _TUNE_FILE_LOADED = True
    path = os.environ.get("BLOCKSPEC_QUANT_TUNE_FILE")
    if path and os.path.exists(path):
        with open(path) as f:
            for key, cfg in json.load(f).items():
                _TUNED.setdefault(key, KernelConfig(**cfg))


def _save_tune_file() -> None:
    path = os.environ.get("BLOCKSPEC_QUANT_TUNE_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({k: asdict(v) for k, v in _TUNED.items()}, f, indent=1)


def tuned_configs() -> dict[str, dict]:
    return {k: asdict(v) for k, v in _TUNED.items()}


def set_tuned_configs(table: dict) -> None:
    for key, cfg in table.items():
        _TUNED[key] = cfg if isinstance(cfg, KernelConfig) else KernelConfig(**cfg)


def _autotune_enabled() -> bool:
    return os.environ.get("BLOCKSPEC_QUANT_AUTOTUNE", "1") != "0"


def lookup_config(x2: torch.Tensor, pw: PackedWeight) -> KernelConfig:
    """Tuned configuration for this shape; tunes on first sight (CUDA, not while capturing a graph)."""
    if not _TUNE_FILE_LOADED:
        _load_tune_file()
    key = _key(x2, pw)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    m = x2.shape[0]
    if (x2.device.type == "cuda" and _autotune_enabled() and m <= 16
            and not torch.cuda.is_current_stream_capturing()):
        return tune(x2, pw)
    return default_config(m, pw.n, pw.k, pw.bits, pw.group_size, _sm_count(x2.device))


def tune(x2: torch.Tensor, pw: PackedWeight, candidates: list[KernelConfig] | None = None,
         rep_ms: float = 20.0, verbose: bool = False) -> KernelConfig:
    """Time the candidate configurations on (x2, pw); keep the fastest one whose output is right."""
    from triton.testing import do_bench

    m = x2.shape[0]
    if candidates is None:
        candidates = candidate_configs(m, pw.n, pw.k, pw.bits, pw.group_size, _sm_count(x2.device))
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randperm(pw.n, generator=gen)[:512].to(x2.device)
    rows = torch.cat([rows, torch.tensor([pw.n - 1], device=x2.device)])
    ref = x2.float() @ pw.dequantize(torch.float32, rows=rows).t()
    tol = 3e-2 * float(ref.abs().max()) + 1e-3
    out = torch.empty(m, pw.n, dtype=x2.dtype, device=x2.device)
    best, best_t, report = None, float("inf"), []
    for cfg in candidates:
        t0 = time.perf_counter()
        try:
            _launch(x2, pw, cfg, out)
            err = float((out[:, rows].float() - ref).abs().max())
            if not err <= tol:
                report.append((cfg, None, f"wrong (max err {err:.3g} > {tol:.3g})"))
                continue
            ms = do_bench(lambda: _launch(x2, pw, cfg, out), warmup=max(2.0, rep_ms / 4), rep=rep_ms,
                          return_mode="median")
        except Exception as exc:  # a configuration that does not compile or launch is skipped
            report.append((cfg, None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"))
            continue
        report.append((cfg, ms, f"{time.perf_counter() - t0:.2f}s"))
        if ms < best_t:
            best, best_t = cfg, ms
    if verbose:
        for cfg, ms, note in report:
            print(f"    {cfg}: {'-' if ms is None else f'{ms * 1e3:.1f} us'} {note}")
    if best is None and any(c.asm for c in candidates):  # PTX unpacking not usable here: plain Triton
        return tune(x2, pw, [replace(c, asm=False) for c in candidates], rep_ms, verbose)
    if best is None:
        raise RuntimeError(f"no working kernel configuration for M={m} N={pw.n} K={pw.k}: {report}")
    _TUNED[_key(x2, pw)] = best
    _save_tune_file()
    return best


def effective_bandwidth_gbs(pw: PackedWeight, ms: float) -> float:
    return pw.nbytes() / (ms * 1e-3) / 1e9


__all__ = ["PackedWeight", "KernelConfig", "pack_planar", "unpack_planar", "dequantize_planar", "layout_geometry",
           "padded_k", "reference_matmul", "wq_matmul", "kernels_available", "default_config", "candidate_configs",
           "tune", "lookup_config", "tuned_configs", "set_tuned_configs", "m_bucket", "effective_bandwidth_gbs"]
