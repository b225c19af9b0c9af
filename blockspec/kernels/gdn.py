"""Gated DeltaNet ops: depthwise causal conv1d with carried state, and the gated delta rule recurrence."""

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over x [T, C], continuing from `history` [K-1, C] (the previous inputs).

    Returns (output [T, C], window [K-1+T, C]); the new history after n tokens is window[n : n+K-1].
    """
    window = torch.cat([history.to(x.dtype), x], dim=0)
    taps = window.unfold(0, weight.shape[-1], 1)  # [T, C, K]: the K inputs each output sees, oldest first
    out = (taps * weight.view(weight.shape[0], -1).to(x.dtype)).sum(-1)
    return F.silu(out), window


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state):
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
