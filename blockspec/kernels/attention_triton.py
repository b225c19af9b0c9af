"""Attention of 1..16 new queries over a KV cache in Triton (split-KV "flash decoding"), the fast path of
`blockspec.kernels.attention.cached_attention` on CUDA; `cached_attention_sdpa` there is its reference.

Why: under a CUDA graph the position is data, so SDPA must read the whole cache under a mask (cost grows with
context_length, not with the tokens actually held): on the H200 at 4096 slots SDPA (cuDNN) takes 23.7 us per 27B
layer at one query and 219 us at eight, this kernel 10.7 / 15.2 us (bench/attention_kernels.py; at 32768 slots
66 / 1731 us against 21 / 33). The filled length is read from `positions` on the device, so a replay reads only the
filled prefix, whatever the capacity.

Layout: the T queries of the KV heads' G grouped query heads are stacked as the M = T*G rows of one tile (row
r: token r // G, head kv*G + r % G), so each key/value tile is loaded once per KV head. Programs (kv head, split)
each cover one slice of the cache with the online softmax and write an unnormalised partial + log-sum-exp; a
second kernel merges the splits (splits past the filled length write lse = -inf and are weighted 0).
"""

from __future__ import annotations

import torch

from . import launch_fitting, pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the SDPA reference
    triton = None

MAX_QUERIES = 16
MAX_SPLITS = 64  # 4 KV heads x 64 splits fills an H200's 132 SMs twice over once the context is long


def available(q: torch.Tensor) -> bool:
    """CUDA fp16/bf16 (fp32 dots would run in TF32), or any dtype under the CPU interpreter (the tests)."""
    if not triton_runs_on(q) or q.shape[0] > MAX_QUERIES or q.shape[-1] & (q.shape[-1] - 1):
        return False
    return not q.is_cuda or q.dtype in (torch.float16, torch.bfloat16)


def split_plan(capacity: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): fixed by the cache capacity, so one captured graph serves every length."""
    splits = max(1, min(MAX_SPLITS, triton.cdiv(capacity, 128)))
    per_split = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    return triton.cdiv(capacity, per_split), per_split


def cached_attention_triton(q, k, v, positions, scale):
    """Same contract as cached_attention_sdpa: q [T, Hq, D] at consecutive positions, k/v [L, Hkv, D] holding every
    key up to positions[-1] (L may be the whole capacity: only keys <= positions[-1] are read)."""
    return _split_kv_attention(q, k, v, positions, None, scale)


def masked_attention_triton(q, k, v, visible, scale):
    """The DFlash2 drafter's attention: q [T, Hq, D], k/v [L, Hkv, D] (its context slots, then the block's own
    rows), visible [T, L] bool: which keys each query sees (every query sees at least one). Returns [T, Hq, D]."""
    return _split_kv_attention(q, k, v, None, visible, scale)


def _split_kv_attention(q, k, v, positions, visible, scale):
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = t * group
    block_m = max(16, triton.next_power_of_2(rows))
    block_n = 64 if block_m <= 32 else 32
    splits, per_split = split_plan(k.shape[0], block_n)
    partial = torch.empty(splits, kv_heads, block_m, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, kv_heads, block_m, device=q.device, dtype=torch.float32)
    masked = visible is not None
    launch_fitting(_attention_split_kernel, (kv_heads, splits),
                   q, k, v, visible.view(torch.uint8) if masked else positions, partial, lse, scale, k.shape[0],
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   visible.stride(0) if masked else 0,
                   T=t, GROUP=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, PER_SPLIT=per_split, MASKED=masked,
                   num_warps=4 if block_m <= 32 else 8, **pdl.options(q))
    out = torch.empty(t, heads, d, device=q.device, dtype=q.dtype)
    _merge_splits_kernel[(kv_heads, rows)](partial, lse, out, out.stride(0), out.stride(1),
                                           SPLITS=splits, GROUP=group, D=d, BLOCK_M=block_m,
                                           BLOCK_S=max(2, triton.next_power_of_2(splits)), KV_HEADS=kv_heads,
                                           **pdl.options(q))
    return out


if triton is not None:
    @triton.jit
    def _attention_split_kernel(q, k, v, positions, partial, lse, scale, L,
                                sq_t, sq_h, sk_l, sk_h, sv_l, sv_h, s_vis,
                                T: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_SPLIT: tl.constexpr,
                                MASKED: tl.constexpr, PDL: tl.constexpr):
        """MASKED: `positions` is the visibility mask [T, L] (row stride s_vis) and every key may be read; else
        the position of query token 0, the cache holding its T tokens' keys up to start + T (causal)."""
        pdl.begin(PDL)
        kv = tl.program_id(0)
        split = tl.program_id(1)
        lo = split * PER_SPLIT
        rows = tl.arange(0, BLOCK_M)
        token = rows // GROUP
        if MASKED:
            hi = tl.minimum(lo + PER_SPLIT, L)
            last_visible = token + L                    # no causal limit: the mask decides
        else:
            start = tl.load(positions)
            hi = tl.minimum(lo + PER_SPLIT, start + T)
            last_visible = start + token                # causal: token i sees keys 0..start+i
        dims = tl.arange(0, D)
        row_ok = rows < T * GROUP
        q_ptrs = q + token[:, None] * sq_t + (kv * GROUP + rows % GROUP)[:, None] * sq_h + dims[None, :]
        qt = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            kt = tl.load(k + keys[:, None] * sk_l + kv * sk_h + dims[None, :], mask=key_ok[:, None], other=0.0)
            s = tl.dot(qt, tl.trans(kt)) * scale
            seen = key_ok[None, :] & (keys[None, :] <= last_visible[:, None])
            if MASKED:
                seen &= tl.load(positions + token[:, None] * s_vis + keys[None, :],
                                mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            vt = tl.load(v + keys[:, None] * sv_l + kv * sv_h + dims[None, :], mask=key_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
        out = (split * tl.num_programs(0) + kv) * BLOCK_M + rows
        tl.store(partial + out[:, None] * D + dims[None, :], acc / tl.where(denom > 0, denom, 1.0)[:, None])
        tl.store(lse + out, tl.where(denom > 0, m + tl.log(denom), float("-inf")))

    @triton.jit
    def _merge_splits_kernel(partial, lse, out, so_t, so_h, SPLITS: tl.constexpr, GROUP: tl.constexpr,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, KV_HEADS: tl.constexpr,
                             PDL: tl.constexpr):
        pdl.begin(PDL)
        kv = tl.program_id(0)
        row = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        split_ok = splits < SPLITS
        at = (splits * KV_HEADS + kv) * BLOCK_M + row
        weights = tl.load(lse + at, mask=split_ok, other=float("-inf"))
        weights = tl.exp(weights - tl.max(weights, 0))
        dims = tl.arange(0, D)
        parts = tl.load(partial + at[:, None] * D + dims[None, :], mask=split_ok[:, None], other=0.0)
        merged = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
        dst = out + (row // GROUP) * so_t + (kv * GROUP + row % GROUP) * so_h + dims
        tl.store(dst, merged.to(out.dtype.element_ty))
