"""Gated DeltaNet kernels in Triton, the fast paths beside the references of blockspec.kernels.gdn: the depthwise
causal conv (any length, window and output written by one launch) and the gated delta rule for short passes
(decode, verification, a partial commit's replay), and a draft tree's pass and kept path.

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

`tree_pass` is the mixer of a draft-tree pass (each node's conv and recurrence along its own path): the tree conv,
then one launch that solves the recurrence over the whole tree in closed form (matrix products under ancestor
masks, no serial steps) and norms. `keep_path` commits a kept path from the nodes' deltas that pass wrote: one
product of the path's keys with its deltas, and the kept conv history, in one launch.
"""

from __future__ import annotations

import torch

from . import arrival_counters, pdl, triton_runs_on
from .gdn_gates import GateProjections, Gates

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

# Tile sizes: the fastest of bench/gdn_kernel.py's sweeps on the H200 (docs/benchmarks.md, "DeltaNet"). Small
# programs: a decode step's work per layer is a few MB, so more programs in flight beat wider ones.
BLOCK_V, NUM_WARPS = 16, 1
CONV_BLOCK_C, CONV_WARPS = 64, 1
CONV_ROWS = 16  # tokens a prefill conv program takes: a program per channel block alone would run serially


def available(x: torch.Tensor) -> bool:
    return triton_runs_on(x)


def gated_delta_short(mixed, state_in, state_out, shape, gates, gates_out=None, out_dtype=None, block_v=None,
                      num_warps=None):
    """mixed [T, 2*Hk*Dk + Hv*Dv] (conv output, rows may be strided); state_in / state_out [Hv, Dk, Dv] float32
    (may be the same tensor); shape = (Hk, Dk, Hv, Dv); gates: GateProjections (b, a rows may be strided) or Gates
    (gdn_gates.py). With gates_out = (g, beta) buffers the computed gates are stored there (for a later replay).
    Returns out [T, Hv, Dv] (out_dtype, default float32). With stored Gates, every buffer may carry a leading
    dimension of layers (state_in [L, Hv, Dk, Dv], mixed [L, T, C], gates [L, T, Hv]; DecodeState's stack): the L
    layers' recurrences in one launch, a grid dimension of layers (out [L, T, Hv, Dv])."""
    stacked = state_in.dim() == 4
    if stacked and not isinstance(gates, Gates):
        raise ValueError("stacked layers take stored Gates, not projections")
    out = torch.empty(*mixed.shape[:-1], shape[2], shape[3], device=mixed.device, dtype=out_dtype or torch.float32)
    layers = (state_in.shape[0], [t.stride(0) for t in (mixed, gates.g, gates.beta, state_in, state_out, out)]) \
        if stacked else None
    _launch(mixed, state_in, state_out, shape, gates, gates_out, out, None, None, block_v, num_warps, layers)
    return out


def keep_path(mixed, g, state, shape, path, deltas, window, history_rows, history, block_v=None, num_warps=None):
    """A kept path of a recorded tree pass in one launch: the contract of blockspec.kernels.gdn.keep_path_reference
    (the state after the path's n <= MAX_PATH nodes in closed form, in place over `state` [Hv, Dk, Dv] float32,
    from the rows `path` [n] of the conv output mixed [T, C], the log decays g [T, Hv] and the deltas [T, Hv, Dv];
    the conv history [K-1, C] set to the rows history_rows [K-1] of the recorded window). Programs (value head, BV
    value channels): the path's keys normalised and weighted by the decay after each node, then one float32
    product [Dk, n] x [n, BV] added to the decayed state tile; the history's channels are copied by their owners as
    in the recurrence kernel. With a leading layer dimension on every buffer but path and history_rows (state [L,
    Hv, Dk, Dv], ...: the layers of one stack, DecodeState's), the L layers' paths in the same launch, a grid
    dimension of layers: their latencies overlap where one launch a layer waits on each in turn."""
    n = path.shape[0]
    if n > MAX_PATH:
        raise ValueError(f"a kept path holds at most {MAX_PATH} nodes, got {n}")
    key_heads, key_dim, value_heads, value_dim = shape
    stacked = state.dim() == 4
    layers = state.shape[0] if stacked else 1
    strides = [t.stride(0) if stacked else 0 for t in (mixed, g, deltas, state, window, history)]
    block_v = block_v or PATH_BLOCK_V
    _keep_path_kernel[(value_heads * triton.cdiv(value_dim, block_v), layers)](
        mixed, mixed.stride(-2), g, deltas, state, path.contiguous(), n, window, history_rows.contiguous(), history,
        *strides, KEY_HEADS=key_heads, VALUE_HEADS=value_heads, K=key_dim, V=value_dim, BV=block_v,
        BK=triton.next_power_of_2(key_dim), BP=MAX_PATH, TAPS=history.shape[-2] + 1,
        num_warps=num_warps or PATH_WARPS, **pdl.options(state))


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


