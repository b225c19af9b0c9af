"""Gated DeltaNet kernels in Triton, the fast paths beside the references of blockspec.kernels.gdn: the depthwise
causal conv (any length, window and output written by one launch) and the gated delta rule for short passes
(decode, verification, a partial commit's replay).

The recurrence kernel does in one launch what the reference spreads over a dozen: it reads the convolved
projection `mixed` as is (q and k L2-normalised in-kernel, q scaled, each key head shared by its value heads
without a repeat), computes the gates g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (or reads them
back for a replay), runs the recurrence from the committed state and writes the final state straight into the
given buffer (the pending state of the pass, or the committed state itself when a partial commit replays n
tokens: each program reads its tile before writing it). Programs: (value head, slice of BV value channels), as
fla-core's fused recurrent kernel.

`short_pass` is the whole DeltaNet mixer of a decode or verification pass in that one launch: it also runs the
causal conv (each program convolves the q/k channels of its key head and its own v slice, from the history and
the projection; the programs that own a channel write it to the window and conv-output buffers a partial commit
replays from), and the gated output norm (the last program of a value head to finish, counted by an atomic,
norms the head's whole output). That is 3 launches -> 1 per layer, 48 per 27B step.
"""

from __future__ import annotations

import torch

from . import arrival_counters, pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

# bench/gdn_kernel.py on the H200: 4.56 / 10.88 us per 27B layer at 1 / 8 tokens (fla-core's 8, 1: 4.85 / 11.72)
BLOCK_V, NUM_WARPS = 16, 1
# the conv (bench/gdn_kernel.py --parts conv, us per 27B layer, 1 / 8 tokens): 64 channels, 1 warp 1.95 / 3.99;
# 512 channels, 4 warps (the earlier choice: 20 programs) 2.17 / 5.41
CONV_BLOCK_C, CONV_WARPS = 64, 1


def available(x: torch.Tensor) -> bool:
    return triton_runs_on(x)


def gated_delta_short(mixed, state_in, state_out, shape, gates, gates_out=None, out_dtype=None, block_v=None,
                      num_warps=None):
    """mixed [T, 2*Hk*Dk + Hv*Dv] (conv output, rows may be strided); state_in / state_out [Hv, Dk, Dv] float32
    (may be the same tensor); shape = (Hk, Dk, Hv, Dv); gates = ("ab", b, a, A_log, dt_bias) with b, a [T, Hv]
    (rows may be strided), or ("given", g, beta) [T, Hv] float32. With gates_out = (g, beta) buffers the computed
    gates are stored there (for a later replay). Returns out [T, Hv, Dv] (out_dtype, default float32)."""
    out = torch.empty(mixed.shape[0], shape[2], shape[3], device=mixed.device, dtype=out_dtype or torch.float32)
    _launch(mixed, state_in, state_out, shape, gates, gates_out, out, None, None, block_v, num_warps)
    return out


def short_pass(x, history, conv_weight, gates, state_in, state_out, shape, z, norm_weight, eps, window_out=None,
               mixed_out=None, gates_out=None, block_v=None, num_warps=None, update_history=False):
    """A DeltaNet layer's mixer over T tokens in one launch: conv + SiLU of the projection x [T, C] (rows may be
    strided) from history [K-1, C] with conv_weight [C, 1, K], the recurrence as `gated_delta_short`, then the
    gated output norm with z [T, Hv, Dv] (strided rows) and norm_weight [Dv]. Writes the window [K-1+T, C] and
    the conv output [T, C] into the given buffers (or scratch), the gates into gates_out when given, the final
    state into state_out. Returns (out [T, Hv, Dv] in x's dtype, window): the contract of the reference chain
    causal_conv1d_reference -> gated_delta -> gated_rms_norm_reference. update_history (one token): the history is
    shifted in place instead (no window, no conv output written; returns window None): each program shifts its
    own v channels, the last program of a key head to finish (an atomic count) its q/k channels, which every
    program of that key head reads."""
    t, channels = x.shape
    taps = conv_weight.shape[-1]
    if update_history and t != 1:
        raise ValueError(f"the history is shifted in place for one-token passes only, got {t} tokens")
    window = window_out if window_out is not None or update_history else x.new_empty(taps - 1 + t, channels)
    mixed = mixed_out if mixed_out is not None or update_history else x.new_empty(t, channels)
    out = torch.empty(t, shape[2], shape[3], device=x.device, dtype=x.dtype)
    _launch(mixed if mixed is not None else x, state_in, state_out, shape, gates, gates_out, out,
            (x, history, conv_weight, window if window is not None else x, update_history), (z, norm_weight, eps),
            block_v, num_warps)
    return out, window


