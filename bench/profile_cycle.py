"""Where a speculative cycle's time goes, on synthetic Qwen3.5-27B weights (H200 run behind docs/benchmarks.md).

Times each piece alone with CUDA events (median of 20 after warm-up): the graphed 1-token step, the graphed
4- and 8-token verification passes, commit graphs, the DFlash2 proposal graph, the drafter context append, and the
eager MTP head steps. Prints one line per piece and writes JSON to $OUT/profile_cycle.json.
"""

import json
import os
import statistics
import time

import torch

from blockspec.config import PredictConfig
from blockspec.engine.engine import Engine
from blockspec.engine.mtp import MTPProposer, load_mtp_head
from blockspec.engine.target import GraphedTarget
from blockspec.synthetic import synthetic_target


def timed(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    t0 = time.perf_counter()
    model, head = synthetic_target("qwen3.5-27b", torch.device("cuda"), torch.bfloat16)
    mtp = {"mtp." + k: v for k, v in head.state_dict().items()}
    config = PredictConfig.build({"mode": "dflash2", "device": "cuda", "compile_mode": 0, "context_length": 4096})
    engine = Engine(config, model=model, mtp_tensors=mtp, tokenizer=object(), synthetic_drafter=0)
    results = {"load_s": round(time.perf_counter() - t0, 1), **engine.load_times}
    target, state, drafter = engine.target, engine.state, engine.proposer.drafter
    assert isinstance(target, GraphedTarget)
    prompt = torch.randint(0, 248320, (512,), device="cuda")
    out = model(prompt, state, engine.proposer.capture_layers, all_logits=False)
    state.commit(512)
    drafter.append_context(out.features, 0)

    def step(t, n):
        target.verify(list(range(t)))
        target.commit(n)
        state.length -= n  # stay at the same position
    results["step_1_ms"] = timed(lambda: step(1, 1))
    for t in (4, 8):
        if t in target.passes:
            results[f"verify_{t}_commit_{t}_ms"] = timed(lambda: step(t, t))
            results[f"verify_{t}_commit_1_ms"] = timed(lambda: step(t, 1))
    results["dflash2_propose_graph_ms"] = timed(lambda: engine.proposer.propose(5, state.length, 7))
    feats = out.features[:4]
    results["drafter_append_4_ms"] = timed(lambda: (drafter.append_context(feats, drafter.context.length)))
    mtp_proposer = MTPProposer(model, load_mtp_head(model, mtp, torch.bfloat16, "cuda"), 3, 4096, "cuda",
                               torch.bfloat16)
    hidden = out.hidden[:4]
    nxt = prompt[1:5]
    results["mtp_observe_4_eager_ms"] = timed(lambda: mtp_proposer.step(model.norm(hidden), nxt, 100))
    results["mtp_chain_step_eager_ms"] = timed(lambda: mtp_proposer.step(hidden[:1], nxt[:1], 104))
    results["lm_head_1_row_ms"] = timed(lambda: model.logits(hidden[:1]))
    for k, v in results.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "profile_cycle.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
