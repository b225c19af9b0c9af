"""Dense projections. The reference is F.linear (cuBLAS on CUDA); few-row bf16/fp16 products whose shape has a
measured faster config run on the Triton kernel of linear_triton.py."""

import torch
import torch.nn.functional as F

from . import linear_triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if bias is None and linear_triton.available(x, weight):
        config = linear_triton.default_config(x.shape[0], weight.shape[0], weight.shape[1])
        if config is not None and linear_triton.fits(config, x.shape[0], x.device):
            return linear_triton.linear_rows(x, weight, config)
    return F.linear(x, weight, bias)

