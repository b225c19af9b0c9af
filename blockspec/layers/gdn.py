"""Gated DeltaNet linear attention (Qwen3.5) and its transactional state.

The state of a DeltaNet layer is a short convolution history plus one recurrent matrix per value head. A pass over
k tokens leaves the committed state untouched and records what commit(n) needs: the final state (n == k), or the
per-token inputs of the recurrence so that the state after n tokens is recomputed by rerunning only the cheap
recurrence over n tokens, never a second target pass. A draft tree's pass records each node's delta instead, from
which the state after a kept path is one product (keep_path). The states of a model's layers share one GDNStack:
each buffer is a slice of one tensor with a leading layer dimension, so a commit of every layer is one launch or
copy (commits, keep_paths).
"""

import torch
from torch import nn

from ..kernels.gdn import deltanet_mixer, deltanet_tree_mixer, gated_delta, keep_path
from ..kernels.gdn_gates import GateProjections, Gates


class GDNStack:
    """The buffers of `count` DeltaNet layers' states of one shape, each with a leading layer dimension (allocated
    once per engine and reused per request, so a CUDA graph of a pass and of each commit can be captured over
    them): committed conv history and recurrent state, and what the pending pass records."""

    def __init__(self, count: int, conv_dim: int, kernel: int, shape: tuple[int, int, int, int], max_partial: int,
                 device, dtype):
        key_heads, key_dim, value_heads, value_dim = shape
        f32 = dict(device=device, dtype=torch.float32)
        self.count, self.shape = count, shape
        self.history = torch.zeros(count, kernel - 1, conv_dim, device=device, dtype=dtype)
        self.recurrent = torch.zeros(count, value_heads, key_dim, value_dim, **f32)
        self.pending_history = torch.zeros_like(self.history)
        self.pending_recurrent = torch.zeros_like(self.recurrent)  # a pass writes its final state here
        # inputs of a short pass (<= max_partial tokens), enough to recompute the state after any n of them
        self.pending_window = torch.zeros(count, kernel - 1 + max_partial, conv_dim, device=device, dtype=dtype)
        self.pending_mixed = torch.zeros(count, max_partial, conv_dim, device=device, dtype=dtype)
        self.pending_g = torch.zeros(count, max_partial, value_heads, **f32)
        self.pending_beta = torch.zeros_like(self.pending_g)
        # a tree pass's nodes' deltas: a kept path's state is built from them (keep_path)
        self.pending_deltas = torch.zeros(count, max_partial, value_heads, value_dim, **f32)


class GDNState:
    """One layer's committed conv history and recurrent state and its pending pass's records: its slice of a
    GDNStack (of its own, unless given one)."""

    def __init__(self, conv_dim: int, kernel: int, shape: tuple[int, int, int, int], max_partial: int,
                 device, dtype, stack: GDNStack | None = None, index: int = 0):
        self.stack = stack or GDNStack(1, conv_dim, kernel, shape, max_partial, device, dtype)
        self.index = index
        self.shape = shape
        self.max_partial = max_partial
        self.in_place = False  # see DecodeState
        for name in ("history", "recurrent", "pending_history", "pending_recurrent", "pending_window",
                     "pending_mixed", "pending_g", "pending_beta", "pending_deltas"):
            setattr(self, name, getattr(self.stack, name)[index])
        self.allocate_snapshots(0)

    def allocate_snapshots(self, count: int) -> int:
        """Room for `count` copies of the committed conv history and recurrent state (DecodeState.save / restore);
        returns their bytes."""
        self.saved_history = self.history.new_zeros(count, *self.history.shape)
        self.saved_recurrent = self.recurrent.new_zeros(count, *self.recurrent.shape)
        return self.saved_history.nbytes + self.saved_recurrent.nbytes

    def save(self, slot: int):
        self.saved_history[slot].copy_(self.history)
        self.saved_recurrent[slot].copy_(self.recurrent)

    def restore(self, slot: int):
        self.history.copy_(self.saved_history[slot])
        self.recurrent.copy_(self.saved_recurrent[slot])

    def write_in_place(self):
        """Passes write their final state over the committed one (see DecodeState's `in_place`); one-token passes
        also shift the conv history in place, so their commit copies nothing."""
        self.in_place = True
        self.pending_recurrent = self.recurrent  # the separate buffer is never needed: freed once no layer holds it
        self.stack.pending_recurrent = self.stack.recurrent

    def history_in_place(self, t: int) -> bool:
        return self.in_place and t == 1

    def commit_moves_data(self, t: int, n: int) -> bool:
        """Whether commit(n) of a t-token pass copies or recomputes anything (else it is bookkeeping only)."""
        return not (n == t and self.history_in_place(n))

    def reset(self):
        self.history.zero_()
        self.recurrent.zero_()

    def short_pass_buffers(self, t: int):
        """Where a pass of t <= max_partial tokens writes its conv window, conv output and gates, so that any
        commit(n) can be replayed from them without copying them afterwards; Nones for longer passes (prefill) and
        for passes that update the history in place (nothing to replay)."""
        if t > self.max_partial or self.history_in_place(t):
            return None, None, None
        return self.pending_window[:self.history.shape[0] + t], self.pending_mixed[:t], \
            (self.pending_g[:t], self.pending_beta[:t])

    def record(self, t: int, window):
        """After a t-token pass (window: None when the pass shifted the history in place): a pass too long for a
        partial commit keeps only its new history."""
        if t > self.max_partial and window is not None:
            self.pending_history.copy_(window[t:])

    def commit(self, t: int, n: int):
        """Keep the first n tokens of the pending t-token pass (DecodeState keeps the counts)."""
        _commit(self, t, n, self)

    def keep_path(self, path: torch.Tensor, history_rows: torch.Tensor):
        """Keep the path `path` [n] (node indices, root first) of the pending tree pass: the state after its nodes
        from their recorded keys, decays and deltas, in place; the conv history from the window rows
        `history_rows` [K-1] (the last kept node's conv inputs after its oldest)."""
        _keep_path(self, path, history_rows)


