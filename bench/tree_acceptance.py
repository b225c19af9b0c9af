"""Draft trees' acceptance on a real pair: one DFlash2 cycle from --cuts random contexts of standard-library code,
at every tree budget from each context's one prefill (the later budgets resume from a snapshot before the context's
last token: blockspec.train.evaluate.one_cycle_acceptance), greedy or sampled.

Prints the mean tokens per cycle (accepted + 1) of each budget and its ratio to the chain's (budget 0); JSON to
--json-out (default $OUT/tree_acceptance.json when OUT is set). The contexts are `blockspec bench --fixtures stdlib`'s
files; the engine runs eagerly (the sweep resumes snapshots between passes), built for the largest budget.
Usage: python bench/tree_acceptance.py --model DIR/target --drafter DIR/drafter [--budgets 0,8,16,24,32,48]
[--scores transition|marginal] [--temperature 0] [--cuts 500] [--device cpu] [--dtype float32]
[--context-length 1024]
"""

import argparse
import json
import os
import time

import torch

from blockspec.bench import code_fixtures, tree_budgets
from blockspec.engine.engine import Engine
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
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    budgets = tree_budgets(args.budgets)
    torch.set_num_threads(1)  # the pair's matrices gain nothing from a second thread (blockspec/demo.py)
    engine = Engine.load(args.model, mode="dflash2", dflash2_model=args.drafter, device=args.device,
                         compute_dtype=args.dtype, context_length=args.context_length, compile_mode=-1,
                         dflash2_tree_budget=max(budgets), dflash2_tree_scores=args.scores)
    sequences = [engine.tokenizer.encode(f.get("text", f["prompt"])) for f in code_fixtures(args.fixtures)]
    sampling = {"temperature": args.temperature, "seed": args.seed} if args.temperature else None
    start = time.perf_counter()
    measured = one_cycle_acceptance(engine, sequences, args.cuts, 0, sampling, budgets)
    chain = measured[budgets[0]]["mean_accepted_length"]
    summary = {"scores": args.scores, "temperature": args.temperature, "cuts": args.cuts,
               "seconds": round(time.perf_counter() - start, 1), "budgets": {b: m for b, m in measured.items()}}
    for budget, m in measured.items():
        print(f"budget {budget:2d}: {m['mean_accepted_length']:.3f} tokens per cycle "
              f"({m['mean_accepted_length'] / chain:.3f}x budget {budgets[0]})", flush=True)
    out = args.json_out or (os.path.join(os.environ["OUT"], "tree_acceptance.json") if "OUT" in os.environ else None)
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
