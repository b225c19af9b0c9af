"""Applying packing and weight-only quantization to loaded modules (target, MTP head, DFlash2 drafter, shared head).

One mechanism for all of them: `prepare` packs the projections (blockspec.layers.linear, if the loader has not), then
swaps every `nn.Linear` whose qualified name passes a filter for its round-to-nearest quantized version
(`replace_linears`). Embeddings, norms, convolutions and other parameters are never touched. A target quantized at
load gets its layers' projections quantized by the loader as they are read (models/checkpoint.py,
fixtures/synthetic.py), with the same quantizer (`rtn`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import BlockspecError
from ..layers.linear import DenseLinear, pack_projections
from ..quant.fp8 import Fp8Linear
from ..quant.int4 import Int4Linear
from ..quant.int8 import Int8Linear

KINDS = {"int4": Int4Linear, "int8": Int8Linear}
Quantizer = Callable[[nn.Linear], nn.Module]
# weights quantized at once: the quantizers hold ~16 bytes of float32 working copies per weight (19 GB for the 27B's
# head in one piece)
QUANTIZE_BLOCK_ELEMENTS = 2 ** 24
ROW_ALIGNMENT = 128  # FP8's block rows: blocks of output rows aligned to them quantize as the whole does


def rtn(kind: str, group_size: int, scale_dtype: torch.dtype) -> Quantizer | None:
    """Round-to-nearest symmetric quantizer of an nn.Linear ("int4" / "int8" in groups of `group_size`, or "fp8"
    in 128 x 128 blocks), applied by blocks of output rows (`by_row_blocks`); None for "none"."""
    if kind == "none":
        return None
    if kind == "fp8":
        return by_row_blocks(Fp8Linear.from_linear)
    if scale_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        scale_dtype = torch.bfloat16
    cls = KINDS[kind]
    return by_row_blocks(lambda linear: cls.from_linear(linear, group_size, scale_dtype=scale_dtype))


def by_row_blocks(make: Quantizer) -> Quantizer:
    """`make` applied to blocks of output rows (multiples of ROW_ALIGNMENT, about QUANTIZE_BLOCK_ELEMENTS weights
    each), the results concatenated: the module `make` gives for the whole projection (RTN quantizes each output row,
    FP8 each 128 rows, on their own), with the working copies of one block instead of the whole projection's."""
    def quantize(linear: nn.Linear) -> nn.Module:
        rows = max(ROW_ALIGNMENT, QUANTIZE_BLOCK_ELEMENTS // linear.in_features // ROW_ALIGNMENT * ROW_ALIGNMENT)
        if linear.out_features <= rows:
            return make(linear)
        blocks = []
        for start in range(0, linear.out_features, rows):
            block = nn.Linear(linear.in_features, min(rows, linear.out_features - start),
                              bias=linear.bias is not None, device="meta")
            block.weight = nn.Parameter(linear.weight[start:start + rows], requires_grad=False)  # views
            if linear.bias is not None:
                block.bias = nn.Parameter(linear.bias[start:start + rows], requires_grad=False)
            blocks.append(make(block))
        return type(blocks[0]).concat(blocks)
    return quantize


def replace_linears(root: nn.Module, make: Quantizer, include: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Replace every nn.Linear submodule of `root` whose qualified name passes `include` by make(linear), one at a
    time (each original is released before the next is made). Returns the replaced names."""
    names = [name for name, m in root.named_modules() if type(m) is nn.Linear and include(name)]
    for name in names:
        root.set_submodule(name, make(root.get_submodule(name)))
    return names


def resident_bytes(root: nn.Module) -> int:
    """Bytes of the distinct storages behind root's parameters and buffers."""
    storages = {}
    for t in list(root.parameters()) + list(root.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def prepare(root: nn.Module, quantize: Quantizer | None = None,
            include: Callable[[str], bool] = lambda name: True) -> dict:
    """Pack the projections (if the loader has not), then quantize the Linear layers `include` accepts (or, left
    dense, run them through blockspec.kernels.linear). Returns the resident weight bytes at each step."""
    memory = {"loaded_bytes": resident_bytes(root)}
    pack_projections(root)
    memory["packed_bytes"] = resident_bytes(root)
    if quantize is not None:
        replace_linears(root, quantize, include)
    replace_linears(root, DenseLinear.wrap, include)  # the dense ones left: the few-row kernel where it pays
    memory["final_bytes"] = resident_bytes(root)
    return memory


def quantize_head(model, kind: str, scale_dtype: torch.dtype, group_size: int = 128) -> None:
    """Quantize the shared head (TargetModel.logits). With tied embeddings the head becomes a quantized copy of the
    embedding table; the embedding lookup itself stays exact."""
    make = rtn(kind, group_size, scale_dtype)
    if make is None:
        return
    if model.lm_head is None:  # tied: quantize the embedding table as a head
        tied = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False, device="meta")
        tied.weight = model.embed_tokens.weight  # shared, not copied
        model.lm_head = make(tied)
        return
    if type(model.lm_head) is not nn.Linear:
        raise BlockspecError(f"vocabulary_quantization: {kind!r}, but the checkpoint's lm_head is already quantized "
                             "(set vocabulary_quantization: none)")
    replace_linears(model, make, lambda name: name == "lm_head")
