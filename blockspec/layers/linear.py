"""The projection modules the loaded models run.

`DenseLinear`: an nn.Linear whose forward goes through blockspec.kernels.linear (the Triton few-row kernel where it
beats cuBLAS, else F.linear).

`PackedLinear`: projections that read the same input run as one matmul, always (the checkpoint's names are loaded as
they are, then packed once at load, as nano-vllm's packed_modules_mapping does).

A module that packs declares `PACKS = {packed_name: (projection names...)}` and a `packed_name` attribute that is
None until packed; its forward calls only the packed projection. `pack_projections` builds one `PackedLinear` per
declared pack and deletes the original projections (their weights are released).
Dense weights are concatenated (pack before quantizing: group-wise quantization is per output row, so quantizing
the packed weight gives exactly the codes of quantizing each part); already quantized projections (a quantized
checkpoint) are concatenated code for code (FP8: with their scales). Projections stored in different formats
(e.g. some kept bf16 by a checkpoint's ignore list) are packed per format, one matmul each.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.linear import linear
from ..quant.linear import QuantLinear


class DenseLinear(nn.Linear):
    @classmethod
    def wrap(cls, original: nn.Linear) -> "DenseLinear":
        """The same parameters (shared, not copied) behind the dispatching forward."""
        module = cls(original.in_features, original.out_features, bias=original.bias is not None, device="meta")
        module.weight = original.weight
        if original.bias is not None:
            module.bias = original.bias
        return module

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def _pack_key(linear: nn.Module) -> tuple:
    if isinstance(linear, QuantLinear):
        return linear.pack_key()
    if type(linear) is not nn.Linear:
        raise TypeError(f"cannot pack {type(linear).__name__}")
    return (nn.Linear, linear.in_features, linear.weight.dtype, linear.weight.device, linear.bias is not None)


def _concat(linears: list[nn.Module]) -> nn.Module:
    first = linears[0]
    if isinstance(first, QuantLinear):
        return type(first).concat(linears)
    out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                    device="meta")
    out.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
    if first.bias is not None:
        out.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return out


class PackedLinear(nn.Module):
    """Several projections of one input; forward returns their outputs (views of one matmul's result) in order."""

    def __init__(self, linears: list[nn.Module], names: tuple[str, ...]):
        super().__init__()
        self.names = tuple(names)
        groups: dict[tuple, list[int]] = {}
        for i, part in enumerate(linears):
            groups.setdefault(_pack_key(part), []).append(i)
        self.parts = nn.ModuleList(_concat([linears[i] for i in idx]) for idx in groups.values())
        self.sizes = [[linears[i].out_features for i in idx] for idx in groups.values()]
        produced = [i for idx in groups.values() for i in idx]
        self.order = [produced.index(i) for i in range(len(linears))]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = [y for part, sizes in zip(self.parts, self.sizes) for y in part(x).split(sizes, dim=-1)]
        return tuple(outs[i] for i in self.order)

    def extra_repr(self) -> str:
        return f"names={self.names}"


def pack_projections(root: nn.Module) -> list[str]:
    """Pack, in every submodule of `root` that declares PACKS, its packs; the original projections are deleted.
    Returns the qualified names of the packed projections (none when root is already packed)."""
    packed = []
    # only the packing modules are listed: a list holding the projections would keep every original alive until
    # the end, i.e. the whole model's packed parts twice at the loading peak (+8.6 GB for a GPTQ 27B)
    for prefix, module in [(p, m) for p, m in root.named_modules() if getattr(m, "PACKS", None)]:
        for packed_name, names in module.PACKS.items():
            if getattr(module, packed_name) is not None:
                continue
            setattr(module, packed_name, PackedLinear([getattr(module, n) for n in names], names))
            for name in names:
                delattr(module, name)
            packed.append(f"{prefix}.{packed_name}" if prefix else packed_name)
    return packed
