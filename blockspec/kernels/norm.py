"""RMSNorm in the two conventions Qwen3.5 checkpoints use."""

import torch
import torch.nn.functional as F

from . import fused


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 decoder norms store weight - 1 (zero-centred): y = x / rms(x) * (1 + w), computed in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


@fused
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add fused with the next norm (one kernel on the fast path): returns (x + delta, its norm)."""
    x = x + delta
    return x, rms_norm.reference(x, weight, eps)


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The usual convention (weight stored as is), used by the DeltaNet output norm and Qwen3-style drafters."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * y


@fused
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm: plain RMSNorm over each value head, then times silu(gate) in float32."""
    y = rms_norm_plain(x, weight, eps)
    return (y * F.silu(gate.float())).to(x.dtype)
