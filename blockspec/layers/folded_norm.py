"""Residual adds and RMSNorms finished inside the quantized projections around them (decode and verification).

Plain, per norm of a 27B step (129 of them): delta = proj_a(a); x, h = add_rms_norm(x, delta); y = proj_b(h), three
launches. Folded, two: proj_a's launch writes the new residual x = x + delta, rows = x * (1 + w) and, per output tile,
each row's sum of x^2 (`quant_matmul_triton.wq_matmul_add_norm`); proj_b's launch reads rows and scales its result by
the row's 1 / rms = rsqrt(sum of the tiles' sums / width + eps). One number per row commutes with the matmul:
proj_b(x / rms * (1 + w)) = proj_b(x * (1 + w)) / rms. The rounding differs from the plain path (rows are rounded
before the 1 / rms scale, the sums are summed per tile), but every pass of <= MAX_FOLDED_ROWS (MAX_PASS_TOKENS)
tokens (plain decoding's one, a chain's or a draft tree's verification) runs this same code row by row, so speculative
decoding stays token-identical to plain decoding; longer passes (prefill) keep the plain path in every mode.

A layer folds when every projection of it is a bias-free W4A16 / W8A16 module (`QuantLinear`: int4, int8 or FP8)
whose kernel runs on its device: an INT4 or FP8 target on CUDA. The post-attention norm then folds into (o_proj or
out_proj, its MLP's gate/up); the next layer's input norm into (down_proj, the next mixer's input projections) when
that layer folds too. The first input norm and the final norm stay norm kernels.

The same layers also fold SwiGLU's activation into a packed gate/up projection (`fuse_gate`, one quantized part):
each program of that launch takes BN / 2 gate rows and the same up rows and stores silu(gate) * up, rounded as the
activation kernel rounds it (`quant_matmul_triton.wq_matmul_swiglu`). PredictConfig.fold_norms: false turns both off
(comparison runs).
"""

from __future__ import annotations

from torch import nn

from ..kernels import quant_matmul_triton as wq
from ..quant.linear import MAX_FOLDED_ROWS, FoldedNorm, QuantLinear

__all__ = ["MAX_FOLDED_ROWS", "FoldedNorm", "foldable", "enable"]


def foldable(layer: nn.Module) -> bool:
    """Whether every projection of a decoder layer runs the W4A16 kernel without a bias."""
    projections = [m for m in layer.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    return bool(projections) and all(
        isinstance(m, QuantLinear) and m.bias is None and wq.kernels_available(m.qweight.device) for m in projections)


def enable(model: nn.Module, on: bool = True) -> int:
    """Marks which norms (and activations) of `model` (a TargetModel) fold; returns the number of norms."""
    layers = list(model.layers)
    for layer in layers:
        layer.fold = on and foldable(layer)
        packed = layer.mlp.gate_up_proj
        layer.mlp.fold_activation = layer.fold and len(packed.parts) == 1 and packed.names == ("gate_proj", "up_proj")
    for layer, nxt in zip(layers, layers[1:] + [None]):
        layer.fold_into = nxt.input_layernorm if layer.fold and nxt is not None and nxt.fold else None
    return sum(layer.fold for layer in layers) + sum(layer.fold_into is not None for layer in layers)
