"""Check and time the CUDA W4A16 kernel (blockspec.quant.w4a16_cuda) against the Triton one, on the 27B shapes.

One command on a GPU machine (repo root, ~3 minutes on an H200):   python bench/w4a16_cuda.py
(SHAPES=o,gdn_in: those shapes only; MS=1,8: those row counts; DIAG=loads:build/loads.cubin: each best config also
timed from other builds of the kernels, e.g. nvcc -DW4A16_LOADS_ONLY: the loads without the math; EPILOGUES=1: the
folded layer's launches with their epilogues, CUDA vs Triton, instead of the table.)
CUBIN=path loads a cubin built elsewhere (nvcc -cubin of wc.source(...)) instead of compiling with NVRTC here.
1. Checks: every swept config (and row tiles 1 / 2, zero points or not) against the dequantized fp32 reference on
   odd strip counts and a K that does not fill the last warp; row 0 of an 8-row launch == the 1-row launch
   (bitwise); a CUDA-graph replay of a K-split launch == eager (bitwise); NVRTC compiles the source here.
2. Timing as bench/quant_kernels.py times: per (shape, M), C weight copies (> 200 MB together) back to back in one
   CUDA graph, median of 7 replays / C; the Triton kernel's default config on as many copies of its own layout in
   the same run. % of 3990 GB/s over codes + scales. Then the best config per (shape, M) launched with PDL (its
   successor released after its wait or at its start; rings of 8 / 16), and the Triton kernel at PDL level 2.
Writes $OUT/w4a16_cuda.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from blockspec.quant import w4a16_cuda as wc  # noqa: E402
from blockspec.kernels import pdl  # noqa: E402
from blockspec.quant import w4a16_triton as wq  # noqa: E402
from timing import replay_ms  # noqa: E402

PEAK_GBS = 3990.0
DEV = torch.device("cuda")
SHAPES = [("gate_up", 34816, 5120), ("gdn_qkv", 10240, 5120), ("q", 12288, 5120), ("gdn_z", 6144, 5120),
          ("down", 5120, 17408), ("o", 5120, 6144), ("vocab", 248320, 5120),
          ("gdn_in", 16480, 5120), ("attn_qkv", 14336, 5120)]  # the packed projections of the INT4 table
MS = [int(m) for m in os.environ.get("MS", "1,8,16").split(",")]
if os.environ.get("SHAPES"):  # e.g. SHAPES=gdn_in,o: those only
    SHAPES = [s for s in SHAPES if s[0] in os.environ["SHAPES"].split(",")]
CONFIGS = [wc.CudaConfig(d, ks, ws, sp) for d in (4, 8) for ks, ws, sp in
           [(4, 1, 1), (4, 2, 1), (8, 1, 1), (2, 2, 4), (4, 1, 2)]]
KERNEL_CONFIGS = sorted({wc.CudaConfig(d, c.k_warps, c.n_warps) for c in CONFIGS for d in (4, 8, 16)}, key=str)
KERNELS = tuple((c, nt, zp) for c in KERNEL_CONFIGS for nt in (1, 2) for zp in (False, True))


def rel_err(y, ref) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-9))


def random_pair(n, k, zp=False, seed=0):
    """The same random int4 weight in both layouts."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // 128, generator=g) * 0.015 + 0.005).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 128), generator=g).to(torch.bfloat16) if zp else None
    pw = wq.pack(codes.to(DEV), scales.to(DEV), None if zeros is None else zeros.to(DEV), 4, 128)
    mw = wc.pack(codes.to(DEV), scales.to(DEV), None if zeros is None else zeros.to(DEV))
    return pw, mw


