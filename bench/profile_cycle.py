"""Where a decode step's and a speculative cycle's time goes, on synthetic Qwen3.5-27B weights (packed projections,
as every engine runs them).

For each mode (one engine each, on a fresh synthetic target, after a 512-token prefill), times each piece alone with
CUDA events (median of 20 after warm-up): the graphed 1-token step with its commit (and its share of the bandwidth
roofline), the graphed verification pass of the mode with a full and a 1-token commit, the DFlash2 proposal graph,
the graphed drafter context append of 4 rows, the graphed MTP observe + chain of 3 drafts, and the head on one row.
With `--tree-budget N` (DFlash2), also the draft tree's pieces: the graphed proposal and tree build, and the graphed
tree pass with its greedy walk, the read back and the graphed commit of a 1-node and a full-depth path.
Then a kernel table of each graphed piece (torch.profiler: which kernels take the time, and the first kernels of a
step in launch order). `--pdl-level 0` gives each kernel's own duration (with PDL a kernel's time includes its wait
for the previous one); `--no-fold-norms` the INT4 step with its norms as kernels of their own. Prints it all; JSON to
$OUT/profile_cycle.json.

Usage (GPU, repo root; ~2-3 minutes on an H200 for the three modes):
  python bench/profile_cycle.py [--modes none,mtp,dflash2] [--quant int4 --vocab-quant int8] [--pdl-level 0]
                                [--tree-budget 16] [--model DIR/target --drafter DIR/drafter]
CPU dry run (the tiny preset, a 16-token prompt, PyTorch's CPU paths, untimed, CPU ops in the tables):
  python bench/profile_cycle.py --dry-run
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockspec.bench import bytes_per_plain_step, measure_read_bandwidth  # noqa: E402
from blockspec.config import PredictConfig  # noqa: E402
from blockspec.engine.decode import prefill  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.engine.weights import rtn  # noqa: E402
from blockspec.kernels import use  # noqa: E402
from blockspec.models.qwen3_5 import TargetOutput  # noqa: E402
from blockspec.fixtures.synthetic import synthetic_drafter, synthetic_target  # noqa: E402
from timing import dry_run, event_ms  # noqa: E402  (bench/timing.py, beside this script)

PROMPT_TOKENS = 512
DEVICE, PRESET, PROFILED = torch.device("cuda"), "qwen3.5-27b", torch.autograd.DeviceType.CUDA


def kernel_table(fn, top=18, sequence=0):
    """The kernels of a few calls of fn, grouped by name: (name, calls per fn call, us per fn call); with
    `sequence`, also the first that many kernels of one call in launch order (what one layer runs)."""
    fn()
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else lambda: None
    sync()
    reps = 1 if DEVICE.type == "cpu" else 5
    activity = torch.profiler.ProfilerActivity.CUDA if DEVICE.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(reps):
            fn()
        sync()
    rows = {}
    for e in prof.events():
        if e.device_type == PROFILED:
            calls, total = rows.get(e.name, (0, 0.0))
            rows[e.name] = (calls + 1, total + _us(e))
    table = sorted(((n[:90], c / reps, t / reps) for n, (c, t) in rows.items()), key=lambda r: -r[2])
    ordered = sorted((e for e in prof.events() if e.device_type == PROFILED),
                     key=lambda e: e.time_range.start)
    return {"total_kernel_us": round(sum(r[2] for r in table), 1), "kernels_per_call": sum(r[1] for r in table),
            "top": [(n, c, round(t, 1)) for n, c, t in table[:top]],
            "sequence": [(e.name[:70], round(_us(e), 1)) for e in ordered[:sequence]]}


def _us(event):
    """A kernel's GPU time; on the CPU (dry run) an operator's own time."""
    return event.device_time if PROFILED == torch.autograd.DeviceType.CUDA else event.self_cpu_time_total


def build_engine(mode, args):
    """An engine on a fresh synthetic target (quantization and norm folding change the model in place), or on
    --model (and --drafter) as the CLI loads them."""
    overrides = {"mode": mode, "device": DEVICE.type, "context_length": args.context_length,
                 "target_quantization": args.quant, "vocabulary_quantization": args.vocab_quant,
                 "fold_norms": not args.no_fold_norms}
    if args.pdl_level is not None:
        overrides["pdl_level"] = args.pdl_level
    if mode == "dflash2":
        overrides["dflash2_tree_budget"] = args.tree_budget
    if args.model:
        overrides["model"] = args.model
        if mode == "dflash2":
            overrides["dflash2_model"] = args.drafter
        return Engine(PredictConfig.build(overrides, source="profile_cycle"))
    config = PredictConfig.build(overrides, source="profile_cycle")
    model, head = synthetic_target(PRESET, DEVICE, config.torch_dtype,
                                   quantize=rtn(config.target_quantization, 128, config.torch_dtype))
    mtp = {"mtp." + k: v for k, v in head.state_dict().items()}
    drafter = synthetic_drafter(model) if mode == "dflash2" else None
    return Engine(config, model=model, mtp_tensors=mtp, drafter=drafter, tokenizer=object())


def profile_engine(engine, bandwidth, kernels) -> dict:
    target, state, proposer, model = engine.target, engine.state, engine.proposer, engine.model
    device, dtype = engine.device, engine.dtype
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,), device=device)
    hidden_size = model.config.hidden_size

    def prime():
        """Every piece is timed from the same point: a fresh request after the prompt's prefill."""
        state.reset()
        proposer.reset()
        prefill(target, prompt, 0, PROMPT_TOKENS, proposer)

    def step(t, n):
        target.verify(list(range(t)))
        state.commit(n)

    def timed(label, fn, sequence=0):
        prime()
        r[label] = event_ms(fn)
        prime()
        kernels[f"{engine.mode} {label}"] = kernel_table(fn, sequence=sequence)

    r = {}
    timed("step_1_commit_1_ms", lambda: step(1, 1), sequence=70)
    step_bytes = bytes_per_plain_step(engine)
    r["step_bytes_gb"] = round(step_bytes / 1e9, 3)
    r["step_roofline_ms"] = round(step_bytes / (bandwidth * 1e9) * 1e3, 3)
    r["step_pct_roofline"] = round(100 * r["step_roofline_ms"] / r["step_1_commit_1_ms"], 1)
    t = 1 + proposer.max_proposals
    if t > 1:
        timed(f"verify_{t}_commit_{t}_ms", lambda: step(t, t))
        prime()
        r[f"verify_{t}_commit_1_ms"] = event_ms(lambda: step(t, 1))
    if proposer.name == "dflash2":
        timed("dflash2_propose_graph_ms", lambda: proposer.propose(5, state.length, 7))
        rows = TargetOutput(None, None, torch.zeros(4, len(proposer.capture_layers) * hidden_size, device=device,
                                                    dtype=dtype))
        timed("drafter_append_4_graph_ms",
              lambda: proposer.observe(rows, proposer.drafter.context.length, [0] * 4, [0] * 4))
        if proposer.tree_budget:
            r.update(profile_tree(engine, prime, timed))
    if proposer.name == "mtp":
        rows = TargetOutput(None, torch.zeros(4, hidden_size, device=device, dtype=dtype), None)

        def observe_and_propose():
            proposer.observe(rows, state.length, [0] * 4, [1, 2, 3, 4])
            return proposer.propose(4, state.length + 4, 3)
        timed("mtp_observe_4_chain_3_graph_ms", observe_and_propose)
    hidden = torch.zeros(1, hidden_size, device=device, dtype=dtype)
    r["head_1_row_ms"] = event_ms(lambda: model.logits(hidden))
    return r


