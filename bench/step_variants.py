"""The graphed plain decode step of a synthetic Qwen3.5-27B (or, with --rows T, its graphed pass of T tokens, committed
whole) under variants of the kernels' constants, each against the default in the same process. Isolated launches can
mislead: the K split that made FP8's down and o projections 1-1.5 us faster alone made the step 0.2-0.3 ms slower. So
a candidate is timed where it runs, alternated with the default (default, variant, default, variant: one capture of
the same step times differently from the next by up to ~0.35 ms, more than some of the differences).

For each variant: the step's median ms over REPS replays for each of the two captures of each, the mean difference
against the default's adjacent captures, and the share of the weight-bandwidth roofline. The variants patch module
constants (the DeltaNet mixer's value slice and warps), wrap `default_config` (the W4A16 / W8A16 table, e.g. the
warp-specialized Gluon kernel on INT4 projections of 1..8 rows, or not, and of 9..16), replace the kernel settings
(PDL level, L2 prefetch) for their capture, or replace every W4A16 / W8A16 launch by a kernel that only reads its
weight bytes ("projections read only": the ceiling of any kernel that keeps one launch per projection; the reader's
time alone per launch is printed first) or by nothing ("projections skipped": the rest of the step), or leave the
DeltaNet mixers' or the attention's kernels out of the capture ("... skipped": what a kernel streaming the weights
under them could save at most); every patch is undone before the next.

Usage (GPU, from bench/; ~20 s per variant on an H200, after building): python step_variants.py --quant fp8
  [--vocab-quant int8] [--variants NAME,...] [--rows T]; JSON to $OUT/step_variants.json.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import types
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace

import profile_cycle  # bench/profile_cycle.py, beside this script: the synthetic engine
import torch
import triton
import triton.language as tl
from timing import event_ms, replay_ms
from warp_specialized import LEAN_16, WHOLE_SM, footprint  # bench/warp_specialized.py, beside this script

from blockspec.bench import bytes_per_plain_step, measure_read_bandwidth
from blockspec.engine.decode import prefill
from blockspec.engine.state import DecodeState
from blockspec.config import MAX_PASS_TOKENS
from blockspec.engine.target import GraphedTarget
from blockspec.kernels import gdn_triton, use
from blockspec.layers import attention as attention_layer
from blockspec.kernels import quant_matmul_triton as wq

REPS = 50


@contextmanager
def patched(module, **values):
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


@contextmanager
def together(*contexts):
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def configs(change, where):
    """default_config with `change` (KernelConfig fields) applied where where(m, n, k, bits) holds."""
    table = wq.default_config

    def wrapped(m, n, k, bits=4, group_size=128):
        cfg = table(m, n, k, bits, group_size)
        return replace(cfg, **change) if where(m, n, k, bits) else cfg
    return patched(wq, default_config=wrapped)


def rows_as(rows, where):
    """default_config's config for `rows` rows where where(m, n, k, bits) holds (a launch of fewer rows in a taller
    x tile)."""
    table = wq.default_config

    def wrapped(m, n, k, bits=4, group_size=128):
        return table(rows if where(m, n, k, bits) else m, n, k, bits, group_size)
    return patched(wq, default_config=wrapped)


def narrow(m, n, k, bits):
    return m <= 8 and n < 64 * 132


def wide(m, n, k, bits):
    return m <= 8 and n >= 64 * 132


def int4_gate_up(m, n, k, bits):
    return m <= 8 and bits == 4 and n * k > wq.GATE_UP_WEIGHTS


def int4_layers(m, n, k, bits):
    return m <= 8 and bits == 4 and n < wq.VOCABULARY_OUTPUTS


def fp8_layers(m, n, k, bits):
    return m <= 8 and bits == 8 and n < wq.VOCABULARY_OUTPUTS


def int4_out_projections(m, n, k, bits):
    """The o / DeltaNet out projections (6144 inputs: 24 heads of 256 or 48 of 128), each after a mixer or
    attention."""
    return m <= 8 and bits == 4 and k == 6144


def int4_layers_16(m, n, k, bits):
    return 8 < m <= 16 and bits == 4 and n < wq.VOCABULARY_OUTPUTS


VARIANTS = {
    "mixer BV 32": lambda s: patched(gdn_triton, BLOCK_V=32),
    "mixer BV 32 2 warps": lambda s: patched(gdn_triton, BLOCK_V=32, NUM_WARPS=2),
    "mixer BV 8": lambda s: patched(gdn_triton, BLOCK_V=8),
    "mixer 2 warps": lambda s: patched(gdn_triton, NUM_WARPS=2),
    "narrow outputs ~2 waves": lambda s: configs({"waves": 2}, narrow),
    "narrow outputs ~8 waves": lambda s: configs({"waves": 8}, narrow),
    "narrow outputs 2 stages": lambda s: configs({"stages": 2}, narrow),
    "wide outputs 2 stages": lambda s: configs({"stages": 2}, wide),
    "wide outputs 4 stages": lambda s: configs({"stages": 4}, wide),
    "no balancing": lambda s: configs({"balance": False}, wide),
    "narrow outputs n32 w2": lambda s: configs({"block_n": 32, "warps": 2}, narrow),
    "wide outputs n32 w2": lambda s: configs({"block_n": 32, "warps": 2}, wide),
    # one program per SM on the wide outputs (its warps in step through the pipeline's barriers) instead of 4-5
    "wide outputs n128 w8 s6": lambda s: configs({"block_n": 128, "warps": 8, "stages": 6}, wide),
    # the warp-specialized Gluon kernel at 1..8 rows (x blocks of 8; Hopper, INT4), by default on every layer
    # projection in its lean footprint: off (the Triton kernel), on gate_up with 3 consumer warpgroups instead (11 %
    # faster alone at one row on an H100), or everywhere in the footprint of 17..32 rows (a whole SM a program)
    "Triton kernel at 1..8 rows": lambda s: configs({"warp_specialized": 0}, int4_layers),
    "gate_up 3 consumers": lambda s: configs({"warp_specialized": 3}, int4_gate_up),
    "projections warp-specialized whole SM": lambda s: together(configs({"warp_specialized": 2}, int4_layers),
                                                                footprint({8: WHOLE_SM})),
    # FP8 targets (--quant fp8), whose layer projections of 1..8 rows take the same kernel's lean program under PDL
    # 3 by default: the Triton kernel there instead, under PDL 3 or without PDL
    "FP8 projections Triton kernel": lambda s: configs({"warp_specialized": 0}, fp8_layers),
    "FP8 projections Triton kernel PDL 0": lambda s: together(configs({"warp_specialized": 0}, fp8_layers),
                                                              use(replace(s, pdl_level=0))),
    # at 9..16 rows (--rows 16: a tree of 15's pass), the same kernel with x blocks of 16 rows on every INT4 layer
    # projection, in a whole SM a program or in warp_specialized.py's candidate lean footprint (LEAN_16)
    "warp-specialized at 9..16 rows": lambda s: configs({"warp_specialized": 2, "block_m": 16}, int4_layers_16),
    "warp-specialized lean at 9..16 rows": lambda s: together(
        configs({"warp_specialized": 2, "block_m": 16}, int4_layers_16), footprint({16: LEAN_16})),
    "warp-specialized at 9..16 rows overlapped dots": lambda s: configs(
        {"warp_specialized": 2, "block_m": 16, "overlap_dots": True}, int4_layers_16),
    "warp-specialized lean at 9..16 rows overlapped dots": lambda s: together(
        configs({"warp_specialized": 2, "block_m": 16, "overlap_dots": True}, int4_layers_16),
        footprint({16: LEAN_16})),
    # or the 17..32-row configs (the warp-specialized kernel's 32-row x blocks on most layer projections)
    "17..32-row configs at 9..16 rows": lambda s: rows_as(32, int4_layers_16),
    # the warp-specialized loader fetching the 2, 4 or 8 units after its ring's first stages into L2 before its PDL
    # wait (`KernelConfig.l2_ahead`; 32 KB a unit with 2 consumers, each tile row's span of them by one bulk
    # prefetch): the weight stream goes on while the kernel before runs (each launch of the INT4 step waits 4-13 us
    # there with its ring's stages loaded; one prefetch a row and unit measured slower, docs/benchmarks.md)
    "loader L2 prefetch 2 units": lambda s: configs({"l2_ahead": 2}, int4_layers),
    "loader L2 prefetch 4 units": lambda s: configs({"l2_ahead": 4}, int4_layers),
    "loader L2 prefetch 8 units": lambda s: configs({"l2_ahead": 8}, int4_layers),
    # only the out projections', whose programs wait ~13 us for a mixer or attention with 3 of their 4 units in
    # the ring: the 4th in L2 before the wait (a probe of one launch after 20 us of idling: 9.8 -> 8.1 us)
    "out projections L2 prefetch 1 unit": lambda s: configs({"l2_ahead": 1}, int4_out_projections),
    # the warp-specialized kernel's consumers issuing each group's wgmma asynchronously (in halves of a group's K)
    # and unpacking the next piece's codes while it runs (`KernelConfig.overlap_dots`), every launch it serves: a
    # consumer's unit of synchronous dots measured ~1.1 us on an H100, above the H200's bandwidth share (0.88 us)
    "overlapped dots": lambda s: configs({"overlap_dots": True}, lambda m, n, k, bits: True),
    # an INT4 target's folded MLP (gate_up, SwiGLU, down) in one warp-specialized launch at 1..8 rows
    "persistent MLP": lambda s: use(replace(s, persistent_mlp=True)),
    "PDL level 0": lambda s: use(replace(s, pdl_level=0)),
    "PDL level 1": lambda s: use(replace(s, pdl_level=1)),
    "PDL level 2": lambda s: use(replace(s, pdl_level=2)),
    "PDL level 3": lambda s: use(replace(s, pdl_level=3)),
    "PDL level 3 prefetch 0 MB": lambda s: use(replace(s, pdl_level=3, pdl_prefetch_mb=0.0)),
    "PDL level 3 prefetch 16 MB": lambda s: use(replace(s, pdl_level=3, pdl_prefetch_mb=16.0)),
    # the ceiling of one launch per projection: each W4A16 / W8A16 launch only reads its weight bytes, or is skipped
    "projections read only": lambda s: patched(wq, _launch=read_only_launch),
    "projections skipped": lambda s: patched(wq, _launch=lambda *args, **kwargs: None),
    # what a kernel that streams the weights under the small kernels could take away at most: the DeltaNet mixers'
    # launches (conv, recurrence, output norm) skipped, the attention's (inputs, split-KV and merge) skipped, and
    # both with every projection read only (the stream and its launches' boundaries alone)
    "DeltaNet mixers skipped": lambda s: patched(gdn_triton, _launch=lambda *args, **kwargs: None),
    "attention skipped": lambda s: attention_skipped(),
    "read only without mixers or attention": lambda s: together(
        patched(wq, _launch=read_only_launch), patched(gdn_triton, _launch=lambda *args, **kwargs: None),
        attention_skipped()),
}


def attention_skipped():
    """The attention layers' kernels left out of the capture: their output is the query, unnormed (timing only)."""
    return patched(attention_layer, prepare_attention_inputs=lambda query, *args: query,
                   cached_attention=lambda q, *args: q)


