"""Where a real pair's DFlash2 cycles go, chain against trees: tokens/s; each piece's host time per cycle, unprofiled
(its calls timed on the host over one generation of each prompt); then one profiled generation per budget with the
cycle's pieces marked (the proposal, the target's pass, the commit, the drafter's context append), per cycle
(medians over the profiled cycles): the wall time, each piece's host time, the time the GPU waited for each piece's
launches, the CUDA runtime calls, the kernels' count and busy time, and each kernel name's time against the first
budget's.

The engines of all budgets are loaded first and take turns fixture by fixture, ROUNDS times over the fixtures, so that
a drifting machine weighs on every budget alike. Under the profiler a cycle takes longer than without (its host
side), so its wall times compare budgets, not absolute speeds; the tokens/s come from the unprofiled rounds.

Usage (GPU, repo root; DIR from `blockspec demo --save DIR`):
  python bench/cycle_trace.py --model DIR/target --drafter DIR/drafter [--budgets 0,15] [--rounds 2]
CPU dry run (a tiny planted pair built here, two short prompts, CPU ops in the tables):
  python bench/cycle_trace.py --dry-run
Writes $OUT/cycle_trace.json (with --json-out, there).
"""

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockspec.bench import code_fixtures  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.fixtures.tiny import build_tiny_checkpoint, build_tiny_drafter  # noqa: E402

PIECES = {"proposer": ("propose", "propose_tree", "observe"), "target": ("run", "run_tree"),
          "state": ("commit", "commit_path")}
SKIPPED_CYCLES = 3  # the first cycles of the profiled generation (the profiler's own start-up)


def wrapped(engine, around):
    """The engine's cycle pieces, each call run inside around(label) ("Class.method"), on its objects only; returns
    a function that puts the plain methods back."""
    owners = {"proposer": engine.proposer, "target": engine.target, "state": engine.state}
    for owner, names in PIECES.items():
        obj = owners[owner]
        for name in names:
            method = getattr(obj, name)

            @functools.wraps(method)
            def piece(*args, method=method, label=f"{type(obj).__name__}.{name}", **kwargs):
                with around(label):
                    return method(*args, **kwargs)
            setattr(obj, name, piece)
    return lambda: [vars(owners[owner]).pop(name) for owner, names in PIECES.items() for name in names]


def host_times(engine, prompts, max_tokens) -> dict:
    """Unprofiled host time per cycle (us, means over one generation of each prompt, its prefill left out): each
    piece's call (no synchronisation inside it: its launches), and the rest of the cycle (the decode loop, the read
    back's wait for the GPU, the yields)."""
    totals, decoding = collections.Counter(), [False]

    @contextlib.contextmanager
    def clocked(label):
        start = time.perf_counter()
        try:
            yield
        finally:
            if decoding[0]:
                totals[label] += time.perf_counter() - start
    seconds = cycles = 0
    unwrap = wrapped(engine, clocked)
    try:
        for prompt in prompts:
            steps = engine.stream(prompt, max_tokens)
            next(steps)  # the prefill and its first token
            decoding[0] = True
            for _ in steps:
                pass
            decoding[0] = False
            seconds, cycles = seconds + engine.last_stats["decode_s"], cycles + engine.last_stats["cycles"]
    finally:
        unwrap()
    pieces = {f"host_us {label}": 1e6 * t / cycles for label, t in totals.items()}
    return {**pieces, "host_us rest": 1e6 * seconds / cycles - sum(pieces.values())}


def correlation(event):
    """The id tying a kernel to the runtime call (a launch, a graph's launch) that issued it."""
    return event.get("args", {}).get("correlation")


