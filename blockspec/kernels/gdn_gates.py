"""A DeltaNet layer's gates, the log decay g and the write strength beta of each token and value head, in the two
forms the recurrence takes them: `GateProjections`, what a pass computes them from (its projection's b and a rows
and the layer's A_log and dt_bias), and `Gates`, computed ones (a partial commit's replay reads back what its pass
stored). `deltanet_gates` is the reference that computes the one from the other; the Triton kernels compute them
in-kernel (gdn_triton.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import fused


@dataclass(frozen=True)
class GateProjections:
    b: torch.Tensor        # [T, Hv], rows may be strided (views of the packed projection)
    a: torch.Tensor        # [T, Hv]
    A_log: torch.Tensor    # [Hv]
    dt_bias: torch.Tensor  # [Hv]


@dataclass(frozen=True)
class Gates:
    g: torch.Tensor     # [T, Hv] float32
    beta: torch.Tensor  # [T, Hv] float32


def computed(gates: GateProjections | Gates, out: tuple | None = None) -> Gates:
    """The gates themselves: computed from projections (into the buffers `out` = (g, beta) when given, for a later
    replay), or as given."""
    if isinstance(gates, Gates):
        return gates
    return Gates(*deltanet_gates(gates.b, gates.a, gates.A_log, gates.dt_bias, out=out))


@fused
def deltanet_gates(b, a, A_log, dt_bias, out: tuple | None = None):
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b), [T, Hv] float32;
    with `out` written into those buffers."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    if out is not None:
        return out[0].copy_(g), out[1].copy_(beta)
    return g, beta