READ_BLOCK, READ_WARPS, READ_PROGRAMS_PER_SM = 2048, 16, 4  # 16-byte loads by 512 threads, 4 programs per SM


def read_only_launch(x2, pw, cfg, out, epilogue=None):
    """Stands in for `quant_matmul_triton._launch`: reads the launch's codes and scales (zero points) and writes
    nothing, so its outputs stay as they were; the step's timing, not its tokens, is what such a capture is for."""
    spans = []
    for t in (pw.q, pw.s, pw.s[:0] if pw.z is None else pw.z):
        words = t.reshape(-1).view(torch.int32)
        spans += [words, words.numel()]
    _read_kernel[(READ_PROGRAMS_PER_SM * wq.sm_count(x2.device),)](
        *spans, _sink(x2.device), BLOCK=READ_BLOCK, num_warps=READ_WARPS, num_stages=4)


def read_only_alone(bandwidth: float) -> dict:
    """The stand-in reader's time per launch alone (graphed, back to back over distinct buffers) for weights of
    16 MB to 4 GB, against the bytes at the step's read bandwidth: its fixed cost per launch."""
    rows = {}
    for mb in (16, 31, 46, 89, 178, 4096):
        weights = [types.SimpleNamespace(q=torch.ones(mb << 19, dtype=torch.int16, device="cuda"),
                                         s=torch.ones(mb << 13, device="cuda"), z=None)
                   for _ in range(max(1, 400 // mb))]
        x = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)

        def read_all():
            for w in weights:
                read_only_launch(x, w, None, None)
        us = replay_ms(read_all) * 1e3 / len(weights)
        at_bandwidth = (mb << 20) * (1 + 1 / 32) / (bandwidth * 1e3)  # codes + scales, us
        rows[f"{mb} MB"] = {"us": round(us, 2), "over_bandwidth_us": round(us - at_bandwidth, 2)}
        print(f"read only, {mb:5d} MB alone: {us:8.2f} us per launch, {us - at_bandwidth:+.2f} us against the "
              "read bandwidth", flush=True)
    return rows


@functools.cache
def _sink(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


@triton.jit
def _xor_span(ptr, n, BLOCK: tl.constexpr):
    """XOR of this program's share of ptr[0:n] (int32 words), read in contiguous BLOCK-word steps."""
    per = tl.cdiv(tl.cdiv(n, BLOCK), tl.num_programs(0)) * BLOCK
    start = tl.program_id(0) * per
    end = tl.minimum(start + per, n)
    acc = tl.zeros([BLOCK], tl.int32)
    for off in tl.range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + idx, mask=idx < end, other=0, cache_modifier=".cg")
    return acc


@triton.jit
def _read_kernel(a, na, b, nb, c, nc, sink, BLOCK: tl.constexpr):
    acc = _xor_span(a, na, BLOCK) ^ _xor_span(b, nb, BLOCK) ^ _xor_span(c, nc, BLOCK)
    total = tl.reduce(acc, 0, _xor)
    if total == 0x1E3779B9:  # practically never: keeps the loads
        tl.store(sink, total)


@triton.jit
def _xor(a, b):
    return a ^ b


def chosen(names: str | None) -> list[str]:
    """The variants named in a comma-separated list (all for None); an unknown name stops the bench in one line
    (exit code 2)."""
    if names is None:
        return list(VARIANTS)
    picked = [name for name in names.split(",") if name]
    unknown = [name for name in picked if name not in VARIANTS]
    if unknown:
        print(f"unknown variant {unknown[0]!r}; the variants: {', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    return picked


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="fp8", help="target_quantization: int4 | fp8")
    ap.add_argument("--vocab-quant", default="none")
    ap.add_argument("--variants", help="comma-separated names (default: all)")
    ap.add_argument("--rows", type=int, default=1, help="tokens a pass (1: the plain step; 8: a chain's "
                    "verification; 16: a tree of 15's rows), each committed whole")
    args = ap.parse_args()
    if not 1 <= args.rows <= MAX_PASS_TOKENS:
        print(f"--rows {args.rows}: between 1 and {MAX_PASS_TOKENS}", file=sys.stderr)
        sys.exit(2)
    names = chosen(args.variants)  # before any long work
    bandwidth = measure_read_bandwidth(torch.device("cuda"))
    engine = profile_cycle.build_engine("none", profile_cycle.arguments().parse_args(
        ["--quant", args.quant, "--vocab-quant", args.vocab_quant]))
    prompt = torch.randint(0, engine.model.config.vocab_size, (profile_cycle.PROMPT_TOKENS,), device="cuda")
    roofline_ms = bytes_per_plain_step(engine) / (bandwidth * 1e9) * 1e3
    # plain decoding's state writes passes in place, which only one-token passes allow: a pass of more rows gets a
    # state of its own, as a speculative engine's
    state = engine.state if args.rows == 1 else DecodeState(engine.model, engine.state.capacity, args.rows, "cuda",
                                                            engine.model.embed_tokens.weight.dtype)

    def step_ms(variant):
        with use(engine.kernels), variant(engine.kernels):
            target = GraphedTarget(engine.model, state, (), lengths=(args.rows,))
        state.reset()
        prefill(target, prompt, 0, len(prompt), engine.proposer)

        def step():
            target.verify([0] * args.rows)
            state.commit(args.rows)
        return event_ms(step, reps=REPS)

    results = {"bandwidth_gb_s": round(bandwidth), "quant": args.quant, "rows": args.rows,
               "roofline_ms": round(roofline_ms, 3)}
    if "projections read only" in names:
        results["read_only_alone"] = read_only_alone(bandwidth)
    for name in names:
        runs = [step_ms(VARIANTS[name] if i % 2 else lambda s: nullcontext()) for i in range(4)]
        base, var = runs[0::2], runs[1::2]
        delta = statistics.mean(v - b for v, b in zip(var, base))
        results[name] = {"default_ms": [round(x, 4) for x in base], "variant_ms": [round(x, 4) for x in var],
                         "difference_ms": round(delta, 4),
                         "roofline_pct": round(100 * roofline_ms / statistics.mean(var), 1)}
        print(f"{name:26s} default {base[0]:.3f} / {base[1]:.3f}  variant {var[0]:.3f} / {var[1]:.3f} ms  "
              f"difference {delta:+.3f} ms", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "step_variants.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
