"""The DFlash2 drafter's grouped dynamic causal convolution over its noise block: the op, its PyTorch reference and
the dispatch to its Triton kernel (drafter_conv_triton.py); drafter/model.py's DynamicCausalConv wraps it around the
drafter's sublayers.

Each output row t mixes the rows t, t-1, ..., t-(K-1) of the same block. Tap o's weight is a learned per-channel
value plus a per-group value predicted from row t's content. Rows before the block start count as zero, so nothing
leaks in from the context or a previous block.
"""

from __future__ import annotations

import torch

from . import drafter_conv_triton


def _shift_rows(x: torch.Tensor, offset: int) -> torch.Tensor:
    """Row t of the result is row t - offset of x; rows that would come from before the block are zero."""
    if offset == 0:
        return x
    if offset >= x.shape[0]:
        return torch.zeros_like(x)
    return torch.cat([x.new_zeros((offset, *x.shape[1:])), x[:-offset]])


def grouped_dynamic_causal_conv(
    x: torch.Tensor, dynamic: torch.Tensor, static: torch.Tensor, group_size: int
) -> torch.Tensor:
    """y[t, c] = sum_o (static[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c].

    x: [T, C] one block; dynamic: [T, K, C // group_size]; static: [K, C]. On CUDA the Triton kernel of
    kernels/drafter_conv_triton.py (one kernel instead of ~5 per tap); else grouped_dynamic_causal_conv_reference.
    """
    if drafter_conv_triton.available(x, dynamic):
        return drafter_conv_triton.grouped_dynamic_causal_conv(x, dynamic, static, group_size)
    return grouped_dynamic_causal_conv_reference(x, dynamic, static, group_size)


def grouped_dynamic_causal_conv_reference(x, dynamic, static, group_size: int) -> torch.Tensor:
    rows, channels = x.shape
    groups = channels // group_size
    x = x.view(rows, groups, group_size)
    y = torch.zeros_like(x)
    for offset in range(static.shape[0]):
        shifted = _shift_rows(x, offset)
        y = y + static[offset].view(groups, group_size).to(x.dtype) * shifted
        y = torch.addcmul(y, dynamic[:, offset, :, None], shifted)
    return y.view(rows, channels)
