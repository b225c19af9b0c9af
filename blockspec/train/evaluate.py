"""Acceptance on real text: what a proposer buys, measured two ways.

One cycle from real contexts: held-out text is cut at random points; from each real prefix the engine prefills,
proposes a full block and verifies once, and the number of tokens that cycle emits (accepted + 1) is recorded. Small
targets fall into loops under greedy decoding, and a loop is trivially predictable, so this is the measure that says
what a drafter has learnt. Over whole greedy generations, the acceptance is split into the cycles that start inside
a repeat (the 8 tokens before them already occurred earlier) and the rest, beside the generations' distinct 8-gram
ratio.
"""

from __future__ import annotations

import bisect
import itertools
import random
import sysconfig
from pathlib import Path

NGRAM = 8


def standard_library_files(count: int | None = None, seed: int = 0) -> list[Path]:
    """Top-level modules of the running interpreter's standard library (at least 4 kB each): code no blockspec
    model was trained on. `count` of them, chosen by the seed, or all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size >= 4096)
    if count is not None and count < len(files):
        files = sorted(random.Random(seed).sample(files, count))
    return files


def one_cycle_acceptance(engine, sequences: list[list[int]], cuts: int, seed: int = 0,
                         sampling: dict | None = None, tree_budgets: list[int] | None = None,
                         trained: list[list[bool]] | None = None) -> dict:
    """One speculative cycle from each of `cuts` random prefixes of the token sequences, every position of the texts
    equally likely (a cut leaves at least one token before it; with `trained`, per sequence and position whether its
    label is trained on (data.Sequence), a cut c only where the cycle's first proposal is a trained label,
    trained[c]), greedy or with `sampling` (Engine.generate's keywords): the mean number of tokens a cycle emits
    (accepted + 1), its histogram, the acceptance rate. With `tree_budgets` (an eager DFlash2 engine whose state
    records trees of the largest), each cut's cycle runs at every budget from one prefill (the later ones resume
    from a snapshot before the last prompt token, engine/reuse.py; the engine's lookup branch cut to what each budget
    leaves beyond the chain): {budget: the measure}."""
    rng = random.Random(seed)
    block = engine.proposer.max_proposals + 1
    longest = engine.config.context_length - 2 * max([block, *(b + 1 for b in tree_budgets or [])])
    # a sequence longer than the context is measured whole, in pieces of `longest` tokens (each piece's contexts
    # start at its own beginning, as train-drafter's sequences do)
    pieces = [(s[start:start + longest], None if trained is None else trained[i][start:start + longest])
              for i, s in enumerate(sequences) for start in range(0, len(s), longest)]
    candidates = [(piece, points) for piece, marks in pieces
                  if (points := [c for c in range(1, len(piece)) if marks is None or marks[c]])]
    if not candidates:
        raise ValueError("no context to cut: every sequence is shorter than two tokens (or has no trained position)")
    counts = list(itertools.accumulate(len(points) for _, points in candidates))
    budgets = tree_budgets or [engine.proposer.tree_budget]
    if tree_budgets and (engine.target.execution != "eager" or engine.prefix is None
                         or max(budgets) + 1 > engine.state.gdn[0].max_partial):
        raise ValueError("a sweep of tree budgets needs an eager engine with prefix reuse, built for the largest")
    lengths = {b: [] for b in budgets}
    kept, lookup = engine.proposer.tree_budget, engine.proposer.tree_lookup
    proposals = engine.proposer.max_proposals
    draws = []
    for _ in range(cuts):  # each cut point of every piece equally likely
        drawn = rng.randrange(counts[-1])
        index = bisect.bisect_right(counts, drawn)
        draws.append((index, candidates[index][1][drawn - (counts[index - 1] if index else 0)]))
    try:
        # by sequence and cut: each prompt extends the one before, so prefix reuse (engine/reuse.py) prefills only
        # the tokens between two cuts
        for index, cut in sorted(draws):
            sequence = candidates[index][0]
            for budget in budgets:  # the lookup branch (if any) cut to what the budget leaves beyond the chain
                engine.proposer.tree_budget = budget
                engine.proposer.tree_lookup = min(lookup, max(0, budget - proposals))
                stats = engine.generate(sequence[:cut], block + 1, stop_at_eos=False, snapshot_at=cut - 1,
                                        **(sampling or {})).stats
                lengths[budget].append(stats["accepted_per_cycle"][0] + 1)
    finally:
        engine.proposer.tree_budget, engine.proposer.tree_lookup = kept, lookup
    measured = {b: {"cuts": len(n), "mean_accepted_length": round(sum(n) / len(n), 4),
                    "acceptance_rate": round((sum(n) - len(n)) / (len(n) * (block - 1)), 4),
                    "histogram": {k: n.count(k) for k in sorted(set(n))}} for b, n in lengths.items()}
    return measured if tree_budgets else measured[budgets[0]]


def repeat_split(prompt: list[int], tokens: list[int], accepted_per_cycle: list[int]) -> dict:
    """One greedy generation's cycles split by whether they start inside a repeat (the 8 tokens before the cycle
    occurred earlier in prompt + generation), with the generation's distinct 8-gram count."""
    text = prompt + tokens
    loop, fresh = [], []
    position = len(prompt) + 1  # the first token comes from the prefill
    for accepted in accepted_per_cycle:
        key = tuple(text[position - NGRAM:position])
        earlier = {tuple(text[i:i + NGRAM]) for i in range(position - NGRAM)}
        (loop if key in earlier else fresh).append(accepted + 1)
        position += accepted + 1
    grams = [tuple(tokens[i:i + NGRAM]) for i in range(len(tokens) - NGRAM + 1)]
    return {"in_repeats": loop, "elsewhere": fresh, "distinct_8grams": len(set(grams)), "8grams": len(grams)}


def summarize_generations(splits: list[dict]) -> dict:
    """Mean accepted length over all cycles, in repeats and elsewhere; the distinct 8-gram ratio."""
    loop = [n for s in splits for n in s["in_repeats"]]
    fresh = [n for s in splits for n in s["elsewhere"]]
    grams = sum(s["8grams"] for s in splits)

    def mean(values):
        return round(sum(values) / len(values), 4) if values else None
    return {"cycles": len(loop) + len(fresh), "mean_accepted_length": mean(loop + fresh),
            "cycles_in_repeats": len(loop), "mean_accepted_length_in_repeats": mean(loop),
            "mean_accepted_length_elsewhere": mean(fresh),
            "distinct_8gram_ratio": round(sum(s["distinct_8grams"] for s in splits) / grams, 4) if grams else None}
