"""The engine on its Triton fast paths (split-KV attention, short-pass DeltaNet kernel; run on the CPU through the
Triton interpreter, in a subprocess) against the engine on the reference paths: the same tokens and the same
accepted lengths in every mode, through passes, partial commits and rollbacks."""

import json
import sys

import pytest
import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.engine.engine import Engine

# Tokens generated per mode. Under the interpreter a plain step costs ~1 s and a speculative cycle 3-6 s: plain
# decoding needs only a few one-token steps; 13 tokens are 4 cycles in mtp and dflash2 on the planted pair, accepting
# 3, 2, 3 and 0 (a whole block, a partial commit, a rollback), as the reference's accepted lengths show.
MAX_TOKENS = {"none": 6, "mtp": 13, "dflash2": 13}


def generate_all(target, drafter) -> dict:
    runs = {}
    for mode, max_tokens in MAX_TOKENS.items():
        e = Engine.load(target, device="cpu", context_length=128, mode=mode, compute_dtype="float32",
                        dflash2_model=str(drafter) if mode == "dflash2" else None)
        r = e.generate(e.tokenizer.encode("hello world"), max_tokens, stop_at_eos=False)
        runs[mode] = {"tokens": r.tokens, "accepted": r.stats.get("accepted_per_cycle")}
    return runs


@pytest.mark.slow
def test_engine_on_triton_kernels_equals_reference(tiny_checkpoint, tiny_drafter):
    from blockspec.kernels import attention_triton, gdn_triton

    assert not attention_triton.available(torch.zeros(1, 1, 32)) and not gdn_triton.available(torch.zeros(1))
    target = tiny_checkpoint(seed=0, planted=True)
    drafter = tiny_drafter(target)
    reference = generate_all(target, drafter)
    fast = run_in_triton_interpreter(__file__, target, drafter)
    assert fast == reference
    assert any(sum(r["accepted"] or []) for r in reference.values())  # speculation accepted (and rolled back)


if __name__ == "__main__":  # python test_fast_paths.py TARGET DRAFTER, with TRITON_INTERPRET=1
    patch_triton_interpreter()
    from blockspec.kernels import attention_triton, gdn_triton

    assert attention_triton.available(torch.zeros(1, 1, 32)) and gdn_triton.available(torch.zeros(1))
    print("RESULTS " + json.dumps(generate_all(*sys.argv[1:3])), file=sys.stdout)
