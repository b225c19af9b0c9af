"""Programmatic dependent launch variants on synthetic Qwen3.5-27B weights (packed projections): the graphed
1-token target step (what plain greedy decoding replays) and the graphed 8-token verification with its commit, for
each setting of blockspec.kernels.pdl, in one process on one model so the ratios are read on one machine.

Variants are "level:prefetch_MB" (levels 0-3 of `kernels.pdl.settings`; see kernels/pdl.py), optionally ":0" after
it for norms left unfolded (BLOCKSPEC_FOLD_NORMS=0, layers/folded_norm.py), then optionally "+NAME=VALUE" settings
of the environment for that variant alone (session 9 compared kernel experiments so, e.g. "3:4+NAME=0"). Each is
timed in `--rounds` rounds, interleaved with the others (median of 40 replays per round), so clock or thermal
drift shows as a round-to-round difference instead of a variant difference.

Usage (GPU, repo root): python bench/pdl_variants.py [--variants 0:0,2:16,2:0,1:0] [--quant none,int4]
       [--mode none|dflash2]
"""

import argparse
import json
import os
import time

import torch

from blockspec.bench import bytes_per_plain_step, measure_read_bandwidth
from blockspec.config import PredictConfig
from blockspec.engine.engine import Engine
from blockspec.kernels import pdl
from blockspec.synthetic import synthetic_target
from timing import event_ms  # bench/timing.py, beside this script


def measure(model, mtp, quant, mode, inspect=None):
    """quant: what the engine applies to the model (in place: "none" once it is quantized); `inspect`, if given, is
    called with the 1-token step function before the engine is released (e.g. to profile it)."""
    config = PredictConfig.build({"mode": mode, "device": "cuda", "compile_mode": 0, "context_length": 4096,
                                  "fuse_kvq": True, "fuse_gate": True, "target_quantization": quant,
                                  "vocabulary_quantization": "int8" if quant == "int4" else "none"})
    engine = Engine(config, model=model, mtp_tensors=mtp, tokenizer=object(), synthetic_drafter=0)
    target, state = engine.target, engine.state
    state.reset()
    model(torch.randint(0, model.config.vocab_size, (512,), device="cuda"), state, None, all_logits=False)
    state.commit(512)

    def step(t):
        target.verify(list(range(t)))
        target.commit(t)
        state.length -= t  # stay at the same position
    result = {t: event_ms(lambda t=t: step(t), reps=40, warmup=5) for t in sorted(target.passes)}
    if inspect is not None:
        inspect(lambda: step(1))
    step_bytes = bytes_per_plain_step(engine)
    del engine
    torch.cuda.empty_cache()
    return result, step_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="0:0,1:0,2:0,3:4")
    ap.add_argument("--quant", default="none,int4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mode", default="none", help="none: the 1-token step; dflash2: also the 8-token verification")
    args = ap.parse_args()
    bandwidth = measure_read_bandwidth(torch.device("cuda"))
    results = {"bandwidth_gbs": round(bandwidth, 1), "runs": []}
    print(f"read bandwidth {bandwidth:.0f} GB/s", flush=True)
    for quant in args.quant.split(","):  # a fresh model each: quantization and packing are in place
        model = head = mtp = None
        torch.cuda.empty_cache()
        model, head = synthetic_target("qwen3.5-27b", torch.device("cuda"), torch.bfloat16)
        mtp = {"mtp." + k: v for k, v in head.state_dict().items()}
        applied = quant
        for rnd in range(args.rounds):
            for variant in args.variants.split(","):
                spec, *env = variant.split("+")  # "+NAME=VALUE": an environment setting of this variant alone
                level, mb, *fold = spec.split(":")
                for name, _, value in (e.partition("=") for e in env):
                    os.environ[name] = value
                os.environ["BLOCKSPEC_PDL"], os.environ["BLOCKSPEC_PDL_PREFETCH_MB"] = level, mb
                os.environ["BLOCKSPEC_FOLD_NORMS"] = fold[0] if fold else "1"
                pdl.reset()
                t0 = time.perf_counter()
                times, step_bytes = measure(model, mtp, applied, args.mode)
                for name, _, _ in (e.partition("=") for e in env):
                    os.environ.pop(name)
                applied = "none"
                roof = step_bytes / (bandwidth * 1e9) * 1e3
                row = {"quant": quant, "round": rnd, "variant": variant, "build_s": round(time.perf_counter() - t0, 1),
                       "roofline_ms": round(roof, 3), **{f"pass_{t}_ms": round(ms, 4) for t, ms in times.items()}}
                results["runs"].append(row)
                step = times.get(1)
                extra = f"  step {step:.4f} ms = {100 * roof / step:.1f}% of roofline" if step else ""
                print(f"{quant:5s} round {rnd} pdl {variant:6s}{extra}  passes "
                      + " ".join(f"{t}:{ms:.4f}" for t, ms in times.items()), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "pdl_variants.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
