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
torch ops) are ordinary launches and serialize as always. Those releases are levels (`settings`); the engine picks
the one its target's weights measured best with (`DEFAULT_LEVEL`: all of it for an INT4 target, none for bf16).
Off on older GPUs and under the interpreter; BLOCKSPEC_PDL=<level> overrides (debugging, comparison runs).
"""

from __future__ import annotations

import functools
import os

import torch

from ..errors import BlockspecError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs run no Triton kernel
    triton = None

PREFETCH_MB = 4  # what a projection prefetches in all (~1 us of HBM time; bench/pdl_variants.py compares)


# The level an engine asks for (`use_level`) unless BLOCKSPEC_PDL says otherwise. Measured on the H200 (synthetic
# 27B, packed; bench/pdl_variants.py, docs/benchmarks.md): INT4 target step 7.13 ms without PDL, 7.01 / 6.85 /
# 6.71 ms at levels 1 / 2 / 3; bf16 step 13.79 ms without, 13.74 / 13.79 / 14.09 at levels 1 / 2 / 3: the bf16
# projections, 4x longer, gain nothing from the overlap, and placing their programs early costs (level 3). Since the
# W4A16 kernel's shallower pipelines (session 7) the INT4 levels are within the 2-3 % noise of no PDL (6.35-6.80 ms);
# with the norms folded into the projections (session 8) every level is 1-3 % ahead of none, within noise of each other.
DEFAULT_LEVEL = {"level": 0}  # direct kernel users (kernel benches) launch as before unless they ask


def use_level(level: int):
    """The level an engine's weights measured best with (see DEFAULT_LEVEL); BLOCKSPEC_PDL still overrides it."""
    DEFAULT_LEVEL["level"] = level
    reset()


@functools.cache
def settings(device: torch.device) -> tuple[int, int]:
    """(level, prefetch bytes) on `device`: level 0 = no PDL, 1 = launched with PDL but each kernel lets its
    successor start only when it exits (hides the launch alone), 2 = projections release after their main loop,
    3 = small kernels also release at their start. BLOCKSPEC_PDL (a level) and BLOCKSPEC_PDL_PREFETCH_MB override
    the defaults; `reset` re-reads them."""
    level, megabytes = os.environ.get("BLOCKSPEC_PDL", DEFAULT_LEVEL["level"]), \
        os.environ.get("BLOCKSPEC_PDL_PREFETCH_MB", PREFETCH_MB)
    try:
        level, budget = int(level), int(float(megabytes) * (1 << 20))
    except ValueError:
        raise BlockspecError(f"BLOCKSPEC_PDL={level!r} / BLOCKSPEC_PDL_PREFETCH_MB={megabytes!r}: expected a level "
                             "0-3 and a number of MB") from None
    if triton is None or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        level = 0
    if device.type == "cuda":  # a third of L2 at most
        budget = min(budget, getattr(torch.cuda.get_device_properties(device), "L2_cache_size", budget) // 3)
    return level, budget if level else 0


def reset():
    settings.cache_clear()


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
