"""Gated DeltaNet ops: depthwise causal conv1d with carried state, the recurrence's inputs (gates, normalised
q/k), and the gated delta rule: the float32 references here, and the forms the CPU runs (a tree in closed form, a
chain in chunks); the fast paths are fla-core's kernels (prefill) and gdn_triton.py (short passes, trees)."""

import functools

import torch
import torch.nn.functional as F

from . import fused, gdn_triton
from .gdn_gates import Gates, computed
from .norm import gated_rms_norm


def causal_conv1d(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
                  window_out: torch.Tensor | None = None,
                  mixed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if gdn_triton.available(x) and x.stride(-1) == 1:
        return gdn_triton.causal_conv1d(x, history, weight, window_out, mixed_out)
    return causal_conv1d_reference(x, history, weight, window_out, mixed_out)


@fused
def causal_conv1d_reference(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
                  window_out: torch.Tensor | None = None,
                  mixed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over x [T, C], continuing from `history` [K-1, C] (the previous inputs).

    Returns (output [T, C], window [K-1+T, C]); the new history after n tokens is window[n : n+K-1]. With
    `window_out` / `mixed_out` they are written there (the state's pending buffers: no copy afterwards).
    """
    window = torch.cat([history.to(x.dtype), x], dim=0)
    if window_out is not None:
        window = window_out.copy_(window)
    taps = window.unfold(0, weight.shape[-1], 1)  # [T, C, K]: the K inputs each output sees, oldest first
    out = F.silu((taps * weight.view(weight.shape[0], -1).to(x.dtype)).sum(-1))
    if mixed_out is not None:
        out = mixed_out.copy_(out)
    return out, window


def causal_conv1d_tree(x, history, weight, window_rows, window_out=None, mixed_out=None):
    """The causal conv of a draft tree's nodes (layers/tree.py): node i convolves the rows window_rows[i] [K] of
    window = [history; x] (its own path), else the contract of causal_conv1d_reference (window [K-1+T, C] written
    to window_out, output [T, C] to mixed_out)."""
    return causal_conv1d_tree_reference(x, history, weight, window_rows, window_out, mixed_out)


def causal_conv1d_tree_reference(x, history, weight, window_rows, window_out=None, mixed_out=None):
    window = torch.cat([history.to(x.dtype), x], dim=0)
    if window_out is not None:
        window = window_out.copy_(window)
    taps = window[window_rows].transpose(1, 2)  # [T, C, K], oldest first: the chain's arithmetic, per path
    out = F.silu((taps * weight.view(weight.shape[0], -1).to(x.dtype)).sum(-1))
    if mixed_out is not None:
        out = mixed_out.copy_(out)
    return out, window


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@fused
def deltanet_qkv(mixed, key_heads: int, key_dim: int, value_heads: int, value_dim: int):
    """Split the convolved projection into the recurrence's q (L2-normalised, pre-scaled) and k (L2-normalised),
    each repeated to the value heads, and v; float32."""
    t = mixed.shape[0]
    qk_size = key_heads * key_dim
    q, k, v = mixed.split([qk_size, qk_size, value_heads * value_dim], dim=-1)
    repeat = value_heads // key_heads
    q = l2_normalize(q.reshape(t, key_heads, key_dim).float()).repeat_interleave(repeat, dim=1) * key_dim ** -0.5
    k = l2_normalize(k.reshape(t, key_heads, key_dim).float()).repeat_interleave(repeat, dim=1)
    return q, k, v.reshape(t, value_heads, value_dim).float()


SHORT_PASS = 64  # up to this many tokens the recurrence runs token by token in one kernel (gdn_triton.py)
# The whole mixer in one launch pays for one token only: at more tokens every program convolves its key head's q/k
# channels token after token (docs/benchmarks.md, "DeltaNet")
FUSED_MIXER_TOKENS = 1


def gated_delta(mixed, gates, state_in, state_out, shape, gates_out=None, out_dtype=None):
    """A DeltaNet layer's recurrence from its convolved projection `mixed` [T, C]: returns out [T, Hv, Dv] and writes
    the final state into state_out (which may be state_in). shape = (Hk, Dk, Hv, Dv); gates: GateProjections, or Gates
    as stored by an earlier pass through gates_out (gdn_gates.py). Short passes on CUDA: one Triton kernel; else
    fla-core's chunked kernel (CUDA) or the CPU's chunked form (gated_delta_rule), after preparing the inputs. With
    stored Gates every buffer may carry a leading dimension of layers (state [L, Hv, Dk, Dv], mixed [L, T, C], gates
    [L, T, Hv]): each layer's recurrence (one launch for all on CUDA), out [L, T, Hv, Dv]."""
    if mixed.shape[-2] <= SHORT_PASS and gdn_triton.available(mixed):
        return gdn_triton.gated_delta_short(mixed, state_in, state_out, shape, gates, gates_out, out_dtype)
    if state_in.dim() == 4:
        return torch.stack([gated_delta(m, Gates(g, beta), s_in, s_out, shape, out_dtype=out_dtype)
                            for m, g, beta, s_in, s_out in zip(mixed, gates.g, gates.beta, state_in, state_out)])
    gates = computed(gates, gates_out)
    out, final = gated_delta_rule(*deltanet_qkv(mixed, *shape), gates.g, gates.beta, state_in)
    state_out.copy_(final)
    return out.to(out_dtype or torch.float32)


def keep_path(mixed, g, state, shape, path, deltas, window, history_rows, history):
    """Keep the root-to-node path `path` [n] (node indices, root first) of a recorded tree pass (conv output
    mixed [T, C], log decays g [T, Hv], the nodes' deltas [T, Hv, Dv] from gated_delta_tree, conv window
    [K-1+T, C]): the state after the path, in place over `state`, in closed form, and the conv history [K-1, C] set
    to the window rows history_rows [K-1]. Every buffer but path and history_rows may carry a leading dimension of
    layers (state [L, Hv, Dk, Dv], ...): the same path kept in each. On CUDA one Triton launch (gdn_triton.keep_path,
    paths of up to MAX_PATH nodes), else the reference, layer by layer."""
    if path.shape[0] <= gdn_triton.MAX_PATH and gdn_triton.available(mixed):
        return gdn_triton.keep_path(mixed, g, state, shape, path, deltas, window, history_rows, history)
    if state.dim() == 4:
        for m, log_decays, s, d, w, h in zip(mixed, g, state, deltas, window, history):
            keep_path_reference(m, log_decays, s, shape, path, d, w, history_rows, h)
        return None
    return keep_path_reference(mixed, g, state, shape, path, deltas, window, history_rows, history)


def keep_path_reference(mixed, g, state, shape, path, deltas, window, history_rows, history):
    """Each node's step adds its key times its delta to its decayed parent state (delta_step), so the state after
    the path is the committed one decayed by the whole path plus each kept node's k u^T decayed by the nodes after
    it: S = e^(G_n) S_0 + sum_i e^(G_n - G_i) k_i u_i^T, G_i the sum of g over the path's nodes up to i. No serial
    steps: one product of the path's keys with its deltas."""
    _, k, _ = deltanet_qkv(mixed.index_select(0, path), *shape)
    log_decay = g.index_select(0, path).float().cumsum(0)  # [n, Hv]
    weights = (log_decay[-1] - log_decay).exp()
    state.mul_(log_decay[-1].exp()[:, None, None]).add_(
        torch.einsum("nhk,nhv->hkv", k * weights[..., None], deltas.index_select(0, path)))
    history.copy_(window.index_select(0, history_rows))


def deltanet_mixer(x, history, conv_weight, gates, state_in, state_out, shape, z, norm_weight, eps, window_out=None,
                   mixed_out=None, gates_out=None, update_history=False):
    """A DeltaNet layer between its input and output projections: causal conv of the projection x [T, C], the
    recurrence (final state into state_out), the gated output norm with z [T, Hv, Dv]. Returns (out [T, Hv, Dv] in
    x's dtype, conv window); with update_history the new history is written over `history` and the window
    returned is None. One token on CUDA: one Triton kernel (gdn_triton.short_pass); else the three steps."""
    if x.shape[0] <= FUSED_MIXER_TOKENS and gdn_triton.available(x) and x.stride(-1) == 1 and z.stride(-1) == 1:
        return gdn_triton.short_pass(x, history, conv_weight, gates, state_in, state_out, shape, z, norm_weight, eps,
                                     window_out, mixed_out, gates_out, update_history=update_history)
    mixed, window = causal_conv1d(x, history, conv_weight, window_out, mixed_out)
    out = gated_delta(mixed, gates, state_in, state_out, shape, gates_out, x.dtype)
    if update_history:
        history.copy_(window[x.shape[0]:])
        window = None
    return gated_rms_norm(out, z, norm_weight, eps), window


def gated_delta_tree(mixed, gates, state, shape, ancestors, gates_out=None, out_dtype=None, deltas_out=None):
    """The recurrence over a draft tree's nodes: node i's state is its parent's after token i (the root's: the
    committed `state` after token 0), so each node's output follows its own path; ancestors [T, T] bool
    (layers/tree.py). `state` is not modified (a kept path is committed from the nodes' deltas: keep_path). Gates
    as gated_delta's; returns out [T, Hv, Dv]; the deltas [T, Hv, Dv] float32 into deltas_out when given. The
    closed form (gated_delta_tree_closed), whose reference is gated_delta_tree_reference."""
    gates = computed(gates, gates_out)
    out, deltas = gated_delta_tree_closed(*deltanet_qkv(mixed, *shape), gates.g, gates.beta, state, ancestors)
    if deltas_out is not None:
        deltas_out.copy_(deltas)
    return out.to(out_dtype or torch.float32)


def gated_delta_tree_closed(q, k, v, g, beta, state, ancestors):
    """gated_delta_tree_reference's contract in closed form, in float32 torch ops (the derivation in
    gdn_triton.tree_pass's docstring): the root's step, then the nodes below it at once, (I + A) U = R solved per
    head, where the reference steps one depth at a time with a state per node. Returns (out, deltas)."""
    s_root = state * g[0].exp()[:, None, None]
    delta0 = (v[0] - torch.einsum("hk,hkv->hv", k[0], s_root)) * beta[0][:, None]
    s_root = s_root + k[0][:, :, None] * delta0[:, None, :]
    out0 = torch.einsum("hk,hkv->hv", q[0], s_root)
    if q.shape[0] == 1:
        return out0[None], delta0[None]
    on_path = ancestors[1:, 1:]  # [n, n]: j on i's path below the root, i included
    log_decay = on_path.float() @ g[1:]  # [n, H]
    ratio = torch.where(on_path[None], (log_decay.T[:, :, None] - log_decay.T[:, None, :]), -torch.inf).exp()
    eye = torch.eye(on_path.shape[0], device=q.device)
    qn, kn = q[1:].transpose(0, 1), k[1:].transpose(0, 1)  # [H, n, Dk]
    a = beta[1:].T[:, :, None] * ratio * (kn @ kn.transpose(1, 2)) * (1 - eye)  # strict ancestors only
    decay = log_decay.T.exp()[:, :, None]  # [H, n, 1]
    r = beta[1:].T[:, :, None] * (v[1:].transpose(0, 1) - decay * (kn @ s_root))
    u = torch.linalg.solve_triangular(eye + a, r, upper=False, unitriangular=True)  # ancestors come first
    out = decay * (qn @ s_root) + (ratio * (qn @ kn.transpose(1, 2))) @ u
    return torch.cat([out0[None], out.transpose(0, 1)]), torch.cat([delta0[None], u.transpose(0, 1)])


def gated_delta_tree_reference(q, k, v, g, beta, state, parents):
    """Per-node states, each from its parent's (float32 reference; q, k, v, g, beta as gated_delta_rule_reference;
    parents [T], the root's ignored). The nodes whose parents are done step together, one depth at a time (a tree
    of 33 nodes and depth 8 takes 9 batched steps, not 33). Returns (out, deltas), [T, H, Dv] float32 each."""
    states = state.new_empty(q.shape[0] + 1, *state.shape)  # row 0: the committed state, row i + 1: node i's
    states[0] = state
    before = torch.cat([parents.new_zeros(1), parents[1:] + 1])  # the row each node's step starts from
    done = torch.zeros(q.shape[0] + 1, dtype=torch.bool, device=q.device)
    done[0] = True
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    deltas = torch.empty_like(out)
    while not bool(done.all()):
        nodes = (~done[1:] & done[before]).nonzero()[:, 0]
        states[nodes + 1], out[nodes], deltas[nodes] = delta_step(states[before[nodes]], q[nodes], k[nodes],
                                                                  v[nodes], g[nodes], beta[nodes])
        done[nodes + 1] = True
    return out, deltas


def delta_step(state, q, k, v, g, beta):
    """One token of the gated delta rule: (the state after it, the token's output, its delta u: the state after
    it is the decayed state plus k u^T); leading dimensions batch independent tokens (a tree's nodes of one
    depth)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("...hk,...hkv->...hv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, torch.einsum("...hk,...hkv->...hv", q, state), delta


def deltanet_tree_mixer(x, history, conv_weight, gates, state, shape, z, norm_weight, eps, tree, window_out=None,
                        mixed_out=None, gates_out=None, deltas_out=None):
    """deltanet_mixer over a draft tree's nodes, laid out by `tree` (layers/tree.py TreeLayout): the conv and the
    recurrence follow each node's path; the committed state is left as it is. Returns (out [T, Hv, Dv] in x's
    dtype, window). On CUDA: two Triton kernels (gdn_triton.tree_pass); else the reference chain (tree conv,
    per-node recurrence, gated norm). The nodes' deltas (keep_path's input) into deltas_out when given."""
    if (x.shape[0] <= gdn_triton.MAX_TREE_NODES and gdn_triton.available(x) and x.stride(-1) == 1
            and z.stride(-1) == 1):
        return gdn_triton.tree_pass(x, history, conv_weight, gates, state, shape, z, norm_weight, eps,
                                    tree.window_rows, tree.ancestors, tree.max_depth, window_out, mixed_out, gates_out,
                                    deltas_out)
    mixed, window = causal_conv1d_tree(x, history, conv_weight, tree.window_rows, window_out, mixed_out)
    out = gated_delta_tree(mixed, gates, state, shape, tree.ancestors, gates_out, x.dtype, deltas_out)
    return gated_rms_norm(out, z, norm_weight, eps), window


def gated_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule over T tokens: fla-core's chunked kernel on CUDA when installed, else the chunked form
    in torch ops (gated_delta_rule_chunked), or token by token for up to SERIAL_TOKENS."""
    if q.is_cuda and fla_available():
        return gated_delta_rule_fla(q, k, v, g, beta, state)
    if q.shape[0] <= SERIAL_TOKENS:
        return gated_delta_rule_reference(q, k, v, g, beta, state)
    return gated_delta_rule_chunked(q, k, v, g, beta, state)


SERIAL_TOKENS = 2  # up to here stepping token by token costs the CPU less than one chunk's solves
CHUNK = 32  # the fastest chunk over a long prompt on the CPU (bench/cpu_recurrence.py)


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """gated_delta_rule_reference's contract without a serial step a token: the chunked form (fla's, in float32
    torch ops). Within a chunk of n tokens from state S, with G_i the cumulative log decay and u_i token i's delta,
        S_i = e^G_i S + sum_{j <= i} e^(G_i - G_j) k_j u_j^T,   (I + A) U = B V - B e^G K S,
    A[i, j] = b_i e^(G_i - G_j) (k_i . k_j) for j < i (gated_delta_tree_closed's system on a path). Everything but S
    is known up front, so every chunk's two triangular solves run at once, and only U = U_v - W S, the outputs and
    the next chunk's state go chunk after chunk: four small products a chunk. Every exponent is <= 0."""
    t, heads = g.shape
    chunk = min(chunk, max(t, 1))  # a short pass is one chunk of its own length
    pad = -t % chunk

    def chunks(x):  # [T, H, ...] -> [chunks, H, chunk, ...], zero tokens (no decay, no update) at the end
        x = torch.cat([x.float(), x.new_zeros(pad, *x.shape[1:], dtype=torch.float32)])
        return x.reshape(-1, chunk, *x.shape[1:]).transpose(1, 2)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # [C, H, n]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = torch.where(lower, log_decay[..., :, None] - log_decay[..., None, :], -torch.inf).exp()  # j <= i
    system = torch.eye(chunk, device=q.device) + (beta[..., None] * ratio * (k @ k.transpose(-1, -2))).tril(-1)
    solve = functools.partial(torch.linalg.solve_triangular, system, upper=False, unitriangular=True)
    u_v = solve(beta[..., None] * v)                                      # U = u_v - w S
    w = solve((beta * log_decay.exp())[..., None] * k)
    q_decayed, scores = log_decay.exp()[..., None] * q, ratio * (q @ k.transpose(-1, -2))
    k_after = (log_decay[..., -1:] - log_decay).exp()[..., None] * k     # decayed to the chunk's end
    tail = log_decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(u_v)
    for c in range(q.shape[0]):
        u = u_v[c] - w[c] @ state
        out[c] = q_decayed[c] @ state + scores[c] @ u
        state = tail[c] * state + k_after[c].transpose(-1, -2) @ u
    return out.transpose(1, 2).reshape(-1, heads, out.shape[-1])[:t], state


@functools.cache
def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gated_delta_rule_fla(q, k, v, g, beta, state):
    """fla-core's chunked kernel (prefill). Same contract as the reference; q is pre-scaled, so scale is 1."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=1.0,
                        initial_state=state[None], output_final_state=True)
    return out[0].float(), final[0]


def gated_delta_rule_reference(q, k, v, g, beta, state):
    """Token-by-token gated delta rule in float32 (reference).

    q, k: [T, H, Dk] (already L2-normalised, q already scaled); v: [T, H, Dv]; g (log decay), beta: [T, H];
    state: [H, Dk, Dv] float32 (not modified). Returns (out [T, H, Dv] float32, final state).
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state, out[t], _ = delta_step(state, q[t], k[t], v[t], g[t], beta[t])
    return out, state