def _launch(mixed, state_in, state_out, shape, gates, gates_out, out, conv, norm, block_v, num_warps):
    key_heads, key_dim, value_heads, value_dim = shape
    if gates[0] == "ab":
        _, b, a, a_log, dt_bias = gates
        g_buf, beta_buf = gates_out if gates_out is not None else (out, out)  # unused unless SAVE_GATES
    else:
        _, g_buf, beta_buf = gates
        b = a = a_log = dt_bias = g_buf
    x, history, conv_weight, window, update_history = conv if conv is not None else (mixed, mixed, mixed, mixed,
                                                                                      False)
    z, norm_weight, eps = norm if norm is not None else (out, out, 0.0)
    block_v, num_warps = block_v or BLOCK_V, num_warps or NUM_WARPS
    counters = arrival_counters(out.device, value_heads + key_heads) if norm is not None else out
    _gated_delta_kernel[(value_heads * triton.cdiv(value_dim, block_v),)](
        mixed, mixed.stride(0), b, a, b.stride(0), a_log, dt_bias, g_buf, beta_buf, state_in, state_out, out,
        key_dim ** -0.5, mixed.shape[0], x, x.stride(0), history, conv_weight, window, z, z.stride(0),
        z.stride(1) if norm is not None else 0, norm_weight, eps, counters, KEY_HEADS=key_heads,
        VALUE_HEADS=value_heads, K=key_dim, V=value_dim, BV=block_v, BK=triton.next_power_of_2(key_dim),
        BVN=triton.next_power_of_2(value_dim), TAPS=conv_weight.shape[-1] if conv is not None else 1,
        COMPUTE_GATES=gates[0] == "ab", SAVE_GATES=gates[0] == "ab" and gates_out is not None,
        CONV=conv is not None, NORM=norm is not None, HISTORY_IN_PLACE=update_history, num_warps=num_warps,
        num_stages=3, **pdl.options(out))


