"""The short-pass gated delta rule kernel (kernels/gdn_triton.py) against the float32 reference, through the Triton
interpreter in a subprocess: a pass computing (and storing) its gates, then a replay of the first n tokens from the
stored gates, in place over the state, as a partial commit does."""

import json

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec.kernels import gdn
from blockspec.kernels.gdn_triton import gated_delta_short

CASES = [  # (key heads, key dim, value heads, value dim, tokens, replayed)
    (2, 16, 4, 12, 1, 1), (2, 16, 4, 12, 8, 3), (1, 32, 3, 16, 5, 5), (4, 24, 8, 20, 16, 9),
]


def reference(mixed, b, a, a_log, dt_bias, state, shape):
    g, beta = gdn.deltanet_gates.reference(b, a, a_log, dt_bias)
    q, k, v = gdn.deltanet_qkv.reference(mixed, *shape)
    out, final = gdn.gated_delta_rule_reference(q, k, v, g, beta, state)
    return out, final, g, beta


def _run_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    patch_triton_interpreter()
    results = []
    for hk, dk, hv, dv, t, n in CASES:
        gen = torch.Generator().manual_seed(t * 100 + hv)
        shape = (hk, dk, hv, dv)
        mixed = torch.randn(t, 2 * hk * dk + hv * dv + 5, generator=gen)[:, :-5]  # strided rows, as in a pack
        ab = torch.randn(t, 2 * hv + 3, generator=gen) * 3
        b, a = ab[:, :hv], ab[:, hv:2 * hv]
        a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
        state = torch.randn(hv, dk, dv, generator=gen)
        out_ref, final_ref, g_ref, beta_ref = reference(mixed, b, a, a_log, dt_bias, state, shape)
        final = torch.full_like(state, float("nan"))
        g_buf, beta_buf = torch.zeros(t, hv), torch.zeros(t, hv)
        out = gated_delta_short(mixed, state, final, shape, ("ab", b, a, a_log, dt_bias), (g_buf, beta_buf))
        replayed = state.clone()
        gated_delta_short(mixed[:n], replayed, replayed, shape, ("given", g_buf[:n], beta_buf[:n]))
        partial_ref = reference(mixed[:n], b[:n], a[:n], a_log, dt_bias, state, shape)[1]
        results.append({"case": [hk, dk, hv, dv, t, n], "out": float((out - out_ref).abs().max()),
                        "final": float((final - final_ref).abs().max()),
                        "gates": float(max((g_buf - g_ref).abs().max(), (beta_buf - beta_ref).abs().max())),
                        "replay": float((replayed - partial_ref).abs().max())})
    print("RESULTS " + json.dumps(results))


def test_short_pass_kernel_matches_reference_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results) == len(CASES)
    for r in results:
        assert max(r["out"], r["final"], r["gates"], r["replay"]) < 1e-4, r


if __name__ == "__main__":
    _run_cases()
