"""The warp-specialized W4A16 kernel (blockspec/kernels/quant_matmul_gluon.py) against the engine's launches at 1, 8,
16 and 32 rows, the 27B's INT4 projections: us per launch over > 300 MB of weight copies in one CUDA graph, % of the
read bandwidth measured in the same run, error against the engine and the fraction of outputs equal to its bits.
Variants: 2 or 3 consumer warpgroups, x blocks of 8 rows (1 and 8 rows: with 2 consumers the kernel's lean footprint,
`quant_matmul_gluon.LEAN`), 16 or 32; at 1 and 8 rows also 2 consumers in the footprint of 17..32 rows, a whole SM a
program ("whole SM"); at 16 rows also 2 consumers in a lean footprint (LEAN_16). The engine takes the kernel for
INT4 at 1..8 and 17..32 rows, FP8 at 1..8, int8 group 32 where quant_matmul_triton's config table says.
GPU (Hopper): python warp_specialized.py [--shapes gate_up,down,...] [--pdl-level N] [--fp8 | --int8-g32] (both
kernels launched under programmatic dependent launch at that level, kernels/pdl.py; default 0, none; the INT4 and
FP8 engines' is 3; --fp8: the projections as FP8 e4m3 codes with 128 x 128 block scales; --int8-g32: the DFlash2 drafter's
projections (DRAFTER_SHAPES) as int8 codes of group 32, `--dflash2-quantization int8`)
With --mlp instead (PDL level 3 unless --pdl-level): the 27B's INT4 MLP with the next norm begun (gate_up with
SwiGLU, then down with the residual add) at 1 and 8 rows, the engine's two launches against one launch of both
(`quant_matmul_gluon.launch_mlp`, the `persistent_mlp` setting), us per MLP over > 300 MB of weight copies in one
CUDA graph, 3 rounds alternated (one capture times differently from the next), and whether the one launch's out,
rows and partials equal the two launches' bits (after the timed replays too: the launch resets its counters).
CPU dry run: python warp_specialized.py --dry-run (each variant, its int8 group-32 program and the MLP's launch
compiled for sm_90 by Gluon's compiler, untimed).
Writes $OUT/warp_specialized.json when OUT is set."""
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

from blockspec.kernels import KernelSettings, quant_matmul_gluon as gk, use
from blockspec.kernels.quant_matmul_triton import (Epilogue, default_config, wq_matmul, wq_matmul_add_norm,
                                                   wq_matmul_swiglu, wq_mlp_add_norm)

SHAPES = {"gate_up": (34816, 5120), "gdn_in": (16480, 5120), "attn_qkv": (14336, 5120), "down": (5120, 17408),
          "o": (5120, 6144)}
DRAFTER_SHAPES = {"d_qkv": (6144, 5120), "d_o": (5120, 4096), "d_gate_up": (34816, 5120), "d_down": (5120, 17408)}
CODES = {"int4": (4, 128), "fp8": (8, 128), "int8-g32": (8, 32)}  # (bits, group size) of each --codes
ROWS = (1, 8, 16, 32)
MLP_ROWS, MLP_ROUNDS = (1, 8), 3
CONSUMERS = (2, 3)