def causal_conv1d(x, history, weight, window_out=None, mixed_out=None, block_c=None, num_warps=None):
    """Depthwise causal conv + SiLU (the contract of blockspec.kernels.gdn.causal_conv1d_reference) in one launch:
    x [T, C] (rows may be strided), history [K-1, C], weight [C, 1, K]; writes the window [K-1+T, C] (history then
    x) and the output [T, C] into the given buffers (or new ones). Accumulates in float32, rounds once."""
    t, channels = x.shape
    taps = weight.shape[-1]
    window = window_out if window_out is not None else x.new_empty(taps - 1 + t, channels)
    mixed = mixed_out if mixed_out is not None else x.new_empty(t, channels)
    block_c, num_warps = block_c or CONV_BLOCK_C, num_warps or CONV_WARPS
    _causal_conv1d_kernel[(triton.cdiv(channels, block_c),)](
        x, x.stride(0), history, weight, window, mixed, t, channels, K=taps, BLOCK_C=block_c, num_warps=num_warps,
        **pdl.options(x))
    return mixed, window


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _causal_conv1d_kernel(x, s_x, history, weight, window, mixed, T, C, K: tl.constexpr, BLOCK_C: tl.constexpr,
                              PDL: tl.constexpr):
        pdl.begin(PDL)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < C
        for t in range(T):  # every program owns its channels: it writes the window (history at t = 0) and output
            _conv_silu(x, s_x, history, weight, window, mixed, t, cols, ok, C, K, True)

    @triton.jit
    def _conv_silu(x, s_x, history, conv_w, window, mixed, t, cols, ok, C, TAPS: tl.constexpr, OWNER):
        """Conv + SiLU output of token t for channels `cols`, rounded to the activation dtype as the reference
        stores it, returned in float32; the channels' owner (OWNER: a scalar, False when nothing is recorded)
        also writes the window (history rows with token 0) and the conv output."""
        acc = tl.zeros(cols.shape, tl.float32)
        for j in tl.static_range(TAPS):
            row = t + j  # window row: history row `row` while row < TAPS-1, else input row row - (TAPS-1)
            from_history = tl.load(history + row * C + cols, mask=ok & (row < TAPS - 1), other=0.0)
            from_input = tl.load(x + (row - (TAPS - 1)) * s_x + cols, mask=ok & (row >= TAPS - 1), other=0.0)
            acc += (from_history + from_input).to(tl.float32) * tl.load(conv_w + cols * TAPS + j, mask=ok).to(
                tl.float32)
        y = (acc * tl.sigmoid(acc)).to(mixed.dtype.element_ty)
        write = ok & OWNER
        if t == 0:
            for r in tl.static_range(TAPS - 1):
                tl.store(window + r * C + cols, tl.load(history + r * C + cols, mask=write), mask=write)
        tl.store(window + (TAPS - 1 + t) * C + cols, tl.load(x + t * s_x + cols, mask=write), mask=write)
        tl.store(mixed + t * C + cols, y, mask=write)
        return y.to(tl.float32)

    @triton.jit
    def _shift_history(x, history, cols, ok, C, TAPS: tl.constexpr):
        for r in tl.static_range(TAPS - 2):
            tl.store(history + r * C + cols, tl.load(history + (r + 1) * C + cols, mask=ok), mask=ok)
        tl.store(history + (TAPS - 2) * C + cols, tl.load(x + cols, mask=ok), mask=ok)

    @triton.jit(do_not_specialize=["T"])
    def _gated_delta_kernel(mixed, s_mixed, b, a, s_ab, a_log, dt_bias, g_buf, beta_buf, h0, ht, out, scale, T,
                            x, s_x, history, conv_w, window, z, s_z_t, s_z_h, norm_w, eps, counters,
                            KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, BK: tl.constexpr, BVN: tl.constexpr, TAPS: tl.constexpr,
                            COMPUTE_GATES: tl.constexpr, SAVE_GATES: tl.constexpr, CONV: tl.constexpr,
                            NORM: tl.constexpr, HISTORY_IN_PLACE: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        pid = tl.program_id(0)
        slices = tl.cdiv(V, BV)
        i_v = pid % slices
        hv = pid // slices
        hk = hv // (VALUE_HEADS // KEY_HEADS)
        ks = tl.arange(0, BK)
        vs = i_v * BV + tl.arange(0, BV)
        k_ok, v_ok = ks < K, vs < V
        tile = hv * K * V + ks[:, None] * V + vs[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        state = tl.load(h0 + tile, mask=tile_ok, other=0.0)
        if COMPUTE_GATES:
            decay_rate = -tl.exp(tl.load(a_log + hv).to(tl.float32))
            bias = tl.load(dt_bias + hv).to(tl.float32)
        # who writes the window and conv output a replay needs: one program per key head its q, k channels; each
        # program its own v slice; nobody when the history is shifted in place (a replay never follows)
        qk_owner = (hv % (VALUE_HEADS // KEY_HEADS) == 0) & (i_v == 0)
        v_owner = i_v >= 0
        if HISTORY_IN_PLACE:
            qk_owner = qk_owner & False
            v_owner = qk_owner
        C = 2 * KEY_HEADS * K + VALUE_HEADS * V
        for t in range(T):
            if CONV:
                q = _conv_silu(x, s_x, history, conv_w, window, mixed, t, hk * K + ks, k_ok, C, TAPS, qk_owner)
                k = _conv_silu(x, s_x, history, conv_w, window, mixed, t, (KEY_HEADS + hk) * K + ks, k_ok, C, TAPS,
                               qk_owner)
                v = _conv_silu(x, s_x, history, conv_w, window, mixed, t, 2 * KEY_HEADS * K + hv * V + vs, v_ok, C,
                               TAPS, v_owner)
            else:
                row = mixed + t * s_mixed
                q = tl.load(row + hk * K + ks, mask=k_ok, other=0.0).to(tl.float32)
                k = tl.load(row + (KEY_HEADS + hk) * K + ks, mask=k_ok, other=0.0).to(tl.float32)
                v = tl.load(row + 2 * KEY_HEADS * K + hv * V + vs, mask=v_ok, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
            if COMPUTE_GATES:
                beta = tl.sigmoid(tl.load(b + t * s_ab + hv).to(tl.float32))
                a_t = tl.load(a + t * s_ab + hv).to(tl.float32) + bias
                g = decay_rate * tl.where(a_t > 20.0, a_t, tl.log(1.0 + tl.exp(a_t)))  # F.softplus, threshold 20
                if SAVE_GATES:
                    tl.store(g_buf + t * VALUE_HEADS + hv, g, mask=i_v == 0)
                    tl.store(beta_buf + t * VALUE_HEADS + hv, beta, mask=i_v == 0)
            else:
                g = tl.load(g_buf + t * VALUE_HEADS + hv)
                beta = tl.load(beta_buf + t * VALUE_HEADS + hv)
            state = state * tl.exp(g)
            delta = (v - tl.sum(state * k[:, None], 0)) * beta
            state = state + k[:, None] * delta[None, :]
            o = tl.sum(state * q[:, None], 0)
            tl.store(out + (t * VALUE_HEADS + hv) * V + vs, o.to(out.dtype.element_ty), mask=v_ok)
        tl.store(ht + tile, state, mask=tile_ok)
        if HISTORY_IN_PLACE:  # one token: history rows 0..TAPS-2 <- rows 1.., then the input
            tl.debug_barrier()  # every read of this program's history is done
            _shift_history(x, history, 2 * KEY_HEADS * K + hv * V + vs, v_ok, C, TAPS)
            arrivals = counters + VALUE_HEADS + hk
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == slices * (VALUE_HEADS // KEY_HEADS) - 1:
                _shift_history(x, history, hk * K + ks, k_ok, C, TAPS)  # the key head's q and k channels
                _shift_history(x, history, (KEY_HEADS + hk) * K + ks, k_ok, C, TAPS)
                tl.atomic_xchg(arrivals, 0)
        if NORM:  # the head's last program to finish norms its whole output (the other slices read back via L2)
            tl.debug_barrier()
            if tl.atomic_add(counters + hv, 1, sem="acq_rel") == slices - 1:
                cols = tl.arange(0, BVN)
                ok = cols < V
                dtype = out.dtype.element_ty
                weight = tl.load(norm_w + cols, mask=ok, other=0.0).to(dtype)
                for t in range(T):
                    o = tl.load(out + (t * VALUE_HEADS + hv) * V + cols, mask=ok, other=0.0, cache_modifier=".cg")
                    o = o.to(tl.float32)
                    normed = (o * tl.rsqrt(tl.sum(o * o, 0) / V + eps)).to(dtype)
                    gate = tl.load(z + t * s_z_t + hv * s_z_h + cols, mask=ok, other=0.0).to(tl.float32)
                    y = (normed * weight).to(tl.float32) * gate * tl.sigmoid(gate)
                    tl.store(out + (t * VALUE_HEADS + hv) * V + cols, y.to(dtype), mask=ok)
                tl.atomic_xchg(counters + hv, 0)  # clean for the next launch / graph replay
