"""The drafter's dynamic causal convolutions around each sublayer: their weights, and the op
(kernels/drafter_conv.py: each output row mixes the K rows up to it of the same block, with per-channel learned
and per-group predicted taps)."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels.drafter_conv import grouped_dynamic_causal_conv


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
