"""The quantized projection module: W4A16 / W8A16 weights in the kernel's q16 layout (kernels/quant_matmul.py), run by
the Triton kernel on CUDA (bf16 / fp16 activations) and by dequantize + matmul elsewhere. `QuantLinear` is the module;
its kinds (int4.py `Int4Linear`, int8.py `Int8Linear`, fp8.py `Fp8Linear`) set the code width and format and how a dense
weight is quantized. `FoldedNorm` is what a projection's fused add + norm epilogue hands the next projections
(layers/folded_norm.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BlockspecError
from ..kernels import quant_matmul_triton as wq
from ..kernels.quant_matmul import (PackedWeight, check_format, pack_codes, pack_groups, padded_k,
                                    unpack_codes)

DEFAULT_GROUP_SIZE = 128
MAX_FOLDED_ROWS = wq.MAX_KERNEL_ROWS  # one W4A16 launch with a norm epilogue: every verification pass


@dataclass
class FoldedNorm:
    """The input of a norm's projections, the norm begun by `QuantLinear.add_norm` (layers/folded_norm.py):
    rows = x * (1 + w), partials [tiles, T] (fp32) the per-tile sums of x^2 that finish it."""
    rows: torch.Tensor
    partials: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    @property
    def rms(self) -> tuple[torch.Tensor, float]:
        """What the W4A16 launches that complete the norm take (`rms=`)."""
        return self.partials, self.eps


class QuantLinear(nn.Module):
    """y = x @ dequant(W)^T (+ bias) with W group-quantized and held in the W4A16 / W8A16 kernel's q16 layout
    (kernels/quant_matmul.py); its kinds set the code width and format: Int4Linear, Int8Linear, Fp8Linear."""

    bits: int  # 4 or 8
    code_format = "uint"  # Fp8Linear: "e4m3"

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                 symmetric: bool = True, bias: bool = False, scale_dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        try:
            check_format(self.bits, group_size)
        except ValueError as exc:
            raise BlockspecError(f"unsupported int{self.bits} group size {group_size}: {exc}") from None
        if in_features <= 0 or out_features <= 0:
            raise BlockspecError(f"{type(self).__name__} needs positive in/out features")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.symmetric = symmetric
        kp, cph = padded_k(in_features, self.bits, group_size), 16 // self.bits
        sz = (kp // (cph * group_size), out_features, cph)
        self.register_buffer("qweight", torch.zeros(out_features, kp // cph, dtype=torch.int16, device=device))
        self.register_buffer("scales", torch.zeros(sz, dtype=scale_dtype, device=device))
        self.register_buffer("zeros", None if symmetric else torch.zeros(sz, dtype=scale_dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
                       group_size: int = DEFAULT_GROUP_SIZE, bias: torch.Tensor | None = None) -> "QuantLinear":
        """From signed codes q [N, K] in [-8, 7], scales [N, ceil(K/g)], signed zero points (or None)."""
        if q.dim() != 2:
            raise BlockspecError(f"codes must be 2-D, got shape {tuple(q.shape)}")
        n, k = q.shape
        groups = -(-k // group_size)
        if tuple(scale.shape) != (n, groups):
            raise BlockspecError(f"scale shape {tuple(scale.shape)} does not match codes {n}x{k} with group "
                                 f"{group_size}")
        if zero_point is not None and tuple(zero_point.shape) != (n, groups):
            raise BlockspecError(f"zero point shape {tuple(zero_point.shape)} does not match scales {(n, groups)}")
        if not scale.is_floating_point():
            raise BlockspecError("scales must be floating point")
        qmin, qmax = -(1 << (cls.bits - 1)), (1 << (cls.bits - 1)) - 1
        if q.numel() and (int(q.min()) < qmin or int(q.max()) > qmax):
            raise BlockspecError(f"codes outside the int{cls.bits} range [{qmin}, {qmax}]")
        sdt = scale.dtype if scale.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
        mod = cls(k, n, group_size=group_size, symmetric=zero_point is None, bias=bias is not None,
                  scale_dtype=sdt, device=q.device)
        bias_off = 1 << (cls.bits - 1)
        mod.qweight.copy_(pack_codes(q, cls.bits, group_size, bias_off))
        mod.scales.copy_(pack_groups(scale.to(sdt), cls.bits, group_size, k, 0.0))
        if zero_point is not None:
            mod.zeros.copy_(pack_groups((zero_point.to(torch.float32) + bias_off).to(sdt), cls.bits, group_size,
                                           k, float(bias_off)))
        if bias is not None:
            mod.bias.copy_(bias.detach().to(torch.float32).reshape(n))
        return mod

    def pack_key(self) -> tuple:
        """Modules with equal keys can be concatenated along their outputs (`concat`)."""
        return (type(self), self.in_features, self.group_size, self.symmetric, self.scales.dtype,
                self.qweight.device, self.bias is not None)

    @classmethod
    def concat(cls, modules: list["QuantLinear"]) -> "QuantLinear":
        """One module computing the outputs of `modules` (same input, same pack_key) side by side."""
        first = modules[0]
        if any(m.pack_key() != first.pack_key() for m in modules):
            raise BlockspecError("only quantized projections of the same input and format can be packed together")
        out = cls(first.in_features, sum(m.out_features for m in modules), first.group_size, first.symmetric,
                  first.bias is not None, first.scales.dtype, device="meta")
        for name in ("qweight", "scales", "zeros", "bias"):
            if getattr(first, name) is not None:
                dim = 1 if name in ("scales", "zeros") else 0  # scales/zeros are [blocks, N, C]
                setattr(out, name, torch.cat([getattr(m, name) for m in modules], dim=dim))
        return out

    # --- use ----------------------------------------------------------------------------------------------

    def packed(self) -> PackedWeight:
        return PackedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                               self.out_features, self.in_features, self.code_format)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight [out, in] this module computes with (or its output rows `rows`)."""
        return self.packed().dequantize(dtype, rows=rows)

    def codes(self) -> torch.Tensor:
        """Signed codes [out, in] (int8)."""
        u = unpack_codes(self.qweight, self.bits, self.group_size, self.in_features)
        return (u - (1 << (self.bits - 1))).to(torch.int8)

    def forward(self, x: torch.Tensor | FoldedNorm, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`out_dtype` float32: the float32 sums returned unrounded (the vocabulary head's logits)."""
        if isinstance(x, FoldedNorm):  # a norm begun by add_norm: the kernel scales the result by 1 / rms
            y = wq.wq_matmul(x.rows, self.packed(), rms=x.rms)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and wq.kernels_available(x.device):
            y = wq.wq_matmul(x, self.packed(), out_dtype=out_dtype)
        else:
            w = self.dequantize(torch.float32)
            y = (x.to(torch.float32) @ w.t()).to(out_dtype or x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, FoldedNorm]:
        """(residual + self(x), that sum's zero-centred `norm` begun) in one kernel launch (layers/folded_norm.py)."""
        if self.bias is not None:
            raise ValueError("add_norm takes a projection without bias")
        summed, rows, partials = wq.wq_matmul_add_norm(x, self.packed(), residual, norm.weight)
        return summed, FoldedNorm(rows, partials, norm.eps)

    def swiglu(self, x: torch.Tensor | FoldedNorm) -> torch.Tensor:
        """silu(gate) * up of this packed [gate; up] projection in one kernel launch (layers/folded_norm.py)."""
        if self.bias is not None:
            raise ValueError("swiglu takes a projection without bias")
        if isinstance(x, FoldedNorm):
            return wq.wq_matmul_swiglu(x.rows, self.packed(), rms=x.rms)
        return wq.wq_matmul_swiglu(x, self.packed())

    def weight_bytes(self) -> int:
        return self.packed().nbytes()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, bias={self.bias is not None}")
