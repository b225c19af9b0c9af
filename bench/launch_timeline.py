"""Where a W4A16 / W8A16 launch's time goes inside the graphed plain decode step of a synthetic Qwen3.5-27B: every
projection launch of the step is captured with a stamped variant of the kernel the engine launches there (defined
here: `launch_timeline`): the Triton kernel's `main_loop` and `finish` with clock reads around them, or the
warp-specialized Gluon kernel's loader and consumers (quant_matmul_gluon) with its first consumer's clock reads
around its wait for the previous kernel and its units. Each records, per program, its start, the end of its wait for
the previous kernel (under PDL; the Triton kernel waits inside its main loop, so there: its start) and its end on the
GPU's global timer, and its start, wait's end, main loop's end and end on its SM's clock. From those, per launch: its
span (first program's start to last program's end) against its bytes at the read bandwidth, the gap since the
previous projection's end (the mixer, attention and small kernels run there), how long the programs take to start
and wait, each program's main loop after its wait and its epilogue (the loops of the first and the last fifth of the
programs in launch order apart), and the tail (last end minus the median end), the SMs used and the most programs
one of them held (the GPU places a launch's programs breadth-first; with PDL, onto the SMs the previous launch frees
first). Averaged per projection shape.

Usage (GPU, from bench/; ~2 minutes on an H200): python launch_timeline.py --quant fp8 [--pdl-levels 0,3]
  [--variants NAME,...] (bench/step_variants.py's, at the engine's PDL level)
JSON to $OUT/launch_timeline.json, each launch's stamps [programs, TRACE_COLUMNS] and shape to
$OUT/launch_timeline_raw.pt.
"""

import argparse
import json
import os
import statistics
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import profile_cycle  # bench/profile_cycle.py, beside this script: the synthetic engine
import step_variants  # bench/step_variants.py: the variants of the kernels' constants
import torch
import triton
import triton.language as tl

from blockspec.bench import measure_read_bandwidth
from blockspec.engine.decode import prefill
from blockspec.engine.target import GraphedTarget
from blockspec.kernels import launch_fitting, pdl, sm_count, use
from blockspec.kernels import quant_matmul_gluon as gk
from blockspec.kernels import quant_matmul_triton as wq

TRACE_COLUMNS = 8  # global start, end; SM clock start, main loop's end, end; SM id; global and SM clock wait's end


@triton.jit
def _stamp(after, GLOBAL: tl.constexpr):
    """A time read once `after` (an int32 scalar) is computed: %globaltimer (ns, one clock for every SM) or %clock64
    (this SM's cycles)."""
    if GLOBAL:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [after], dtype=tl.int64,
                                         is_pure=False, pack=1)
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,r", [after], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit(do_not_specialize=["M", "WHOLE", "REST", "BPS", "SPLIT"])
def _stamped_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, KH, NBLK, WHOLE, REST, BPS, SPLIT,
                    stride_xm, stride_om, res_ptr, nw_ptr, rows_ptr, part_ptr, PARTS, eps, trace_ptr,
                    BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    STAGES: tl.constexpr, HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
                    F32DOT: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr,
                    U2: tl.constexpr, U3: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                    EPI: tl.constexpr, RMS: tl.constexpr, PBLOCK: tl.constexpr, E4M3: tl.constexpr,
                    HALVES: tl.constexpr, WIDE: tl.constexpr):
    """quant_matmul_triton's `_wq_kernel` (its `main_loop`, then its `finish`, the same arguments), and the program's
    row of trace_ptr [programs, TRACE_COLUMNS] int64 (its wait for the previous kernel is inside the main loop: the
    wait's end stamps are its start's)."""
    pid = tl.program_id(0)
    t_start = _stamp(pid, True)
    c_start = _stamp(pid, False)
    acc, sums = wq.main_loop(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, M, N, K, KH, NBLK, WHOLE, REST, BPS, SPLIT, PARTS,
                             stride_xm, BITS, G, BN, BM, STAGES, HAS_ZP, EVEN_K, USE_ASM, F32DOT, U0, U1, U2, U3,
                             PREFETCH, PDL, EPI, RMS, PBLOCK, E4M3, HALVES, WIDE)
    c_loop = _stamp(tl.sum(tl.sum(acc, 1), 0).to(tl.int32, bitcast=True), False)
    total = wq.finish(acc, sums, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, M, N, K, WHOLE, REST,
                      SPLIT, stride_om, eps, BN, BM, PDL, EPI, RMS)
    after = tl.sum(tl.sum(total, 1), 0).to(tl.int32, bitcast=True)
    _store_trace(trace_ptr + pid.to(tl.int64) * 8, t_start, _stamp(after, True), c_start, c_loop,
                 _stamp(after, False), t_start, c_start)


