"""RMSNorm modules holding their weight; the math lives in blockspec.kernels.norm."""

import torch
from torch import nn

from ..kernels.norm import add_rms_norm, rms_norm, rms_norm_plain_fast


class RMSNorm(nn.Module):
    """Zero-centred weight (y * (1 + w)), the convention of Qwen3.5 decoder, q/k and MTP norms."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None):
        """(x + delta, its norm); delta None: (x, norm of x)."""
        if delta is None:
            return x, self(x)
        return add_rms_norm(x, delta, self.weight, self.eps)


class PlainRMSNorm(RMSNorm):
    """Weight stored as is (y * w): the DFlash2 drafter's (Qwen3-style) norms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_plain_fast(x, self.weight, self.eps)
