"""RMSNorm in the two conventions Qwen3.5 checkpoints use. Zero-centred norms (every decoder norm) and the DeltaNet
gated output norm run as the Triton kernels of norm_triton.py on CUDA; the *_reference functions are the reference
(compiled when fusion is on)."""

import torch
import torch.nn.functional as F

from . import fused, norm_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 decoder norms store weight - 1 (zero-centred): y = x / rms(x) * (1 + w), computed in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add and the next norm: returns (x + delta, its norm)."""
    x = x + delta
    return x, rms_norm_reference(x, weight, eps)


_rms_norm_fused, _add_rms_norm_fused = fused(rms_norm_reference), fused(add_rms_norm_reference)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if norm_triton.available(x):
        return norm_triton.add_rms_norm_rows(x, None, weight, eps)
    return _rms_norm_fused(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    if norm_triton.available(x) and delta.stride(-1) == 1:
        return norm_triton.add_rms_norm_rows(x, delta, weight, eps)
    return _add_rms_norm_fused(x, delta, weight, eps)


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The usual convention (weight stored as is), used by the DeltaNet output norm and Qwen3-style drafters."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * y


_rms_norm_plain_fused = fused(rms_norm_plain)


def rms_norm_plain_fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_plain on its fastest path: the Triton kernel on CUDA, else compiled (fusion on) or plain."""
    if norm_triton.available(x):
        return norm_triton.add_rms_norm_rows(x, None, weight, eps, zero_centred=False)
    return _rms_norm_plain_fused(x, weight, eps)


@fused
def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm: plain RMSNorm over each value head, then times silu(gate) in float32."""
    y = rms_norm_plain(x, weight, eps)
    return (y * F.silu(gate.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if norm_triton.available(x) and x.dim() == 3 and gate.stride(-1) == 1:
        return norm_triton.gated_rms_norm_rows(x, gate, weight, eps)
    return gated_rms_norm_reference(x, gate, weight, eps)
