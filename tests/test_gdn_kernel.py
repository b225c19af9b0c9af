"""The short-pass gated delta rule kernel (kernels/gdn_triton.py) against the float32 reference, through the Triton
interpreter in a subprocess: a pass computing (and storing) its gates, then a replay of the first n tokens from the
stored gates, in place over the state, as a partial commit does; and the whole mixer in one launch (conv +
recurrence + gated output norm, `short_pass`) against the reference chain, also shifting the conv history in place
(plain decoding's one-token step); and the layers of one state stack committed by one launch."""

import json

import pytest
import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec import kernels
from blockspec.kernels import gdn
from blockspec.kernels.gdn_gates import GateProjections, Gates, deltanet_gates
from blockspec.kernels.gdn_triton import gated_delta_short, short_pass
from blockspec.kernels.norm import gated_rms_norm_reference

CASES = [  # (key heads, key dim, value heads, value dim, tokens, replayed)
    (2, 16, 4, 12, 1, 1), (2, 16, 4, 12, 8, 3), (1, 32, 3, 16, 5, 5), (4, 24, 8, 20, 16, 9),
]


def _err(got, want) -> float:
    """Largest absolute difference; infinite where got holds a NaN (an unwritten element of a NaN-filled buffer)."""
    diff = (got - want).abs()
    return float("inf") if bool(diff.isnan().any()) else float(diff.max())


def reference(mixed, b, a, a_log, dt_bias, state, shape):
    g, beta = deltanet_gates.reference(b, a, a_log, dt_bias)
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
        out = gated_delta_short(mixed, state, final, shape, GateProjections(b, a, a_log, dt_bias), (g_buf, beta_buf))
        replayed = state.clone()
        gated_delta_short(mixed[:n], replayed, replayed, shape, Gates(g_buf[:n], beta_buf[:n]))
        partial_ref = reference(mixed[:n], b[:n], a[:n], a_log, dt_bias, state, shape)[1]
        results.append({"case": [hk, dk, hv, dv, t, n], "out": _err(out, out_ref),
                        "final": _err(final, final_ref),
                        "gates": max(_err(g_buf, g_ref), _err(beta_buf, beta_ref)),
                        "replay": _err(replayed, partial_ref)})
    print("RESULTS " + json.dumps({"recurrence": results, "mixer": _mixer_cases(), "stacked": _stacked_cases()}))


def _stacked_cases():
    """Three layers' states in one GDNStack (DecodeState's): a partial commit (the recurrence replayed over the first
    n recorded tokens) and a whole one, each one call for all layers (`commits`), against each layer alone."""
    from unittest import mock

    from blockspec.kernels import gdn_triton
    from blockspec.layers.gdn import GDNStack, GDNState, commits

    hk, dk, hv, dv, t, layers = 2, 16, 6, 20, 8, 3
    shape, channels = (hk, dk, hv, dv), 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(7)
    stack = GDNStack(layers, channels, 4, shape, t, "cpu", torch.float32)
    states = [GDNState(channels, 4, shape, t, "cpu", torch.float32, stack, i) for i in range(layers)]
    for buffer in (stack.pending_mixed, stack.recurrent, stack.pending_recurrent, stack.pending_window):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    stack.pending_g.copy_(-torch.rand(stack.pending_g.shape, generator=gen))
    stack.pending_beta.copy_(torch.rand(stack.pending_beta.shape, generator=gen))
    committed = stack.recurrent.clone()
    out = {}
    for n in (5, t):
        stack.recurrent.copy_(committed)
        want = []
        for s in states:
            q, k, v = gdn.deltanet_qkv.reference(s.pending_mixed[:n], *shape)
            final = gdn.gated_delta_rule_reference(q, k, v, s.pending_g[:n], s.pending_beta[:n], s.recurrent)[1]
            want.append((final if n < t else s.pending_recurrent.clone(), s.pending_window[n:n + 3].clone()))
        with mock.patch.object(gdn_triton, "gated_delta_short", wraps=gdn_triton.gated_delta_short) as kernel:
            commits(states, t, n)
        out[f"n={n}"] = {"state": max(_err(s.recurrent, w[0]) for s, w in zip(states, want)),
                         "history": max(_err(s.history, w[1]) for s, w in zip(states, want)),
                         "launches": kernel.call_count}
    return out


