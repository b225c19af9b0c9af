"""Gated DeltaNet kernels in Triton, the fast paths beside the references of blockspec.kernels.gdn: the depthwise
causal conv (any length, window and output written by one launch) and the gated delta rule for short passes
(decode, verification, a partial commit's replay, a kept tree path's replay).

The recurrence kernel does in one launch what the reference spreads over a dozen: it reads the convolved
projection `mixed` as is (q and k L2-normalised in-kernel, q scaled, each key head shared by its value heads
without a repeat), computes the gates g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (or reads them
back for a replay), runs the recurrence from the committed state and writes the final state straight into the
given buffer (the pending state of the pass, or the committed state itself when a partial commit replays n
tokens: each program reads its tile before writing it). Programs: (value head, slice of BV value channels), as
fla-core's fused recurrent kernel. `keep_path` replays a draft tree's kept path the same way, reading each node's
recorded row through the path (no gathered copies) and copying the kept conv history in the same launch.

`short_pass` is the whole DeltaNet mixer of a decode or verification pass in that one launch: it also runs the
causal conv (each program convolves the q/k channels of its key head and its own v slice, from the history and
the projection; the programs that own a channel write it to the window and conv-output buffers a partial commit
replays from), and the gated output norm (the last program of a value head to finish, counted by an atomic,
norms the head's whole output). That is 3 launches -> 1 per layer, 48 per 27B step.

`tree_pass` is the mixer of a draft-tree pass (each node's conv and recurrence along its own path): the tree conv,
then one recurrence launch that walks the tree in preorder with a stack of saved states (T steps, nothing
recomputed), and norms.
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


def keep_path(mixed, g, beta, state, shape, path, window, history_rows, history, block_v=None, num_warps=None):
    """A kept path of a recorded pass in one launch: the recurrence alone over the rows `path` [n] of the conv
    output mixed [T, C] and the gates g, beta [T, Hv] float32, in place over `state` [Hv, Dk, Dv] float32, and the
    conv history [K-1, C] set to the rows history_rows [K-1] of the recorded window. The contract of
    blockspec.kernels.gdn.keep_path_reference, bitwise where that runs `gated_delta_short` (each step reads the row
    the gathered copy would hold). The history's channels are copied by their owners as the conv's window is
    written: each program its v slice, one program per key head its q and k channels."""
    if path.shape[0] > MAX_PATH:
        raise ValueError(f"a kept path holds at most {MAX_PATH} nodes, got {path.shape[0]}")
    out = torch.empty(path.shape[0], shape[2], shape[3], device=mixed.device, dtype=torch.float32)  # written, not kept
    _launch(mixed, state, state, shape, ("given", g, beta), None, out, None, None, block_v, num_warps,
            (path.contiguous(), window, history_rows.contiguous(), history))


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


def tree_pass(x, history, conv_weight, gates, state, shape, z, norm_weight, eps, window_rows, parents,
              window_out=None, mixed_out=None, gates_out=None, block_v=None, num_warps=None):
    """A DeltaNet layer's mixer over a draft tree's T <= 64 nodes (layers/tree.py): the contract of
    blockspec.kernels.gdn.deltanet_tree_mixer. Node i convolves the rows window_rows[i] [K] of [history; x] and
    steps from its parent's state (the root from the committed `state` [Hv, Dk, Dv] float32, which is left as it
    is: a kept path is replayed at commit); parents[i] < i for i > 0, parents[0] = 0. Gates, z and the norm as
    `short_pass`. Writes the window [K-1+T, C], the conv output [T, C] and the gates (computed ones) into the given
    buffers (or scratch); returns (out [T, Hv, Dv] in x's dtype, window). No host synchronisation and no ordering
    tensor: CUDA-graph capturable.

    Two launches: the conv (`_tree_conv_kernel`, nodes x channel blocks), then the recurrence with the gated output
    norm (`_tree_kernel`, programs (value head, BV slice) as `short_pass`'s, the head's last program norming its
    rows). The conv stays out of the recurrence kernel because there every program of a key head convolves its
    q/k channels again (24 programs a key head on the 27B), node after node: on the H200 that fused form cost
    50.9 / 100.4 us per 27B layer at 17 / 33 nodes against 24.6 / 52.1 for these two launches.

    The recurrence takes T steps, not T x depth: each program walks the tree once in DFS preorder, worked out
    in-kernel from `parents`, and its state tile stays in registers from a node to its first child. A node with
    several children stores its state in a slot of a global scratch (`tree_stack`); each later child (a node that
    follows a leaf) reloads it. The slot is the number of such branching ancestors: at most (T-3)/2 for a branching
    node (each one on its path has a child off the path), so (T-1)//2 slots hold any tree (a depth bound would
    serve too, but the kernel is not told the depth). The next node's conv rows and its parent's saved tile are
    loaded before the current step's arithmetic, which hides their latency. Scratch traffic per layer: one state
    tile per branching node written and one per node that follows a leaf read, each Hv x Dk x Dv x 4 bytes = 3.1 MB
    at the 27B's shapes (Hv 48, Dk = Dv = 128), mostly from L2 since the writer reads it back. A tree with b
    branching nodes and l leaves moves (b + l - 1) x 3.1 MB: none for a chain, 97 MB for the 27B's 33-node comb
    (a chain of 15 with a leaf on each node, b = 15, l = 17). The scratch holds (T-1)//2 tiles (25 / 50 / 97 MB at
    17 / 33 / 64 nodes), allocated once per device and shared by every layer. Measured on the H200 (us per 27B
    layer, 48 layers in one graph, the whole tree pass): 8-node chain 15.7 (chain kernels: recurrence alone 11.2,
    three launches 17.4, `short_pass` 26.8); 17 nodes (chain of 15 + a leaf) 24.6; 33 nodes 40.4 (b 7, l 10) to
    52.1 (the comb), of which the recurrence 37.6 at 33 nodes: its T serial steps.

    Not chosen: recomputing along each leaf's path (each leaf's programs run the recurrence from the committed state
    down its path: latency of the depth, work the sum of the paths; bitwise the same outputs) measured slower on
    every tree, drafted or comb, 9 to 64 nodes (the whole tree pass, us per 27B layer, its best BV and warps against
    this kernel's BV 16, 1 warp): 50.2 against 40.6 at 33 drafted nodes, 94.0 against 68.6 at 64, 201.0 against
    101.6 at a 64-node comb.

    bench/gdn_kernel.py --parts tree times it on the 27B's shapes."""
    t, channels = x.shape
    if t > MAX_TREE_NODES:
        raise ValueError(f"a tree pass runs at most {MAX_TREE_NODES} nodes, got {t}")
    key_heads, key_dim, value_heads, value_dim = shape
    taps = conv_weight.shape[-1]
    window = window_out if window_out is not None else x.new_empty(taps - 1 + t, channels)
    mixed = mixed_out if mixed_out is not None else x.new_empty(t, channels)
    out = torch.empty(t, value_heads, value_dim, device=x.device, dtype=x.dtype)
    b, a, a_log, dt_bias, g_buf, beta_buf = _gate_args(gates, gates_out, out)
    slots = max(1, (t - 1) // 2)
    stack = tree_stack(x.device, slots * value_heads * key_dim * value_dim)
    block_v, num_warps = block_v or BLOCK_V, num_warps or NUM_WARPS
    window_rows, parents = window_rows.contiguous(), parents.contiguous()
    _tree_conv_kernel[(triton.cdiv(channels, CONV_BLOCK_C), triton.cdiv(t, TREE_CONV_ROWS))](
        x, x.stride(0), history, conv_weight, window, mixed, window_rows, t, channels, TAPS=taps, BLOCK_C=CONV_BLOCK_C,
        ROWS=TREE_CONV_ROWS, num_warps=CONV_WARPS, **pdl.options(x))
    _tree_kernel[(value_heads * triton.cdiv(value_dim, block_v),)](
        mixed, parents, b, a, b.stride(0), a_log, dt_bias, g_buf, beta_buf, state, stack, slots, out, key_dim ** -0.5,
        t, z, z.stride(0), z.stride(1), norm_weight, eps, arrival_counters(x.device, value_heads),
        KEY_HEADS=key_heads, VALUE_HEADS=value_heads, K=key_dim, V=value_dim, BV=block_v,
        BK=triton.next_power_of_2(key_dim), BVN=triton.next_power_of_2(value_dim), BT=MAX_TREE_NODES,
        NORM_ROWS=TREE_NORM_ROWS, COMPUTE_GATES=gates[0] == "ab",
        SAVE_GATES=gates[0] == "ab" and gates_out is not None, num_warps=num_warps, num_stages=3, **pdl.options(out))
    return out, window


MAX_TREE_NODES = 64  # the walk packs node indices into 6 bits
MAX_PATH = 16  # nodes of a kept path: a drafter block's rows at most
TREE_NORM_ROWS, TREE_CONV_ROWS = 8, 16  # rows the norm epilogue / a tree conv program takes at a time
_STACKS: dict = {}
_OUTGROWN_STACKS: list = []  # replaced by larger ones: CUDA graphs recorded with them still use them


def tree_stack(device: torch.device, numel: int) -> torch.Tensor:
    """float32 scratch of at least numel elements on `device` for tree_pass's saved states: one buffer per device
    for every layer and launch (nothing in it outlives a launch), grown when a larger tree or shape needs it."""
    key = (device.type, device.index)
    if key not in _STACKS or _STACKS[key].numel() < numel:
        if key in _STACKS:
            _OUTGROWN_STACKS.append(_STACKS[key])
        _STACKS[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return _STACKS[key]


def _gate_args(gates, gates_out, out):
    """(b, a, A_log, dt_bias, g buffer, beta buffer) for the kernels; placeholders where unused."""
    if gates[0] == "ab":
        _, b, a, a_log, dt_bias = gates
        g_buf, beta_buf = gates_out if gates_out is not None else (out, out)  # unused unless SAVE_GATES
        return b, a, a_log, dt_bias, g_buf, beta_buf
    _, g_buf, beta_buf = gates
    return g_buf, g_buf, g_buf, g_buf, g_buf, beta_buf


def _launch(mixed, state_in, state_out, shape, gates, gates_out, out, conv, norm, block_v, num_warps, path=None):
    key_heads, key_dim, value_heads, value_dim = shape
    b, a, a_log, dt_bias, g_buf, beta_buf = _gate_args(gates, gates_out, out)
    x, history, conv_weight, window, update_history = conv if conv is not None else (mixed, mixed, mixed, mixed,
                                                                                      False)
    taps = conv_weight.shape[-1] if conv is not None else 1
    rows, history_rows = mixed, mixed  # placeholders unless a path is kept
    if path is not None:
        rows, window, history_rows, history = path
        taps = history.shape[0] + 1
    z, norm_weight, eps = norm if norm is not None else (out, out, 0.0)
    block_v, num_warps = block_v or BLOCK_V, num_warps or NUM_WARPS
    counters = arrival_counters(out.device, value_heads + key_heads) if norm is not None else out
    _gated_delta_kernel[(value_heads * triton.cdiv(value_dim, block_v),)](
        mixed, mixed.stride(0), rows, b, a, b.stride(0), a_log, dt_bias, g_buf, beta_buf, state_in, state_out, out,
        key_dim ** -0.5, out.shape[0], x, x.stride(0), history, conv_weight, window, history_rows, z, z.stride(0),
        z.stride(1) if norm is not None else 0, norm_weight, eps, counters, KEY_HEADS=key_heads,
        VALUE_HEADS=value_heads, K=key_dim, V=value_dim, BV=block_v, BK=triton.next_power_of_2(key_dim),
        BVN=triton.next_power_of_2(value_dim), TAPS=taps, COMPUTE_GATES=gates[0] == "ab",
        SAVE_GATES=gates[0] == "ab" and gates_out is not None, CONV=conv is not None, NORM=norm is not None,
        HISTORY_IN_PLACE=update_history, PATH=path is not None, BP=MAX_PATH, num_warps=num_warps, num_stages=3,
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

    @triton.jit(do_not_specialize=["T"])
    def _gated_delta_kernel(mixed, s_mixed, rows, b, a, s_ab, a_log, dt_bias, g_buf, beta_buf, h0, ht, out, scale,
                            T, x, s_x, history, conv_w, window, history_rows, z, s_z_t, s_z_h, norm_w, eps, counters,
                            KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, BK: tl.constexpr, BVN: tl.constexpr, TAPS: tl.constexpr,
                            COMPUTE_GATES: tl.constexpr, SAVE_GATES: tl.constexpr, CONV: tl.constexpr,
                            NORM: tl.constexpr, HISTORY_IN_PLACE: tl.constexpr, PATH: tl.constexpr,
                            BP: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
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
        if PATH:  # the path in registers: a load of its index per step would serialise each step's input loads
            lanes = tl.arange(0, BP)
            path = tl.load(rows + lanes, mask=lanes < T, other=0)
        for t in range(T):
            source = _pick(path, lanes, t) if PATH else t  # the input row of token t: a kept path's node, or t
            if CONV:
                q = _conv_silu(x, s_x, history, conv_w, window, mixed, t, hk * K + ks, k_ok, C, TAPS, qk_owner)
                k = _conv_silu(x, s_x, history, conv_w, window, mixed, t, (KEY_HEADS + hk) * K + ks, k_ok, C, TAPS,
                               qk_owner)
                v = _conv_silu(x, s_x, history, conv_w, window, mixed, t, 2 * KEY_HEADS * K + hv * V + vs, v_ok, C,
                               TAPS, v_owner)
            else:
                row = mixed + source * s_mixed
                q = tl.load(row + hk * K + ks, mask=k_ok, other=0.0).to(tl.float32)
                k = tl.load(row + (KEY_HEADS + hk) * K + ks, mask=k_ok, other=0.0).to(tl.float32)
                v = tl.load(row + 2 * KEY_HEADS * K + hv * V + vs, mask=v_ok, other=0.0).to(tl.float32)
            g, beta = _gates(b, a, s_ab, g_buf, beta_buf, source, t < T, hv, decay_rate, bias, i_v == 0,
                             VALUE_HEADS, COMPUTE_GATES, SAVE_GATES)
            state, o = _delta_step(state, q, k, v, g, beta, scale)
            tl.store(out + (t * VALUE_HEADS + hv) * V + vs, o.to(out.dtype.element_ty), mask=v_ok)
        tl.store(ht + tile, state, mask=tile_ok)
        if PATH:  # the kept path's conv history, from the recorded window (nothing else here reads either)
            _copy_rows(window, history_rows, history, hk * K + ks, k_ok & qk_owner, C, TAPS)
            _copy_rows(window, history_rows, history, (KEY_HEADS + hk) * K + ks, k_ok & qk_owner, C, TAPS)
            _copy_rows(window, history_rows, history, 2 * KEY_HEADS * K + hv * V + vs, v_ok, C, TAPS)
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

    @triton.jit
    def _pick(values, lanes, node):
        """values[node] of a [BT] vector held in registers."""
        return tl.sum(tl.where(lanes == node, values, 0), 0)

    @triton.jit(do_not_specialize=["T", "SLOTS"])
    def _tree_kernel(mixed, parents, b, a, s_ab, a_log, dt_bias, g_buf, beta_buf, h0, stack, SLOTS, out, scale, T,
                     z, s_z_t, s_z_h, norm_w, eps, counters,
                     KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BV: tl.constexpr, BK: tl.constexpr, BVN: tl.constexpr, BT: tl.constexpr,
                     NORM_ROWS: tl.constexpr, COMPUTE_GATES: tl.constexpr, SAVE_GATES: tl.constexpr,
                     PDL: tl.constexpr):
        pdl.begin(PDL)
        i_v, hv, hk, ks, vs, k_ok, v_ok, tile, tile_ok = _head_tile(tl.program_id(0), KEY_HEADS, VALUE_HEADS, K, V,
                                                                    BV, BK)
        slot_size = VALUE_HEADS * K * V
        state = tl.load(h0 + tile, mask=tile_ok, other=0.0)
        C = 2 * KEY_HEADS * K + VALUE_HEADS * V
        q_cols, k_cols, v_cols = hk * K + ks, (KEY_HEADS + hk) * K + ks, 2 * KEY_HEADS * K + hv * V + vs
        # every node's gates, computed (and stored) at once and kept in registers: a step picks its node's pair
        lanes = tl.arange(0, BT)
        in_tree = lanes < T
        decay_rate, bias = _gate_constants(a_log, dt_bias, hv, COMPUTE_GATES)
        all_g, all_beta = _gates(b, a, s_ab, g_buf, beta_buf, lanes, in_tree, hv, decay_rate, bias, i_v == 0,
                                 VALUE_HEADS, COMPUTE_GATES, SAVE_GATES)
        # The walk, in preorder (children by index). Per node: its depth and stack slot (the number of its
        # ancestors with several children). key[c] of a node not yet processed whose parent was (the only
        # candidates: every other processed node's subtree is done) packs (depth, slot, 63 - c), so that the
        # maximum is the first child of the deepest node of the path that has one.
        parent = tl.load(parents + lanes, mask=(lanes > 0) & in_tree, other=-1).to(tl.int32)
        key = tl.full([BT], -1, tl.int32)
        node = hv * 0  # an int32 scalar tensor, as the walk updates it
        depth, slot = node, node
        q = tl.load(mixed + q_cols, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(mixed + k_cols, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(mixed + v_cols, mask=v_ok, other=0.0).to(tl.float32)
        g, beta = _pick(all_g, lanes, node), _pick(all_beta, lanes, node)
        for step in range(T):
            # the next node and what it reads, first: none of it depends on this step's state, so the loads (its
            # conv output; its parent's saved state when this node is a leaf) overlap this step's arithmetic
            kids = parent == node
            n_kids = tl.sum(kids.to(tl.int32), 0)
            branches = n_kids > 1
            key = tl.where(kids, ((depth + 1) << 12) | ((slot + branches.to(tl.int32)) << 6) | (63 - lanes), key)
            top = tl.max(key, 0)
            nxt, nxt_slot = 63 - (top & 63), (top >> 6) & 63
            key = tl.where(lanes == nxt, -1, key)
            more = step + 1 < T
            q_next = tl.load(mixed + nxt * C + q_cols, mask=k_ok & more, other=0.0)
            k_next = tl.load(mixed + nxt * C + k_cols, mask=k_ok & more, other=0.0)
            v_next = tl.load(mixed + nxt * C + v_cols, mask=v_ok & more, other=0.0)
            reload = more & (n_kids == 0) & (nxt_slot > 0) & (nxt_slot <= SLOTS)  # a leaf: nxt's parent branches
            saved = tl.load(stack + (nxt_slot - 1) * slot_size + tile, mask=tile_ok & reload, other=0.0)
            # this node's step; a branching node keeps its state for its later children
            state, o = _delta_step(state, q, k, v, g, beta, scale)
            tl.store(out + (node * VALUE_HEADS + hv) * V + vs, o.to(out.dtype.element_ty), mask=v_ok)
            tl.store(stack + slot * slot_size + tile, state, mask=tile_ok & branches & (slot < SLOTS))
            q, k, v = q_next.to(tl.float32), k_next.to(tl.float32), v_next.to(tl.float32)
            g, beta = _pick(all_g, lanes, nxt), _pick(all_beta, lanes, nxt)
            state = tl.where(reload, saved, state)
            node, depth, slot = nxt, top >> 12, nxt_slot
            tl.debug_barrier()  # a saved tile is read back by whichever threads a later load's layout gives it
        _output_norm(out, z, s_z_t, s_z_h, norm_w, eps, counters, hv, tl.cdiv(V, BV), T, VALUE_HEADS, V, BVN, NORM_ROWS)

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
