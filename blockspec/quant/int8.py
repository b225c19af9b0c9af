"""W8A16 weight-only quantization: symmetric int8 codes in groups of 32 along the input dimension, RTN.

  scale = max|w| / 127 per group; q = clamp(round(w / scale), -127, 127); w ~= q * scale (error <= scale/2).
`Int8Linear` stores unsigned codes u = q + 128 in the q16 layout of kernels/quant_matmul.py (2 codes per int16 halfword:
qweight int16 [N, Kp/2], blocks of 2 groups, scales [Kp/(2G), N, 2]) and runs the same Triton kernel on CUDA (byte i of
each halfword is group i of a block) and dequantize + matmul elsewhere (figures: docs/benchmarks.md, "W4A16 / W8A16").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import BlockspecError
from ..kernels.quant_matmul import check_format
from .int4 import _round_scale_up
from .linear import QuantLinear

QMAX = 127
DEFAULT_GROUP_SIZE = 32


def quantize(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, scale_dtype: torch.dtype = torch.bfloat16):
    """Symmetric RTN: (q int8 [N, K] in [-127, 127], scale [N, ceil(K/g)] in scale_dtype)."""
    if weight.dim() != 2:
        raise BlockspecError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if group_size <= 0:
        raise BlockspecError(f"group size must be positive, got {group_size}")
    n, k = weight.shape
    groups = -(-k // group_size)
    w = F.pad(weight.to(torch.float32), (0, groups * group_size - k)).view(n, groups, group_size)
    amax = w.abs().amax(dim=2).to(torch.float64)
    scale = _round_scale_up((amax / QMAX).clamp(min=torch.finfo(scale_dtype).tiny), scale_dtype)
    q = torch.round(w / scale.to(torch.float32)[:, :, None]).clamp(-QMAX, QMAX)
    return q.view(n, groups * group_size)[:, :k].to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = q.shape[1]
    return (q.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]).to(dtype)


class Int8Linear(QuantLinear):
    """A QuantLinear with 8-bit symmetric codes (default group 32)."""

    bits = 8

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                 symmetric: bool = True, bias: bool = False, scale_dtype: torch.dtype = torch.bfloat16,
                 device=None):
        if not symmetric:
            raise BlockspecError("Int8Linear is symmetric only")
        super().__init__(in_features, out_features, group_size, True, bias, scale_dtype, device)

    @classmethod
    def from_quantized(cls, q, scale, zero_point=None, group_size: int = DEFAULT_GROUP_SIZE, bias=None):
        if zero_point is not None:
            raise BlockspecError("Int8Linear is symmetric only")
        if q.numel() and int(q.min()) < -QMAX:
            raise BlockspecError("int8 codes must lie in [-127, 127]")
        return super().from_quantized(q, scale, None, group_size, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                   bias: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        if not symmetric:
            raise BlockspecError("Int8Linear is symmetric only")
        if not weight.is_floating_point():
            raise BlockspecError("from_float needs a floating-point weight")
        try:
            check_format(8, group_size)
        except ValueError as exc:
            raise BlockspecError(f"unsupported int8 group size {group_size}: {exc}") from None
        q, scale = quantize(weight.detach(), group_size, scale_dtype)
        return cls.from_quantized(q, scale, None, group_size, bias)

    @classmethod
    def from_linear(cls, linear, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        return cls.from_float(linear.weight, group_size, symmetric, linear.bias, scale_dtype)


__all__ = ["Int8Linear", "quantize", "dequantize"]