def random_mma(n, k) -> wc.MmaWeight:
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (n // 16, k // 64, 32, 4), dtype=torch.int32, device=DEV)
    s = (torch.rand(n, k // 128, device=DEV) * 0.015 + 0.005).to(torch.bfloat16)
    return wc.MmaWeight(qw, wc._pairs(s), None, n, k)


def checks(module, log) -> None:
    def add(name, ok, **kw):
        log.append(dict(check=name, ok=bool(ok), **kw))
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {kw}", flush=True)

    g = torch.Generator(device="cpu").manual_seed(1)
    for zp in (False, True):
        for n, k in ((1040, 3072), (528, 17408)):
            pw, mw = random_pair(n, k, zp, seed=n + zp)
            w = pw.dequantize().to(DEV)
            for cfg in CONFIGS:
                for m in (1, 5, 8, 12, 16):
                    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
                    y = wc.matmul(x, mw, cfg, module=module)
                    err = rel_err(y, x.float() @ w.t())
                    if not err < 5e-3 or m == 16:
                        add(f"{cfg.short()} N={n} K={k} zp={zp} M={m}", err < 5e-3, rel_err=err,
                            cfg=cfg.short())
                x = torch.randn(8, k, generator=g).to(torch.bfloat16).to(DEV)
                y8, y1 = wc.matmul(x, mw, cfg, module=module), wc.matmul(x[:1], mw, cfg, module=module)
                if not torch.equal(y8[:1], y1):
                    add(f"{cfg.short()} N={n} K={k}: row 0 of M=8 == M=1", False)
    pw, mw = random_pair(5120, 17408)
    cfg = wc.CudaConfig(8, 2, 2, 4)
    x = torch.randn(4, 17408, generator=g).to(torch.bfloat16).to(DEV)
    y0 = wc.matmul(x, mw, cfg, module=module)
    graph, out = torch.cuda.CUDAGraph(), torch.empty_like(y0)
    with torch.cuda.graph(graph):
        wc.matmul(x, mw, cfg, out=out, module=module)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    add(f"graph replay of {cfg.short()} == eager", torch.equal(out, y0))


def timing(module, records, diag: dict) -> None:
    for name, n, k in SHAPES:
        probe = random_mma(n, k)
        nb = probe.nbytes()
        copies = min(64, max(1 if nb > 300e6 else 2, -(-int(200e6) // nb)))
        mws = [probe] + [random_mma(n, k) for _ in range(copies - 1)]
        kp = wq.padded_k(k, 4, 128)
        pws = [wq.PackedWeight(torch.randint(-2 ** 15, 2 ** 15, (n, kp // 4), dtype=torch.int16, device=DEV),
                               (torch.rand(kp // 512, n, 4, device=DEV) * 0.015 + 0.005).to(torch.bfloat16), None,
                               4, 128, n, k) for _ in range(copies)]
        print(f"\n[{name}] N={n} K={k}: {nb / 1e6:.1f} MB, {copies} copies", flush=True)
        for m in MS:
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            tcfg = wq.default_config(m, n, k)
            t_us = replay_ms(lambda: [wq.wq_matmul(x, w, tcfg, out=out) for w in pws], 7) * 1e3 / copies
            t_nb = pws[0].nbytes()
            records.append(dict(shape=name, m=m, variant="triton", cfg=tcfg.short(), us=t_us, bytes=t_nb,
                                pct=t_nb / t_us / 1e3 / PEAK_GBS * 100))
            print(f"  M={m:2d} triton {tcfg.short():24s} {t_us:8.1f} us {records[-1]['pct']:5.1f}%", flush=True)
            best = None
            for cfg in CONFIGS:
                try:
                    us = replay_ms(lambda: [wc.matmul(x, w, cfg, out=out, module=module) for w in mws], 7)
                    us *= 1e3 / copies
                except Exception as exc:  # noqa: BLE001
                    print(f"  M={m:2d} cuda {cfg.short()} FAILED {exc}", flush=True)
                    continue
                rec = dict(shape=name, m=m, variant="cuda", cfg=cfg.short(), us=us, bytes=nb,
                           pct=nb / us / 1e3 / PEAK_GBS * 100, vs_triton=t_us / us)
                records.append(rec)
                if best is None or us < best["us"]:
                    best = rec
                print(f"  M={m:2d} cuda   {cfg.short():24s} {us:8.1f} us {rec['pct']:5.1f}%  "
                      f"x{rec['vs_triton']:.2f} vs triton", flush=True)
            if best:
                print(f"  M={m:2d} BEST   {best['cfg']:24s} {best['us']:8.1f} us {best['pct']:5.1f}%  "
                      f"x{best['vs_triton']:.2f}", flush=True)
                # with programmatic dependent launch: each launch may start under its predecessor's tail, its
                # successor released after its wait (late) or at its start (early); deeper rings preload more
                cfg = next(c for c in CONFIGS if c.short() == best["cfg"])
                for variant, c2, early in [("pdl late", cfg, False), ("pdl early", cfg, True)] + [
                        (f"pdl early d{d}", replace(cfg, ring=d), True) for d in (8, 16) if d != cfg.ring]:
                    us = replay_ms(lambda: [wc.matmul(x, w, c2, out=out, module=module, pdl=True,
                                                      early_release=early) for w in mws], 7) * 1e3 / copies
                    records.append(dict(shape=name, m=m, variant="cuda " + variant, cfg=c2.short(), us=us, bytes=nb,
                                        pct=nb / us / 1e3 / PEAK_GBS * 100, vs_triton=t_us / us))
                    print(f"  M={m:2d} PDL    cuda {variant:14s} {c2.short():16s} {us:8.1f} us "
                          f"{records[-1]['pct']:5.1f}%", flush=True)
                for label, mod in diag.items():  # the same launches, other builds of the kernel
                    for variant, pdl_on in ((label, False), (label + " pdl", True)):
                        us = replay_ms(lambda: [wc.matmul(x, w, cfg, out=out, module=mod, pdl=pdl_on)
                                                for w in mws], 7) * 1e3 / copies
                        records.append(dict(shape=name, m=m, variant="cuda " + variant, cfg=cfg.short(), us=us,
                                            bytes=nb, pct=nb / us / 1e3 / PEAK_GBS * 100))
                        print(f"  M={m:2d} DIAG   cuda {variant:14s} {cfg.short():16s} {us:8.1f} us "
                              f"{records[-1]['pct']:5.1f}%", flush=True)
                pdl.use_level(2)
                tp_us = replay_ms(lambda: [wq.wq_matmul(x, w, tcfg, out=out) for w in pws], 7) * 1e3 / copies
                pdl.use_level(0)
                records.append(dict(shape=name, m=m, variant="triton+pdl2", cfg=tcfg.short(), us=tp_us, bytes=t_nb,
                                    pct=t_nb / tp_us / 1e3 / PEAK_GBS * 100))
                print(f"  M={m:2d} PDL    triton (level 2) {tp_us:8.1f} us {records[-1]['pct']:5.1f}%", flush=True)


def epilogue_timing(records) -> None:
    """The launches a folded layer runs (EPILOGUES=1): add_norm on out_proj / down, SwiGLU with the norm completed on
    gate_up, rms on in_proj, and gate_up plain; CUDA (PDL, successor released at its start) vs Triton (PDL level 2),
    at the MS row counts, with each CUDA kernel's registers."""
    cases = [("out add_norm", 5120, 6144, "add_norm"), ("down add_norm", 5120, 17408, "add_norm"),
             ("gate_up swiglu+rms", 34816, 5120, "swiglu"), ("in_proj rms", 16480, 5120, "rms"),
             ("gate_up plain", 34816, 5120, "plain")]
    kinds = dict(add_norm=wc.ADD_NORM, swiglu=wc.SWIGLU, rms=wc.STORE, plain=wc.STORE)
    for label, n, k, kind in cases:
        pw, _ = random_pair(n, k)
        mw = wc.from_q16(pw, swiglu=kind == "swiglu")
        nb = mw.nbytes()
        copies = max(2, -(-int(200e6) // nb))
        pws = [wq.PackedWeight(pw.q.clone(), pw.s.clone(), None, 4, 128, n, k) for _ in range(copies)]  # distinct:
        mws = [wc.MmaWeight(mw.qw.clone(), mw.sc.clone(), None, n, k) for _ in range(copies)]  # no L2 reuse
        for m in MS:
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            res = torch.randn(m, n, device=DEV).to(torch.bfloat16)
            nw = torch.randn(n, device=DEV).to(torch.bfloat16)
            sums = torch.rand(1, m, device=DEV) * k
            if kind == "add_norm":
                cuda = lambda: [wc.matmul_add_norm(x, w, res, nw, pdl=True) for w in mws]  # noqa: E731
                trit = lambda: [wq.wq_matmul_add_norm(x, w, res, nw) for w in pws]  # noqa: E731
            elif kind == "swiglu":
                cuda = lambda: [wc.matmul_swiglu(x, w, pdl=True, rms=(sums, 1e-6)) for w in mws]  # noqa: E731
                trit = lambda: [wq.wq_matmul_swiglu(x, w, rms=(sums, 1e-6)) for w in pws]  # noqa: E731
            else:
                rms = (sums, 1e-6) if kind == "rms" else None
                cuda = lambda: [wc.matmul(x, w, pdl=True, early_release=True, rms=rms) for w in mws]  # noqa: E731
                trit = lambda: [wq.wq_matmul(x, w, rms=rms) for w in pws]  # noqa: E731
            c_us = replay_ms(cuda, 7) * 1e3 / copies
            pdl.use_level(2)
            t_us = replay_ms(trit, 7) * 1e3 / copies
            pdl.use_level(0)
            cfg = wc.default_config(m, n, k)
            kernel = (cfg, 1 if m <= 8 else 2, False, kinds[kind])
            regs = wc.module_for((kernel,), DEV).registers(wc.kernel_name(*kernel))
            records.append(dict(epilogue=label, m=m, cuda_us=c_us, triton_us=t_us, bytes=nb, registers=regs))
            print(f"  {label:20s} M={m}: CUDA {c_us:7.1f} us  Triton {t_us:7.1f} us  x{t_us / c_us:.2f}  "
                  f"({nb / c_us / 1e3 / PEAK_GBS * 100:.0f} % vs {nb / t_us / 1e3 / PEAK_GBS * 100:.0f} %; "
                  f"{regs} registers)", flush=True)


def main() -> None:
    log, records = [], []
    if os.environ.get("EPILOGUES") == "1":
        epilogue_timing(records)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "w4a16_epilogues.json").write_text(json.dumps(records, indent=1))
        return
    t0 = time.perf_counter()
    try:
        major, minor = torch.cuda.get_device_capability()
        nv = wc.compile_cubin(wc.source([k for k in KERNELS if k[0] == wc.CudaConfig()]), f"sm_{major}{minor}")
        log.append(dict(check="nvrtc compiles", ok=True, seconds=time.perf_counter() - t0, bytes=len(nv)))
    except Exception as exc:  # noqa: BLE001
        log.append(dict(check="nvrtc compiles", ok=False, error=str(exc)[:2000]))
    print(log[-1], flush=True)
    cubin = os.environ.get("CUBIN")
    t0 = time.perf_counter()
    module = wc.Module(Path(cubin).read_bytes()) if cubin else wc.module_for(KERNELS, DEV)
    print(f"module loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    checks(module, log)
    diag = {}  # DIAG=label:cubin,...: other builds of the same kernels (e.g. -DW4A16_LOADS_ONLY), timed beside
    for item in filter(None, os.environ.get("DIAG", "").split(",")):
        label, path = item.split(":")
        diag[label] = wc.Module(Path(path).read_bytes())
    if os.environ.get("CHECK_ONLY") != "1":
        timing(module, records, diag)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w4a16_cuda.json").write_text(json.dumps(dict(checks=log, timing=records), indent=1))
    bad = [c for c in log if not c["ok"]]
    print(f"\n{len(log) - len(bad)} checks ok, {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
