"""Causal attention of T new queries over a KV cache (grouped KV heads).

Paths: flash-attn's KV-cache kernel (`flash_attn_with_kvcache`) when the package is installed and the inputs
are CUDA fp16/bf16; else, for 1..16 queries (decode, verification), the split-KV Triton kernel of
attention_triton.py. Both read only the filled part of the cache, the length being a device tensor, so a CUDA
graph replays them at any position. Otherwise (prefill, CPU, no Triton) PyTorch SDPA over the given cache prefix
under a causal mask: the reference.

Rotary position embedding (rotate-half layout, optionally on the leading part of each head only) lives here too:
`rope_tables` gives the cos/sin both the target and the drafter pass to `prepare_attention_inputs`, `apply_rope` is
the reference of the RoPE inside the attention-inputs kernel (attention_inputs_triton.py).
"""

import functools

import torch
import torch.nn.functional as F

from . import attention_inputs_triton, attention_triton, triton_runs_on
from .norm import rms_norm_plain, rms_norm_reference


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at consecutive `positions` [T]; k, v: [L, Hkv, D], a prefix of the cache that holds every key
    up to the last position (entries past a query's position are masked). Returns [T, Hq, D]."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_with_kvcache() is not None:
        return cached_attention_flash(q, k, v, positions, scale)
    if attention_triton.available(q):
        return attention_triton.cached_attention_triton(q, k, v, positions, scale)
    return cached_attention_sdpa(q, k, v, positions, scale)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, ancestors: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention of a draft tree's T nodes (layers/tree.py): q [T, Hq, D], the nodes' keys and values at cache
    entries `slots` (consecutive, from the committed length); node i sees every committed entry and the nodes
    ancestors[i] marks. k, v: a prefix of the cache holding the nodes' entries. Returns [T, Hq, D]. The split-KV
    Triton kernel's tree mode where it runs (up to MAX_PASS_TOKENS nodes; it reads only keys < slots[0] + T, so the
    whole cache may be passed under a graph), else the SDPA reference. flash-attn has no per-query key mask."""
    if attention_triton.available(q, tree=True):
        return attention_triton.tree_attention_triton(q, k, v, slots, ancestors, scale)
    return tree_attention_sdpa(q, k, v, slots, ancestors, scale)


def tree_attention_sdpa(q, k, v, slots, ancestors, scale):
    t = q.shape[0]
    relative = torch.arange(k.shape[0], device=q.device) - slots[0]  # key index - committed length
    in_tree = (relative >= 0) & (relative < t)
    on_path = ancestors.gather(1, relative.clamp(0, t - 1).expand(t, -1))
    return masked_attention_sdpa(q, k, v, (relative < 0) | (in_tree & on_path), scale)


def prepare_attention_inputs(query, key, value, q_weight, k_weight, eps: float, cos, sin, slots, cache_k, cache_v,
                             zero_centred: bool = True):
    """query [T, Hq, D], key / value [T, Hkv, D] (rows may be strided): per-head RMSNorm (zero-centred, or the plain
    convention of the DFlash2 drafter) then RoPE of query and key; key and value written into the cache
    [slots, Hkv, D] at `slots` (a device tensor). Returns the query; query None: the keys and values alone."""
    args = (query, key, value, q_weight, k_weight, eps, cos, sin, slots, cache_k, cache_v, zero_centred)
    if attention_inputs_triton.available(key, query):
        return attention_inputs_triton.prepare_attention_inputs(*args)
    return prepare_attention_inputs_reference(*args)


def prepare_attention_inputs_reference(query, key, value, q_weight, k_weight, eps, cos, sin, slots, cache_k,
                                       cache_v, zero_centred: bool = True):
    norm = rms_norm_reference if zero_centred else rms_norm_plain
    cache_k.index_copy_(0, slots, apply_rope(norm(key, k_weight, eps), cos, sin))
    cache_v.index_copy_(0, slots, value)
    return None if query is None else apply_rope(norm(query, q_weight, eps), cos, sin)


def keep_path(cache_k: torch.Tensor, cache_v: torch.Tensor, start, path: torch.Tensor):
    """A draft tree's pass wrote node i's key and value at cache entry start + i (start: an int, or a 0-dim device
    tensor under CUDA graphs); the kept path's nodes `path` [n] (root first, increasing) move to start .. start +
    n - 1. One Triton launch for both caches where it runs (attention_inputs_triton.keep_path), else the
    reference."""
    if triton_runs_on(cache_k) and cache_k.is_contiguous() and cache_v.is_contiguous():
        return attention_inputs_triton.keep_path(cache_k, cache_v, start, path)
    return keep_path_reference(cache_k, cache_v, start, path)


def keep_path_reference(cache_k, cache_v, start, path):
    """Gathered before written: a node may move onto an entry another kept node leaves."""
    slots = start + torch.arange(path.shape[0], device=path.device)
    for cache in (cache_k, cache_v):
        cache.index_copy_(0, slots, cache.index_select(0, start + path))


def cached_attention_sdpa(q, k, v, positions, scale):
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def masked_attention(q, k, v, visible, scale: float):
    """Attention under an explicit mask (the DFlash2 drafter's block over its context slots and its own rows):
    q [T, Hq, D], k / v [L, Hkv, D], visible [T, L] bool -> [T, Hq, D]. The split-KV Triton kernel in mask mode
    on CUDA (no torch.compile region to trace at start-up; SDPA's cuDNN choice is slower for a drafter block:
    docs/benchmarks.md, "Attention"); SDPA, the reference, otherwise."""
    if attention_triton.available(q):
        return attention_triton.masked_attention_triton(q, k, v, visible, scale)
    return masked_attention_sdpa(q, k, v, visible, scale)


def masked_attention_sdpa(q, k, v, visible, scale: float):
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


@functools.cache
def flash_attn_with_kvcache():
    try:
        from flash_attn import flash_attn_with_kvcache as kernel
    except ImportError:
        return None
    return kernel


def cached_attention_flash(q, k, v, positions, scale, kernel=None):
    """flash-attn with cache_seqlens = last position + 1; causal=True aligns the T queries to the end of that
    prefix, so query i sees keys 0..positions[i]."""
    kernel = kernel or flash_attn_with_kvcache()
    seqlens = (positions[-1:] + 1).to(torch.int32)
    return kernel(q[None], k[None], v[None], cache_seqlens=seqlens, softmax_scale=scale, causal=True)[0]


def rope_inverse_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [T, rotary_dim] for integer positions: angles in float32 (channel j pairs with
    j + rotary_dim/2, the rotate-half layout), cast like the activations."""
    inv_freq = rope_inverse_frequencies(rotary_dim, theta, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates the first cos.shape[-1] channels of each head, passes the rest through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot
