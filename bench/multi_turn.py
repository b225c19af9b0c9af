"""Prefix reuse over a scripted chat: time to first token of each turn, and decode tokens/s, with and without reuse.

A conversation of --turns turns, each --turn-tokens new prompt tokens (seeded random ids) and a --reply-tokens reply
(greedy; EOS ignored), is run twice on one engine (`blockspec bench`'s engine: synthetic weights of the preset, the
engine's defaults): first with the kept state dropped before each turn (every prompt prefilled whole), then keeping
it (each turn prefills only its new tokens). Each turn's prompt is the previous turn's prompt, its reply and the new
tokens. Both runs must produce the same replies (checked). Time to first token is the request's prefill_s (the
prefill and the first token's choice).
Usage: python bench/multi_turn.py [--synthetic qwen3.5-27b] [--mode none] [--turns 10] [--turn-tokens 1000]
[--reply-tokens 128] [--device auto]; JSON to --json-out (default $OUT/multi_turn.json when OUT is set).
"""

import argparse
import json
import os
import statistics
import sys

import torch

from blockspec.bench import add_bench_parser, build_engine


def conversation(engine, turns, turn_tokens, reply_tokens, reuse: bool, seed: int = 0):
    """Per turn: (reply tokens, stats) of one run of the scripted chat."""
    ids = torch.Generator().manual_seed(seed)
    history, results = [], []
    for _ in range(turns):
        prompt = history + torch.randint(0, engine.vocab_size, (turn_tokens,), generator=ids).tolist()
        if not reuse:
            engine.forget_prefix()
        result = engine.generate(prompt, reply_tokens, stop_at_eos=False)
        results.append((result.tokens, result.stats))
        history = prompt + result.tokens
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic", default="qwen3.5-27b", help="synthetic preset: qwen3.5-27b or tiny")
    p.add_argument("--mode", default="none", choices=["none", "mtp", "dflash2"])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-tokens", type=int, default=1000, help="new prompt tokens per turn")
    p.add_argument("--reply-tokens", type=int, default=128, help="tokens generated per turn")
    p.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json-out", default=os.path.join(os.environ["OUT"], "multi_turn.json") if "OUT" in os.environ
                   else None)
    args = p.parse_args(argv)
    context = args.turns * (args.turn_tokens + args.reply_tokens) + 16
    bench_parser = argparse.ArgumentParser()
    add_bench_parser(bench_parser.add_subparsers())
    engine_args = bench_parser.parse_args(["bench", "--synthetic", args.synthetic, "--mode", args.mode, "--device",
                                           args.device, "--dtype", args.dtype, "--context-length", str(context)])
    engine = build_engine(engine_args, args.mode)
    # warm-up: first launches and the long prefill shapes (a whole chunk and a turn's remainder) out of the timings
    warm = min(engine.config.prefill_chunk_size + args.turn_tokens, context // 2)
    engine.generate([1 + i % (engine.vocab_size - 1) for i in range(warm)], 8, stop_at_eos=False)
    engine.forget_prefix()
    shape = (engine, args.turns, args.turn_tokens, args.reply_tokens)
    without, with_reuse = conversation(*shape, reuse=False), conversation(*shape, reuse=True)
    if [r for r, _ in without] != [r for r, _ in with_reuse]:
        sys.exit("blockspec: error: the replies with and without prefix reuse differ")
    rows = []
    for turn, ((_, off), (_, on)) in enumerate(zip(without, with_reuse), 1):
        rows.append({"turn": turn, "cached_tokens": on["cached_tokens"], "ttft_s_without": off["prefill_s"],
                     "ttft_s_with": on["prefill_s"], "speedup": round(off["prefill_s"] / on["prefill_s"], 2),
                     "decode_tokens_per_s_without": off["decode_tokens_per_s"],
                     "decode_tokens_per_s_with": on["decode_tokens_per_s"]})
    decode = {key: statistics.median(r[f"decode_tokens_per_s_{key}"] for r in rows) for key in ("without", "with")}
    summary = {"preset": args.synthetic, "mode": args.mode, "execution": engine.execution, "turns": rows,
               "decode_tokens_per_s_median": decode,
               "decode_change": round(decode["with"] / decode["without"] - 1, 4) if decode["without"] else None,
               "prefix_snapshots": engine.memory.prefix_snapshots}
    print(f"{'turn':>4} {'cached':>7} {'TTFT off s':>10} {'TTFT on s':>10} {'x':>6} {'tok/s off':>9} {'tok/s on':>9}")
    for r in rows:
        print(f"{r['turn']:>4} {r['cached_tokens']:>7} {r['ttft_s_without']:>10.4f} {r['ttft_s_with']:>10.4f} "
              f"{r['speedup']:>6.2f} {r['decode_tokens_per_s_without']:>9.1f} {r['decode_tokens_per_s_with']:>9.1f}")
    print(f"decode tokens/s (median over turns): {decode['without']:.1f} without, {decode['with']:.1f} with reuse")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
