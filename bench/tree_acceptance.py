"""Draft trees' acceptance on a real pair: one DFlash2 cycle from --cuts random contexts of standard-library code,
at every tree budget from each context's one prefill (the later budgets resume from a snapshot before the context's
last token: blockspec.train.evaluate.one_cycle_acceptance), greedy or sampled.

Prints the mean tokens per cycle (accepted + 1) of each budget and its ratio to the chain's (budget 0); JSON to
--json-out (default $OUT/tree_acceptance.json when OUT is set). The contexts are `blockspec bench --fixtures stdlib`'s
files; the engine runs eagerly (the sweep resumes snapshots between passes), built for the largest budget.

With --tokens-per-s N, also whole generations: N greedy tokens from each file's prompt (as `blockspec bench`), by
plain decoding and by each budget (one engine each, the device's default execution), the engines taking turns file
by file and round by round (--rounds), so that a machine whose speed drifts over minutes (a shared CPU) weighs on
every budget alike; tokens/s (all tokens after each first over all decode time), the tokens per cycle of those
generations, and each one's ratio to the chain's.
Usage: python bench/tree_acceptance.py --model DIR/target --drafter DIR/drafter [--budgets 0,8,16,24,32,48]
[--scores transition|marginal] [--temperature 0] [--cuts 500] [--device cpu] [--dtype float32]
[--context-length 1024] [--tokens-per-s 64 --rounds 2 --threads 2] [--score-temperature 1] [--lookup 0,7]
(--score-temperature TAU: the tree's best-first order from the selector's scores / TAU, the chain, their argmax walk,
unchanged: whether the scores as trained order the tree best.)
"""

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from unittest import mock

import torch