def profile_tree(engine, prime, timed) -> dict:
    """The pieces of one draft-tree cycle (engine/sampling.py walk), each graphed as the decode loop runs it."""
    target, state, proposer = engine.target, engine.state, engine.proposer
    n, depth = proposer.tree_budget + 1, proposer.max_proposals
    r = {}
    timed(f"tree_{n}_propose_graph_ms", lambda: proposer.propose_tree(5, state.length))
    prime()
    tree = proposer.propose_tree(5, state.length)

    def verify(kept):  # the pass with its greedy walk, the read back, the commit of the walk's path's first `kept`
        # nodes (past the accepted ones the walk's path repeats the root: a commit's kernels take the same time)
        target.run_tree(tree, depth)[1].tolist()
        state.commit_path(kept)
    for kept in (1, min(depth + 1, n)):
        timed(f"tree_{n}_pass_walk_commit_{kept}_ms", lambda: verify(kept))
    return r


def arguments() -> argparse.ArgumentParser:
    """This script's options; step_variants.py and launch_timeline.py build their engines from its parse too."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,mtp,dflash2")
    ap.add_argument("--quant", default="none", help="target_quantization: none | int4")
    ap.add_argument("--vocab-quant", default="none", help="vocabulary_quantization: none | int8 | int4")
    ap.add_argument("--pdl-level", type=int, help="pdl_level (default: the engine's choice for the target)")
    ap.add_argument("--no-fold-norms", action="store_true",
                    help="INT4: residual adds, norms and SwiGLU as kernels of their own (fold_norms: false)")
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--tree-budget", type=int, default=0, help="dflash2: also the pieces of a draft tree of N nodes")
    ap.add_argument("--model", help="a checkpoint directory instead of the synthetic 27B (e.g. DIR/target from "
                                    "blockspec demo --save DIR)")
    ap.add_argument("--drafter", help="with --model: the DFlash2 drafter's directory")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the tiny preset, a 16-token prompt, untimed")
    return ap


def main():
    ap = arguments()
    args = ap.parse_args()
    if args.model and "dflash2" in args.modes.split(",") and not args.drafter:
        ap.error("--model with mode dflash2 needs --drafter DIR")
    if args.dry_run:
        global DEVICE, PRESET, PROFILED, PROMPT_TOKENS
        DEVICE, PRESET, PROFILED, PROMPT_TOKENS = dry_run(False), "tiny", torch.autograd.DeviceType.CPU, 16
    bandwidth = measure_read_bandwidth(DEVICE) or float("nan")  # GB/s; none on the CPU
    results = {"bandwidth_gbs": round(bandwidth, 1), "quant": args.quant, "vocab_quant": args.vocab_quant}
    kernels = {}
    for mode in args.modes.split(","):
        start = time.perf_counter()
        engine = build_engine(mode, args)
        with use(engine.kernels):
            r = profile_engine(engine, bandwidth, kernels)
        results[mode] = {"engine_s": round(time.perf_counter() - start, 1), **engine.load_times.as_dict(), **r}
        for key, value in results[mode].items():
            print(f"{mode:8s} {key:32s} {value}", flush=True)
        del engine
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    for label, table in kernels.items():
        print(f"\n== {label}: {table['kernels_per_call']:.0f} kernels, {table['total_kernel_us']:.0f} us of kernels")
        for name, calls, us in table["top"]:
            print(f"  {us:9.1f} us {calls:6.1f}x  {name}")
        if table["sequence"]:
            print("  -- first kernels of one call, in order:")
            for name, us in table["sequence"]:
                print(f"  {us:9.1f} us  {name}")
    with open(os.path.join(os.environ.get("OUT", "."), "profile_cycle.json"), "w") as f:
        json.dump({"results": results, "kernels": kernels}, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
