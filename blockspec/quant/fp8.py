"""Block-wise FP8 weights (W8A16): float8_e4m3fn values with one float32 scale per 128 x 128 block, as the FP8
checkpoints of Qwen and DeepSeek store them (`quantization_config: {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128], activation_scheme: dynamic}`; per projection `<module>.weight` float8_e4m3fn [N, K]
and `<module>.weight_scale_inv` float32 [ceil(N / 128), ceil(K / 128)]):  w[n, k] = fp8[n, k] * scale[n // 128, k // 128].

`Fp8Linear` keeps the stored bytes and scales as they are (never dequantized at load) and runs
kernels/fp8_linear.py. Packed projections (layers/linear.py) concatenate their FP8 rows and scale rows along the
outputs; `scale_row` [N] maps each output to its scale row, so a projection whose size is not a multiple of 128
(a DeltaNet's b / a) keeps its own blocks after packing. `quantize` makes the same format from dense weights
(target_quantization: fp8, round to nearest with scale = block max / 448).
Other formats (fmt e5m2, other block sizes, per-tensor scales, static activation scales) are refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BlockspecError
from ..kernels.fp8_linear import BLOCK_K, fp8_dequantize, fp8_linear
from .hf_quantization import check_converted, check_shape, config_value, not_converted, part

BLOCK = BLOCK_K  # the kernel's input blocks are the format's (and its output blocks the same size)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FLOAT8 = torch.float8_e4m3fn


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N/128), ceil(K/128)]): per block, scale = max|w|
    / 448 and the values rounded to nearest (saturating at the block's maximum)."""
    n, k = weight.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    w = torch.nn.functional.pad(weight.to(torch.float32), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = w.view(nb, BLOCK, kb, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FLOAT8)
    return q.view(nb * BLOCK, kb * BLOCK)[:n, :k].clone(memory_format=torch.contiguous_format), scale  # no padding kept


class Fp8Linear(nn.Module):
    """y = x @ dequant(W)^T with W in block-scaled FP8 (module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("scale_row", scale_row)

    @classmethod
    def from_blocks(cls, weight: torch.Tensor, scale: torch.Tensor) -> "Fp8Linear":
        """From FP8 values [N, K] and float32 scales of 128 x 128 blocks."""
        rows = torch.arange(weight.shape[0], device=weight.device, dtype=torch.int32) // BLOCK
        return cls(weight, scale.to(torch.float32).contiguous(), rows)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        if linear.bias is not None:
            raise BlockspecError("FP8 projections take no bias")
        return cls.from_blocks(*quantize(linear.weight.detach()))

    def pack_key(self) -> tuple:
        """Modules with equal keys can be concatenated along their outputs (`concat`)."""
        return (type(self), self.in_features, self.weight.device)

    @classmethod
    def concat(cls, modules: list["Fp8Linear"]) -> "Fp8Linear":
        offsets, rows = 0, []
        for m in modules:
            rows.append(m.scale_row + offsets)
            offsets += m.scale.shape[0]
        return cls(torch.cat([m.weight for m in modules]), torch.cat([m.scale for m in modules]), torch.cat(rows))

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight [out, in] this module computes with (or its output rows `rows`)."""
        if rows is None:
            return fp8_dequantize(self.weight, self.scale, self.scale_row, dtype)
        return fp8_dequantize(self.weight[rows], self.scale, self.scale_row[rows], dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`out_dtype` float32: the float32 sums returned unrounded (the vocabulary head's logits)."""
        return fp8_linear(x, self.weight, self.scale, self.scale_row, out_dtype)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.scale_row))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 blocks 128x128"


@dataclass(frozen=True)
class FP8Scheme:
    """The reader of a block-wise FP8 checkpoint (the interface of checkpoint.py's readers)."""
    not_converted: tuple[str, ...]

    kind = "fp8"
    anchor = ".weight"

    @classmethod
    def from_config(cls, qc: dict) -> "FP8Scheme":
        config_value(qc, "fmt", ("e4m3",), what="for FP8")
        block = qc.get("weight_block_size")
        if block != [BLOCK, BLOCK]:
            raise BlockspecError(f"quantization_config.weight_block_size {block!r} is not supported (blockspec loads "
                                 f"FP8 with [{BLOCK}, {BLOCK}] blocks)")
        config_value(qc, "activation_scheme", ("dynamic",), what="for FP8 (weights only)")
        return cls(not_converted(qc))

    def holds(self, name: str, value: torch.Tensor) -> bool:
        return name.endswith(".weight_scale_inv") or (name.endswith(".weight") and value.dtype == FLOAT8)

    def read(self, parts: dict, prefix: str) -> nn.Module:
        check_converted(prefix, self.not_converted)
        weight = part(parts, prefix, ".weight", (FLOAT8,), 2)
        part(parts, prefix, ".weight_scale_inv", (torch.float32, torch.bfloat16, torch.float16), 2)
        n, k = weight.shape
        check_shape(parts, prefix + ".weight_scale_inv", (-(-n // BLOCK), -(-k // BLOCK)),
                    f"{prefix}.weight {tuple(weight.shape)}, blocks of {BLOCK} x {BLOCK}")
        return Fp8Linear.from_blocks(weight, parts[prefix + ".weight_scale_inv"])

