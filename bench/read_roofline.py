"""What one launch that only READS a weight-sized buffer achieves on this GPU: the ceiling of any projection kernel.

One command on a GPU machine (repo root, ~1 minute):   python bench/read_roofline.py
A CUDA kernel (NVRTC) streams B bytes with 16-byte non-caching loads, U per thread in flight, and folds them into one
word (so the loads stay); it releases its successor at its start and waits for its predecessor at its end (a
projection under PDL: weights first, its input after). "grid": a grid-stride walk; "chunk": each block a contiguous
range (as projection kernels read their weights). Timed as bench/quant_kernels.py times the W4A16 kernels: C buffers
(> 200 MB together) read back to back in one CUDA graph, median of 7 replays / C. Prints the best config per size with
% of 3990 GB/s, then that config launched with programmatic dependent launch (each read may start under its
predecessor's tail).
Writes $OUT/read_roofline.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ctypes  # noqa: E402

import torch  # noqa: E402

from blockspec.quant import w4a16_cuda as wc  # noqa: E402
from timing import replay_ms  # noqa: E402

PEAK_GBS = 3990.0
SIZES_MB = {"o": 16.2, "gdn_z": 19.4, "gdn_qkv": 27.0, "q": 32.4, "down": 45.9, "gate_up": 91.9, "vocab": 655.6}
UNROLL = (2, 4, 8)
SOURCE = r"""
DEVI uint4 ld_nc(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
template <int U, bool CHUNK>  // this thread's share of [0, n16) read, folded into one word (so the loads stay)
DEVI unsigned read_span(const uint4* __restrict__ p, long long n16) {
    long long start, stride, end;
    if (CHUNK) {  // block b reads [b * per, (b + 1) * per), its threads interleaved
        const long long per = (n16 + gridDim.x - 1) / gridDim.x;
        start = blockIdx.x * per + threadIdx.x; end = min(n16, (long long)(blockIdx.x + 1) * per);
        stride = blockDim.x;
    } else {
        start = (long long)blockIdx.x * blockDim.x + threadIdx.x; end = n16;
        stride = (long long)gridDim.x * blockDim.x;
    }
    unsigned acc = 0;
    long long i = start;
    for (; i + (U - 1) * stride < end; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ld_nc(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < end; i += stride) { uint4 v = ld_nc(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    return acc;
}
template <int U, bool CHUNK>
DEVI void read_body(const uint4* __restrict__ p, long long n16, unsigned* __restrict__ out) {
    asm volatile("griddepcontrol.launch_dependents;" :::);  // under PDL: the next read may start at once
    const unsigned acc = read_span<U, CHUNK>(p, n16);
    asm volatile("griddepcontrol.wait;" ::: "memory");  // a projection would wait here before its first store
    if (acc == 0x9E3779B9u) out[0] = acc;  // never true for the test data: keeps the loads
}
"""


def kernels():
    return [(u, chunk) for u in UNROLL for chunk in (False, True)]


def name(u, chunk):
    return f"read_u{u}_{'chunk' if chunk else 'grid'}"


def main() -> None:
    src = "#define DEVI __device__ __forceinline__\n" + SOURCE + "\n".join(
        f'extern "C" __global__ void {name(u, c)}(const uint4* p, long long n16, unsigned* out) '
        f'{{ read_body<{u}, {str(c).lower()}>(p, n16, out); }}' for u, c in kernels())
    major, minor = torch.cuda.get_device_capability()
    module = wc.Module(wc.compile_cubin(src, f"sm_{major}{minor}"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    records = []
    for label, mb in SIZES_MB.items():
        nbytes = int(mb * 1e6) // 16 * 16
        copies = min(64, max(1 if nbytes > 300e6 else 2, -(-int(200e6) // nbytes)))
        bufs = [torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(copies)]
        best = None
        for u, chunk in kernels():
            for threads in (256, 512, 1024):
                for per_sm in (1, 2, 4, 8):
                    blocks = sms * per_sm
                    if threads * per_sm > 2048:
                        continue
                    f = module.function(name(u, chunk))

                    def launch(buf, pdl=False, f=f, blocks=blocks, threads=threads):
                        args = [ctypes.c_void_p(buf.data_ptr()), ctypes.c_longlong(nbytes // 16),
                                ctypes.c_void_p(out.data_ptr())]
                        wc.cu_launch(f, (blocks, 1), threads, args, out.device, pdl)
                    us = replay_ms(lambda: [launch(b) for b in bufs], 7) * 1e3 / copies
                    rec = dict(size=label, mb=nbytes / 1e6, kernel=name(u, chunk), threads=threads, blocks=blocks,
                               us=us, pct=nbytes / us / 1e3 / PEAK_GBS * 100)
                    records.append(rec)
                    if best is None or us < best["us"]:
                        best, best_launch = rec, launch
        us = replay_ms(lambda: [best_launch(b, True) for b in bufs], 7) * 1e3 / copies
        records.append(dict(best, pdl=True, us=us, pct=nbytes / us / 1e3 / PEAK_GBS * 100))
        print(f"{label:8s} {nbytes / 1e6:6.1f} MB  with PDL {us:7.2f} us  {records[-1]['pct']:5.1f} %", flush=True)
        print(f"{label:8s} {nbytes / 1e6:6.1f} MB  best {best['kernel']:14s} {best['threads']:4d} thr x "
              f"{best['blocks']:4d} blocks  {best['us']:7.2f} us  {best['pct']:5.1f} % of {PEAK_GBS:.0f} GB/s",
              flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "read_roofline.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
