"""One function per op. Each file holds the plain PyTorch reference (CPU, float32, used by every CI test) and,
beside it in `<op>_triton.py`, the fast GPU kernel that replaces it on CUDA (tested against the reference through
Triton's CPU interpreter): attention, attention inputs, norms, DeltaNet conv and recurrence, gated activations, the
few-row matmul of dense and of weight-only quantized projections (`linear`, `quant_matmul`: the q16 layout of quant/'s
formats).

`fused` marks the elementwise-heavy ops that have no kernel of their own (DeltaNet prefill input preparation; the
references of the kernels above where Triton cannot take the input): on CUDA with fusion on (the graphed path,
`KernelSettings`) they run through torch.compile, which turns each into one or a few kernels. The undecorated
function stays the reference. The DFlash2 drafter's ops (`drafter_<op>.py`) have Triton kernels instead: torch.compile
traces again at every start, a Triton kernel loads from its disk cache.

At import, the compiled kernels' disk cache (inductor's FX-graph cache and Triton's) goes under the user's cache,
~/.cache/blockspec/inductor, rather than inductor's default in /tmp, unless TORCHINDUCTOR_CACHE_DIR is set: a
second start then skips compilation.
"""

import contextvars
import functools
import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "blockspec",
                                                               "inductor"))


# How the kernels launch: one immutable settings object, built by the engine from PredictConfig (fusion on with CUDA
# graphs, `pdl_level`, `pdl_prefetch_mb`, `persistent_mlp`) and active only around that engine's own work (`use`).
# Scoped rather than global: two engines in one process (the bench builds one per mode) may want different settings, and benches or
# tests that call kernels directly get the defaults (no PDL, no compilation).
@dataclass(frozen=True)
class KernelSettings:
    fusion: bool = False          # torch.compile the elementwise ops that have no kernel of their own (`fused`)
    pdl_level: int = 0            # programmatic dependent launch (kernels/pdl.py): 0 off .. 3
    pdl_prefetch_mb: float = 4.0  # weight bytes the projections prefetch into L2 while they wait (PDL only)
    persistent_mlp: bool = False  # a folded INT4 MLP in one launch (quant_matmul_triton.wq_mlp_add_norm)


_ACTIVE: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar("blockspec_kernels",
                                                                         default=KernelSettings())


def active() -> KernelSettings:
    return _ACTIVE.get()


@contextmanager
def use(settings: KernelSettings):
    token = _ACTIVE.set(settings)
    try:
        yield settings
    finally:
        _ACTIVE.reset(token)


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can take x: a CUDA tensor with triton installed, or any tensor under
    TRITON_INTERPRET=1 (the CPU interpreter the tests use)."""
    return TRITON_INSTALLED and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


_COUNTERS: dict = {}
_OUTGROWN: list = []  # counter buffers replaced by larger ones: CUDA graphs recorded with them still use them


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters on `device` for kernels whose last-arriving program finishes a tile (split-K sums, a
    head's output norm); each such program resets its counter, so one buffer per device serves every launch on
    one stream, graph replays included."""
    key = (device.type, device.index)
    if key not in _COUNTERS or _COUNTERS[key].numel() < count:
        if key in _COUNTERS:
            _OUTGROWN.append(_COUNTERS[key])
        _COUNTERS[key] = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
    return _COUNTERS[key]


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, which split-K and the W4A16 schedule spread programs over; under the
    CPU interpreter the H200's 132, the count the kernels' configs were tuned for."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


_FITTING_STAGES: dict = {}


def launch_fitting(kernel, grid, *args, stages_key: str = "num_stages", **meta):
    """kernel[grid](*args, **meta) with as deep a software pipeline as the GPU's shared memory holds: the depths
    were tuned on the H200 (227 KB per block), consumer Ampere / Ada / Blackwell cards give ~100 KB, where Triton
    refuses the launch (OutOfResources); then the same kernel runs with fewer stages (same numerics). The depth
    that fits is remembered per kernel and constants."""
    from triton.runtime.errors import OutOfResources

    tuned = meta.pop(stages_key, 3)
    key = (kernel, tuned, tuple(sorted(meta.items())))  # constants: ints, bools, strings (hashable as they are)
    stages = _FITTING_STAGES.get(key, tuned)
    while True:
        try:
            result = kernel[grid](*args, **meta, **{stages_key: stages})
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _FITTING_STAGES[key] = stages
        return result


def prepare_compilation():
    """Before the first compiled call: each op sees a handful of shapes (pass lengths, head layouts), and all of
    them stay compiled."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


COMPILED: dict = {}  # fn -> its torch.compile'd version, made at its first compiled call


def fused(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if active().fusion and args[0].is_cuda:
            compiled = COMPILED.get(fn)
            if compiled is None:
                prepare_compilation()
                compiled = COMPILED[fn] = torch.compile(fn, fullgraph=True)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    wrapper.reference = fn
    return wrapper
