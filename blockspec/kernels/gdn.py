"""Gated DeltaNet ops: depthwise causal conv1d with carried state, and the gated delta rule recurrence."""

import functools

import torch
import torch.nn.functional as F

from . import fused


@fused
def causal_conv1d(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
                  window_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over x [T, C], continuing from `history` [K-1, C] (the previous inputs).

    Returns (output [T, C], window [K-1+T, C]); the new history after n tokens is window[n : n+K-1]. With
    `window_out` the window is written there (the state's pending buffer: no copy afterwards).
    """
    window = torch.cat([history.to(x.dtype), x], dim=0)
    if window_out is not None:
        window = window_out.copy_(window)
    taps = window.unfold(0, weight.shape[-1], 1)  # [T, C, K]: the K inputs each output sees, oldest first
    out = (taps * weight.view(weight.shape[0], -1).to(x.dtype)).sum(-1)
    return F.silu(out), window


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@fused
def deltanet_inputs(mixed, b, a, A_log, dt_bias, key_heads: int, key_dim: int, value_heads: int, value_dim: int,
                    out: tuple | None = None):
    """Split the convolved projection into the recurrence's inputs: L2-normalised q (pre-scaled) and k repeated
    to the value heads, v, log-decay g = -exp(A_log) * softplus(a + dt_bias), write strength beta = sigmoid(b).
    With `out` (the state's pending buffers, for a partial commit) they are written there by the same kernel."""
    t = mixed.shape[0]
    qk_size = key_heads * key_dim
    q, k, v = mixed.split([qk_size, qk_size, value_heads * value_dim], dim=-1)
    repeat = value_heads // key_heads
    q = l2_normalize(q.reshape(t, key_heads, key_dim).float()).repeat_interleave(repeat, dim=1) * key_dim ** -0.5
    k = l2_normalize(k.reshape(t, key_heads, key_dim).float()).repeat_interleave(repeat, dim=1)
    v = v.reshape(t, value_heads, value_dim).float()
    beta = torch.sigmoid(b).float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    if out is not None:
        return tuple(buffer.copy_(value) for buffer, value in zip(out, (q, k, v, g, beta)))
    return q, k, v, g, beta


def gated_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule over T tokens: fla-core's Triton kernels on CUDA when installed, else the reference."""
    if q.is_cuda and fla_available():
        return gated_delta_rule_fla(q, k, v, g, beta, state)
    return gated_delta_rule_reference(q, k, v, g, beta, state)


@functools.cache
def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gated_delta_rule_fla(q, k, v, g, beta, state):
    """fla-core: fused recurrent kernel for short passes (decode, verification), chunked kernel for prefill.
    Same contract as the reference; q is pre-scaled, so the kernel's scale is 1."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    kernel = fused_recurrent_gated_delta_rule if q.shape[0] <= 64 else chunk_gated_delta_rule
    out, final = kernel(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=1.0,
                        initial_state=state[None], output_final_state=True)
    return out[0].float(), final[0]


def gated_delta_rule_reference(q, k, v, g, beta, state):
    """Token-by-token gated delta rule in float32 (reference).

    q, k: [T, H, Dk] (already L2-normalised, q already scaled); v: [T, H, Dv]; g (log decay), beta: [T, H];
    state: [H, Dk, Dv] float32 (not modified). Returns (out [T, H, Dv] float32, final state).
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out, state