@triton.jit
def _store_trace(row, t_start, t_end, c_start, c_loop, c_end, t_wait, c_wait):
    """A program's row of the trace (TRACE_COLUMNS), its SM read here."""
    tl.store(row, t_start)
    tl.store(row + 1, t_end)
    tl.store(row + 2, c_start)
    tl.store(row + 3, c_loop)
    tl.store(row + 4, c_end)
    tl.store(row + 5, tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False,
                                                pack=1).to(tl.int64))
    tl.store(row + 6, t_wait)
    tl.store(row + 7, c_wait)


if gk.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _stamped_consume(c: gl.constexpr, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr,
                         ring_q, ring_x, scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps,
                         trace_ptr, NBLK: gl.constexpr, C: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr,
                         RMS: gl.constexpr, PBLOCK: gl.constexpr, BM: gl.constexpr, PDL: gl.constexpr,
                         GROUPS: gl.constexpr, BOXES: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr,
                         U2: gl.constexpr, U3: gl.constexpr, OVERLAP: gl.constexpr):
        """quant_matmul_gluon's `_consume` (its scales, wait, 1 / rms and units), consumer 0 stamping its program's
        row of trace_ptr around the wait and the units."""
        pid = gl.program_id(0)
        t_start = _stamp(pid, True)
        c_start = _stamp(pid, False)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        rows = gl.arange(0, gk._BN, layout=gl.SliceLayout(1, mma))
        nx = gk._scales(s_ptr, start, count > 0, N, rows, NBLK, C, c, EPI, GROUPS, BOXES)
        pdl.wait(PDL)
        t_wait = _stamp(pid, True)
        c_wait = _stamp(pid, False)
        inv_rms = gk._inv_rms(part_ptr, M, K, PARTS, eps, RMS, PBLOCK, BM)
        gk._units(c, 0, nx, inv_rms, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q,
                  ring_x, scratch, ready, empty, start, count, M, N, PER, stride_om, NBLK, C, S, EPI, RMS, BM,
                  GROUPS, BOXES, U0, U1, U2, U3, OVERLAP)
        c_loop = _stamp(pid, False)
        pdl.release(PDL)
        if c == 0:
            _store_trace(trace_ptr + pid.to(gl.int64) * 8, t_start, _stamp(pid, True), c_start, c_loop,
                         _stamp(pid, False), t_wait, c_wait)

    @gluon.jit
    def _stamped_ws_kernel(q_desc, x_desc, q_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr,
                           part_ptr, M, N, UNITS, PER, PARTS, stride_om, eps, trace_ptr, K: gl.constexpr,
                           C: gl.constexpr, BM: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr, RMS: gl.constexpr,
                           PBLOCK: gl.constexpr, PDL: gl.constexpr, CREGS: gl.constexpr, LREGS: gl.constexpr,
                           GROUPS: gl.constexpr, BOXES: gl.constexpr, L2AHEAD: gl.constexpr, U0: gl.constexpr,
                           U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr, OVERLAP: gl.constexpr,
                           num_warps: gl.constexpr):
        """quant_matmul_gluon's `_ws_kernel` with 2 consumers (the engine's), its consumers `_stamped_consume`."""
        NBLK: gl.constexpr = K // (gk._G * GROUPS)
        ring_q, ring_x, scratch, ready, empty = gk._ring(x_desc, C, S, C if EPI == 2 else 1, BM, GROUPS, BOXES)
        start = gl.program_id(0) * PER
        count = gl.maximum(gl.minimum(UNITS - start, PER), 0)
        gl.warp_specialize([
            (_stamped_consume, (0, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q,
                                ring_x, scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps,
                                trace_ptr, NBLK, C, S, EPI, RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3,
                                OVERLAP)),
            (_stamped_consume, (1, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q,
                                ring_x, scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps,
                                trace_ptr, NBLK, C, S, EPI, RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3,
                                OVERLAP)),
            (gk._loader, (q_desc, x_desc, q_ptr, ring_q, ring_x, ready, empty, start, count, N, K, NBLK, C, S, EPI,
                          BM, PDL, GROUPS, BOXES, L2AHEAD))],
            [4, 1], [CREGS, LREGS])


