"""Dense projections. The reference is F.linear (cuBLAS on CUDA); bf16/fp16 products of up to a verification pass's
rows whose shape has a config in the table of linear_triton.py (measured faster up to 8 rows) run on its kernel.

`linear_float32` is the vocabulary head's product: accumulated in float32 and returned unrounded. Why: at logit
magnitudes around 100 a bfloat16 result steps by 0.5, so the top two logits often tie exactly, and passes of
different lengths (a 1-token step, an 8-token verification) broke those ties differently; sampling needs float32
probabilities anyway. The head is bound by its weight read, so the wider output costs nothing measurable.
"""

import torch
import torch.nn.functional as F

from . import linear_triton

CPU_SLICE_WEIGHTS = 1 << 22  # weights per float32 slice of a 16-bit head on the CPU


def _triton_config(x: torch.Tensor, weight: torch.Tensor):
    if not linear_triton.available(x, weight):
        return None
    config = linear_triton.default_config(x.shape[0], weight.shape[0], weight.shape[1])
    return config if config is not None and linear_triton.fits(config, x.shape[0], x.device) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    config = _triton_config(x, weight) if bias is None else None
    if config is not None:
        return linear_triton.linear_rows(x, weight, config)
    return F.linear(x, weight, bias)


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T accumulated in float32 and returned as float32 (module docstring)."""
    if (x.dtype == weight.dtype == torch.float32
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # training keeps its operands' rounding: the float32-output matmuls below have no backward
        return F.linear(x, weight).float()
    rows = x.reshape(-1, x.shape[-1])
    config = _triton_config(rows, weight)
    if config is not None:  # the few-row kernel (a draft vocabulary's head) stores its float32 sums as they are
        out = torch.empty(rows.shape[0], weight.shape[0], device=x.device, dtype=torch.float32)
        return linear_triton.linear_rows(rows, weight, config, out=out).view(*x.shape[:-1], -1)
    if x.is_cuda:
        return torch.mm(rows, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    # the CPU has no float32-output matmul for 16-bit operands: float32 slices of the weight
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    rows, step = rows.float(), max(1, CPU_SLICE_WEIGHTS // weight.shape[1])
    for first in range(0, weight.shape[0], step):
        out[:, first:first + step] = F.linear(rows, weight[first:first + step].float())
    return out.view(*x.shape[:-1], -1)
