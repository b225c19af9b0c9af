"""GPTQ int4 checkpoints (`quantization_config.quant_method: gptq`), repacked at load into blockspec's int4 layout
(quant/int4.py), so the projections then run exactly as those of a compressed-tensors checkpoint.

The format (AutoGPTQ / GPTQModel, per projection `<module>.`):
  qweight int32 [K / 8, N]: input k of output n is nibble k % 8 (bits 4 * (k % 8)) of word [k // 8, n];
  qzeros  int32 [groups, N / 8]: output n's zero point is nibble n % 8 of word [g, n // 8];
  scales  float [groups, N];  g_idx int32 [K] (optional): the group of each input.
  w[n, k] = (u - z) * s, u and z unsigned 4-bit, group g_idx[k] (k // group_size without act-order).
`checkpoint_format: gptq` (v1, the default) stores z - 1 (the historical offset: z = nibble + 1, so 1..16);
`gptq_v2` stores z itself. `group_size: -1` is one group per row (replicated over groups of 128 here).
Act-order (`desc_act: true`) is loaded when its g_idx keeps groups contiguous (`static_groups`); a g_idx that
scatters a group's inputs is refused, naming the tensor (the int4 layout holds groups of consecutive inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BlockspecError
from .hf_quantization import SCALE_DTYPES, check_converted, check_shape, config_value, not_converted, part
from .int4 import BITS, DEFAULT_GROUP_SIZE, from_unsigned, unpack_int32

GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)  # what the int4 layout holds (kernels/quant_matmul.check_format)
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> the offset added to a stored zero point
PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


@dataclass(frozen=True)
class GPTQScheme:
    group_size: int
    zero_offset: int
    not_converted: tuple[str, ...]

    kind = "int4"
    anchor = ".qweight"

    @classmethod
    def from_config(cls, qc: dict) -> "GPTQScheme":
        config_value(qc, "bits", (BITS,), what="for GPTQ")
        group_size = config_value(qc, "group_size", GROUP_SIZES, what="for GPTQ")
        fmt = config_value(qc, "checkpoint_format", tuple(FORMATS), "gptq", "for GPTQ")
        config_value(qc, "pack_dtype", ("int32",), "int32", "for GPTQ")
        return cls(group_size, FORMATS[fmt], not_converted(qc))

    def holds(self, name: str, value: torch.Tensor) -> bool:
        return name.endswith(PARTS)

    def read(self, parts: dict, prefix: str) -> nn.Module:
        check_converted(prefix, self.not_converted)
        qweight = part(parts, prefix, ".qweight", (torch.int32,), 2)
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        group = self.group_size if self.group_size > 0 else k
        groups = -(-k // group)
        context = f"{prefix}.qweight {tuple(qweight.shape)}, group size {self.group_size}"
        part(parts, prefix, ".scales", SCALE_DTYPES, 2)
        check_shape(parts, prefix + ".scales", (groups, n), context)
        part(parts, prefix, ".qzeros", (torch.int32,), 2)
        check_shape(parts, prefix + ".qzeros", (groups, -(-n // 8)), context)
        if prefix + ".g_idx" in parts:
            g_idx = part(parts, prefix, ".g_idx", (torch.int32, torch.int64), 1)
            check_shape(parts, prefix + ".g_idx", (k,), context)
            if not torch.equal(g_idx.to(torch.int64), torch.arange(k, device=g_idx.device) // group):
                raise BlockspecError(f"{prefix}.g_idx scatters groups over the inputs (act-order without "
                                     "static_groups), which blockspec's int4 layout does not hold")
        codes = unpack_int32(qweight, BITS, k, dim=0).t()
        zeros = unpack_int32(parts[prefix + ".qzeros"], BITS, n, dim=1).t() + self.zero_offset
        scales = parts[prefix + ".scales"].t()
        if self.group_size == -1:  # one group per row: the same scale and zero over groups of 128
            groups = -(-k // DEFAULT_GROUP_SIZE)
            scales, zeros, group = scales.expand(n, groups), zeros.expand(n, groups), DEFAULT_GROUP_SIZE
        return from_unsigned(codes, scales.contiguous(), zeros.contiguous(), group)
