"""Dense (bf16 / fp16) matmul for few activation rows in Triton: y[M, N] = x[M, K] @ w[N, K]^T, M <= 16.

Why, beside cuBLAS (F.linear stays the reference and the default): for the 27B's projections onto the 5120-wide
stream (MLP down 17408 -> 5120, DeltaNet out and attention o 6144 -> 5120) cuBLAS picks split-K kernels that add a
memset and a reduction launch per call, or runs at ~3.5 TB/s; with 64 such calls per step that is ~0.3-0.4 ms.
Here split-K partial sums are added by the last program to finish a tile (blockspec.quant.w4a16_triton's
`_finish`): one launch, no memset. Programs: (BN output rows, a range of BK-wide input blocks); M <= 8 uses an
8-row MMA tile (mma.sync), or for one row a CUDA-core dot (DOT=False).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import arrival_counters, triton_runs_on

try:
    import triton
    import triton.language as tl

    from ..quant.w4a16_triton import _finish
except ImportError:  # pragma: no cover - CPU-only installs use F.linear
    triton = None


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    dot: bool = True      # MMA (block_m 8 / 16 rows); False: CUDA-core dot, one row only
    warps: int = 4
    stages: int = 4
    waves: int = 2        # split K until about waves * SMs programs

    def short(self) -> str:
        kind = "dot" if self.dot else "fma"
        return f"n{self.block_n} k{self.block_k} {kind} w{self.warps} s{self.stages} wv{self.waves}"


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return triton_runs_on(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and \
        x.shape[0] <= 16 and weight.stride(-1) == 1


def linear_rows(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig, out: torch.Tensor | None = None,
                sms: int = 132) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = out if out is not None else torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m = 1 if not config.dot else (8 if m <= 8 else 16)
    if not config.dot and m != 1:
        raise ValueError("the CUDA-core variant takes one row")
    tiles, blocks = -(-n // config.block_n), -(-k // config.block_k)
    target = config.waves * sms
    split = min(-(-target // tiles), blocks) if tiles < target else 1
    per_split = -(-blocks // split)
    split = -(-blocks // per_split)
    ws = torch.empty(split * m * n if split > 1 else 1, device=x.device, dtype=torch.float32)
    sync = config.dot and x.is_cuda
    if sync:
        os.environ["DISABLE_MMA_V3"] = "1"  # mma.sync for 8-row tiles; read by the compiler on a first call
    try:
        _linear_kernel[(tiles, split)](x, weight, out, ws, arrival_counters(x.device, tiles), m, n, k, x.stride(0),
                                       weight.stride(0), out.stride(0), per_split, split, BN=config.block_n,
                                       BK=config.block_k, BM=block_m, STAGES=config.stages, DOT=config.dot,
                                       EVEN_K=k % config.block_k == 0, SYNC=sync, F32DOT=not x.is_cuda,
                                       num_warps=config.warps)
    finally:
        if sync:
            os.environ.pop("DISABLE_MMA_V3", None)
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["M", "PER_SPLIT", "SPLIT"])
    def _linear_kernel(x, w, out, ws, counters, M, N, K, s_x, s_w, s_o, PER_SPLIT, SPLIT, BN: tl.constexpr,
                       BK: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, DOT: tl.constexpr,
                       EVEN_K: tl.constexpr, SYNC: tl.constexpr, F32DOT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        offs_m = tl.arange(0, BM)
        m_ok = offs_m < M
        offs_k = tl.arange(0, BK)
        w_tile = w + offs_n[:, None].to(tl.int64) * s_w + offs_k[None, :]
        b_lo = pid_k * PER_SPLIT
        b_hi = tl.minimum(b_lo + PER_SPLIT, tl.cdiv(K, BK))
        if DOT:
            acc = tl.zeros([BN, BM], tl.float32)
            x_tile = x + offs_m[None, :] * s_x + offs_k[:, None]  # x^T [BK, BM]
            for b in tl.range(b_lo, b_hi, num_stages=STAGES):
                k_ok = (b * BK + offs_k < K) | EVEN_K
                wt = tl.load(w_tile + b * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x_tile + b * BK, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
                if F32DOT:  # the interpreter's bf16 dot is broken
                    wt, xt = wt.to(tl.float32), xt.to(tl.float32)
                acc = tl.dot(wt, xt, acc)
        else:
            row = tl.zeros([BN], tl.float32)
            for b in tl.range(b_lo, b_hi, num_stages=STAGES):
                k_ok = (b * BK + offs_k < K) | EVEN_K
                wt = tl.load(w_tile + b * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xr = tl.load(x + b * BK + offs_k, mask=k_ok, other=0.0)
                row += tl.sum(wt.to(tl.float32) * xr.to(tl.float32)[None, :], 1)
            acc = row[:, None]
        _finish(acc, out, ws, counters, offs_n, offs_m, M, N, s_o, pid_n, pid_k, SPLIT)
