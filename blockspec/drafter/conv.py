"""Grouped dynamic causal convolution over the drafter's noise block.

Each output row t mixes the rows t, t-1, ..., t-(K-1) of the same block. Tap o's weight is a learned
per-channel value plus a per-group value predicted from row t's content. Rows before the block start
count as zero, so nothing leaks in from the context or a previous block.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels import drafter_conv_triton


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


class DynamicCausalConv(nn.Module):
    """A conv pair wrapped around one sublayer: `prepare` before it, `finish` after it.

    Both dynamic kernels are predicted from the sublayer's (normed) input, so `prepare` returns the one
    `finish` needs.
    """

    def __init__(self, channels: int, kernel_size: int, group_size: int, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = channels // group_size
        # [0] = taps before the sublayer, [1] = taps after it.
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, channels, dtype=dtype))
        self.kernel_projection = nn.Linear(channels, 2 * kernel_size * self.groups, bias=False, dtype=dtype)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        before = grouped_dynamic_causal_conv(x, dynamic[:, 0], self.base_kernel[0], self.group_size)
        return before, dynamic[:, 1]

    def finish(self, y: torch.Tensor, dynamic_after: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_causal_conv(y, dynamic_after, self.base_kernel[1], self.group_size)