def _commit(b: GDNState | GDNStack, t: int, n: int, state: GDNState):
    """commit(t, n) over the buffers of `b`: a state's, or a whole stack's (the same with a leading layer dimension:
    one launch or copy for every layer); `state`'s flags hold for all of them."""
    keep = b.history.shape[-2]
    if n == t:
        if not state.history_in_place(n):
            b.history.copy_(b.pending_history if n > state.max_partial else b.pending_window.narrow(-2, n, keep))
        if not state.in_place:
            b.recurrent.copy_(b.pending_recurrent)
        return
    if state.in_place:
        raise RuntimeError(f"partial commit of an in-place pass ({n} of {t} tokens)")
    if t > state.max_partial:
        raise RuntimeError(f"partial commit of a {t}-token pass (max {state.max_partial})")
    # the recurrence alone over the first n tokens, in place, from the recorded inputs
    gates = Gates(b.pending_g.narrow(-2, 0, n), b.pending_beta.narrow(-2, 0, n))
    gated_delta(b.pending_mixed.narrow(-2, 0, n), gates, b.recurrent, b.recurrent, b.shape)
    b.history.copy_(b.pending_window.narrow(-2, n, keep))


def _keep_path(b: GDNState | GDNStack, path: torch.Tensor, history_rows: torch.Tensor):
    """keep_path over the buffers of `b`: a state's, or a whole stack's (one launch for every layer)."""
    keep_path(b.pending_mixed, b.pending_g, b.recurrent, b.shape, path, b.pending_deltas, b.pending_window,
              history_rows, b.history)


def _whole_stack(states: list[GDNState]) -> GDNStack | None:
    """The stack of which `states` are every layer, in order, alike in place or not; else None."""
    stack = states[0].stack if states else None
    if stack is None or stack.count < 2 or len({s.in_place for s in states}) > 1:
        return None
    return stack if [(s.stack, s.index) for s in states] == [(stack, i) for i in range(stack.count)] else None


def commits(states: list[GDNState], t: int, n: int):
    """commit(t, n) of every state: the layers of one stack at once."""
    stack = _whole_stack(states)
    if stack is not None:
        _commit(stack, t, n, states[0])
        return
    for s in states:
        s.commit(t, n)


def keep_paths(states: list[GDNState], path: torch.Tensor, history_rows: torch.Tensor):
    """keep_path of every state: the layers of one stack at once."""
    stack = _whole_stack(states)
    if stack is not None:
        _keep_path(stack, path, history_rows)
        return
    for s in states:
        s.keep_path(path, history_rows)


class GatedDeltaNet(nn.Module):
    PACKS = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}  # packed at load (layers/linear.py)

    def __init__(self, hidden_size: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.eps = eps
        qk_size, v_size = key_heads * key_dim, value_heads * value_dim
        self.conv_dim = 2 * qk_size + v_size
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, v_size, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(value_dim))
        self.out_proj = nn.Linear(v_size, hidden_size, bias=False)
        self.in_proj = None

    def state_shape(self) -> tuple[int, int, int, int, int, int]:
        """(key heads, key dim, value heads, value dim, conv channels, conv taps): what its state's buffers hold."""
        return self.key_heads, self.key_dim, self.value_heads, self.value_dim, self.conv_dim, self.conv1d.kernel_size[0]

    def new_state(self, max_partial: int, device, dtype, stack: GDNStack | None = None, index: int = 0) -> GDNState:
        """This layer's state: slice `index` of `stack` (of layers of its state_shape), else in a stack of its own."""
        *shape, conv_dim, kernel = self.state_shape()
        return GDNState(conv_dim, kernel, tuple(shape), max_partial, device, dtype, stack, index)

    def new_stack(self, count: int, max_partial: int, device, dtype) -> GDNStack:
        """Room for the states of `count` layers of this one's state_shape (new_state's `stack`)."""
        *shape, conv_dim, kernel = self.state_shape()
        return GDNStack(count, conv_dim, kernel, tuple(shape), max_partial, device, dtype)

    def forward(self, x: torch.Tensor, state: GDNState) -> torch.Tensor:
        return self.out_proj(self.mix(x, state))

    def mix(self, x: torch.Tensor, state: GDNState, tree=None) -> torch.Tensor:
        """The gated, normed DeltaNet output [T, value heads * value dim], out_proj's input. tree: a draft tree's
        TreeLayout (layers/tree.py): conv and recurrence follow each node's path, and the pass records what
        keep_path needs."""
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x)
        window_buffer, mixed_buffer, gate_buffers = state.short_pass_buffers(t)
        gates = GateProjections(b, a, self.A_log, self.dt_bias)
        z = z.view(t, self.value_heads, self.value_dim)
        if tree is not None:
            if window_buffer is None:
                raise RuntimeError(f"a {t}-node tree pass is longer than the state records ({state.max_partial})")
            out, _ = deltanet_tree_mixer(qkv, state.history, self.conv1d.weight, gates, state.recurrent, state.shape,
                                         z, self.norm.weight, self.eps, tree,
                                         window_buffer, mixed_buffer, gate_buffers, state.pending_deltas[:t])
            return out.reshape(t, -1)
        out, window = deltanet_mixer(qkv, state.history, self.conv1d.weight, gates, state.recurrent,
                                     state.pending_recurrent, state.shape, z, self.norm.weight, self.eps,
                                     window_buffer, mixed_buffer, gate_buffers, state.history_in_place(t))
        state.record(t, window)
        return out.reshape(t, -1)
