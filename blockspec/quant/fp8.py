"""Block-wise FP8 weights (W8A16): float8_e4m3fn values with one float32 scale per 128 x 128 block, as the FP8
checkpoints of Qwen and DeepSeek store them (`quantization_config: {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128], activation_scheme: dynamic}`; per projection `<module>.weight` float8_e4m3fn [N, K]
and `<module>.weight_scale_inv` float32 [ceil(N / 128), ceil(K / 128)]):
w[n, k] = fp8[n, k] * scale[n // 128, k // 128].

`dequantize` is the format's reference. `Fp8Linear` keeps the stored e4m3 bytes as they are (never dequantized at
load) as 8-bit codes of the W4A16 / W8A16 kernel's q16 layout (kernels/quant_matmul.py: `pack_e4m3`), with each
output's block scale repeated per 128 inputs (4 bytes per 128 weights): a QuantLinear like the int4 and int8 ones,
so FP8 projections pack, run inside the CUDA graphs and take the folded norms' epilogues as INT4 ones do. Packed
projections whose sizes are not multiples of 128 keep their own blocks. `quantize` makes the same format from dense
weights (target_quantization: fp8, round to nearest with scale = block max / 448).
Other formats (fmt e5m2, other block sizes, per-tensor scales, static activation scales) are refused in one line.
compressed-tensors `float-quantized` checkpoints (e4m3 with per-tensor, per-output, per-128-input or 128 x 128 block
scales: `CompressedTensorsFp8Scheme`) load into the same Fp8Linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BlockspecError
from ..kernels.quant_matmul import pack_e4m3, unpack_codes
from .hf_quantization import SCALE_DTYPES, check_converted, check_shape, config_value, not_converted, part
from .int4 import group_weights, scheme_for
from .linear import QuantLinear

BLOCK = 128  # the format's block: 128 outputs x 128 inputs
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


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: float32 [N, K] of FP8 values [N, K] and their block scales [ceil(N/128), ceil(K/128)]."""
    n, k = weight.shape
    per_weight = scale.to(torch.float32).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return weight.to(torch.float32) * per_weight