def tree_pass(x, history, conv_weight, gates, state, shape, z, norm_weight, eps, window_rows, ancestors, max_depth,
              window_out=None, mixed_out=None, gates_out=None, deltas_out=None, block_v=None, num_warps=None,
              precision=None, block_k=None):
    """A DeltaNet layer's mixer over a draft tree's T <= 64 nodes (layers/tree.py): the contract of
    blockspec.kernels.gdn.deltanet_tree_mixer. Node i convolves the rows window_rows[i] [K] of [history; x] and
    steps from its parent's state (the root from the committed `state` [Hv, Dk, Dv] float32, which is left as it
    is); ancestors [T, T] bool: node j on node i's path (i included), no node deeper than max_depth. Gates, z and
    the norm as `short_pass`. Writes the window [K-1+T, C], the conv output [T, C], the gates (computed ones) and
    the nodes' deltas [T, Hv, Dv] float32 (keep_path's input) into the given buffers (or scratch); returns
    (out [T, Hv, Dv] in x's dtype, window). No host synchronisation: CUDA-graph capturable.

    Two launches: the conv (`_tree_conv_kernel`, nodes x channel blocks), then the recurrence with the gated output
    norm (`_tree_kernel`, programs (value head, BV slice), the head's last program norming its rows). The conv stays
    out of the recurrence kernel because there every program of a key head would convolve its q/k channels again.

    The recurrence is solved in closed form over the whole tree at once instead of stepping node by node. The
    root takes its one step (S_r = e^g_0 (I - b_0 k_0 k_0^T) S_0 + b_0 k_0 v_0^T, kept as S_0 and a rank-one term);
    below it, along a path, the gated delta rule S_i = e^g_i (I - b_i k_i k_i^T) S_parent + b_i k_i v_i^T unrolls to
        S_i = d_i S_r + sum_{j on i's path} (d_i / d_j) k_j u_j^T,   d_i = exp(sum of g over i's path below the root),
        u_i = b_i (v_i - d_i S_r^T k_i - sum_{j strict ancestor of i} (d_i / d_j) (k_i . k_j) u_j),
    so (I + A) U = R with A[i, j] = b_i (d_i / d_j) (k_i . k_j) on strict ancestors only, and
        o_i = d_i S_r^T q_i + sum_{j on i's path} (d_i / d_j) (q_i . k_j) u_j:
    the tree form of the chunked delta rule (fla's chunk kernels use the causal mask where these use the ancestor
    masks). A is nilpotent (a product of n factors follows n strict-ancestor steps: A^D = 0 when no node lies deeper
    than D), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)..., bit_length(D - 1) factors applied to R by as many matrix
    products. Every step is a matrix product on the tensor cores over the T - 1 nodes below the root (padded to 16,
    32 or 64: the root's own step keeps 17 and 33 nodes at 16 and 32); nothing runs T serial steps and no state per
    node is kept: u_i is node i's delta, from which keep_path builds a kept path's state. The products take TF32 on
    bfloat16 / float16 activations (relative error ~2^-11, under the output's own rounding at 2^-9; a kept state
    carries it in its deltas' share) and TF32x3 on float32 ones (about float32's precision, three TF32 products a
    product).

    bench/gdn_kernel.py --parts tree times it on the 27B's shapes (docs/benchmarks.md, "Draft trees")."""
    t, channels = x.shape
    if t > MAX_TREE_NODES:
        raise ValueError(f"a tree pass runs at most {MAX_TREE_NODES} nodes, got {t}")
    key_heads, key_dim, value_heads, value_dim = shape
    taps = conv_weight.shape[-1]
    window = window_out if window_out is not None else x.new_empty(taps - 1 + t, channels)
    mixed = mixed_out if mixed_out is not None else x.new_empty(t, channels)
    out = torch.empty(t, value_heads, value_dim, device=x.device, dtype=x.dtype)
    deltas = deltas_out if deltas_out is not None else torch.empty(t, value_heads, value_dim, device=x.device,
                                                                   dtype=torch.float32)
    b, a, a_log, dt_bias, g_buf, beta_buf = _gate_args(gates, gates_out, out)
    computes = isinstance(gates, GateProjections)
    rows = max(16, triton.next_power_of_2(t - 1))  # the nodes below the root, as tl.dot takes them
    block_v = block_v or TREE_BLOCK_V
    num_warps = num_warps or (4 if rows <= 16 else 8)
    precision = precision or ("tf32x3" if x.dtype == torch.float32 else "tf32")
    window_rows = window_rows.contiguous()
    _tree_conv_kernel[(triton.cdiv(channels, CONV_BLOCK_C), triton.cdiv(t, TREE_CONV_ROWS))](
        x, x.stride(0), history, conv_weight, window, mixed, window_rows, t, channels, TAPS=taps, BLOCK_C=CONV_BLOCK_C,
        ROWS=TREE_CONV_ROWS, num_warps=CONV_WARPS, **pdl.options(x))
    _tree_kernel[(value_heads * triton.cdiv(value_dim, block_v),)](
        mixed, ancestors.contiguous().view(torch.uint8), b, a, b.stride(0), a_log, dt_bias, g_buf, beta_buf, state,
        out, deltas, key_dim ** -0.5, t, z, z.stride(0), z.stride(1), norm_weight, eps,
        arrival_counters(x.device, value_heads), KEY_HEADS=key_heads, VALUE_HEADS=value_heads, K=key_dim, V=value_dim,
        BV=block_v, BK=block_k or TREE_BLOCK_K, BVN=triton.next_power_of_2(value_dim), BT=rows,
        DOUBLINGS=max(0, min(max_depth, t - 1) - 1).bit_length(), PRECISION=precision, NORM_ROWS=TREE_NORM_ROWS,
        COMPUTE_GATES=computes, SAVE_GATES=computes and gates_out is not None, num_warps=num_warps,
        **pdl.options(out))
    return out, window


