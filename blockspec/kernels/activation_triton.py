"""x * act(gate) for act in {silu, sigmoid} in one Triton kernel over rows that may be strided (the halves of a
packed projection's output, the gate half of each attention head): the fast path of blockspec.kernels.activation.
Computed in float32, rounded once, as the compiled reference does."""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

BLOCK = 1024


def _rows(t: torch.Tensor):
    """A [rows, N] view with unit inner stride, or None when the layout does not allow one."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def available(*tensors: torch.Tensor) -> bool:
    return triton_runs_on(tensors[0]) and all(_rows(t) is not None and t.shape == tensors[0].shape
                                               for t in tensors)


def gated(x: torch.Tensor, gate: torch.Tensor, activation: str) -> torch.Tensor:
    """x * act(gate); the caller has checked `available(x, gate)`."""
    xs, gs = _rows(x), _rows(gate)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    n = xs.shape[1]
    _gated_kernel[(xs.shape[0], triton.cdiv(n, BLOCK))](xs, xs.stride(0), gs, gs.stride(0), out, n,
                                                       SILU=activation == "silu", BLOCK=BLOCK, num_warps=4,
                                                       **pdl.options(x))
    return out


if triton is not None:
    @triton.jit
    def _gated_kernel(x, s_x, gate, s_gate, out, N, SILU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(gate + row * s_gate + cols, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(x + row * s_x + cols, mask=ok, other=0.0).to(tl.float32)
        act = tl.sigmoid(g)
        if SILU:
            act = g * act
        tl.store(out + row * N + cols, (v * act).to(out.dtype.element_ty), mask=ok)
