"""Recording work as a CUDA graph over static buffers (compile_mode 0).

Warm-up runs go on a side stream first, so that lazy initialisation, kernel autotuning and torch.compile happen
outside the capture (none of them may run while a graph records); then one call is recorded. Whatever the
recorded function returns are static tensors: each replay rewrites them in place.

The rule every owner of a graph keeps: a graph holds no reference to a caller's tensors. It records over buffers its
owner allocated once; a call copies its inputs into them, replays, and reads (or copies out) the outputs.
"""

from __future__ import annotations

import torch


def capture(fn, warmup: int = 2, pool=None):
    """Returns (graph, fn's outputs from the recorded call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs
