"""Weight-only quantization: the QuantLinear module and its kinds, int4 group-128 (W4A16, compressed-tensors / GPTQ /
AWQ checkpoints or RTN at load), int8 group-32 (RTN) and block-scaled FP8, all in the q16 layout of
kernels/quant_matmul.py, run by the Triton kernel of kernels/quant_matmul_triton.py on CUDA and by the plain PyTorch
reference elsewhere."""

from .int4 import Int4Linear, from_compressed_tensors
from .int8 import Int8Linear
from .linear import QuantLinear

__all__ = ["QuantLinear", "Int4Linear", "Int8Linear", "from_compressed_tensors"]