class _TracedLaunch:
    """Stands in for `quant_matmul_gluon._ws_kernel`: its launches run `_stamped_ws_kernel` with `trace`."""

    def __init__(self, trace: torch.Tensor):
        self.trace = trace

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if meta["C"] != 2:
                raise ValueError(f"the stamped warp-specialized kernel runs 2 consumers, this launch {meta['C']}")
            return _stamped_ws_kernel[grid](*args, self.trace, **meta)
        return launch


@contextmanager
def launch_timeline():
    """Within the block, each W4A16 / W8A16 launch captured into a CUDA graph runs `_stamped_kernel` or, where the
    config takes the warp-specialized kernel, `_stamped_ws_kernel` instead of the production kernel, with a new int64
    [programs, TRACE_COLUMNS] buffer for its stamps (launches outside a capture run as they are): yields the list
    of {"trace", "n", "k", "bytes", "rows", "epilogue", "rms", "schedule", "config"} (epilogue, rms: the launch's
    `Epilogue` kind and rms), one per stamped launch in launch order, whose buffers hold the latest replay's
    stamps."""
    launches, production = [], wq._launch

    def stamped(x2, pw, cfg, out, epilogue=None):
        if not (x2.is_cuda and torch.cuda.is_current_stream_capturing()):
            return production(x2, pw, cfg, out, epilogue)
        epi = epilogue or wq.Epilogue()
        entry = {"n": pw.n, "k": pw.k, "bytes": pw.nbytes(), "rows": x2.shape[0], "epilogue": epi.kind,
                 "rms": epi.rms, "config": cfg.short()}
        if wq.warp_specialized(x2, pw, cfg):
            sms = sm_count(x2.device)
            trace = torch.empty(sms, TRACE_COLUMNS, dtype=torch.int64, device=x2.device)  # no memset node
            launches.append(entry | {"trace": trace, "schedule": ["warp-specialized", sms, cfg.block_m]})
            with step_variants.patched(gk, _ws_kernel=_TracedLaunch(trace)):
                if not gk.launch(x2, pw, out, epi, cfg.warp_specialized, cfg.block_m, cfg.l2_ahead, cfg.overlap_dots):
                    raise RuntimeError("the stamped warp-specialized kernel did not build")
            return
        plan = wq.launch_plan(x2, pw, cfg, out, epilogue)
        trace = torch.empty(plan.programs, TRACE_COLUMNS, dtype=torch.int64, device=x2.device)
        launches.append(entry | {"trace": trace, "schedule": plan.schedule})
        launch_fitting(_stamped_kernel, (plan.programs,), *plan.args, trace, stages_key="STAGES", **plan.meta)

    with step_variants.patched(wq, _launch=stamped):
        yield launches


