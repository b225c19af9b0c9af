"""Timing a piece of GPU work as the engine runs it: recorded once as a CUDA graph, replayed, timed with events."""

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
