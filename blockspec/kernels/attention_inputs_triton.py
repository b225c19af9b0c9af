"""An attention layer's input preparation in one Triton kernel, the fast path beside
`prepare_attention_inputs_reference` (blockspec.kernels.attention): per-head RMSNorm (zero-centred for the target,
plain for the DFlash2 drafter) and partial rotate-half RoPE of the queries and keys, the keys and values written
into the KV cache at their slots (read from the device, so a CUDA graph replays it at any position). The reference
takes 8 kernels per layer on the H200 (6 compiled, 2 index copies); here one program per (token, head) does it all.
Rounding as the reference: the normed vector is rounded to the activation dtype before the rotation.

`keep_path` moves a draft tree's kept entries within the cache (`keep_path_reference` there): one launch for the
keys and values of a layer where the reference takes four (a gather and a scatter of each).
"""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None


def available(*rows: torch.Tensor | None) -> bool:
    d = rows[0].shape[-1]
    return triton_runs_on(rows[0]) and d & (d - 1) == 0 and all(x is None or x.stride(-1) == 1 for x in rows)


def prepare_attention_inputs(query, key, value, q_weight, k_weight, eps, cos, sin, slots, cache_k, cache_v,
                             zero_centred: bool = True):
    """The reference's contract; query None: only the keys and values are written (grid of kv heads alone)."""
    t, kv_heads, d = key.shape
    heads = 0 if query is None else query.shape[1]
    out = None if query is None else torch.empty(t, heads, d, device=key.device, dtype=key.dtype)
    q, sq = (key, (0, 0)) if query is None else (query, query.stride())
    cos, sin = cos.contiguous(), sin.contiguous()
    _attention_inputs_kernel[(t, heads + kv_heads)](
        q, key, value, k_weight if query is None else q_weight, k_weight, cos, sin, slots, cache_k, cache_v,
        key if out is None else out, eps, sq[0], sq[1], key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), cache_k.stride(0), cache_k.stride(1), HEADS=heads, D=d, ROT=cos.shape[-1],
        ZERO_CENTRED=zero_centred, num_warps=2, **pdl.options(key))
    return out


# cache channels (kv heads x head dim) a keep_path program moves: 8 programs for the 27B's 4 x 256 keys and values,
# 32 KB at 8 nodes, a move that latency bounds whatever the split
MOVE_BLOCK = 256


def keep_path(cache_k, cache_v, start, path):
    """The reference's contract (caches contiguous) in one launch; programs (block of channels, k or v)."""
    width, n = cache_k[0].numel(), path.shape[0]
    start = start if isinstance(start, torch.Tensor) else torch.tensor(start, device=path.device)
    block = min(MOVE_BLOCK, triton.next_power_of_2(width))
    _keep_path_kernel[(triton.cdiv(width, block), 2)](cache_k, cache_v, start, path.contiguous(), n, width,
                                                      ROWS=triton.next_power_of_2(n), BLOCK=block, num_warps=1,
                                                      **pdl.options(cache_k))


if triton is not None:
    @triton.jit
    def _keep_path_kernel(cache_k, cache_v, start, path, n, width, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        pdl.begin(PDL)
        cache = cache_k if tl.program_id(1) == 0 else cache_v
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        nodes = tl.arange(0, ROWS)
        here = (nodes < n)[:, None] & (cols < width)[None, :]
        first = tl.load(start)
        source = first + tl.load(path + nodes, mask=nodes < n, other=0)
        kept = tl.load(cache + source[:, None] * width + cols[None, :], mask=here)
        # a node may move onto an entry another kept node leaves (path [0, 2, 3]: node 3 onto node 2's), and
        # another thread may hold that entry's elements: every read of this program is done before any write
        tl.debug_barrier()
        tl.store(cache + (first + nodes)[:, None] * width + cols[None, :], kept, mask=here)

    @triton.jit
    def _normed(x, rstd, w, dtype: tl.constexpr, ZERO_CENTRED: tl.constexpr):
        """The norm as each convention rounds it (rms_norm_reference / rms_norm_plain), back in float32."""
        if ZERO_CENTRED:
            return (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
        return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)

    @triton.jit
    def _norm_rope(src, weight, cos, sin, eps, D: tl.constexpr, ROT: tl.constexpr, ZERO_CENTRED: tl.constexpr):
        dims = tl.arange(0, D)
        x = tl.load(src + dims).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        dtype = src.dtype.element_ty
        normed = _normed(x, rstd, tl.load(weight + dims).to(tl.float32), dtype, ZERO_CENTRED)
        rotated = dims < ROT
        half = ROT // 2
        partner = tl.where(dims < half, dims + half, dims - half)
        xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
        wp = tl.load(weight + partner, mask=rotated, other=0.0).to(tl.float32)
        partner_normed = _normed(xp, rstd, wp, dtype, ZERO_CENTRED)
        c = tl.load(cos + dims, mask=rotated, other=1.0).to(tl.float32)
        s = tl.load(sin + dims, mask=rotated, other=0.0).to(tl.float32)
        turned = tl.where(dims < half, -partner_normed, partner_normed)
        return tl.where(rotated, normed * c + turned * s, normed).to(dtype)

    @triton.jit
    def _attention_inputs_kernel(q, k, v, q_weight, k_weight, cos, sin, slots, cache_k, cache_v, out, eps,
                                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_l, sc_h,
                                 HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                                 ZERO_CENTRED: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        t = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, D)
        if head < HEADS:
            y = _norm_rope(q + t * sq_t + head * sq_h, q_weight, cos + t * ROT, sin + t * ROT, eps, D, ROT,
                           ZERO_CENTRED)
            tl.store(out + (t * HEADS + head) * D + dims, y)
        else:
            kv = head - HEADS
            slot = tl.load(slots + t)
            y = _norm_rope(k + t * sk_t + kv * sk_h, k_weight, cos + t * ROT, sin + t * ROT, eps, D, ROT,
                           ZERO_CENTRED)
            tl.store(cache_k + slot * sc_l + kv * sc_h + dims, y)
            tl.store(cache_v + slot * sc_l + kv * sc_h + dims, tl.load(v + t * sv_t + kv * sv_h + dims))
