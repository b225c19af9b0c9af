"""RMSNorm rows, optionally after the residual add, in Triton: the fast path beside `rms_norm` / `add_rms_norm`
(blockspec.kernels.norm), which stay the reference.

Why a hand-written kernel: for one 5120-wide row torch.compile emits a looped reduction (two passes over the row in
one program), and a 27B decode step makes 129 such calls; one program holding the whole row in registers reads and
writes it once (docs/benchmarks.md, "RMSNorm"). Same rounding as the reference: the sum x + delta is rounded to
the activation dtype first (it is the new residual stream), the norm is computed in float32 from that.
"""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

MAX_WIDTH = 16384


def available(x: torch.Tensor) -> bool:
    return triton_runs_on(x) and x.shape[-1] <= MAX_WIDTH and x.stride(-1) == 1


def norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def add_rms_norm_rows(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      zero_centred: bool = True, num_warps: int | None = None):
    """Zero-centred RMSNorm (y = x / rms(x) * (1 + w)) of each row of x [..., N], after x += delta when given.
    Returns the norm, or (x + delta, the norm) with delta. zero_centred=False: the plain convention
    (rms_norm_plain: the norm rounded to x's dtype, times w in that dtype), the drafter's."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    summed = torch.empty_like(rows) if delta is not None else rows
    normed = torch.empty_like(rows)
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(rows.shape[0],)](
        rows, rows.stride(0), delta if delta is not None else rows, delta.reshape(-1, width).stride(0)
        if delta is not None else 0, weight, summed, normed, width, eps,
        HAS_DELTA=delta is not None, ZERO_CENTRED=zero_centred, BLOCK=block, num_warps=num_warps or norm_warps(block),
        **pdl.options(x))
    if delta is None:
        return normed.view(x.shape)
    return summed.view(x.shape), normed.view(x.shape)


def gated_rms_norm_rows(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The DeltaNet output norm (plain-weight RMSNorm of each head's vector of x [T, H, D], times silu(gate)); gate
    [T, H, D] may be strided (a slice of the packed projection). Rounding as the reference: the norm is rounded to
    x's dtype and multiplied by the weight in it."""
    t, heads, width = x.shape
    xs = x.reshape(-1, width)
    out = torch.empty(xs.shape, device=x.device, dtype=x.dtype)
    block = triton.next_power_of_2(width)
    _gated_rms_norm_kernel[(xs.shape[0],)](xs, xs.stride(0), gate, gate.stride(0), gate.stride(1), weight, out, width,
                                           eps, HEADS=heads, BLOCK=block, num_warps=max(1, min(8, block // 256)),
                                           **pdl.options(x))
    return out.view(x.shape)


if triton is not None:
    @triton.jit
    def _gated_rms_norm_kernel(x, s_x, gate, s_gate_t, s_gate_h, weight, out, N, eps, HEADS: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        v = tl.load(x + row * s_x + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out.dtype.element_ty
        normed = (v * tl.rsqrt(tl.sum(v * v, 0) / N + eps)).to(dtype)
        scaled = (normed * tl.load(weight + cols, mask=ok, other=0.0).to(dtype)).to(tl.float32)
        g = tl.load(gate + (row // HEADS) * s_gate_t + (row % HEADS) * s_gate_h + cols, mask=ok, other=0.0)
        g = g.to(tl.float32)
        tl.store(out + row * N + cols, (scaled * g * tl.sigmoid(g)).to(dtype), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(x, s_x, delta, s_delta, weight, summed, normed, N, eps,
                             HAS_DELTA: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        pdl.begin(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        v = tl.load(x + row * s_x + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            v = v + tl.load(delta + row * s_delta + cols, mask=ok, other=0.0)
            tl.store(summed + row * N + cols, v, mask=ok)  # rounded to the stream's dtype, as the reference adds
        v = v.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, 0) / N + eps)
        dtype = normed.dtype.element_ty
        w = tl.load(weight + cols, mask=ok, other=0.0)
        if ZERO_CENTRED:
            y = v * rstd * (1.0 + w.to(tl.float32))
        else:
            y = (v * rstd).to(dtype).to(tl.float32) * w.to(dtype).to(tl.float32)
        tl.store(normed + row * N + cols, y.to(dtype), mask=ok)
