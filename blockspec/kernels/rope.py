"""Rotary position embedding (rotate-half layout), optionally on the leading part of each head only: the reference
of the RoPE inside the attention-inputs kernel (attention_inputs_triton.py)."""

import torch


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
