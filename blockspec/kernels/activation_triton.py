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
    """(rows, inner rows B, outer stride, inner stride): row r of the [rows, N] view starts at (r // B) * outer +
    (r % B) * inner. Covers [..., N] tensors whose leading dims merge into one stride, and [A, B, N] head slices of a
    wider row (the attention gate: a chunk of each head of a packed projection's output). None otherwise."""
    if t.stride(-1) != 1:
        return None
    try:
        flat = t.view(-1, t.shape[-1])
        return flat.shape[0], 1, flat.stride(0), 0
    except RuntimeError:
        if t.dim() != 3:
            return None
        return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def available(*tensors: torch.Tensor) -> bool:
    return triton_runs_on(tensors[0]) and all(_rows(t) is not None and t.shape == tensors[0].shape
                                               for t in tensors)


def gated(x: torch.Tensor, gate: torch.Tensor, activation: str) -> torch.Tensor:
    """x * act(gate); the caller has checked `available(x, gate)`."""
    (rows, bx, ox, ix), (_, bg, og, ig) = _rows(x), _rows(gate)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    n = x.shape[-1]
    _gated_kernel[(rows, triton.cdiv(n, BLOCK))](x, bx, ox, ix, gate, bg, og, ig, out, n,
                                                SILU=activation == "silu", BLOCK=BLOCK, num_warps=4,
                                                **pdl.options(x))
    return out


if triton is not None:
    @triton.jit
    def _gated_kernel(x, b_x, o_x, i_x, gate, b_gate, o_gate, i_gate, out, N, SILU: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g_at = (row // b_gate).to(tl.int64) * o_gate + (row % b_gate) * i_gate
        x_at = (row // b_x).to(tl.int64) * o_x + (row % b_x) * i_x
        g = tl.load(gate + g_at + cols, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(x + x_at + cols, mask=ok, other=0.0).to(tl.float32)
        act = tl.sigmoid(g)
        if SILU:
            act = g * act
        tl.store(out + row.to(tl.int64) * N + cols, (v * act).to(out.dtype.element_ty), mask=ok)
