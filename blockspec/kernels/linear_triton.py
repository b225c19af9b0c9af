"""Dense (bf16 / fp16) matmul for few activation rows in Triton: y[M, N] = x[M, K] @ w[N, K]^T, M up to
MAX_PASS_TOKENS (a verification pass: a chain's or a draft tree's rows); F.linear (cuBLAS) stays the reference and
serves every other shape.

Why, beside cuBLAS: for the MLP's down projection (17408 -> 5120 on the 27B) cuBLAS picks a split-K kernel plus a
memset and a reduction launch (docs/benchmarks.md, "Few-row bf16 matmul"). Here split-K partial sums
are added by the last program to finish a tile (`split_k_total`, shared with the W4A16 kernel): one launch, no
memset. Programs: (BN output rows, a range of BK-wide input blocks); an MMA tile of BM = 8, 16, 32 or 64 rows
(the next power of two of M, at least 8; Triton compiles 8 rows to mma.sync and more to Hopper's wgmma, a 64-row
weight tile a warp group with the x rows as its N side, asynchronous), or for one row a CUDA-core dot (dot=False).

`default_config` holds the H200 winners of bench/linear_kernels.py (docs/benchmarks.md, "Few-row bf16 matmul"):
the one-row CUDA-core dot for down and o / gdn out, 8-row mma.sync tiles for down, gate_up and gdn in, and for a
draft tree's 9..32 rows wgmma tiles for down, gate_up, gdn in and attention qkv (above 32 rows gdn in and qkv only);
cuBLAS elsewhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import MAX_PASS_TOKENS
from . import arrival_counters, launch_fitting, pdl, sm_count, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use F.linear
    triton = None


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    dot: bool = True      # MMA (`block_rows`); False: CUDA-core dot, one row only
    warps: int = 4
    stages: int = 4
    waves: int = 2        # split K until about waves * SMs programs

    def short(self) -> str:
        kind = "dot" if self.dot else "fma"
        return f"n{self.block_n} k{self.block_k} {kind} w{self.warps} s{self.stages} wv{self.waves}"


def default_config(m: int, n: int, k: int) -> LinearConfig | None:
    """The measured winners (module docstring); None where cuBLAS is as fast or faster, or where nothing was
    measured (the vocabulary head)."""
    if n > 65536 or m > MAX_PASS_TOKENS:
        return None
    if m > 8:  # a draft tree's rows: wgmma tiles, except onto narrow outputs from short inputs (o / gdn out)
        if k < 12288 and n <= 8192 or m > 32 and not 8192 < n < 32768:
            return None
        if n >= 32768:  # gate_up
            return LinearConfig(64, 128, True, 4, 3, 4 if m > 16 else 1)
        return LinearConfig(64, 128, True, 4, 4 if m <= 32 else 3, 1)
    if n >= 16384:  # wide outputs: enough tiles without splitting K
        return LinearConfig(64, 256, True, 4, 3, 1)
    if k >= 12288:  # long inputs onto a narrow output: one row as CUDA-core dots (no split), more rows split K
        return LinearConfig(16, 256, False, 4, 5, 2) if m == 1 else LinearConfig(64, 128, True, 4, 3, 2)
    if m == 1 and n <= 8192:  # o / gdn out: 8-row tiles, 640 programs spread evenly over the SMs
        return LinearConfig(8, 256, False, 4, 5, 1)
    return None


def fits(config: LinearConfig, m: int, device: torch.device) -> bool:
    """Whether the config's pipeline (stages x (weight tile + input tile), bf16) fits the device's shared memory per
    block: the H200's 8-row winners need up to ~110 KB (192 KB at 64 rows), more than consumer Ampere / Ada cards give
    (~100 KB), which then keep cuBLAS."""
    need = config.stages * (config.block_n + block_rows(config, m)) * config.block_k * 2
    return device.type != "cuda" or need <= _shared_memory(device)


def block_rows(config: LinearConfig, m: int) -> int:
    """Rows of the program's input tile: the next power of two of M, at least MMA's 8; one for the CUDA-core dot."""
    return max(8, 1 << (m - 1).bit_length()) if config.dot else 1


def split_blocks(tiles: int, blocks: int, programs: int) -> tuple[int, int]:
    """(split, blocks per split): each output tile's K blocks split until about `programs` programs run, no split
    empty (shared with the W4A16 kernel)."""
    split = min(-(-programs // tiles), blocks) if tiles < programs else 1
    per_split = -(-blocks // split)
    return -(-blocks // per_split), per_split


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return triton_runs_on(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and \
        weight.dtype == x.dtype and weight.stride(-1) == 1


def linear_rows(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig, out: torch.Tensor | None = None,
                sms: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with `config` (M <= MAX_PASS_TOKENS; one row for dot=False)."""
    m, k = x.shape
    if m > MAX_PASS_TOKENS:
        raise ValueError(f"the few-row kernel takes at most {MAX_PASS_TOKENS} rows, got {m}")
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = out if out is not None else torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m = block_rows(config, m)
    if not config.dot and m != 1:
        raise ValueError("the CUDA-core variant takes one row")
    tiles = -(-n // config.block_n)
    split, per_split = split_blocks(tiles, -(-k // config.block_k), config.waves * (sms or sm_count(x.device)))
    ws = torch.empty(split * m * n if split > 1 else 1, device=x.device, dtype=torch.float32)
    prefetch = pdl.prefetch_blocks(config.block_n * config.block_k * weight.element_size(), tiles * split,
                                   per_split, x.device)
    launch_fitting(_linear_kernel, (tiles, split), x, weight, out, ws, arrival_counters(x.device, tiles), m, n, k,
                   x.stride(0), weight.stride(0), out.stride(0), per_split, split, stages_key="STAGES",
                   BN=config.block_n, BK=config.block_k, BM=block_m, STAGES=config.stages, DOT=config.dot,
                   EVEN_K=k % config.block_k == 0, F32DOT=not x.is_cuda, PREFETCH=prefetch,
                   LINE=128 // weight.element_size(), num_warps=config.warps, **pdl.options(x))
    return out


@functools.cache
def _shared_memory(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


if triton is not None:
    @triton.jit
    def split_k_total(vals, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, pid_n, pid_k, SPLIT):
        """(the tile's fp32 sum [BN, BM], whether this program holds it): without split-K every program holds its
        own; under split-K the last program of the tile to arrive adds the partials in a fixed order."""
        total = vals
        done = pid_k == pid_k
        if SPLIT > 1:
            mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
            w_off = offs_m[None, :] * N + offs_n[:, None]
            tl.store(ws_ptr + pid_k * M * N + w_off, vals, mask=mask)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1
            if done:
                total = tl.zeros(vals.shape, tl.float32)
                for sk in range(SPLIT):
                    total += tl.load(ws_ptr + sk * M * N + w_off, mask=mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # clean for the next launch / graph replay
        return total, done

    @triton.jit
    def split_k_finish(vals, out_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, pid_n, pid_k, SPLIT):
        """vals [BN, BM] fp32 -> out (see split_k_total)."""
        total, done = split_k_total(vals, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, pid_n, pid_k, SPLIT)
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :] & done
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M", "PER_SPLIT", "SPLIT"])
    def _linear_kernel(x, w, out, ws, counters, M, N, K, s_x, s_w, s_o, PER_SPLIT, SPLIT, BN: tl.constexpr,
                       BK: tl.constexpr, BM: tl.constexpr,
                       STAGES: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                       F32DOT: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
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
        pdl.prefetch_rows(w, offs_n, s_w, b_lo * BK, N, K, PREFETCH * BK, LINE, PDL)  # while the previous kernel ends
        pdl.wait(PDL)
        if DOT:
            acc = tl.zeros([BN, BM], tl.float32)
            for b in tl.range(b_lo, b_hi, num_stages=STAGES):
                k_ok = (b * BK + offs_k < K) | EVEN_K
                wt = tl.load(w_tile + b * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x + offs_m[None, :] * s_x + b * BK + offs_k[:, None],  # x^T [BK, BM]
                             mask=m_ok[None, :] & k_ok[:, None], other=0.0)
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
        pdl.release(PDL)
        split_k_finish(acc, out, ws, counters, offs_n, offs_m, M, N, s_o, pid_n, pid_k, SPLIT)
