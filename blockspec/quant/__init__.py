"""Weight-only quantization: int4 group-128 (W4A16, compressed-tensors checkpoints or RTN at load) and
int8 group-32 (RTN), with Triton kernels for few-row matmuls on CUDA and plain PyTorch references elsewhere."""

from .int4 import Int4Linear, from_compressed_tensors
from .int8 import Int8Linear

__all__ = ["Int4Linear", "Int8Linear", "from_compressed_tensors"]
