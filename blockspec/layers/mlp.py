"""SwiGLU feed-forward block."""

import torch
from torch import nn

from ..kernels import active
from ..kernels import quant_matmul_triton as wq
from ..kernels.activation import silu_mul
from .folded_norm import MAX_FOLDED_ROWS, FoldedNorm


class SwiGLU(nn.Module):
    """gate_proj and up_proj as loaded; packed into gate_up_proj at load (layers/linear.py), the only one forward
    uses."""

    PACKS = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.gate_up_proj = None
        self.fold_activation = False  # silu(gate) * up inside the packed projection's launch (layers/folded_norm.py)

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input."""
        if self.fold_activation and x.shape[0] <= MAX_FOLDED_ROWS:
            return self.gate_up_proj.parts[0].swiglu(x)
        return silu_mul(*self.gate_up_proj(x))

    def add_norm(self, x: FoldedNorm, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, FoldedNorm]:
        """(residual + self(x), that sum's `norm` begun) for a folded layer (layers/folded_norm.py): with the kernel
        setting persistent_mlp in one launch where the kernel serves it, else the activation's launch and down's."""
        if self.fold_activation and active().persistent_mlp:  # a folded pass: <= MAX_FOLDED_ROWS rows
            summed, rows, partials = wq.wq_mlp_add_norm(x.rows, self.gate_up_proj.parts[0].packed(),
                                                        self.down_proj.packed(), residual, norm.weight, x.rms)
            return summed, FoldedNorm(rows, partials, norm.eps)
        return self.down_proj.add_norm(self.activate(x), residual, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(x))
