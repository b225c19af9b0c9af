"""The gated delta rule on the CPU (blockspec/kernels/gdn.py), as a DeltaNet layer of the demo pair runs it (6 value
heads, 64 x 64 state per head, float32): token by token (`gated_delta_rule_reference`) against the chunked form
(`gated_delta_rule_chunked`), milliseconds per call (median of repeats) and the largest difference of the outputs and
the final state. Short passes (1, 2, 3, 8 tokens: a plain step, a chain's verification) as one chunk, then a prompt
(900 tokens) in chunks of 16, 32, 64 and 128; the engine's choice (`gated_delta_rule`'s SERIAL_TOKENS, CHUNK) is
marked. JSON to $OUT/cpu_recurrence.json.
Usage (the CPU, seconds): OMP_NUM_THREADS=2 python bench/cpu_recurrence.py [--threads 2]; --dry-run: 40 tokens.
"""

import json
import os
import sys
import time

import torch

from blockspec.kernels import gdn

HEADS, DIM, PROMPT, SHORT, CHUNKS = 6, 64, 900, (1, 2, 3, 8), (16, 32, 64, 128)


def ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    dry = "--dry-run" in sys.argv
    torch.set_num_threads(int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2)
    tokens = 40 if dry else PROMPT
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(tokens, HEADS, DIM, generator=gen), dim=-1) * DIM ** -0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, HEADS, DIM, generator=gen), dim=-1)
    v = torch.randn(tokens, HEADS, DIM, generator=gen)
    g = -torch.rand(tokens, HEADS, generator=gen)  # log decays as the demo target's gates give them
    beta = torch.rand(tokens, HEADS, generator=gen)
    state = 0.1 * torch.randn(HEADS, DIM, DIM, generator=gen)
    repeats = 1 if dry else 7
    results = {}
    for n, chunks in [*((n, (n,)) for n in SHORT), (tokens, CHUNKS)]:
        args = (q[:n], k[:n], v[:n], g[:n], beta[:n], state)
        out_ref, final_ref = gdn.gated_delta_rule_reference(*args)
        row = {"token by token ms": round(ms(lambda: gdn.gated_delta_rule_reference(*args), repeats), 3)}
        for chunk in chunks:
            out, final = gdn.gated_delta_rule_chunked(*args, chunk)
            row[f"chunks of {chunk} ms"] = round(ms(lambda c=chunk: gdn.gated_delta_rule_chunked(*args, c), repeats), 3)
            row[f"chunks of {chunk} max_err"] = max(float((out - out_ref).abs().max()),
                                                    float((final - final_ref).abs().max()))
        engine = "token by token" if n <= gdn.SERIAL_TOKENS else f"chunks of {min(gdn.CHUNK, n)}"
        row["engine"] = engine
        results[str(n)] = row
        print(f"{n:4d} tokens: " + ", ".join(f"{key} {value}" for key, value in row.items() if "err" not in key),
              flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "cpu_recurrence.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
