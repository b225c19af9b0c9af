"""Projections with block-scaled FP8 weights (quant/fp8.py): w[n, k] = fp8[n, k] * scale[row[n], k // 128].

`fp8_dequantize` and `fp8_linear_reference` (dequantize to float32, then multiply) are the reference: the CPU path
and the tests' oracle. `fp8_linear` dispatches: up to 16 rows where the Triton kernel runs (fp8_linear_triton.py:
the FP8 bytes read as stored, the scales applied in the kernel), the reference elsewhere; longer passes (prefill)
dequantize slices of the weight to x's dtype and multiply them (F.linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fp8_linear_triton

BLOCK_K = fp8_linear_triton.BLOCK_K
SLICE_WEIGHTS = 1 << 24  # weights dequantized at a time for a long pass


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [N, K] (computed in float32) of an FP8 weight [N, K], its block scales [rows, ceil(K / 128)] and each
    output's scale row [N]."""
    k = weight.shape[1]
    per_input = scale[scale_row.long()].to(torch.float32).repeat_interleave(BLOCK_K, dim=1)[:, :k]
    return (weight.to(torch.float32) * per_input).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T in float32, returned in `out_dtype` (default x's)."""
    w = fp8_dequantize(weight, scale, scale_row)
    return (x.to(torch.float32) @ w.t()).to(out_dtype or x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if fp8_linear_triton.available(rows, weight):
        return fp8_linear_triton.fp8_matmul(rows, weight, scale, scale_row, out_dtype).view(*x.shape[:-1], -1)
    if not x.is_cuda:
        return fp8_linear_reference(x, weight, scale, scale_row, out_dtype)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    step = max(1, SLICE_WEIGHTS // weight.shape[1])
    for first in range(0, weight.shape[0], step):
        part = slice(first, first + step)
        out[:, part] = F.linear(rows, fp8_dequantize(weight[part], scale, scale_row[part], rows.dtype))
    return out.view(*x.shape[:-1], -1)
