"""AWQ int4 checkpoints (`quantization_config.quant_method: awq`, `version: gemm`, with zero points), repacked at
load into blockspec's int4 layout (quant/int4.py), so the projections then run exactly as those of a
compressed-tensors checkpoint.

The format (AutoAWQ's GEMM packing, per projection `<module>.`):
  qweight int32 [K, N / 8]: eight outputs per word along N, in the interleaved order ORDER: nibble i (bits 4 * i)
          of word [k, c] holds output c * 8 + ORDER[i];
  qzeros  int32 [groups, N / 8]: the unsigned zero points, packed the same way;  scales float [groups, N].
  w[n, k] = (u - z) * s, groups of `group_size` consecutive inputs.
Other versions (gemv, gemv_fast, marlin, exllama, ipex) pack differently and are refused, as is `zero_point: false`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .hf_quantization import SCALE_DTYPES, check_converted, check_shape, config_value, not_converted, part
from .int4 import BITS, from_unsigned, unpack_int32

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output ORDER[i] of its eight
GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)  # what the int4 layout holds (kernels/quant_matmul.check_format)
PARTS = (".qweight", ".qzeros", ".scales")


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's packing -> unsigned codes [R, C * 8] in output order."""
    nibbles = unpack_int32(packed, BITS, packed.shape[1] * 8, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[:, :, [ORDER.index(j) for j in range(8)]].reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class AWQScheme:
    group_size: int
    not_converted: tuple[str, ...]

    kind = "int4"
    anchor = ".qweight"

    @classmethod
    def from_config(cls, qc: dict) -> "AWQScheme":
        config_value(qc, "bits", (BITS,), qc.get("w_bit"), "for AWQ")
        group_size = config_value(qc, "group_size", GROUP_SIZES, qc.get("q_group_size"), "for AWQ")
        config_value(qc, "version", ("gemm",), "gemm", "for AWQ")
        config_value(qc, "zero_point", (True,), True, "for AWQ")
        return cls(group_size, not_converted(qc))

    def holds(self, name: str, value: torch.Tensor) -> bool:
        return name.endswith(PARTS)

    def read(self, parts: dict, prefix: str) -> nn.Module:
        check_converted(prefix, self.not_converted)
        qweight = part(parts, prefix, ".qweight", (torch.int32,), 2)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = -(-k // self.group_size)
        context = f"{prefix}.qweight {tuple(qweight.shape)}, group size {self.group_size}"
        scales = part(parts, prefix, ".scales", SCALE_DTYPES, 2)
        check_shape(parts, prefix + ".scales", (groups, n), context)
        qzeros = part(parts, prefix, ".qzeros", (torch.int32,), 2)
        check_shape(parts, prefix + ".qzeros", (groups, n // 8), context)
        return from_unsigned(unpack_columns(qweight).t(), scales.t().contiguous(), unpack_columns(qzeros).t(),
                             self.group_size)