def per_cycle(events) -> dict:
    """Medians per cycle of a profiled generation's trace events (a cycle: from one proposal's start to the next).
    idle_us PIECE: the time the GPU waited, within a cycle, for a kernel that PIECE's host time launched ("between
    pieces": launched outside them, e.g. the decode loop's own ops)."""
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ranges if e["name"].endswith((".propose", ".propose_tree"))]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:  # the CPU: its ops stand for kernels
        kernels = [e for e in events if e.get("cat") == "cpu_op"]
    cycles = list(zip(starts, starts[1:]))[SKIPPED_CYCLES:] or list(zip(starts, starts[1:]))
    piece_names = list(dict.fromkeys(e["name"] for e in ranges))
    launched_in = {}  # a runtime call's correlation id -> the piece whose host time issued it
    for call in runtime:
        inside = [e for e in ranges if e["ts"] <= call["ts"] < e["ts"] + e["dur"]]
        if inside and correlation(call) is not None:
            launched_in[correlation(call)] = max(inside, key=lambda e: e["ts"])["name"]
    rows = collections.defaultdict(list)
    names = collections.defaultdict(float)
    for begin, end in cycles:
        rows["wall_us"].append(end - begin)
        for e in ranges:
            if begin <= e["ts"] < end:
                rows[f"host_us {e['name']}"].append(e["dur"])
        calls = collections.Counter(e["name"] for e in runtime if begin <= e["ts"] < end)
        for name, count in calls.items():
            rows[f"calls {name}"].append(count)
        spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"], correlation(e)) for e in kernels
                       if begin <= e["ts"] < end)
        busy, reached = 0.0, begin
        idle = collections.Counter({f"idle_us {piece}": 0.0 for piece in (*piece_names, "between pieces")})
        for start, stop, name, launch in spans:
            busy += max(0.0, stop - max(start, reached))
            if start > reached and reached > begin:  # the GPU waited: for the host's launch of this kernel
                idle[f"idle_us {launched_in.get(launch, 'between pieces')}"] += start - reached
            reached = max(reached, stop)
            names[name[:80]] += (stop - start) / len(cycles)
        rows["kernels"].append(len(spans))
        rows["busy_us"].append(busy)
        for key, value in idle.items():
            rows[key].append(value)
    return {"cycles": len(cycles), **{key: statistics.median(values) for key, values in rows.items()},
            "by_kernel_us": dict(names)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the target's directory")
    ap.add_argument("--drafter", help="the DFlash2 drafter's directory")
    ap.add_argument("--budgets", default="0,15", help="comma-separated dflash2_tree_budget values (0: the chain)")
    ap.add_argument("--rounds", type=int, default=2, help="unprofiled rounds over the fixtures")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json-out", help="default: $OUT/cycle_trace.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU: a tiny planted pair, two short prompts")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    settings = {}
    if args.dry_run:
        work = tempfile.mkdtemp(prefix="cycle-trace-")
        args.model, args.drafter = build_tiny_checkpoint(f"{work}/target", planted=True), f"{work}/drafter"
        build_tiny_drafter(args.drafter, args.model)
        settings = dict(device="cpu", compute_dtype="float32")
        prompts_text, args.max_tokens, args.rounds = ["hello world " * 4, "def f(x):\n    return x"], 24, 1
    elif not (args.model and args.drafter):
        sys.exit("--model and --drafter are needed (or --dry-run)")
    else:
        prompts_text = [f["prompt"] for f in code_fixtures("stdlib")]
    engines = {b: Engine.load(str(args.model), dflash2_model=str(args.drafter), dflash2_tree_budget=b, **settings)
               for b in budgets}
    prompts = [engines[budgets[0]].tokenizer.encode(text) for text in prompts_text]
    totals = {b: collections.Counter() for b in budgets}
    for engine in engines.values():
        engine.generate(prompts[0], args.max_tokens)  # warm
    for _ in range(args.rounds):
        for prompt in prompts:
            for b, engine in engines.items():
                engine.generate(prompt, args.max_tokens)
                stats = engine.last_stats
                totals[b].update(tokens=stats["generated"] - 1, seconds=stats["decode_s"], cycles=stats["cycles"],
                                 emitted=round(stats["mean_accepted_length"] * stats["cycles"]))
    results = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and not args.dry_run:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    hosts = {b: host_times(engine, prompts, args.max_tokens) for b, engine in engines.items()}
    for b, engine in engines.items():
        wrapped(engine, torch.profiler.record_function)
        with torch.profiler.profile(activities=activities) as prof:
            engine.generate(prompts[min(3, len(prompts) - 1)], args.max_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
        t = totals[b]
        results[b] = {"tokens_per_s": t["tokens"] / t["seconds"], "cycle_ms": t["seconds"] / t["cycles"] * 1e3,
                      "tokens_per_cycle": t["emitted"] / t["cycles"], "unprofiled": hosts[b],
                      "profiled": per_cycle(events)}
    first = budgets[0]
    print(f"{'budget':>6s} {'tok/s':>9s} {'x first':>8s} {'tok/cycle':>9s} {'cycle ms':>9s}   profiled, per cycle: "
          f"{'wall us':>8s} {'busy us':>8s} {'kernels':>7s}")
    for b, r in results.items():
        p = r["profiled"]
        print(f"{b:6d} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / results[first]['tokens_per_s']:8.3f} "
              f"{r['tokens_per_cycle']:9.3f} {r['cycle_ms']:9.3f}   {'':20s} {p['wall_us']:8.1f} {p['busy_us']:8.1f} "
              f"{p['kernels']:7.1f}")
    for b, r in results.items():
        print(f"\nbudget {b}, unprofiled host time per cycle (means): "
              + "; ".join(f"{k} {v:.1f}" for k, v in r["unprofiled"].items()))
    for b, r in results.items():
        print(f"\nbudget {b}, per profiled cycle (medians): "
              + "; ".join(f"{k} {v:.1f}" for k, v in r["profiled"].items() if k.startswith(("host", "idle", "calls"))))
    for b in budgets[1:]:
        mine, theirs = results[b]["profiled"]["by_kernel_us"], results[first]["profiled"]["by_kernel_us"]
        print(f"\nkernel time per cycle, budget {b} against {first} (us; the largest differences):")
        for name in sorted(set(mine) | set(theirs), key=lambda n: -abs(mine.get(n, 0) - theirs.get(n, 0)))[:16]:
            print(f"  {name:80s} {theirs.get(name, 0):7.1f} -> {mine.get(name, 0):7.1f}")
    out = Path(args.json_out or Path(os.environ.get("OUT", ".")) / "cycle_trace.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"budgets": budgets, "results": {str(b): r for b, r in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