EPILOGUES = {0: "store", 1: "add+norm", 2: "swiglu"}  # Epilogue.kind; with rms: "rms" before it (a store: "rms")


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def launch_stats(stamps, bytes_read, bandwidth, cycles_per_ns):
    """One launch's figures (us) from its [programs, TRACE_COLUMNS] stamps (ns on the global timer, cycles on the
    SMs')."""
    t_start, t_end = stamps[:, 0].tolist(), stamps[:, 1].tolist()
    wait = ((stamps[:, 6] - stamps[:, 0]).double() / 1e3).tolist()
    loop = ((stamps[:, 3] - stamps[:, 7]).double() / cycles_per_ns / 1e3).tolist()
    epilogue = ((stamps[:, 4] - stamps[:, 3]).double() / cycles_per_ns / 1e3).tolist()
    first, last = min(t_start), max(t_end)
    fifth = max(1, len(loop) // 5)  # programs in launch order: the GPU places the later ones on SMs already busy
    per_sm, held = defaultdict(float), defaultdict(int)
    for sm, end in zip(stamps[:, 5].tolist(), t_end):
        per_sm[sm] = max(per_sm[sm], end)
        held[sm] += 1
    return {"programs": len(t_start), "first_ns": first, "last_ns": last,
            "span_us": (last - first) / 1e3, "ideal_us": bytes_read / bandwidth / 1e3,
            "start_spread_us": (quantile(t_start, 0.9) - first) / 1e3, "wait_p50_us": quantile(wait, 0.5),
            "loop_p50_us": quantile(loop, 0.5), "loop_max_us": max(loop),
            "loop_first_fifth_us": statistics.mean(loop[:fifth]), "loop_last_fifth_us": statistics.mean(loop[-fifth:]),
            "epilogue_p50_us": quantile(epilogue, 0.5), "epilogue_max_us": max(epilogue),
            "tail_us": (last - quantile(t_end, 0.5)) / 1e3,
            "sm_idle_at_end_us": statistics.mean(last - e for e in per_sm.values()) / 1e3,
            "sms_used": len(held), "most_programs_on_an_sm": max(held.values())}


def timeline(engine, settings, variant, prompt, bandwidth):
    with use(settings), variant(settings), launch_timeline() as launches:
        target = GraphedTarget(engine.model, engine.state, (), lengths=(1,))
    engine.state.reset()
    prefill(target, prompt, 0, len(prompt), engine.proposer)
    for _ in range(5):
        target.verify([0])
        engine.state.commit(1)
    torch.cuda.synchronize()
    stamps = [entry["trace"].cpu() for entry in launches]
    durations = torch.cat([(s[:, 1] - s[:, 0]) for s in stamps]).double()
    cycles = torch.cat([(s[:, 4] - s[:, 2]) for s in stamps]).double()
    long = durations > 5000
    cycles_per_ns = float((cycles[long] / durations[long]).median())
    ticks = torch.cat([s[:, :2].flatten() for s in stamps]).unique().diff()
    rows, previous_end = [], None
    for entry, s in zip(launches, stamps):
        row = launch_stats(s, entry["bytes"], bandwidth, cycles_per_ns)
        row["gap_us"] = None if previous_end is None else (row["first_ns"] - previous_end) / 1e3
        previous_end = row["last_ns"]
        epilogue = EPILOGUES[entry["epilogue"]]
        if entry["rms"]:
            epilogue = "rms" if entry["epilogue"] == 0 else f"rms+{epilogue}"
        row["shape"] = f"{entry['n']}x{entry['k']} {epilogue}"
        row["schedule"], row["config"] = entry["schedule"], entry["config"]
        rows.append(row)
    step_us = (rows[-1]["last_ns"] - rows[0]["first_ns"]) / 1e3
    by_shape = defaultdict(list)
    for row in rows:
        by_shape[row["shape"]].append(row)
    keys = ("span_us", "ideal_us", "gap_us", "start_spread_us", "wait_p50_us", "loop_p50_us", "loop_max_us",
            "loop_first_fifth_us", "loop_last_fifth_us", "epilogue_p50_us", "epilogue_max_us", "tail_us",
            "sm_idle_at_end_us", "sms_used", "most_programs_on_an_sm")
    shapes = {}
    for shape, group in by_shape.items():
        shapes[shape] = {"launches": len(group), "programs": group[0]["programs"], "schedule": group[0]["schedule"],
                         "config": group[0]["config"]}
        for k in keys:
            values = [g[k] for g in group if g[k] is not None]
            shapes[shape][k] = round(statistics.mean(values), 2) if values else None
    summary = {"launches": len(rows), "first_to_last_us": round(step_us, 1),
               "spans_us": round(sum(r["span_us"] for r in rows), 1),
               "ideal_us": round(sum(r["ideal_us"] for r in rows), 1),
               "gaps_us": round(sum(r["gap_us"] for r in rows[1:]), 1),
               "cycles_per_ns": round(cycles_per_ns, 4), "timer_tick_ns": int(ticks[ticks > 0].min()),
               "shapes": shapes}
    return summary, [dict((k, v) for k, v in entry.items() if k != "trace") | {"stamps": s}
                     for entry, s in zip(launches, stamps)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="fp8", help="target_quantization: int4 | fp8")
    ap.add_argument("--vocab-quant", default="none")
    ap.add_argument("--pdl-levels", default="0,3")
    ap.add_argument("--variants", default="", help="comma-separated names of bench/step_variants.py's variants, "
                    "each traced after the default")
    args = ap.parse_args()
    variants = step_variants.chosen(args.variants)  # before any long work
    levels = [int(v) for v in args.pdl_levels.split(",")]
    bandwidth = measure_read_bandwidth(torch.device("cuda"))
    engine = profile_cycle.build_engine("none", profile_cycle.arguments().parse_args(
        ["--quant", args.quant, "--vocab-quant", args.vocab_quant]))
    prompt = torch.randint(0, engine.model.config.vocab_size, (profile_cycle.PROMPT_TOKENS,), device="cuda")
    results, raw = {"bandwidth_gb_s": round(bandwidth), "quant": args.quant}, {}
    runs = [(f"PDL level {v}", v, lambda s: nullcontext()) for v in levels]
    runs += [(name, engine.kernels.pdl_level, step_variants.VARIANTS[name]) for name in variants]
    for label, level, variant in runs:
        summary, traced = timeline(engine, replace(engine.kernels, pdl_level=level), variant, prompt, bandwidth)
        results[label], raw[label] = summary, traced
        print(f"{label}: {summary['launches']} launches, first start to last end "
              f"{summary['first_to_last_us']} us; spans {summary['spans_us']} us (at the read bandwidth "
              f"{summary['ideal_us']} us), gaps {summary['gaps_us']} us; timer tick {summary['timer_tick_ns']} ns, "
              f"{summary['cycles_per_ns']} cycles/ns", flush=True)
        print(f"  {'shape':28s} {'n':>3s} {'progs':>5s} {'span':>6s} {'ideal':>6s} {'gap':>6s} {'start':>6s} "
              f"{'wait':>6s} {'loop50':>6s} {'loopmx':>6s} {'loop1':>6s} {'loop5':>6s} {'epi50':>6s} {'epimx':>6s} "
              f"{'tail':>6s} {'smidle':>6s} {'SMs':>6s} {'most':>6s}  schedule")
        for shape, s in summary["shapes"].items():
            print(f"  {shape:28s} {s['launches']:3d} {s['programs']:5d} " + " ".join(
                f"{s[k]:6.2f}" if s[k] is not None else "     -" for k in (
                    "span_us", "ideal_us", "gap_us", "start_spread_us", "wait_p50_us", "loop_p50_us", "loop_max_us",
                    "loop_first_fifth_us", "loop_last_fifth_us", "epilogue_p50_us", "epilogue_max_us", "tail_us",
                    "sm_idle_at_end_us", "sms_used", "most_programs_on_an_sm"))
                + f"  {tuple(s['schedule'])} {s['config']}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "launch_timeline.json"), "w") as f:
        json.dump(results, f, indent=2)
    torch.save(raw, os.path.join(out, "launch_timeline_raw.pt"))


if __name__ == "__main__":
    with torch.no_grad():
        main()
