"""Gated activations: SwiGLU's silu(gate) * up and gated attention's out * sigmoid(gate). The plain PyTorch
references (compiled when fusion is on); on CUDA one Triton kernel (activation_triton.py) serves both."""

import torch
import torch.nn.functional as F

from . import activation_triton, fused


@fused
def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@fused
def sigmoid_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, both [..., N] (rows may be strided)."""
    if activation_triton.available(gate, up):
        return activation_triton.gated(up, gate, "silu")
    return silu_mul_reference(gate, up)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), both [..., N] (rows may be strided)."""
    if activation_triton.available(gate, x):
        return activation_triton.gated(x, gate, "sigmoid")
    return sigmoid_mul_reference(x, gate)
