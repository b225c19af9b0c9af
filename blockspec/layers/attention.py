"""Gated full attention (Qwen3.5) and its fixed-capacity KV cache."""

import torch
from torch import nn

from ..kernels.activation import sigmoid_mul
from ..kernels.attention import cached_attention, keep_path, prepare_attention_inputs, tree_attention
from .norm import RMSNorm


class KVCache:
    """Static K/V buffers for one attention layer. Entries past the committed length are scratch:
    a pass writes there, commit(n) only moves the length (kept by DecodeState), discard leaves them unused."""

    def __init__(self, capacity: int, kv_heads: int, head_dim: int, device, dtype):
        self.k = torch.zeros(capacity, kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def keep_path(self, start, path: torch.Tensor):
        """A tree pass wrote node i's entry at start + i; the kept path's nodes `path` [n] move to start .. start +
        n - 1."""
        keep_path(self.k, self.v, start, path)


class GatedAttention(nn.Module):
    """q_proj yields query and an output gate per head; q/k RMSNorm; partial RoPE; grouped KV heads."""

    PACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # packed at load (layers/linear.py): forward uses qkv_proj

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, heads * head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden_size, bias=False)
        self.qkv_proj = None
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cache: KVCache, positions: torch.Tensor, rope, visible: int | None,
                tree=None):
        return self.o_proj(self.attend(x, cache, positions, rope, visible, tree))

    def attend(self, x: torch.Tensor, cache: KVCache, positions: torch.Tensor, rope, visible: int | None,
               tree=None):
        """The gated attention output, o_proj's input. visible: cache entries to attend over (eager: exactly the
        filled prefix); None under CUDA-graph capture, where the position is data and the whole cache is passed
        (the fast kernels read only its filled part). tree: a draft tree's TreeLayout (layers/tree.py): each node
        writes its entry at its slot and sees its own path only."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)
        query, gate = q.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        kv_shape = (t, self.kv_heads, self.head_dim)
        slots = positions if tree is None else tree.slots
        query = prepare_attention_inputs(query, k.view(kv_shape), v.view(kv_shape), self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps, *rope, slots, cache.k, cache.v)
        k, v = (cache.k, cache.v) if visible is None else (cache.k[:visible], cache.v[:visible])
        if tree is None:
            out = cached_attention(query, k, v, positions, self.head_dim ** -0.5)
        else:
            out = tree_attention(query, k, v, tree.slots, tree.ancestors, self.head_dim ** -0.5)
        return sigmoid_mul(out, gate).reshape(t, -1)

