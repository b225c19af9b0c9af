"""The DFlash2 drafter's grouped dynamic causal convolution in one Triton kernel, the fast path of
`grouped_dynamic_causal_conv` (drafter_conv.py), whose `grouped_dynamic_causal_conv_reference` is its reference.

Why a kernel of its own: the reference is ~5 elementwise ops per tap; torch.compile makes it one kernel but traces
it again at every start, while a Triton kernel loads from Triton's disk cache, so the drafter's graphs are ready in
a fraction of a second on a second start. Each program holds BLOCK channels of every row of the block, so the shifted
rows are re-read from L1, not from memory. Computed in float32 and rounded once, as the compiled reference does.
"""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

BLOCK = 256
MAX_ROWS = 16  # one drafter block (the whole row loop is unrolled)


def available(x: torch.Tensor, dynamic: torch.Tensor) -> bool:
    return triton_runs_on(x) and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and dynamic.stride(-1) == 1


def grouped_dynamic_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, static: torch.Tensor,
                                group_size: int) -> torch.Tensor:
    """Same contract as the reference: x [T, C], dynamic [T, K, C // group_size] (may be a strided view of the
    kernel projection's output), static [K, C] -> [T, C]."""
    rows, channels = x.shape
    taps = static.shape[0]
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    _dynamic_conv_kernel[(triton.cdiv(channels, BLOCK),)](
        x, x.stride(0), dynamic, dynamic.stride(0), dynamic.stride(1), static, static.stride(0), out, channels,
        ROWS=rows, TAPS=taps, GROUP=group_size, BLOCK=BLOCK, num_warps=2, **pdl.options(x))
    return out


if triton is not None:
    @triton.jit
    def _dynamic_conv_kernel(x, s_x, dynamic, s_dt, s_do, static, s_so, out, C,
                             ROWS: tl.constexpr, TAPS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        pdl.begin(PDL)
        channels = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = channels < C
        for t in tl.static_range(ROWS):
            acc = tl.zeros([BLOCK], tl.float32)
            for o in tl.static_range(TAPS):
                if o <= t:  # rows before the block start count as zero
                    tap = tl.load(static + o * s_so + channels, mask=ok, other=0.0).to(tl.float32)
                    tap += tl.load(dynamic + t * s_dt + o * s_do + channels // GROUP, mask=ok, other=0.0).to(tl.float32)
                    acc += tap * tl.load(x + (t - o) * s_x + channels, mask=ok, other=0.0).to(tl.float32)
            tl.store(out + t * C + channels, acc.to(out.dtype.element_ty), mask=ok)