class Fp8Linear(QuantLinear):
    """y = x @ dequant(W)^T with W in block-scaled FP8, held as e4m3 codes in the q16 layout (module docstring)."""

    bits = 8
    code_format = "e4m3"

    def __init__(self, in_features: int, out_features: int, group_size: int = BLOCK, symmetric: bool = True,
                 bias: bool = False, scale_dtype: torch.dtype = torch.float32, device=None):
        if (group_size, symmetric, bias, scale_dtype) != (BLOCK, True, False, torch.float32):
            raise BlockspecError("FP8 projections have 128 x 128 blocks, float32 scales, no zero points, no bias")
        super().__init__(in_features, out_features, BLOCK, True, False, torch.float32, device)

    @classmethod
    def from_blocks(cls, weight: torch.Tensor, scale: torch.Tensor) -> "Fp8Linear":
        """From FP8 values [N, K] and float32 scales of 128 x 128 blocks (kept exactly)."""
        return cls.from_row_scales(weight, scale.to(torch.float32).repeat_interleave(BLOCK, 0)[:weight.shape[0]])

    @classmethod
    def from_row_scales(cls, weight: torch.Tensor, scale: torch.Tensor) -> "Fp8Linear":
        """From FP8 values [N, K] and float32 scales [N, ceil(K / 128)], one per output and 128 inputs (kept
        exactly): the form any per-tensor, per-output or per-group-of-128 scale takes."""
        packed = pack_e4m3(weight, scale, rows_per_scale=1)
        module = cls(packed.k, packed.n, device="meta")
        module.qweight, module.scales = packed.q, packed.s
        return module

    @classmethod
    def from_float(cls, weight: torch.Tensor, *args, **kwargs) -> "Fp8Linear":
        """Round-to-nearest FP8 of a dense weight [out, in] (`quantize`)."""
        return cls.from_blocks(*quantize(weight.detach()))

    @classmethod
    def from_linear(cls, linear: nn.Linear, *args, **kwargs) -> "Fp8Linear":
        if linear.bias is not None:
            raise BlockspecError("FP8 projections take no bias")
        return cls.from_float(linear.weight)

    def codes(self) -> torch.Tensor:
        """The FP8 values [out, in] as stored."""
        return unpack_codes(self.qweight, 8, BLOCK, self.in_features).to(torch.uint8).view(FLOAT8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, 128 x 128 block scales"


@dataclass(frozen=True)
class FP8Scheme:
    """The reader of a block-wise FP8 checkpoint (the interface of models/checkpoint.py's readers)."""
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


@dataclass(frozen=True)
class CompressedTensorsFp8Scheme:
    """The reader of a compressed-tensors `float-quantized` config (llm-compressor's FP8 schemes): `<module>.weight`
    float8_e4m3fn [N, K] and `<module>.weight_scale` with one scale per tensor, output, group of 128 inputs or
    128 x 128 block, kept exactly as a float32 scale per output and 128 inputs. Dynamic FP8 activations run in the
    compute dtype (W8A16), as block-wise FP8 checkpoints' do; the `ignore` list is compressed-tensors' own."""
    config: dict

    kind = "fp8"
    anchor = ".weight"
    FORMAT = "float-quantized"

    @classmethod
    def from_config(cls, qc: dict) -> "CompressedTensorsFp8Scheme":
        groups = qc.get("config_groups") or {}
        if not groups:
            raise BlockspecError("quantization_config has no config_groups")
        for name, group in groups.items():
            scale_layout(group_weights(name, group, qc, cls.FORMAT), f"config group {name}")
        return cls(qc)

    def holds(self, name: str, value: torch.Tensor) -> bool:
        return name.endswith(".weight_scale") or (name.endswith(".weight") and value.dtype == FLOAT8)

    def read(self, parts: dict, prefix: str) -> nn.Module:
        strategy = scale_layout(scheme_for(prefix, self.config, self.FORMAT), prefix)
        weight = part(parts, prefix, ".weight", (FLOAT8,), 2)
        n, k = weight.shape
        groups = -(-k // BLOCK)
        shapes = {"tensor": [(1,), (), (1, 1)], "channel": [(n, 1), (n,)], "group": [(n, groups)],
                  "block": [(-(-n // BLOCK), groups)]}[strategy]
        scale = parts.get(prefix + ".weight_scale")
        if scale is None:
            raise BlockspecError(f"checkpoint is missing {prefix}.weight_scale")
        if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) not in shapes:
            raise BlockspecError(f"{prefix}.weight_scale is {scale.dtype} of shape {tuple(scale.shape)}, expected "
                                 f"{shapes[0]} ({strategy} scales of {prefix}.weight {tuple(weight.shape)})")
        scale = scale.to(torch.float32)
        rows = scale.repeat_interleave(BLOCK, 0)[:n] if strategy == "block" else \
            scale.reshape(-1, groups if strategy == "group" else 1).expand(n, groups)
        return Fp8Linear.from_row_scales(weight, rows.contiguous())


def scale_layout(weights: dict, where: str) -> str:
    """The strategy of float-quantized `weights` arguments blockspec loads (e4m3: 8-bit float, symmetric, static);
    anything else refused in one line."""
    if weights.get("type") != "float" or int(weights.get("num_bits") or 0) != 8:
        raise BlockspecError(f"{where}: weights of type {weights.get('type')!r}, {weights.get('num_bits')} bits are "
                             "not supported in float-quantized (blockspec loads 8-bit float, e4m3)")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise BlockspecError(f"{where}: asymmetric or dynamic FP8 weights are not supported")
    strategy = weights.get("strategy")
    if strategy == "group" and weights.get("group_size") != BLOCK:
        raise BlockspecError(f"{where}: FP8 group size {weights.get('group_size')!r} is not supported (need {BLOCK})")
    if strategy == "block" and list(weights.get("block_structure") or []) != [BLOCK, BLOCK]:
        raise BlockspecError(f"{where}: FP8 block_structure {weights.get('block_structure')!r} is not supported "
                             f"(need [{BLOCK}, {BLOCK}])")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise BlockspecError(f"{where}: FP8 strategy {strategy!r} is not supported (tensor, channel, group or block)")
    return strategy