def _mixer_cases():
    results = []
    for hk, dk, hv, dv, t, block_v in [(2, 16, 4, 12, 1, 4), (2, 16, 4, 12, 8, 8), (1, 32, 3, 16, 5, 16),
                                       (4, 24, 8, 20, 16, 8)]:
        gen = torch.Generator().manual_seed(t * 10 + hv)
        shape, channels = (hk, dk, hv, dv), 2 * hk * dk + hv * dv
        packed = torch.randn(t, channels + 2 * hv * dv + 3, generator=gen)  # the projection's slices: strided
        x, z = packed[:, :channels], packed[:, channels:channels + hv * dv].view(t, hv, dv)
        history, conv_w = torch.randn(3, channels, generator=gen), torch.randn(channels, 1, 4, generator=gen) * 0.5
        ab = torch.randn(t, 2 * hv, generator=gen) * 3
        gates = GateProjections(ab[:, :hv], ab[:, hv:], torch.randn(hv, generator=gen), torch.randn(hv, generator=gen))
        norm_w = torch.randn(dv, generator=gen) * 0.1 + 1
        state = torch.randn(hv, dk, dv, generator=gen)
        ref_mixed, ref_window = gdn.causal_conv1d_reference.reference(x, history, conv_w)
        ref_out, ref_final, ref_g, ref_beta = reference(ref_mixed, gates.b, gates.a, gates.A_log, gates.dt_bias, state,
                                                        shape)
        ref_out = gated_rms_norm_reference.reference(ref_out, z, norm_w, 1e-6)
        in_place = state.clone()  # plain decoding's in-place pass: the state is read and written by one launch
        window, mixed = torch.full_like(ref_window, float("nan")), torch.full_like(ref_mixed, float("nan"))
        g_buf, beta_buf = torch.zeros(t, hv), torch.zeros(t, hv)
        out, _ = short_pass(x, history, conv_w, gates, in_place, in_place, shape, z, norm_w, 1e-6, window, mixed,
                            (g_buf, beta_buf), block_v=block_v)
        results.append({"case": [hk, dk, hv, dv, t, block_v], "out": _err(out, ref_out),
                        "final": _err(in_place, ref_final),
                        "window": _err(window, ref_window),
                        "mixed": _err(mixed, ref_mixed),
                        "gates": max(_err(g_buf, ref_g), _err(beta_buf, ref_beta)),
                        "counters_clean": int(kernels._COUNTERS[("cpu", None)].abs().sum()) == 0})
        if t == 1:  # plain decoding's step: the history shifted in place, nothing recorded for a replay
            shifted, in_place = history.clone(), state.clone()
            out, window = short_pass(x, shifted, conv_w, gates, in_place, in_place, shape, z, norm_w, 1e-6,
                                     block_v=block_v, update_history=True)
            results[-1].update(shifted_out=_err(out, ref_out), shifted_final=_err(in_place, ref_final),
                               shifted_history=_err(shifted, ref_window[1:]), no_window=window is None,
                               shifted_counters_clean=int(kernels._COUNTERS[("cpu", None)].abs().sum()) == 0)
    return results


@pytest.mark.slow
def test_short_pass_kernel_matches_reference_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results["recurrence"]) == len(CASES)
    for r in results["recurrence"]:
        assert max(r["out"], r["final"], r["gates"], r["replay"]) < 1e-4, r
    assert len(results["mixer"]) == 4
    for r in results["mixer"]:  # NaN-filled buffers: a channel the kernel forgets to write fails here
        assert max(r["out"], r["final"], r["window"], r["mixed"], r["gates"]) < 1e-4 and r["counters_clean"], r
    stacked = results["stacked"]
    assert stacked["n=5"]["state"] < 1e-4 and stacked["n=5"]["history"] == 0 and stacked["n=5"]["launches"] == 1
    assert stacked["n=8"]["state"] == 0 and stacked["n=8"]["history"] == 0 and stacked["n=8"]["launches"] == 0
    shifted = [r for r in results["mixer"] if "shifted_history" in r]
    assert shifted
    for r in shifted:
        assert max(r["shifted_out"], r["shifted_final"], r["shifted_history"]) < 1e-4, r
        assert r["no_window"] and r["shifted_counters_clean"], r


if __name__ == "__main__":
    _run_cases()


@pytest.mark.parametrize("tokens", [1, 7, 32, 33, 100])
def test_chunked_rule_equals_token_by_token_reference(tokens):
    """The CPU's gated delta rule (closed form, chunk after chunk) gives the reference's outputs and final state,
    across chunk boundaries; the committed state is not modified."""
    gen = torch.Generator().manual_seed(tokens)
    hk, dk, hv, dv = 2, 16, 4, 12
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=gen)
    g, beta = deltanet_gates.reference(*torch.randn(2, tokens, hv, generator=gen) * 3,
                                       torch.randn(hv, generator=gen), torch.randn(hv, generator=gen))
    q, k, v = gdn.deltanet_qkv.reference(mixed, hk, dk, hv, dv)
    state = torch.randn(hv, dk, dv, generator=gen)
    kept = state.clone()
    out_ref, final_ref = gdn.gated_delta_rule_reference(q, k, v, g, beta, state)
    out, final = gdn.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=32)
    assert torch.equal(state, kept)
    assert _err(out, out_ref) < 1e-5 and _err(final, final_ref) < 1e-5
    if tokens > 1:  # the state really follows the tokens: without the last one it is another
        assert _err(gdn.gated_delta_rule_chunked(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], state)[1],
                    final_ref) > 1e-3