MAX_TREE_NODES = 64  # the walk packs node indices into 6 bits
MAX_PATH = 16  # nodes of a kept path: a drafter block's rows at most
PATH_BLOCK_V, PATH_WARPS = 16, 2  # keep_path: the fastest in bench/gdn_kernel.py --parts tree
TREE_NORM_ROWS, TREE_CONV_ROWS = 8, 16  # rows the norm epilogue / a tree conv program takes at a time
# the closed-form tree recurrence: value channels a program (tl.dot needs >= 16), key channels a load (the 27B's
# 128 in one: one dependent round of products instead of four, the fastest in bench/gdn_kernel.py --parts tree)
TREE_BLOCK_V, TREE_BLOCK_K = 64, 128


def _gate_args(gates, gates_out, out):
    """(b, a, A_log, dt_bias, g buffer, beta buffer) for the kernels; placeholders where unused."""
    if isinstance(gates, GateProjections):
        g_buf, beta_buf = gates_out if gates_out is not None else (out, out)  # unused unless SAVE_GATES
        return gates.b, gates.a, gates.A_log, gates.dt_bias, g_buf, beta_buf
    return gates.g, gates.g, gates.g, gates.g, gates.g, gates.beta


def _launch(mixed, state_in, state_out, shape, gates, gates_out, out, conv, norm, block_v, num_warps, layers=None):
    """The recurrence kernel's launch; layers: (count, the strides between layers of mixed, g, beta, state_in,
    state_out, out) for stacked layers (gated_delta_short)."""
    key_heads, key_dim, value_heads, value_dim = shape
    count, strides = layers or (1, [0] * 6)
    b, a, a_log, dt_bias, g_buf, beta_buf = _gate_args(gates, gates_out, out)
    computes = isinstance(gates, GateProjections)
    x, history, conv_weight, window, update_history = conv if conv is not None else (mixed, mixed, mixed, mixed,
                                                                                      False)
    taps = conv_weight.shape[-1] if conv is not None else 1
    z, norm_weight, eps = norm if norm is not None else (out, out, 0.0)
    block_v, num_warps = block_v or BLOCK_V, num_warps or NUM_WARPS
    counters = arrival_counters(out.device, value_heads + key_heads) if norm is not None else out
    _gated_delta_kernel[(value_heads * triton.cdiv(value_dim, block_v), count)](
        mixed, mixed.stride(-2), b, a, b.stride(0), a_log, dt_bias, g_buf, beta_buf, state_in, state_out, out,
        key_dim ** -0.5, out.shape[-3], x, x.stride(0), history, conv_weight, window, z, z.stride(0),
        z.stride(1) if norm is not None else 0, norm_weight, eps, counters, *strides, KEY_HEADS=key_heads,
        VALUE_HEADS=value_heads, K=key_dim, V=value_dim, BV=block_v, BK=triton.next_power_of_2(key_dim),
        BVN=triton.next_power_of_2(value_dim), TAPS=taps, COMPUTE_GATES=computes,
        SAVE_GATES=computes and gates_out is not None, CONV=conv is not None, NORM=norm is not None,
        HISTORY_IN_PLACE=update_history, num_warps=num_warps, num_stages=3,
        **pdl.options(out))


