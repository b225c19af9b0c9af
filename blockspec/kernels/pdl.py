"""Programmatic dependent launch (PDL, sm_90 and later) for blockspec's Triton kernels.

Why: a batch-one decode step is ~700 dependent launches. Without PDL each kernel starts only after the previous one
has finished and drained: a launch gap, then a weight-streaming kernel that needs a microsecond or two of latency
before its memory pipe is full, while the small kernels between the projections (norms, the DeltaNet mixer,
attention) leave HBM idle. With PDL the next kernel's programs are placed while the current one still runs; they
wait (`griddepcontrol.wait`: the previous kernel has completed and its writes are visible) before touching anything
that kernel may write, and the projection kernels first prefetch the start of their weight rows into L2, so HBM
streams weights during the small kernels and the gaps.

The rules every kernel launched with PDL follows here:
  * before `wait`, only read-only model weights are touched (an L2 prefetch; L2 is where global memory is coherent,
    so even a prefetch of a line being written cannot return stale data);
  * small kernels release their successor at their start (`begin`), projection kernels after their main loop
    (`release`): a successor released earlier would prefetch weights that this kernel's own stream evicts from L2
    again, and at most one projection's programs wait for their turn at any time.
The chain is transitive (a kernel past its wait implies every earlier kernel completed). Kernels without PDL (cuBLAS,
torch ops) are ordinary launches and serialize as always. Those releases are levels (`settings`), chosen by
PredictConfig.pdl_level (the engine's default: what its target's weights measured best with, docs/benchmarks.md) and
active around the engine's work (`kernels.use`). Off on older GPUs and under the interpreter.
"""

from __future__ import annotations

import functools

import torch

from . import active

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs run no Triton kernel
    triton = None


def settings(device: torch.device) -> tuple[int, int]:
    """(level, prefetch bytes) of the active kernel settings on `device`: level 0 = no PDL, 1 = launched with PDL but
    each kernel lets its successor start only when it exits (hides the launch alone), 2 = projections release after
    their main loop, 3 = small kernels also release at their start."""
    chosen = active()
    if chosen.pdl_level == 0 or not _supports_pdl(device):
        return 0, 0
    return chosen.pdl_level, min(int(chosen.pdl_prefetch_mb * (1 << 20)), _l2_bytes(device) // 3)  # a third of L2


@functools.cache
def _supports_pdl(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 1 << 30)


def enabled(x: torch.Tensor) -> bool:
    return settings(x.device)[0] > 0


def options(x: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking the PDL constexpr: launch_pdl only where it applies (the interpreter
    takes no such option)."""
    level = settings(x.device)[0]
    return {"PDL": level, "launch_pdl": True} if level else {"PDL": 0}


def prefetch_blocks(tile_bytes: int, programs: int, blocks_per_program: int, device: torch.device) -> int:
    """How many of its first weight tiles each of `programs` prefetches (a power of two, at most its own range, 0
    without PDL): the prefetch budget in all, as if every program were resident at once."""
    return blocks_for_budget(tile_bytes, programs, blocks_per_program, settings(device)[1])


def blocks_for_budget(tile_bytes: int, programs: int, blocks_per_program: int, budget: int) -> int:
    if budget <= 0:
        return 0
    blocks = max(1, min(blocks_per_program, budget // max(1, programs * tile_bytes)))
    return 1 << (blocks.bit_length() - 1)


if triton is not None:
    @triton.jit
    def wait(PDL: tl.constexpr):
        """Until the previous kernel has completed and its writes are visible (a no-op without PDL)."""
        if PDL >= 1:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def release(PDL: tl.constexpr):
        """Lets the next kernel's programs be placed once every program of this one got here (or exited)."""
        if PDL >= 2:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def begin(PDL: tl.constexpr):
        """A small kernel's start: release the successor (level 3), then wait for the predecessor."""
        if PDL >= 3:
            release(PDL)
        wait(PDL)

    @triton.jit
    def prefetch_rows(base, rows, row_stride, col0, n_rows, n_cols, COLS: tl.constexpr, LINE: tl.constexpr,
                      PDL: tl.constexpr):
        """L2 prefetch of elements [col0, col0 + COLS) of the given rows of a row-major matrix (n_rows x n_cols,
        indices clamped into it), one prefetch per LINE elements (a 128-byte line); COLS 0: none."""
        if PDL >= 1 and COLS > 0:
            LINES: tl.constexpr = (COLS + LINE - 1) // LINE
            cols = tl.minimum(col0 + tl.arange(0, LINES) * LINE, n_cols - 1)
            r = tl.minimum(rows, n_rows - 1).to(tl.int64)
            ptrs = base + r[:, None] * row_stride + cols[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
