import json, os, sys
import torch
from timing import replay_ms
from blockspec.kernels import KernelSettings, use
from blockspec.quant import w4a16_triton as wq
import layer_tail as lt

info = {}
orig = wq._resident_programs
def spy(compiled, warps, device):
    p = orig(compiled, warps, device)
    info["last"] = dict(n_regs=compiled.n_regs, n_spills=compiled.n_spills, shared=compiled.metadata.shared, programs=p)
    return p
wq._resident_programs = spy
dev = torch.device("cuda")
norm = [0.3 * torch.randn(lt.HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2)]
for kind in ("fp8", "int4"):
    layers = [(lt.packed(kind, lt.HIDDEN, lt.MIXED, dev), lt.packed(kind, 2 * lt.INTER, lt.HIDDEN, dev),
               lt.packed(kind, lt.HIDDEN, lt.INTER, dev)) for _ in range(lt.LAYERS)]
    three = lt.three if hasattr(lt, 'three') else None
    x = torch.randn(1, lt.MIXED, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, lt.HIDDEN, device=dev, dtype=torch.bfloat16)
    with use(KernelSettings(pdl_level=3)):
        three = lambda: [lt.wq.wq_matmul_add_norm(lt.wq.wq_matmul_swiglu(r[1], gu, rms=(r[2], 1e-6)), d, r[0], norm[1])
                         for o, gu, d in layers for r in [lt.wq.wq_matmul_add_norm(x, o, res, norm[0])]]
        print(kind, "three launches", replay_ms(three) * 1e3 / lt.LAYERS, flush=True)
        for opts in ({"OUTER": 2, "maxnreg": 96}, {"OUTER": 2, "maxnreg": 96, "SLEEP": 100}, {"OUTER": 2, "maxnreg": 96, "SLEEP": 500}, {"OUTER": 0, "maxnreg": 96, "SLEEP": 100}) if kind == "fp8" else ({"OUTER": 0, "maxnreg": 128, "SLEEP": 100}, {"OUTER": 0, "SLEEP": 100}):
            wq.CHAIN_OPTIONS.clear(); wq.CHAIN_OPTIONS.update(opts); info.clear()
            try:
                us = replay_ms(lambda: [wq.wq_layer_tail(x, o, res, norm[0], 1e-6, gu, d, norm[1]) for o, gu, d in layers]) * 1e3 / lt.LAYERS
            except Exception as e:
                us = repr(e)[:200]
            print(kind, opts, us, info.get("last"), flush=True)
    if kind == "fp8":
        with use(KernelSettings(pdl_level=3)):
            for mb in (0.0, 48.0):
                wq.CHAIN_PREFETCH_MB = mb
                wq.CHAIN_OPTIONS.clear(); wq.CHAIN_OPTIONS.update({"OUTER": 2, "maxnreg": 96, "SLEEP": 100})
                print(kind, "prefetch", mb, replay_ms(lambda: [wq.wq_layer_tail(x, o, res, norm[0], 1e-6, gu, d, norm[1]) for o, gu, d in layers]) * 1e3 / lt.LAYERS, flush=True)
            wq.CHAIN_PREFETCH_MB = 16.0
    layers.clear()