def causal_conv1d(x, history, weight, window_out=None, mixed_out=None, block_c=None, num_warps=None):
    """Depthwise causal conv + SiLU (the contract of blockspec.kernels.gdn.causal_conv1d_reference) in one launch:
    x [T, C] (rows may be strided), history [K-1, C], weight [C, 1, K]; writes the window [K-1+T, C] (history then
    x) and the output [T, C] into the given buffers (or new ones). Accumulates in float32, rounds once."""
    t, channels = x.shape
    taps = weight.shape[-1]
    window = window_out if window_out is not None else x.new_empty(taps - 1 + t, channels)
    mixed = mixed_out if mixed_out is not None else x.new_empty(t, channels)
    block_c, num_warps = block_c or CONV_BLOCK_C, num_warps or CONV_WARPS
    _causal_conv1d_kernel[(triton.cdiv(channels, block_c), triton.cdiv(t, CONV_ROWS))](
        x, x.stride(0), history, weight, window, mixed, t, channels, K=taps, BLOCK_C=block_c, ROWS=CONV_ROWS,
        num_warps=num_warps, **pdl.options(x))
    return mixed, window


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _causal_conv1d_kernel(x, s_x, history, weight, window, mixed, T, C, K: tl.constexpr, BLOCK_C: tl.constexpr,
                              ROWS: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < C
        first = tl.program_id(1) * ROWS
        # a program owns its channels of ROWS tokens (a prefill's tokens run in parallel, not one after another):
        # it writes their window rows (and the history's, with token 0) and outputs
        for t in range(first, tl.minimum(first + ROWS, T)):
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

    @triton.jit
    def _copy_rows(window, history_rows, history, cols, ok, C, TAPS: tl.constexpr):
        """history rows 0..TAPS-2 <- the window rows history_rows[0..TAPS-2], channels `cols`."""
        for r in tl.static_range(TAPS - 1):
            source = tl.load(history_rows + r)
            tl.store(history + r * C + cols, tl.load(window + source * C + cols, mask=ok), mask=ok)

    @triton.jit
    def _head_tile(pid, KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, BK: tl.constexpr):
        """Program pid's (value head, BV slice) of the recurrence: (slice index, value head, its key head, key and
        value channel ranges with their masks, the state tile's offsets and mask)."""
        slices = tl.cdiv(V, BV)
        i_v = pid % slices
        hv = pid // slices
        hk = hv // (VALUE_HEADS // KEY_HEADS)
        ks = tl.arange(0, BK)
        vs = i_v * BV + tl.arange(0, BV)
        k_ok, v_ok = ks < K, vs < V
        tile = hv * K * V + ks[:, None] * V + vs[None, :]
        return i_v, hv, hk, ks, vs, k_ok, v_ok, tile, k_ok[:, None] & v_ok[None, :]

    @triton.jit
    def _gate_constants(a_log, dt_bias, hv, COMPUTE_GATES: tl.constexpr):
        """Value head hv's -exp(A_log) and dt_bias (zeros when the gates are given)."""
        if COMPUTE_GATES:
            decay_rate, bias = -tl.exp(tl.load(a_log + hv).to(tl.float32)), tl.load(dt_bias + hv).to(tl.float32)
        else:
            decay_rate, bias = 0.0, 0.0
        return decay_rate, bias

    @triton.jit
    def _gates(b, a, s_ab, g_buf, beta_buf, row, ok, hv, decay_rate, bias, save, VALUE_HEADS: tl.constexpr,
               COMPUTE_GATES: tl.constexpr, SAVE_GATES: tl.constexpr):
        """(g, beta) of value head hv at token(s) `row` (where ok): computed from b, a (and stored by the program
        `save`, a scalar, when SAVE_GATES), or read back from the gate buffers."""
        if COMPUTE_GATES:
            beta = tl.sigmoid(tl.load(b + row * s_ab + hv, mask=ok, other=0.0).to(tl.float32))
            a_t = tl.load(a + row * s_ab + hv, mask=ok, other=0.0).to(tl.float32) + bias
            g = decay_rate * tl.where(a_t > 20.0, a_t, tl.log(1.0 + tl.exp(a_t)))  # F.softplus, threshold 20
            if SAVE_GATES:
                tl.store(g_buf + row * VALUE_HEADS + hv, g, mask=ok & save)
                tl.store(beta_buf + row * VALUE_HEADS + hv, beta, mask=ok & save)
        else:
            g = tl.load(g_buf + row * VALUE_HEADS + hv, mask=ok, other=0.0)
            beta = tl.load(beta_buf + row * VALUE_HEADS + hv, mask=ok, other=0.0)
        return g, beta

    @triton.jit
    def _delta_step(state, q, k, v, g, beta, scale):
        """One token of the gated delta rule on a [K, BV] state tile from raw q, k (L2-normalised here, q scaled):
        (the state after it, the token's output)."""
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * delta[None, :]
        return state, tl.sum(state * q[:, None], 0)

    @triton.jit
    def _output_norm(out, z, s_z_t, s_z_h, norm_w, eps, counters, hv, slices, T, VALUE_HEADS: tl.constexpr,
                     V: tl.constexpr, BVN: tl.constexpr, ROWS: tl.constexpr):
        """The gated output norm of value head hv's T rows of `out`, in place, ROWS rows at a time, by the last of
        the head's `slices` programs to finish (an atomic count, acquire and release: the others' stores before
        theirs are visible to it, read back via L2), which resets the counter."""
        tl.debug_barrier()
        if tl.atomic_add(counters + hv, 1, sem="acq_rel") == slices - 1:
            cols = tl.arange(0, BVN)
            ok = cols < V
            dtype = out.dtype.element_ty
            weight = tl.load(norm_w + cols, mask=ok, other=0.0).to(dtype)
            for t0 in range(0, T, ROWS):
                t = t0 + tl.arange(0, ROWS)
                here = (t < T)[:, None] & ok[None, :]
                at = out + (t[:, None] * VALUE_HEADS + hv) * V + cols[None, :]
                o = tl.load(at, mask=here, other=0.0, cache_modifier=".cg").to(tl.float32)
                normed = (o * tl.rsqrt(tl.sum(o * o, 1) / V + eps)[:, None]).to(dtype)
                gate = tl.load(z + t[:, None] * s_z_t + hv * s_z_h + cols[None, :], mask=here, other=0.0)
                gate = gate.to(tl.float32)
                y = (normed * weight[None, :]).to(tl.float32) * gate * tl.sigmoid(gate)
                tl.store(at, y.to(dtype), mask=here)
            tl.atomic_xchg(counters + hv, 0)  # clean for the next launch / graph replay

    @triton.jit
    def _in_layer(ptr, stride):
        """ptr moved to layer program_id(1) of a stack whose layers lie `stride` elements apart."""
        return ptr + tl.program_id(1).to(tl.int64) * stride

    @triton.jit(do_not_specialize=["T"])
    def _gated_delta_kernel(mixed, s_mixed, b, a, s_ab, a_log, dt_bias, g_buf, beta_buf, h0, ht, out, scale,
                            T, x, s_x, history, conv_w, window, z, s_z_t, s_z_h, norm_w, eps, counters,
                            l_mixed, l_g, l_beta, l_h0, l_ht, l_out,
                            KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, BK: tl.constexpr, BVN: tl.constexpr, TAPS: tl.constexpr,
                            COMPUTE_GATES: tl.constexpr, SAVE_GATES: tl.constexpr, CONV: tl.constexpr,
                            NORM: tl.constexpr, HISTORY_IN_PLACE: tl.constexpr, PDL: tl.constexpr):
        """Layer program_id(1) (stacked layers, l_*: each buffer's stride between layers; 0 for one layer)."""
        pdl.begin(PDL)
        mixed, g_buf, beta_buf = _in_layer(mixed, l_mixed), _in_layer(g_buf, l_g), _in_layer(beta_buf, l_beta)
        h0, ht, out = _in_layer(h0, l_h0), _in_layer(ht, l_ht), _in_layer(out, l_out)
        i_v, hv, hk, ks, vs, k_ok, v_ok, tile, tile_ok = _head_tile(tl.program_id(0), KEY_HEADS, VALUE_HEADS, K, V,
                                                                    BV, BK)
        state = tl.load(h0 + tile, mask=tile_ok, other=0.0)
        decay_rate, bias = _gate_constants(a_log, dt_bias, hv, COMPUTE_GATES)
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
            g, beta = _gates(b, a, s_ab, g_buf, beta_buf, t, t < T, hv, decay_rate, bias, i_v == 0,
                             VALUE_HEADS, COMPUTE_GATES, SAVE_GATES)
            state, o = _delta_step(state, q, k, v, g, beta, scale)
            tl.store(out + (t * VALUE_HEADS + hv) * V + vs, o.to(out.dtype.element_ty), mask=v_ok)
        tl.store(ht + tile, state, mask=tile_ok)
        if HISTORY_IN_PLACE:  # one token: history rows 0..TAPS-2 <- rows 1.., then the input
            tl.debug_barrier()  # every read of this program's history is done
            _shift_history(x, history, 2 * KEY_HEADS * K + hv * V + vs, v_ok, C, TAPS)
            arrivals = counters + VALUE_HEADS + hk
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == tl.cdiv(V, BV) * (VALUE_HEADS // KEY_HEADS) - 1:
                _shift_history(x, history, hk * K + ks, k_ok, C, TAPS)  # the key head's q and k channels
                _shift_history(x, history, (KEY_HEADS + hk) * K + ks, k_ok, C, TAPS)
                tl.atomic_xchg(arrivals, 0)
        if NORM:  # the head's last program to finish norms its whole output
            _output_norm(out, z, s_z_t, s_z_h, norm_w, eps, counters, hv, tl.cdiv(V, BV), T, VALUE_HEADS, V, BVN, 1)

    @triton.jit(do_not_specialize=["N"])
    def _keep_path_kernel(mixed, s_mixed, g_buf, deltas, state, path, N, window, history_rows, history,
                          l_mixed, l_g, l_deltas, l_state, l_window, l_history,
                          KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BV: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, TAPS: tl.constexpr,
                          PDL: tl.constexpr):
        """keep_path's closed form for value head hv's BV value channels of layer program_id(1) (keep_path_reference's
        docstring; l_*: each buffer's stride between layers)."""
        pdl.begin(PDL)
        mixed, g_buf, deltas = _in_layer(mixed, l_mixed), _in_layer(g_buf, l_g), _in_layer(deltas, l_deltas)
        state, window, history = _in_layer(state, l_state), _in_layer(window, l_window), _in_layer(history, l_history)
        i_v, hv, hk, ks, vs, k_ok, v_ok, tile, tile_ok = _head_tile(tl.program_id(0), KEY_HEADS, VALUE_HEADS, K, V,
                                                                    BV, BK)
        C = 2 * KEY_HEADS * K + VALUE_HEADS * V
        lanes = tl.arange(0, BP)
        kept = lanes < N
        nodes = tl.load(path + lanes, mask=kept, other=0)
        log_decay = tl.cumsum(tl.load(g_buf + nodes * VALUE_HEADS + hv, mask=kept, other=0.0), 0)
        total = tl.sum(tl.where(lanes == N - 1, log_decay, 0.0), 0)
        weights = tl.where(kept, tl.exp(total - log_decay), 0.0)
        k = tl.load(mixed + nodes[:, None] * s_mixed + (KEY_HEADS + hk) * K + ks[None, :],
                    mask=kept[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        k = k * (tl.rsqrt(tl.sum(k * k, 1) + 1e-6) * weights)[:, None]
        u = tl.load(deltas + (nodes[:, None] * VALUE_HEADS + hv) * V + vs[None, :], mask=kept[:, None] & v_ok[None, :],
                    other=0.0)
        state_tile = tl.load(state + tile, mask=tile_ok, other=0.0) * tl.exp(total)
        state_tile = tl.dot(tl.trans(k), u, state_tile, input_precision="ieee")
        tl.store(state + tile, state_tile, mask=tile_ok)
        qk_owner = (hv % (VALUE_HEADS // KEY_HEADS) == 0) & (i_v == 0)  # one program per key head
        _copy_rows(window, history_rows, history, hk * K + ks, k_ok & qk_owner, C, TAPS)
        _copy_rows(window, history_rows, history, (KEY_HEADS + hk) * K + ks, k_ok & qk_owner, C, TAPS)
        _copy_rows(window, history_rows, history, 2 * KEY_HEADS * K + hv * V + vs, v_ok, C, TAPS)

    @triton.jit(do_not_specialize=["T"])
    def _tree_kernel(mixed, ancestors, b, a, s_ab, a_log, dt_bias, g_buf, beta_buf, h0, out, deltas, scale, T,
                     z, s_z_t, s_z_h, norm_w, eps, counters,
                     KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BV: tl.constexpr, BK: tl.constexpr, BVN: tl.constexpr, BT: tl.constexpr,
                     DOUBLINGS: tl.constexpr, PRECISION: tl.constexpr, NORM_ROWS: tl.constexpr,
                     COMPUTE_GATES: tl.constexpr, SAVE_GATES: tl.constexpr, PDL: tl.constexpr):
        """tree_pass's closed form (its docstring) for value head hv's BV value channels: the root's step first,
        then the other nodes solved from the root's state; their matrices are [BT, BT], row r for node r + 1, rows
        past the tree zero."""
        pdl.begin(PDL)
        slices = tl.cdiv(V, BV)
        i_v, hv = tl.program_id(0) % slices, tl.program_id(0) // slices
        hk = hv // (VALUE_HEADS // KEY_HEADS)
        C = 2 * KEY_HEADS * K + VALUE_HEADS * V
        q_at, k_at, v_at = hk * K, (KEY_HEADS + hk) * K, 2 * KEY_HEADS * K + hv * V
        nodes = 1 + tl.arange(0, BT)
        in_tree = nodes < T
        vs = i_v * BV + tl.arange(0, BV)
        v_ok = vs < V
        decay_rate, bias = _gate_constants(a_log, dt_bias, hv, COMPUTE_GATES)
        g, beta = _gates(b, a, s_ab, g_buf, beta_buf, nodes, in_tree, hv, decay_rate, bias, i_v == 0, VALUE_HEADS,
                         COMPUTE_GATES, SAVE_GATES)
        g0, beta0 = _gates(b, a, s_ab, g_buf, beta_buf, 0, hv >= 0, hv, decay_rate, bias, i_v == 0, VALUE_HEADS,
                           COMPUTE_GATES, SAVE_GATES)
        on_path = tl.load(ancestors + nodes[:, None] * T + nodes[None, :],
                          mask=in_tree[:, None] & in_tree[None, :], other=0) != 0
        log_decay = tl.sum(tl.where(on_path, g[None, :], 0.0), 1)  # log d_i from the root's state: g over i's path
        # raw dot products over the key channels (the L2 norms scale them afterwards): of the nodes' q and k with
        # each other, with the root's k (k0) and with S_0; and the root's q0, k0 with S_0
        kk = tl.zeros([BT, BT], tl.float32)
        qk = tl.zeros([BT, BT], tl.float32)
        ks = tl.zeros([BT, BV], tl.float32)
        qs = tl.zeros([BT, BV], tl.float32)
        k_sq, q_sq, k_k0, q_k0 = (tl.zeros([BT], tl.float32), tl.zeros([BT], tl.float32), tl.zeros([BT], tl.float32),
                                  tl.zeros([BT], tl.float32))
        k0s, q0s = tl.zeros([BV], tl.float32), tl.zeros([BV], tl.float32)
        k0_sq, q0_sq, q0k0 = tl.sum(k0s, 0), tl.sum(k0s, 0), tl.sum(k0s, 0)
        for c0 in tl.static_range(0, K, BK):
            cols = c0 + tl.arange(0, BK)
            c_ok = cols < K
            rows_ok = in_tree[:, None] & c_ok[None, :]
            q = tl.load(mixed + nodes[:, None] * C + q_at + cols[None, :], mask=rows_ok, other=0.0).to(tl.float32)
            k = tl.load(mixed + nodes[:, None] * C + k_at + cols[None, :], mask=rows_ok, other=0.0).to(tl.float32)
            q0 = tl.load(mixed + q_at + cols, mask=c_ok, other=0.0).to(tl.float32)
            k0 = tl.load(mixed + k_at + cols, mask=c_ok, other=0.0).to(tl.float32)
            s0 = tl.load(h0 + hv * K * V + cols[:, None] * V + vs[None, :], mask=c_ok[:, None] & v_ok[None, :],
                         other=0.0)
            q_sq += tl.sum(q * q, 1)
            k_sq += tl.sum(k * k, 1)
            k_k0 += tl.sum(k * k0[None, :], 1)
            q_k0 += tl.sum(q * k0[None, :], 1)
            k0s += tl.sum(k0[:, None] * s0, 0)
            q0s += tl.sum(q0[:, None] * s0, 0)
            k0_sq += tl.sum(k0 * k0, 0)
            q0_sq += tl.sum(q0 * q0, 0)
            q0k0 += tl.sum(q0 * k0, 0)
            kt = tl.trans(k)
            kk = tl.dot(k, kt, kk, input_precision=PRECISION)
            qk = tl.dot(q, kt, qk, input_precision=PRECISION)
            ks = tl.dot(k, s0, ks, input_precision=PRECISION)
            qs = tl.dot(q, s0, qs, input_precision=PRECISION)
        k_norm, q_norm = tl.rsqrt(k_sq + 1e-6), tl.rsqrt(q_sq + 1e-6) * scale
        k0_norm, q0_norm = tl.rsqrt(k0_sq + 1e-6), tl.rsqrt(q0_sq + 1e-6) * scale
        # the root's step: S_r = e^g0 S_0 + k0 delta0^T, so x^T S_r = e^g0 x^T S_0 + (x . k0) delta0
        decay0 = tl.exp(g0)
        v0 = tl.load(mixed + v_at + vs, mask=v_ok, other=0.0).to(tl.float32)
        delta0 = beta0 * (v0 - decay0 * k0_norm * k0s)
        o0 = decay0 * q0_norm * q0s + (q0_norm * k0_norm * q0k0) * delta0
        tl.store(out + hv * V + vs, o0.to(out.dtype.element_ty), mask=v_ok)
        tl.store(deltas + hv * V + vs, delta0, mask=v_ok)
        ks = decay0 * k_norm[:, None] * ks + (k_k0 * k_norm * k0_norm)[:, None] * delta0[None, :]  # k^T S_r
        qs = decay0 * q_norm[:, None] * qs + (q_k0 * q_norm * k0_norm)[:, None] * delta0[None, :]  # q^T S_r
        # the other nodes from S_r
        v = tl.load(mixed + nodes[:, None] * C + v_at + vs[None, :], mask=in_tree[:, None] & v_ok[None, :],
                    other=0.0).to(tl.float32)
        ratio = tl.exp(tl.where(on_path, log_decay[:, None] - log_decay[None, :], 0.0))  # d_i / d_j along a path
        decay = tl.exp(log_decay)
        strict = on_path & (nodes[:, None] != nodes[None, :])
        power = tl.where(strict, -(kk * k_norm[:, None] * k_norm[None, :]) * ratio * beta[:, None], 0.0)  # -A
        u = beta[:, None] * (v - decay[:, None] * ks)  # R
        for step in tl.static_range(DOUBLINGS):  # u <- (I + (-A)^(2^step)) u
            u = tl.dot(power, u, u, input_precision=PRECISION)
            if step + 1 < DOUBLINGS:
                power = tl.dot(power, power, input_precision=PRECISION)
        tl.store(deltas + (nodes[:, None] * VALUE_HEADS + hv) * V + vs[None, :], u,
                 mask=in_tree[:, None] & v_ok[None, :])
        scores = tl.where(on_path, qk * q_norm[:, None] * k_norm[None, :] * ratio, 0.0)
        o = tl.dot(scores, u, decay[:, None] * qs, input_precision=PRECISION)
        tl.store(out + (nodes[:, None] * VALUE_HEADS + hv) * V + vs[None, :], o.to(out.dtype.element_ty),
                 mask=in_tree[:, None] & v_ok[None, :])
        _output_norm(out, z, s_z_t, s_z_h, norm_w, eps, counters, hv, slices, T, VALUE_HEADS, V, BVN, NORM_ROWS)

    @triton.jit
    def _tree_conv_kernel(x, s_x, history, weight, window, mixed, window_rows, T, C, TAPS: tl.constexpr,
                          BLOCK_C: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
        """The tree conv (causal_conv1d_tree's contract) of ROWS nodes x BLOCK_C channels a program: node i reads
        the rows window_rows[i] of [history; x]. Accumulates in float32, rounds once."""
        pdl.begin(PDL)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        nodes = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        ok, here = cols < C, nodes < T
        acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
        for j in tl.static_range(TAPS):
            row = tl.load(window_rows + nodes * TAPS + j, mask=here, other=0).to(tl.int32)[:, None]
            from_history = tl.load(history + row * C + cols[None, :],
                                   mask=here[:, None] & (row < TAPS - 1) & ok[None, :], other=0.0)
            from_input = tl.load(x + (row - (TAPS - 1)) * s_x + cols[None, :],
                                 mask=here[:, None] & (row >= TAPS - 1) & ok[None, :], other=0.0)
            acc += (from_history + from_input).to(tl.float32) * tl.load(weight + cols * TAPS + j, mask=ok).to(
                tl.float32)[None, :]
        write = here[:, None] & ok[None, :]
        tl.store(mixed + nodes[:, None] * C + cols[None, :], (acc * tl.sigmoid(acc)).to(mixed.dtype.element_ty),
                 mask=write)
        tl.store(window + (TAPS - 1 + nodes[:, None]) * C + cols[None, :],
                 tl.load(x + nodes[:, None] * s_x + cols[None, :], mask=write), mask=write)
        first = ok & (tl.program_id(1) == 0)
        for r in tl.static_range(TAPS - 1):
            tl.store(window + r * C + cols, tl.load(history + r * C + cols, mask=first), mask=first)
