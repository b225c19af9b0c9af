"""The dense projection module the loaded models run: an nn.Linear whose forward goes through
blockspec.kernels.linear (the Triton few-row kernel where it beats cuBLAS, else F.linear)."""

from torch import nn

from ..kernels.linear import linear


class DenseLinear(nn.Linear):
    @classmethod
    def wrap(cls, original: nn.Linear) -> "DenseLinear":
        """The same parameters (shared, not copied) behind the dispatching forward."""
        module = cls(original.in_features, original.out_features, bias=original.bias is not None, device="meta")
        module.weight = original.weight
        if original.bias is not None:
            module.bias = original.bias
        return module

    def forward(self, x):
        return linear(x, self.weight, self.bias)
