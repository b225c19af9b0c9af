"""How the fast kernels launch: one immutable settings object, built by the engine from PredictConfig
(`fuse_elementwise`, `pdl_level`, `pdl_prefetch_mb`) and active only around that engine's own work (`use`).

Why scoped rather than global: two engines in one process (the bench builds one per mode) may want different
settings, and kernel benches or tests that call kernels directly get the defaults (no PDL, no compilation).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSettings:
    fusion: bool = False          # torch.compile the elementwise ops that have no kernel of their own (`fused`)
    pdl_level: int = 0            # programmatic dependent launch (kernels/pdl.py): 0 off .. 3
    pdl_prefetch_mb: float = 4.0  # weight bytes the projections prefetch into L2 while they wait (PDL only)


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