def sm90_compile(k: int, consumers: int, block_m: int, epi: int = 0, rms: bool = False, pdl_level: int = 3,
                 bits: int = 4, e4m3: bool = False, kernel=None, pointers: dict | None = None,
                 group_size: int = 128, l2_ahead: int = 0, overlap_dots: bool = False) -> tuple[str, int]:
    """The kernel (or a `kernel` of its arguments and more `pointers`, {name: type}) compiled here for sm_90 (no GPU
    needed): (its PTX, its shared memory in bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    def desc(rows, dtype, gl_dtype):  # boxes of one block's int16 columns (of codes), group_size (of x)
        layout = gl.NVMMASharedLayout.get_default_for([rows, group_size], gl_dtype)
        return mangle_type(TensorDescriptor.from_tensor(torch.zeros(64, 1280, dtype=dtype), [rows, group_size],
                                                        layout))

    signature = dict(q_desc=desc(gk.BN // 2 if epi == 2 else gk.BN, torch.int16, gl.int16),
                     x_desc=desc(block_m, torch.bfloat16, gl.bfloat16), q_ptr="*i16", s_ptr="*bf16", out_ptr="*bf16",
                     ws_ptr="*fp32", cnt_ptr="*i32", res_ptr="*bf16", nw_ptr="*bf16", rows_ptr="*bf16",
                     part_ptr="*fp32", M="i32", N="i32", UNITS="i32", PER="i32", PARTS="i32", stride_om="i32",
                     eps="fp32") | (pointers or {})
    kernel = kernel or gk._ws_kernel
    registers = gk.footprint(consumers, block_m)[0]
    constants = dict(K=k, C=consumers, BM=block_m, S=gk.plan(34816, k, 132, consumers, block_m, bits)[0], EPI=epi,
                     RMS=rms, PBLOCK=128 if rms else 1, PDL=pdl_level, CREGS=registers[1], LREGS=registers[2],
                     BOXES=gk.G // group_size, L2AHEAD=l2_ahead, OVERLAP=overlap_dots,
                     **gk.unpacking(bits, e4m3), num_warps=4)
    full = {n: "constexpr" if n in constants else signature[n] for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if full[n][0] == "*"}
    compiled = triton.compile(GluonASTSource(kernel, full, constexprs=constants, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": registers[0]})
    return compiled.asm["ptx"], compiled.metadata.shared


def sm90_compile_mlp(rms: bool = True, pdl_level: int = 3) -> tuple[str, int]:
    """The MLP's one launch (`quant_matmul_gluon._mlp_kernel`, the 27B's shapes) compiled here for sm_90: (its PTX,
    its shared memory in bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    def desc(rows, dtype, gl_dtype):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl_dtype)
        return mangle_type(TensorDescriptor.from_tensor(torch.zeros(64, 1280, dtype=dtype), [rows, 128], layout))

    kernel = gk._mlp_kernel
    signature = dict(qa_desc=desc(gk.BN // 2, torch.int16, gl.int16), xa_desc=desc(8, torch.bfloat16, gl.bfloat16),
                     qb_desc=desc(gk.BN, torch.int16, gl.int16), xb_desc=desc(8, torch.bfloat16, gl.bfloat16),
                     eps="fp32")
    for name in kernel.arg_names:  # the rest: int32
        if name.endswith("_ptr"):
            signature[name] = ("*fp32" if name.startswith(("ws", "part")) else
                               "*i32" if name.startswith(("cnt", "done", "exit")) else "*bf16")
    registers = gk.LEAN[0]
    constants = dict(KA=5120, KB=17408, C=gk.CONSUMERS, BM=8, S=gk.plan(34816, 5120, 132, gk.CONSUMERS, 8)[0],
                     RMS=rms, PBLOCK=128 if rms else 1, PDL=pdl_level, CREGS=registers[1], LREGS=registers[2],
                     **gk.unpacking(4), num_warps=4)
    full = {n: "constexpr" if n in constants else signature.get(n, "i32") for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if full[n][0] == "*"}
    compiled = triton.compile(GluonASTSource(kernel, full, constexprs=constants, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": registers[0]})
    return compiled.asm["ptx"], compiled.metadata.shared


# A candidate lean footprint for x blocks of 16 rows (9..16 rows: a tree of 15's pass), not yet the config table's:
# 112 registers a thread at launch (152 a worker consumer, 24 the loader; ptxas: no spills) and a 144 KB ring (3
# stages), about half an SM
LEAN_16 = ((112, 152, 24), 144 * 1024)
WHOLE_SM = (gk.REGISTERS[2], gk.SMEM)  # 2 consumers in the footprint of 17..32 rows: a whole SM a program


def variants(m: int) -> list[tuple[str, int, int, object]]:
    """(label, consumers, x block rows, the footprint it runs in) of each variant timed at m rows."""
    block_m = max(8, 1 << (m - 1).bit_length())
    out = [(f"C{c} m{block_m}", c, block_m, nullcontext()) for c in CONSUMERS]
    if m <= 8:
        out.append(("C2 m8 whole SM", 2, 8, footprint({8: WHOLE_SM})))
    elif m <= 16:
        out.append(("C2 m16 lean", 2, 16, footprint({16: LEAN_16})))
    return out


def footprint(table: dict):
    """The kernel's footprints with 2 consumers at the x block rows in `table` replaced by its (registers, ring
    bytes): a context for the launches (and captures) made under it."""
    plain = gk.footprint
    return mock.patch.object(gk, "footprint", lambda c, b: table[b] if c == 2 and b in table else plain(c, b))


def dry_run() -> dict:
    out = {}
    for m in ROWS:
        for label, consumers, block_m, context in variants(m):
            with context:
                ptx, shared = sm90_compile(5120, consumers, block_m)
                ptx_g32, shared_g32 = sm90_compile(5120, consumers, block_m, bits=8, group_size=32)
            wgmma = f"wgmma.mma_async.sync.aligned.m64n{block_m}k16"
            out[label] = dict(shared=shared, wgmma=ptx.count(wgmma), shared_int8_g32=shared_g32,
                              wgmma_int8_g32=ptx_g32.count(wgmma))
    ptx, shared = sm90_compile_mlp()
    out["MLP"] = dict(shared=shared, wgmma=ptx.count("wgmma.mma_async.sync.aligned.m64n8k16"))
    return out


def measure(names: list[str], pdl_level: int, codes: str = "int4") -> dict:
    from blockspec.bench import measure_read_bandwidth

    dev = torch.device("cuda")
    bandwidth = measure_read_bandwidth(dev)
    results = dict(device=torch.cuda.get_device_name(dev), read_gbs=bandwidth, pdl_level=pdl_level, codes=codes,
                   shapes={})
    print(f"{results['device']}: read bandwidth {bandwidth:.0f} GB/s, PDL level {pdl_level}", flush=True)
    with use(KernelSettings(pdl_level=pdl_level)):
        for name in names:
            results["shapes"][name] = measure_shape(name, bandwidth, codes)
    return results


def measure_shape(name: str, bandwidth: float, codes: str = "int4") -> dict:
    """us per launch at each of ROWS: the engine's config, then each variant."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import replay_ms

    from blockspec.quant.fp8 import Fp8Linear, quantize
    from blockspec.quant.int4 import Int4Linear
    from blockspec.quant.int8 import Int8Linear

    dev = torch.device("cuda")
    n, k = (SHAPES | DRAFTER_SHAPES)[name]

    def packed():
        w = torch.randn(n, k, device=dev) * k ** -0.5
        if codes == "fp8":
            return Fp8Linear.from_blocks(*quantize(w)).packed()
        if codes == "int8-g32":
            return Int8Linear.from_float(w, 32).packed()
        return Int4Linear.from_float(w, 128, True, scale_dtype=torch.bfloat16).packed()
    weights = [packed()]
    weights += [packed() for _ in range(max(1, -(-300_000_000 // weights[0].nbytes())) - 1)]
    nbytes = weights[0].nbytes()
    rows = {}
    for m in ROWS:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        cfg = default_config(m, n, k, *CODES[codes])
        want = wq_matmul(x, weights[0]).float()
        engine = replay_ms(lambda: [wq_matmul(x, w, cfg, out=out) for w in weights]) * 1e3 / len(weights)
        row = rows[m] = {"engine": dict(us=engine, config=cfg.short(), pct=nbytes / engine / 1e3 / bandwidth * 100)}
        for label, consumers, block_m, context in variants(m):
            def run(w, o):
                if not gk.launch(x, w, o, Epilogue(), consumers, block_m):
                    raise SystemExit(f"the kernel does not build here: {gk._BROKEN[0]}")
                return o
            with context:  # launches captured under it keep its kernel
                got = run(weights[0], torch.empty_like(out)).float()
                us = replay_ms(lambda: [run(w, out) for w in weights]) * 1e3 / len(weights)
            row[label] = dict(
                us=us, pct=nbytes / us / 1e3 / bandwidth * 100, equal=float((got == want).float().mean()),
                rel_err=float((got - want).abs().max() / want.abs().max()))
        print(f"{name} M={m}: " + "; ".join(
            f"{label} {r['us']:.1f} us ({r['pct']:.1f} %)"
            + (f", equal {r['equal']:.3f}, rel err {r['rel_err']:.1e}" if "equal" in r else f" [{r['config']}]")
            for label, r in row.items()), flush=True)
    return rows


def measure_mlp(pdl_level: int) -> dict:
    """us per MLP at each of MLP_ROWS: the engine's two launches, then one launch of both."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import replay_ms

    from blockspec.bench import measure_read_bandwidth
    from blockspec.quant.int4 import Int4Linear

    dev = torch.device("cuda")
    bandwidth = measure_read_bandwidth(dev)
    hidden, inner = SHAPES["down"]

    def packed(n, k):
        return Int4Linear.from_float(torch.randn(n, k, device=dev) * k ** -0.5, 128, True,
                                     scale_dtype=torch.bfloat16).packed()
    pairs = [(packed(2 * inner, hidden), packed(hidden, inner))]
    nbytes = pairs[0][0].nbytes() + pairs[0][1].nbytes()
    pairs += [(packed(2 * inner, hidden), packed(hidden, inner)) for _ in range(-(-300_000_000 // nbytes) - 1)]
    results = dict(device=torch.cuda.get_device_name(dev), read_gbs=bandwidth, pdl_level=pdl_level,
                   mb_per_mlp=nbytes / 1e6, rows={})
    print(f"{results['device']}: read bandwidth {bandwidth:.0f} GB/s, PDL level {pdl_level}, "
          f"{nbytes / 1e6:.1f} MB an MLP", flush=True)
    with use(KernelSettings(pdl_level=pdl_level)):
        for m in MLP_ROWS:
            x = torch.randn(m, hidden, device=dev).to(torch.bfloat16)
            partials = torch.rand(hidden // gk.BN, m, device=dev) * (2 * gk.BN)  # 1 / rms ~ 1
            residual = torch.randn(m, hidden, device=dev).to(torch.bfloat16)
            weight = (torch.randn(hidden, device=dev) * 0.1).to(torch.bfloat16)

            def apart(gate_up, down):
                return wq_matmul_add_norm(wq_matmul_swiglu(x, gate_up, (partials, 1e-6)), down, residual, weight)

            def one(gate_up, down):
                return wq_mlp_add_norm(x, gate_up, down, residual, weight, (partials, 1e-6))
            if not gk.mlp_usable(x, *pairs[0]):
                raise SystemExit(f"the MLP's launch does not serve {m} rows here: {gk._MLP_BROKEN[:1]}")
            want = apart(*pairs[0])
            row = results["rows"][m] = {}
            for _ in range(MLP_ROUNDS):  # alternated: one capture times differently from the next
                for label, fn in (("two launches", apart), ("one launch", one)):
                    us = replay_ms(lambda: [fn(*pair) for pair in pairs]) * 1e3 / len(pairs)
                    got = fn(*pairs[0])
                    r = row.setdefault(label, dict(us=[], pct=[], equal=True))
                    r["us"].append(us)
                    r["pct"].append(nbytes / us / 1e3 / bandwidth * 100)
                    r["equal"] &= all(bool(torch.equal(a, b)) for a, b in zip(got, want))
            print(f"MLP M={m}: " + "; ".join(
                f"{label} {' / '.join(f'{us:.1f}' for us in r['us'])} us ({max(r['pct']):.1f} % at best), "
                f"equal {r['equal']}" for label, r in row.items()), flush=True)
    return results


def main() -> None:
    if "--dry-run" in sys.argv:
        results = dry_run()
        print(json.dumps(results))
    else:
        if "--fp8" in sys.argv and "--int8-g32" in sys.argv:
            print("--fp8 and --int8-g32: one code format at a time", file=sys.stderr)
            sys.exit(2)
        codes = "fp8" if "--fp8" in sys.argv else "int8-g32" if "--int8-g32" in sys.argv else "int4"
        shapes = DRAFTER_SHAPES if codes == "int8-g32" else SHAPES
        names = sys.argv[sys.argv.index("--shapes") + 1].split(",") if "--shapes" in sys.argv else list(shapes)
        unknown = [n for n in names if n not in shapes]
        if unknown:
            print(f"unknown shape {unknown[0]!r}; the shapes: {', '.join(shapes)}", file=sys.stderr)
            sys.exit(2)
        default = ["3"] if "--mlp" in sys.argv else ["0"]  # the MLP at the INT4 engine's level
        level = sys.argv[sys.argv.index("--pdl-level") + 1:][:1] if "--pdl-level" in sys.argv else default
        if level not in (["0"], ["1"], ["2"], ["3"]):
            print(f"--pdl-level {' '.join(level)!r}: one of 0, 1, 2, 3", file=sys.stderr)
            sys.exit(2)
        if "--mlp" in sys.argv:
            results = measure_mlp(int(level[0]))
        else:
            results = measure(names, int(level[0]), codes)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "warp_specialized.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
