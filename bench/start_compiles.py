"""What torch.compile traces during an engine's start: runs `blockspec <args>` (e.g. a bench line) in this process,
then prints the frames dynamo traced and inductor's compile times per function. The drafter's graphs should show
none (they record Triton kernels only); whatever appears was traced at this start, i.e. at every start.
Usage (GPU): python bench/start_compiles.py bench --synthetic qwen3.5-27b --compile-mode 0 --mode dflash2 ...
"""

import runpy
import sys
import traceback

import torch
import torch._dynamo.utils as dynamo_utils

_compile = torch.compile


def _named_compile(fn=None, **kwargs):
    """torch.compile that says what it was given and from where (blockspec's `fused` compiles on first use)."""
    print(f"torch.compile({getattr(fn, '__qualname__', fn)}) from", traceback.extract_stack(limit=4)[0].name)
    return _compile(fn, **kwargs)


if __name__ == "__main__":
    torch.compile = _named_compile
    sys.argv = ["blockspec"] + sys.argv[1:]
    try:
        runpy.run_module("blockspec.cli", run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    print("dynamo frames:", dict(dynamo_utils.counters["frames"]))
    print(dynamo_utils.compile_times(repr="str"))
