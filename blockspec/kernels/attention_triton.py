"""Attention of 1..16 new queries over a KV cache in Triton (split-KV "flash decoding"), the fast path of
`blockspec.kernels.attention.cached_attention` on CUDA; `cached_attention_sdpa` there is its reference. The same
kernel serves a draft tree's 1..MAX_PASS_TOKENS nodes (`tree_attention`, reference `tree_attention_sdpa`).

Why: under a CUDA graph the position is data, so SDPA must read the whole cache under a mask (cost grows with
context_length, not with the tokens actually held; docs/benchmarks.md, "Attention"). The filled length is read
from `positions` on the device, so a replay reads only the filled prefix, whatever the capacity.

Layout: the T queries of the KV heads' G grouped query heads are stacked as the M = T*G rows of one tile (row
r: token r // G, head kv*G + r % G), so each key/value tile is loaded once per KV head. Programs (kv head, split)
each cover one slice of the cache with the online softmax and write an unnormalised partial + log-sum-exp; a
second kernel merges the splits it was given. The causal and tree kernels share the filled keys (read from
`positions`) out among as many splits as keep the programs to one wave, so a short fill of a long cache still
spreads over the GPU, and a split that gets no keys writes no partial.

Trees: every node sees the committed prefix (keys < slots[0]) and, of the tree's own T keys after it, those of its
ancestors (the [T, T] mask, read as uint8 in the tiles that reach them). Beyond MAX_QUERIES nodes the T*G rows
(384 for the 27B at 64 nodes) are split into row blocks of TREE_ROW_BLOCK, a third grid dimension, so that a
program's tile (q, accumulator: BLOCK_M x D) stays in registers; the row blocks of a slice of keys read it together.
A tree row's partial is written, and merged, only where its split held a key it sees (finite lse): at 32768 slots
the partials of 64 splits x 384 rows would be 100 MB per layer, of which a short context fills a few splits.
"""

from __future__ import annotations

import torch

from ..config import MAX_PASS_TOKENS
from . import launch_fitting, pdl, sm_count, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the SDPA reference
    triton = None

MAX_QUERIES = 16  # chains (cached / masked attention); trees take up to MAX_PASS_TOKENS nodes
TREE_ROW_BLOCK = 64  # rows per program for trees beyond MAX_QUERIES nodes (64 x 256 fp32 accumulator: 64 registers)
MAX_SPLITS = 64  # 4 KV heads x 64 splits fills an H200's 132 SMs twice over once the context is long


def available(q: torch.Tensor, tree: bool = False) -> bool:
    """CUDA fp16/bf16 (fp32 dots would run in TF32), or any dtype under the CPU interpreter (the tests); a power-of-two
    head dim; up to MAX_QUERIES queries, or MAX_PASS_TOKENS nodes of a tree."""
    limit = MAX_PASS_TOKENS if tree else MAX_QUERIES
    if not triton_runs_on(q) or q.shape[0] > limit or q.shape[-1] & (q.shape[-1] - 1):
        return False
    return not q.is_cuda or q.dtype in (torch.float16, torch.bfloat16)


