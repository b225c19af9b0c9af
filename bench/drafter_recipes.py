"""What each change of the training recipe buys: DFlash2 drafters and MTP heads of one target trained side by side
(several train-drafter runs at once on one GPU: the demo pair's are launch-bound, so they share it well), each
evaluated as it trains by the product's own measure, one speculative cycle from real contexts of the standard
library's bench fixtures (`--eval-data`: code none of them was trained on; the same 10 files as `blockspec bench
--fixtures stdlib`).

A recipe is a name from RECIPES: the train-drafter flags it adds to the common ones after `--`, and the data it
reads (`text`: the --data of the common flags; `regen`: the --regenerated file of `blockspec regenerate` in place
of --data; `mixed`: both).
Every run writes into --work/NAME (kept: resumable, inspectable). The table: per recipe, the mean accepted length
at each evaluation (the learning curve), the last, and block tokens/s.

Usage (repo root): python bench/drafter_recipes.py --recipes drafter,mtp,drafter-4x --work DIR [--parallel 4]
  [--regenerated FILE.jsonl] [--eval-every N] [--eval-cuts N] [--json-out FILE] -- --target DIR --data PATH ...
  --seq-len 1024 --steps 2000 ...
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blockspec.bench import CODE_FIXTURE_FILES  # noqa: E402
from blockspec.train.evaluate import standard_library_files  # noqa: E402
from blockspec.train.run import DrafterTraining  # noqa: E402

DRAFTER = ["--layers", "2", "--window", "1024", "--selector-rank", "64", "--intermediate-size", "1024", "--lr", "1e-3"]
MTP = ["--kind", "mtp", "--replace-mtp"]  # the demo target has a head: each recipe trains its own
# name: (train-drafter flags, data, x --steps). The shipped demo pair's proposers are `drafter-3-layers-4x` and
# `mtp-4x` (at --steps 2000: 8000 steps each) on the target's own corpus.
RECIPES = {
    "drafter": (DRAFTER, "text", 1),
    "mtp": (MTP, "text", 1),
    "drafter-4x": (DRAFTER, "text", 4),
    "mtp-4x": (MTP, "text", 4),
    "drafter-3-layers": (["--layers", "3", *DRAFTER[2:]], "text", 1),
    "drafter-3-layers-4x": (["--layers", "3", *DRAFTER[2:]], "text", 4),
    # sequences as long as the engine's default context (the same target tokens a step): the proposers see the
    # target's features at every position a 4096-token context reaches
    "drafter-3-layers-4x-seq-4096": (["--layers", "3", *DRAFTER[2:], "--seq-len", "4096"], "text", 4),
    "mtp-4x-seq-4096": ([*MTP, "--seq-len", "4096"], "text", 4),
    "drafter-block-16": (DRAFTER + ["--block-size", "16"], "text", 1),
    "drafter-regenerated": (DRAFTER, "regen", 1),
    "mtp-regenerated": (MTP, "regen", 1),
    "drafter-mixed": (DRAFTER, "mixed", 1),
    "mtp-mixed": (MTP, "mixed", 1),
    # the shipped pair's recipes on the mixed data (at 2000 steps, human code with sampled regenerations led both
    # proposers trained on either alone; at these 8000 they accept 1-5 % less than the shipped pair on the CPU)
    "drafter-3-layers-4x-mixed": (["--layers", "3", *DRAFTER[2:]], "mixed", 4),
    "mtp-4x-mixed": (MTP, "mixed", 4),
}


def recipe_flags(name: str, common: list[str], regenerated: str | None) -> list[str]:
    """The common flags with the recipe's: the --regenerated file in place of --data's paths (`regen`) or beside
    them (`mixed`), and its multiple of --steps."""
    flags, data, scale = RECIPES[name]
    out = list(common)
    if data != "text":
        if regenerated is None:
            sys.exit(f"recipe {name} trains on regenerated data: give --regenerated FILE.jsonl")
        start = out.index("--data") + 1
        end = next((i for i in range(start, len(out)) if out[i].startswith("--")), len(out))
        out[start:end] = [regenerated] if data == "regen" else [*out[start:end], regenerated]
    if scale != 1:
        steps = int(common[common.index("--steps") + 1]) if "--steps" in common else DrafterTraining.steps
        out += ["--steps", str(scale * steps)]
    return [*out, *flags]


def launch(name: str, flags: list[str], work: Path, evaluation: list[str]) -> subprocess.Popen:
    out = work / name
    log = open(work / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "blockspec", "train-drafter", *flags, *evaluation, "--out",
                             str(out)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def result(name: str, work: Path) -> dict:
    summary_file = work / name / ("mtp_training.json" if "--kind" in RECIPES[name][0] else "training.json")
    summary = json.loads(summary_file.read_text())
    return {"recipe": name, "steps": summary["steps"],
            "block_tokens_per_s": summary["training_tokens_per_s"],
            "curve": {e["step"]: e["mean_accepted_length"] for e in summary.get("evaluations", [])},
            "mean_accepted_length": summary["evaluation"]["mean_accepted_length"],
            "cuts": summary["evaluation"]["cuts"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", required=True, help="comma-separated names of RECIPES: " + ", ".join(RECIPES))
    parser.add_argument("--work", required=True, type=Path, help="a folder per run (and its log) goes here")
    parser.add_argument("--parallel", type=int, default=4, help="runs at once (default 4)")
    parser.add_argument("--regenerated", help="blockspec regenerate's JSONL: the data of the *-regenerated "
                        "recipes, added to --data in the *-mixed ones")
    parser.add_argument("--eval-every", type=int, default=500, help="steps between evaluations (default 500)")
    parser.add_argument("--eval-cuts", type=int, default=500, help="contexts of each evaluation (default 500)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train-drafter's common flags")
    args = parser.parse_args()
    common = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown or "--data" not in common or "--target" not in common:
        sys.exit(f"unknown recipe {unknown[0]!r} (known: {', '.join(RECIPES)})" if unknown else
                 "give train-drafter's common flags after --, with --target and --data")
    args.work.mkdir(parents=True, exist_ok=True)
    evaluation = ["--eval-data", *map(str, standard_library_files(CODE_FIXTURE_FILES)), "--eval-every",
                  str(args.eval_every), "--eval-cuts", str(args.eval_cuts)]
    pending = [(n, recipe_flags(n, common, args.regenerated)) for n in names]
    running, failed, start, read = {}, [], time.perf_counter(), {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name, flags = pending.pop(0)
            running[name] = launch(name, flags, args.work, evaluation)
        time.sleep(0.2)
        for name, proc in list(running.items()):
            ended = proc.poll() is not None  # before the read: an ended run's last lines are all in its log
            # each evaluation as it comes: a run stopped early (a time limit) still leaves its curve so far
            with open(args.work / f"{name}.log") as log:
                log.seek(read.get(name, 0))
                for line in re.findall(r"step \d+: mean accepted length .*", log.read()):  # (after a bar's \r)
                    print(f"{time.perf_counter() - start:6.0f} s  {name}: {line.strip()}", flush=True)
                read[name] = log.tell()
            if ended:
                del running[name]
                if proc.returncode:
                    said = (args.work / f"{name}.log").read_text().splitlines()
                    failed.append(f"{name} (exit {proc.returncode}): " + " | ".join(said[-3:]))
    if failed:
        sys.exit("failed: " + "; ".join(failed))
    rows = [result(n, args.work) for n in names]
    print(f"{len(rows)} runs, {args.parallel} at once, {time.perf_counter() - start:.0f} s; one cycle from "
          f"{rows[0]['cuts']} contexts of {CODE_FIXTURE_FILES} standard-library files")
    print(f"{'recipe':<22}{'steps':>7}{'block tok/s':>13}{'accepted':>10}  curve (step: mean accepted length)")
    for r in rows:
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in r["curve"].items())
        print(f"{r['recipe']:<22}{r['steps']:>7}{r['block_tokens_per_s']:>13.0f}{r['mean_accepted_length']:>10.3f}  "
              f"{curve}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"runs": rows, "train_args": common}, indent=1))


if __name__ == "__main__":
    main()