from blockspec.bench import code_fixtures, tree_budgets
from blockspec.engine.engine import Engine
from blockspec.kernels import drafter_tree
from blockspec.train.evaluate import one_cycle_acceptance


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the target's checkpoint directory")
    p.add_argument("--drafter", required=True, help="its DFlash2 drafter's directory")
    p.add_argument("--budgets", default="0,8,16,24,32,48", help="tree budgets, 0 = the chain")
    p.add_argument("--scores", default="transition", choices=["transition", "marginal"], help="dflash2_tree_scores")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled with --seed")
    p.add_argument("--seed", type=int, default=1, help="the sampled cycles' seed")
    p.add_argument("--cuts", type=int, default=500)
    p.add_argument("--fixtures", default="stdlib", help="as blockspec bench --fixtures")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--tokens-per-s", type=int, default=0, metavar="N", help="also time N-token generations")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the files of the generations' timing")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (the pair's matrices gain little "
                                                          "from a second one: blockspec/demo.py)")
    p.add_argument("--score-temperature", type=float, default=1.0, metavar="TAU",
                   help="the tree's order from the selector's scores / TAU (module docstring)")
    p.add_argument("--lookup", default="0", help="comma-separated dflash2_tree_lookup values: each budget above 0 "
                   "runs with each (the last L of its nodes a branch copied from the context; labels BUDGET+L)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    budgets = tree_budgets(args.budgets)
    if not args.score_temperature > 0:
        print(f"--score-temperature {args.score_temperature}: must be positive", file=sys.stderr)
        sys.exit(2)
    lookups = [int(v) for v in args.lookup.split(",")]
    with tempered(args.score_temperature):
        return measure(args, budgets, lookups)


def tempered(tau: float):
    """A context in which the tree's transition table is log q of the selector's scores / tau: the table's log-softmax
    divided by tau and log-softmaxed again, which is the same."""
    if tau == 1.0:
        return nullcontext()
    table = drafter_tree.transition_table
    return mock.patch.object(drafter_tree, "transition_table",
                             lambda *args: torch.log_softmax(table(*args) / tau, -1))


def label(budget: int, lookup: int):
    """A tree's name in the output: its budget, +L with a lookup branch of L nodes."""
    return f"{budget}+{lookup}" if lookup and budget else budget


def measure(args, budgets, lookups) -> dict:
    torch.set_num_threads(args.threads)
    measured = {}
    start = time.perf_counter()
    for lookup in lookups:  # one engine each, the same cuts (seed 0)
        runs = [b for b in budgets if b or lookup == lookups[0]]  # the chain's cycles hold no tree: measured once
        engine = Engine.load(args.model, mode="dflash2", dflash2_model=args.drafter, device=args.device,
                             compute_dtype=args.dtype, context_length=args.context_length, compile_mode=-1,
                             dflash2_tree_budget=max(runs), dflash2_tree_scores=args.scores,
                             dflash2_tree_lookup=lookup)
        sequences = [engine.tokenizer.encode(f.get("text", f["prompt"])) for f in code_fixtures(args.fixtures)]
        sampling = {"temperature": args.temperature, "seed": args.seed} if args.temperature else None
        for budget, m in one_cycle_acceptance(engine, sequences, args.cuts, 0, sampling, runs).items():
            measured[label(budget, lookup)] = m
        del engine
    chain = measured[budgets[0]]["mean_accepted_length"]
    summary = {"scores": args.scores, "temperature": args.temperature, "score_temperature": args.score_temperature,
               "cuts": args.cuts,
               "seconds": round(time.perf_counter() - start, 1), "budgets": {b: m for b, m in measured.items()}}
    for budget, m in measured.items():
        print(f"budget {budget!s:>4}: {m['mean_accepted_length']:.3f} tokens per cycle "
              f"({m['mean_accepted_length'] / chain:.3f}x budget {budgets[0]})", flush=True)
    if args.tokens_per_s:
        summary["generations"] = generations(args, budgets, lookups)
    out = args.json_out or (os.path.join(os.environ["OUT"], "tree_acceptance.json") if "OUT" in os.environ else None)
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def generations(args, budgets, lookups) -> dict:
    """The --tokens-per-s measurement (module docstring): {"tokens_per_s", "tokens_per_cycle": {"none" and each
    budget: its figure}}."""
    engines = {"none": Engine.load(args.model, device=args.device, compute_dtype=args.dtype,
                                   context_length=args.context_length, prefix_reuse=False)}
    for lookup in lookups:
        for budget in budgets:
            if budget or lookup == lookups[0]:
                engines[label(budget, lookup)] = Engine.load(
                    args.model, mode="dflash2", dflash2_model=args.drafter, device=args.device,
                    compute_dtype=args.dtype, context_length=args.context_length, dflash2_tree_budget=budget,
                    dflash2_tree_scores=args.scores, dflash2_tree_lookup=lookup if budget else 0, prefix_reuse=False)
    room = args.context_length - args.tokens_per_s  # a prompt's tokens beyond the context's room are cut
    prompts = [engines["none"].tokenizer.encode(f["prompt"])[:room] for f in code_fixtures(args.fixtures)]
    tokens, seconds, cycles = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    for _ in range(args.rounds):
        for ids in prompts:
            for name, engine in engines.items():
                stats = engine.generate(ids, args.tokens_per_s, stop_at_eos=False).stats
                tokens[name] += stats["generated"] - 1
                seconds[name] += stats["decode_s"]
                cycles[name] += stats.get("cycles", stats["generated"] - 1)  # plain decoding: a token a step
    rates = {name: round(tokens[name] / seconds[name], 2) for name in engines}
    per_cycle = {name: round(tokens[name] / cycles[name], 4) for name in engines}
    chain = rates[budgets[0]]
    for name, rate in rates.items():
        shown = "plain decoding" if name == "none" else f"budget {name!s:>4}"
        print(f"{shown}: {rate:.1f} tokens/s ({rate / chain:.3f}x budget {budgets[0]}), {per_cycle[name]:.3f} "
              f"tokens per cycle ({per_cycle[name] / per_cycle[budgets[0]]:.3f}x)", flush=True)
    return {"tokens_per_s": rates, "tokens_per_cycle": per_cycle}


if __name__ == "__main__":
    main()