def split_plan(capacity: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split) over `capacity` keys: the grid, fixed by the cache capacity so that one captured
    graph serves every length. The causal and tree kernels share the filled keys out among these splits, read on
    the device (the keys per split here: the masked kernel's, which may read every key)."""
    splits = max(1, min(MAX_SPLITS, triton.cdiv(capacity, 128)))
    per_split = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    return triton.cdiv(capacity, per_split), per_split


def cached_attention_triton(q, k, v, positions, scale):
    """Same contract as cached_attention_sdpa: q [T, Hq, D] at consecutive positions, k/v [L, Hkv, D] holding every
    key up to positions[-1] (L may be the whole capacity: only keys <= positions[-1] are read)."""
    return _split_kv_attention(q, k, v, positions, None, scale)


def tree_attention_triton(q, k, v, slots, ancestors, scale):
    """Same contract as tree_attention_sdpa: q [T, Hq, D] the nodes of a draft tree (T <= MAX_PASS_TOKENS), their
    keys at k/v [L, Hkv, D] entries slots = committed length + arange(T) (int64, on the device: read there, so a
    graph replays at any length); ancestors [T, T] bool. Node i sees keys < slots[0] and slots[0] + j where
    ancestors[i, j]; only keys < slots[0] + T are read. Returns [T, Hq, D]."""
    return _split_kv_attention(q, k, v, slots, None, scale, ancestors)


def masked_attention_triton(q, k, v, visible, scale):
    """The DFlash2 drafter's attention: q [T, Hq, D], k/v [L, Hkv, D] (its context slots, then the block's own
    rows), visible [T, L] bool: which keys each query sees (every query sees at least one). Returns [T, Hq, D]."""
    return _split_kv_attention(q, k, v, None, visible, scale)


def launch_plan(t: int, group: int, capacity: int, tree: bool = False) -> dict:
    """The split kernel's launch for t queries of `group` heads per KV head over `capacity` cache entries: rows per
    program (BLOCK_M), row blocks, keys per tile (BLOCK_N), warps, splits and keys per split."""
    rows = t * group
    block_m = max(16, triton.next_power_of_2(rows))
    if tree and t > MAX_QUERIES:
        block_m = min(block_m, TREE_ROW_BLOCK)
    block_n = 64 if block_m <= 32 else 32
    splits, per_split = split_plan(capacity, block_n)
    return dict(block_m=block_m, row_blocks=triton.cdiv(rows, block_m), block_n=block_n,
                num_warps=4 if block_m <= 32 else 8, splits=splits, per_split=per_split)


def _split_kv_attention(q, k, v, positions, visible, scale, ancestors=None):
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    masked, tree = visible is not None, ancestors is not None
    mask = visible if masked else ancestors  # None for the causal chain
    plan = launch_plan(t, group, k.shape[0], tree)
    splits, padded = plan["splits"], plan["block_m"] * plan["row_blocks"]
    partial = torch.empty(splits, kv_heads, padded, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, kv_heads, padded, device=q.device, dtype=torch.float32)
    launch_fitting(_attention_split_kernel, (plan["row_blocks"], kv_heads, splits),
                   q, k, v, positions, None if mask is None else mask.view(torch.uint8), partial, lse, scale,
                   k.shape[0], sm_count(q.device), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   0 if mask is None else mask.stride(0),
                   T=t, GROUP=group, D=d, BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"],
                   PER_SPLIT=plan["per_split"], MASKED=masked, TREE=tree, num_warps=plan["num_warps"],
                   **pdl.options(q))
    out = torch.empty(t, heads, d, device=q.device, dtype=q.dtype)
    _merge_splits_kernel[(kv_heads, t * group)](partial, lse, out, out.stride(0), out.stride(1),
                                                SPLITS=splits, GROUP=group, D=d, ROWS=padded,
                                                BLOCK_S=max(2, triton.next_power_of_2(splits)), KV_HEADS=kv_heads,
                                                **pdl.options(q))
    return out


if triton is not None:
    @triton.jit
    def _attention_split_kernel(q, k, v, positions, mask, partial, lse, scale, L, wave,
                                sq_t, sq_h, sk_l, sk_h, sv_l, sv_h, s_mask,
                                T: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_SPLIT: tl.constexpr,
                                MASKED: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr):
        """Program (row block, kv head, split): the row blocks of one slice of keys run side by side, so that they
        read its tiles once from memory and again from L2. MASKED: `mask` is the visibility [T, L] (row stride s_mask) and
        every key may be read. Else `positions[0]` is the start (query token 0's position, or the committed length of
        a tree) and keys up to start + T are read: causal (token i sees keys 0..start+i), or TREE: every key before
        start, and start + j where mask[i, j] (the ancestors [T, T], row stride s_mask). `wave`: the programs one
        wave runs (the SMs)."""
        pdl.begin(PDL)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        token = rows // GROUP
        if MASKED:
            lo = split * PER_SPLIT
            hi = tl.minimum(lo + PER_SPLIT, L)
            last_visible = token + L                    # no causal limit: the mask decides
        else:
            start = tl.load(positions)
            # the filled keys, not the capacity, are shared out, among as many splits as keep the programs to
            # one wave: a split past them writes no partial, which the merge would read back (rows x D floats)
            filled = start + T
            active = tl.minimum(tl.num_programs(2), tl.cdiv(filled, BLOCK_N))
            active = tl.minimum(active, tl.maximum(1, wave // (tl.num_programs(0) * tl.num_programs(1))))
            per_split = tl.cdiv(tl.cdiv(filled, active), BLOCK_N) * BLOCK_N
            lo = split * per_split
            hi = tl.minimum(lo + per_split, filled)
            if TREE:
                last_visible = token + L                # no causal limit: the ancestor mask decides past start
            else:
                last_visible = start + token            # causal: token i sees keys 0..start+i
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
                seen &= tl.load(mask + token[:, None] * s_mask + keys[None, :],
                                mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
            if TREE:
                if n0 + BLOCK_N > start:                # only the tiles reaching the tree's own keys read the mask
                    node = keys - start
                    on_path = tl.load(mask + token[:, None] * s_mask + node[None, :],
                                      mask=row_ok[:, None] & (key_ok & (node >= 0))[None, :], other=0) != 0
                    seen &= (node < 0)[None, :] | on_path
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            vt = tl.load(v + keys[:, None] * sv_l + kv * sv_h + dims[None, :], mask=key_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
        out = (split * tl.num_programs(1) + kv) * (BLOCK_M * tl.num_programs(0)) + rows
        result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        # the merge reads a partial only where its lse is finite
        tl.store(partial + out[:, None] * D + dims[None, :], result, mask=(denom > 0)[:, None])
        tl.store(lse + out, tl.where(denom > 0, m + tl.log(denom), float("-inf")))

    @triton.jit
    def _merge_splits_kernel(partial, lse, out, so_t, so_h, SPLITS: tl.constexpr, GROUP: tl.constexpr,
                             D: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr, KV_HEADS: tl.constexpr,
                             PDL: tl.constexpr):
        """partial [SPLITS, KV_HEADS, ROWS, D], lse [SPLITS, KV_HEADS, ROWS]; a partial whose lse is -inf was not
        written (and weighs 0)."""
        pdl.begin(PDL)
        kv = tl.program_id(0)
        row = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        split_ok = splits < SPLITS
        at = (splits * KV_HEADS + kv) * ROWS + row
        weights = tl.load(lse + at, mask=split_ok, other=float("-inf"))
        split_ok &= weights > float("-inf")
        weights = tl.exp(weights - tl.max(weights, 0))
        dims = tl.arange(0, D)
        parts = tl.load(partial + at[:, None] * D + dims[None, :], mask=split_ok[:, None], other=0.0)
        merged = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
        dst = out + (row // GROUP) * so_t + (kv * GROUP + row % GROUP) * so_h + dims
        tl.store(dst, merged.to(out.dtype.element_ty))
