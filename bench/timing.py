"""The benches' timing helper (measures nothing by itself): GPU work timed with CUDA events, either a piece recorded
once as a CUDA graph and replayed (`replay_ms`), or a host function that launches work, e.g. replays the engine's own
graphs (`event_ms`). A script's `--dry-run` (`dry_run`) times on the CPU instead."""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from blockspec.engine.graphs import capture

_wall_clock = False  # dry_run(): one call timed by the host's clock, no CUDA


def dry_run(interpreted: bool = True) -> torch.device:
    """For a script's --dry-run: its own code on tiny shapes on the CPU (so that a test sees every path and check of
    the script run), its Triton kernels in the interpreter; each timer then runs fn once and returns its wall time, a
    figure that means nothing. Returns the device to use. A kernel bench run without TRITON_INTERPRET=1 (it must be
    set before Triton starts) stops in one line; an engine's (interpreted False) takes PyTorch's CPU paths."""
    global _wall_clock
    if interpreted:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the Triton kernels on the CPU: TRITON_INTERPRET=1 python ... --dry-run")
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from helpers import patch_triton_interpreter  # numpy >= 2 vs the interpreter's program ids

        patch_triton_interpreter()
    _wall_clock = True
    return torch.device("cpu")


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def replay_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of one replay of a CUDA graph that runs fn() once (warm-up on a side stream first)."""
    if _wall_clock:
        return _wall_ms(fn)
    graph, _ = capture(fn, warmup=1)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def event_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds between CUDA events around fn(), after warm-up calls."""
    if _wall_clock:
        return _wall_ms(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
