"""FP8 block-scaled weights times few activation rows in Triton (W8A16): y[M, N] = x[M, K] @ dequant(W)[N, K]^T,
M <= 16, reading the stored float8_e4m3fn bytes and applying the block scales in the kernel.

Weights as block-wise FP8 checkpoints store them (quant/fp8.py): w[n, k] = fp8[n, k] * scale[row[n], k // BK],
BK = 128 inputs per scale block; `row` maps each output to its scale row (n // 128 for one projection; packed
projections whose sizes are not multiples of 128 keep their own blocks through it).
Program (pid_n, pid_k): BN outputs over a range of BK-wide input blocks. Each step loads the [BN, BK] FP8 tile,
converts it to the activations' dtype (exact: every e4m3 value is a bf16 and an fp16; sign, exponent and mantissa
bits moved into an fp32 with the mask 0x87F00000 and the exponent's bias difference multiplied back: ~5 instructions
per weight, where Triton's own e4m3 -> bf16 conversion held the kernel near 2 TB/s), multiplies it with the x^T
tile [BK, BM] (tensor cores, fp32 sums) and adds the product times the block's scale per output row. Split-K partial
sums are added by the last program of a tile (linear_triton.split_k_total: one launch, no memset, a fixed order).
One config for every M <= 16 (BM = 16): a row's result does not depend on how many rows the launch has, so a
1-token step and an 8-token verification pass compute each row alike (speculative output equals plain greedy).
The reference (kernels/fp8_linear.py) dequantizes to float32 and multiplies; the sums differ only in their rounding
order. Runs on CUDA devices with FP8 conversion (compute capability 8.9 and later), and on the CPU under the
Triton interpreter (fp32 dots).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import arrival_counters, launch_fitting, pdl, triton_runs_on
from .linear_triton import split_blocks

try:
    import triton
    import triton.language as tl

    from .linear_triton import split_k_finish
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

MAX_ROWS = 16
BLOCK_K = 128  # inputs per scale block: the only block size the loader takes


@dataclass(frozen=True)
class Fp8Config:
    block_n: int = 64
    warps: int = 4
    stages: int = 4
    waves: int = 2  # split K until about waves * SMs programs


@functools.cache
def _fp8_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x [M, K] (M <= 16) against the FP8 weight."""
    if not triton_runs_on(x) or x.dim() != 2 or x.shape[0] > MAX_ROWS or weight.dtype != torch.float8_e4m3fn:
        return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16) and _fp8_capable(x.device)
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
               out_dtype: torch.dtype | None = None, config: Fp8Config = Fp8Config(),
               sms: int | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale[scale_row[n], k // 128])^T in `out_dtype` (default x's)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    tiles = -(-n // config.block_n)
    split, per_split = split_blocks(tiles, -(-k // BLOCK_K), config.waves * (sms or _sm_count(x.device)))
    ws = torch.empty(split * m * n if split > 1 else 1, device=x.device, dtype=torch.float32)
    prefetch = pdl.prefetch_blocks(config.block_n * BLOCK_K, tiles * split, per_split, x.device)
    launch_fitting(_fp8_kernel, (tiles, split), x, weight, scale, scale_row, out, ws,
                   arrival_counters(x.device, tiles), m, n, k, scale.shape[1], x.stride(0), weight.stride(0),
                   out.stride(0), per_split, split, stages_key="STAGES", BN=config.block_n, BK=BLOCK_K, BM=MAX_ROWS,
                   STAGES=config.stages, EVEN_K=k % BLOCK_K == 0, F32DOT=not x.is_cuda, PREFETCH=prefetch,
                   num_warps=config.warps, **pdl.options(x))
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["M", "PER_SPLIT", "SPLIT"])
    def _fp8_kernel(x, w, scale, scale_row, out, ws, counters, M, N, K, KB, s_x, s_w, s_o, PER_SPLIT, SPLIT,
                    BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr,
                    EVEN_K: tl.constexpr, F32DOT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        offs_m = tl.arange(0, BM)
        m_ok = offs_m < M
        offs_k = tl.arange(0, BK)
        w_tile = w + offs_n[:, None].to(tl.int64) * s_w + offs_k[None, :]
        s_rows = scale + tl.load(scale_row + offs_n, mask=n_ok, other=0).to(tl.int64) * KB  # each output's scales
        b_lo = pid_k * PER_SPLIT
        b_hi = tl.minimum(b_lo + PER_SPLIT, tl.cdiv(K, BK))
        pdl.prefetch_rows(w, offs_n, s_w, b_lo * BK, N, K, PREFETCH * BK, 128, PDL)  # 1-byte weights: 128 per line
        pdl.wait(PDL)
        acc = tl.zeros([BN, BM], tl.float32)
        for b in tl.range(b_lo, b_hi, num_stages=STAGES):
            k_ok = (b * BK + offs_k < K) | EVEN_K
            wt = tl.load(w_tile + b * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x + offs_m[None, :] * s_x + b * BK + offs_k[:, None],  # x^T [BK, BM]
                         mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            s = tl.load(s_rows + b, mask=n_ok, other=0.0)
            if F32DOT:  # the interpreter's 16-bit dot is broken; fp32 holds every product exactly
                part = tl.dot(wt.to(tl.float32), xt.to(tl.float32))
            else:  # e4m3 -> fp32 by moving its bits (the value times 2**-120), times 2**120: exact, and cheaper
                bits = wt.to(tl.int8, bitcast=True).to(tl.int32)  # than Triton's conversion (module docstring)
                a = ((bits << 20) & -2014314496).to(tl.float32, bitcast=True) * 1.329227995784916e36
                part = tl.dot(a.to(xt.dtype), xt)
            acc += part * s[:, None]
        pdl.release(PDL)
        split_k_finish(acc, out, ws, counters, offs_n, offs_m, M, N, s_o, pid_n, pid_k, SPLIT)
