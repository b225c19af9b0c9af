"""The benches' timing helper (measures nothing by itself): GPU work timed with CUDA events, either a piece recorded
once as a CUDA graph and replayed (`replay_ms`), or a host function that launches work, e.g. replays the engine's own
graphs (`event_ms`)."""

import statistics

import torch

from blockspec.engine.graphs import capture


def replay_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of one replay of a CUDA graph that runs fn() once (warm-up on a side stream first)."""
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
