"""What the INT4 plain step would take if every projection were a perfect reader: the ceiling of any design that
keeps one launch per projection (docs/benchmarks.md, "Session 11").

One command on a GPU machine (repo root; ~2 minutes on an H200):   python bench/step_floor.py [--rounds 2]
The synthetic Qwen3.5-27B target, INT4 with the int8 head, packed projections, norms folded, default PDL; the
graphed 1-token step (bench/pdl_variants.py `measure`) with every W4A16 / W8A16 launch (`w4a16_triton._launch`)
replaced by, in turn:
  triton      the real kernel (the step as it is);
  read        a kernel that only reads the launch's codes, scales and zero points (16-byte non-caching loads, the
              best launch shape of bench/read_roofline.py), its outputs left unwritten;
  read+pdl    the same launched with programmatic dependent launch (successor released at its start, waiting for
              its predecessor at its end): each read may stream under the previous kernel's tail;
  read+pdl@B  read+pdl with B blocks of 512 threads per SM instead of 4 (fewer: room for the next kernels to be
              placed beside it while it streams);
  none        nothing: the step's other kernels alone (DeltaNet mixers, attention, norms, embedding, argmax).
Every variant re-captures the engine's graphs; rounds interleave the variants. % = bytes of the step / 3990 GB/s / time.
`--profile none,triton`: then those variants once more without PDL (so each kernel's time is its own, not its wait
too), with the kernels of the step by total time (bench/profile_cycle.py `kernel_table`).
Writes $OUT/step_floor.json when OUT is set.
"""

import argparse
import ctypes
import json
import os
import time
from pathlib import Path

import torch

from blockspec.kernels import pdl
from blockspec.quant import w4a16_cuda as wc
from blockspec.quant import w4a16_triton as wq
from blockspec.synthetic import synthetic_target

import read_roofline  # bench/, beside this script: the read-only kernel (read_span)
from pdl_variants import measure
from profile_cycle import kernel_table

PEAK_GBS = 3990.0
READ_SOURCE = "#define DEVI __device__ __forceinline__\n" + read_roofline.SOURCE + r"""
extern "C" __global__ void __launch_bounds__(512) read3(const uint4* a, long long na, const uint4* b, long long nb,
                                                         const uint4* c, long long nc, unsigned* out) {
    asm volatile("griddepcontrol.launch_dependents;" :::);
    const unsigned acc = read_span<2, false>(a, na) ^ read_span<2, false>(b, nb) ^ read_span<2, false>(c, nc);
    asm volatile("griddepcontrol.wait;" ::: "memory");  // a projection would wait here before its first store
    if (acc == 0x9E3779B9u) out[0] = acc;  // practically never: keeps the loads
}
"""


class Replacement:
    """A stand-in for w4a16_triton._launch: reads the launch's weight bytes (or nothing)."""

    def __init__(self, variant: str):
        self.kind, _, per_sm = variant.partition("@")
        major, minor = torch.cuda.get_device_capability()
        self.func = wc.Module(wc.compile_cubin(READ_SOURCE, f"sm_{major}{minor}")).function("read3")
        self.blocks = int(per_sm or 4) * torch.cuda.get_device_properties(0).multi_processor_count
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.weights: dict[int, int] = {}  # the distinct weights read: codes' address -> bytes

    def __call__(self, x2, pw, cfg, out, epilogue=None):
        if self.kind == "none":
            return
        args = []
        for t in (pw.q, pw.s, pw.z if pw.z is not None else pw.s[:0]):
            args += [ctypes.c_void_p(t.data_ptr()), ctypes.c_longlong(t.numel() * t.element_size() // 16)]
        self.weights[pw.q.data_ptr()] = pw.nbytes()
        wc.cu_launch(self.func, (self.blocks, 1), 512, args + [ctypes.c_void_p(self.sink.data_ptr())],
                     x2.device, pdl=self.kind == "read+pdl")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="triton,read,read+pdl,none")
    ap.add_argument("--profile", default="", help="variants to profile without PDL after the timing, e.g. none")
    args = ap.parse_args()
    model, head = synthetic_target("qwen3.5-27b", torch.device("cuda"), torch.bfloat16)
    mtp = {"mtp." + k: v for k, v in head.state_dict().items()}
    real_launch, applied, rows = wq._launch, "int4", []
    for rnd in range(args.rounds):
        for variant in args.variants.split(","):
            rep = None if variant == "triton" else Replacement(variant)
            wq._launch = rep or real_launch
            t0 = time.perf_counter()
            try:
                times, step_bytes = measure(model, mtp, applied, "none")
            finally:
                wq._launch = real_launch
            applied = "none"  # quantization and packing are in place: once
            step = times[1]
            row = dict(round=rnd, variant=variant, step_ms=round(step, 4), step_bytes=step_bytes,
                       pct_of_roofline=round(100 * step_bytes / (PEAK_GBS * 1e9) / (step * 1e-3), 1),
                       build_s=round(time.perf_counter() - t0, 1))
            if rep is not None and rep.kind != "none":  # the distinct weights the stand-in read
                row.update(weights_read=len(rep.weights), weight_bytes=sum(rep.weights.values()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    profiles = {}
    if args.profile:
        os.environ["BLOCKSPEC_PDL"] = "0"
        pdl.reset()
    for variant in filter(None, args.profile.split(",")):
        rep = None if variant == "triton" else Replacement(variant)
        wq._launch = rep or real_launch
        try:
            measure(model, mtp, "none", "none",
                    inspect=lambda step: profiles.update({variant: kernel_table(step, top=24)}))
        finally:
            wq._launch = real_launch
        table = profiles[variant]
        print(f"\n{variant} without PDL: {table['total_kernel_us']} us of kernels, {table['kernels_per_call']} "
              "per step")
        for name, calls, us in table["top"]:
            print(f"  {us:8.1f} us  {calls:5.0f} x  {name}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "step_floor.json").write_text(json.dumps(dict(rows=rows, profiles=profiles), indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
