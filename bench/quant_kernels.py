"""GPU benchmark of the W4A16 (and W8A16) Triton kernels on the Qwen3.5-27B linear shapes.

For M in 1, 2, 4, 8, 16 and each shape: tune (a few configurations, checked against a dequantized reference),
then time with triton.testing.do_bench (L2 flushed between calls, median) our kernel, torch bf16 F.linear and
torch._weight_int4pack_mm (tinygemm, when it works). Prints a table with GB/s of weight bytes read (packed codes
+ scales for the quantized kernels, bf16 weight for F.linear) and % of 3990 GB/s, the max error against the
reference, and writes everything to $OUT/quant_kernels.json when OUT is set.

Run on a GPU machine from the repo root:  python bench/quant_kernels.py   (only torch + triton + blockspec)
Options (env): BENCH_M="1,2,4,8,16"  BENCH_BUDGET_S=120 (stop tuning new shapes after that; defaults are used)
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from blockspec.quant import w4a16_triton as wq  # noqa: E402
from blockspec.quant.int4 import Int4Linear  # noqa: E402
from blockspec.quant.int8 import Int8Linear  # noqa: E402

PEAK_GBS = 3990.0
SHAPES = [  # name, N (out), K (in)
    ("gate_up (packed)", 34816, 5120),
    ("gdn qkv", 10240, 5120),
    ("6144x5120", 6144, 5120),
    ("12288x5120", 12288, 5120),
    ("vocab (lm_head)", 248320, 5120),
    ("down", 5120, 17408),
    ("o / gdn out", 5120, 6144),
]
INT8_SHAPES = [("6144x5120", 6144, 5120), ("down", 5120, 17408)]


def _bench(fn, rep=30):
    return do_bench(fn, warmup=8, rep=rep, return_mode="median")


def _tinygemm_setup(lin: Int4Linear, n: int, k: int):
    """torch._weight_int4pack_mm operands from the same codes (w = (u - 8) * scale + zero, zero = 0)."""
    if not hasattr(torch, "_weight_int4pack_mm") or lin.zeros is not None:
        return None
    try:
        u = wq.unpack_planar(lin.qweight, 4, 128, k).to(torch.int32)  # unsigned codes [N, K]
        packed_u8 = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)
        w_tg = torch._convert_weight_to_int4pack(packed_u8.contiguous(), 8)
        sz = torch.stack([lin.scales[: k // 128].to(torch.bfloat16),
                          torch.zeros_like(lin.scales[: k // 128], dtype=torch.bfloat16)], dim=2).contiguous()
        del u, packed_u8
        return w_tg, sz
    except Exception as exc:  # noqa: BLE001
        print(f"    tinygemm unavailable: {type(exc).__name__}: {str(exc)[:100]}")
        return None


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t_start = time.time()
    budget = float(os.environ.get("BENCH_BUDGET_S", "120"))
    ms_list = [int(v) for v in os.environ.get("BENCH_M", "1,2,4,8,16").split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, SMs {props.multi_processor_count}; torch {torch.__version__}, triton {triton.__version__}")
    records, notes = [], []
    hdr = (f"{'shape':18s} {'N':>6s} {'K':>6s} {'M':>3s} | {'ours us':>8s} {'GB/s':>6s} {'%pk':>5s} {'cfg':28s} "
           f"{'err':>8s} | {'bf16 us':>8s} {'GB/s':>6s} | {'tg us':>8s} {'GB/s':>6s} {'tg err':>8s}")

    def run_shape(name, n, k, bits, group):
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        lin = Int4Linear.from_float(w, 128, True) if bits == 4 else Int8Linear.from_float(w, group)
        pw = lin.packed()
        qbytes = pw.nbytes()
        rows = torch.cat([torch.randperm(n, device=dev)[:2048], torch.tensor([0, n - 1], device=dev)])
        w_rows = pw.dequantize(torch.float32, rows=rows)
        tg = _tinygemm_setup(lin, n, k) if bits == 4 else None
        out = torch.empty(max(ms_list), n, dtype=torch.bfloat16, device=dev)
        print(f"\n[{name}] N={n} K={k} int{bits} g{group}: quantized weight {qbytes / 1e6:.1f} MB")
        for m in ms_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t0 = time.time()
            tuned = time.time() - t_start < budget
            if tuned:
                cfg = wq.tune(x, pw, rep_ms=10.0, verbose=True)
            else:
                cfg = wq.default_config(m, n, k, bits, group, props.multi_processor_count)
                notes.append(f"{name} M={m}: not tuned (time budget)")
            t_tune = time.time() - t0
            y = wq.wq_matmul(x, pw, cfg, out=out[:m])
            ref = x.float() @ w_rows.t()
            err = float((y[:, rows].float() - ref).abs().max())
            rel = err / max(float(ref.abs().max()), 1e-9)
            t_ours = _bench(lambda: wq.wq_matmul(x, pw, cfg, out=out[:m]))
            t_bf16 = _bench(lambda: F.linear(x, w))
            t_tg, tg_rel = None, None
            if tg is not None:
                try:
                    ytg = torch._weight_int4pack_mm(x, tg[0], 128, tg[1])
                    tg_rel = float((ytg[:, rows].float() - ref).abs().max()) / max(float(ref.abs().max()), 1e-9)
                    t_tg = _bench(lambda: torch._weight_int4pack_mm(x, tg[0], 128, tg[1]))
                except Exception as exc:  # noqa: BLE001
                    notes.append(f"{name} M={m}: tinygemm failed: {type(exc).__name__}: {str(exc)[:80]}")
                    tg = None
            gbs = qbytes / (t_ours * 1e-3) / 1e9
            gbs_bf16 = n * k * 2 / (t_bf16 * 1e-3) / 1e9
            gbs_tg = None if t_tg is None else qbytes / (t_tg * 1e-3) / 1e9
            rec = dict(shape=name, n=n, k=k, m=m, bits=bits, group=group, weight_bytes=qbytes,
                       ours_us=t_ours * 1e3, ours_gbs=gbs, ours_pct_peak=100 * gbs / PEAK_GBS, config=cfg.__dict__,
                       tuned=tuned, tune_s=t_tune, max_abs_err=err, rel_err=rel,
                       bf16_us=t_bf16 * 1e3, bf16_gbs=gbs_bf16,
                       tinygemm_us=None if t_tg is None else t_tg * 1e3, tinygemm_gbs=gbs_tg, tinygemm_rel_err=tg_rel)
            records.append(rec)
            c = f"{cfg.kind} m{cfg.block_m} n{cfg.block_n} w{cfg.words} s{cfg.split_k} nw{cfg.num_warps}{'' if cfg.asm else ' noasm'}"
            tg_s = (f"{t_tg * 1e3:8.1f} {gbs_tg:6.0f} {tg_rel:8.1e}" if t_tg is not None else f"{'-':>8s} {'-':>6s} {'-':>8s}")
            print(hdr)
            print(f"{name[:18]:18s} {n:6d} {k:6d} {m:3d} | {t_ours * 1e3:8.1f} {gbs:6.0f} {100 * gbs / PEAK_GBS:5.1f} "
                  f"{c:28s} {rel:8.1e} | {t_bf16 * 1e3:8.1f} {gbs_bf16:6.0f} | {tg_s}   (tune {t_tune:.1f}s)")
        del w, lin, pw, w_rows, tg
        torch.cuda.empty_cache()

    for name, n, k in SHAPES:
        run_shape(name, n, k, 4, 128)
    for name, n, k in INT8_SHAPES:
        ms_saved = ms_list
        ms_list = [m for m in (1, 16) if m in ms_saved] or [1]
        run_shape(name + " i8", n, k, 8, 32)
        ms_list = ms_saved

    # odd row counts (bucketed configs) and CUDA-graph capture of a split-K launch
    checks = []
    n, k = 5120, 17408
    lin = Int4Linear.from_float((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    pw = lin.packed()
    wdeq = pw.dequantize(torch.float32)
    for m in (3, 5, 12):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = lin(x)
        ref = x.float() @ wdeq.t()
        checks.append(dict(check=f"odd M={m}", rel_err=float((y.float() - ref).abs().max() / ref.abs().max())))
    try:
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y0 = lin(x).clone()  # tunes / compiles outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            lin(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = lin(x)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        checks.append(dict(check="cuda graph replay (split-K, M=1)", identical=bool(torch.equal(yg, y0))))
    except Exception as exc:  # noqa: BLE001
        checks.append(dict(check="cuda graph replay", error=f"{type(exc).__name__}: {exc}"[:200]))
    print("\nchecks:", json.dumps(checks, indent=1))

    print("\nsummary (int4, % of 3990 GB/s):")
    for m in ms_list:
        rs = [r for r in records if r["m"] == m and r["bits"] == 4]
        if rs:
            pcts = ", ".join(f"{r['shape'].split()[0]} {r['ours_pct_peak']:.0f}" for r in rs)
            print(f"  M={m:2d}: min {min(r['ours_pct_peak'] for r in rs):5.1f}%  [{pcts}]")
    total = time.time() - t_start
    print(f"total time {total:.1f}s; notes: {notes}")
    result = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(), peak_gbs=PEAK_GBS,
                  records=records, checks=checks, tuned_configs=wq.tuned_configs(), notes=notes, total_s=total)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "quant_kernels.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {Path(out_dir) / 'quant_kernels.json'}")


if __name__ == "__main__":
    main()
