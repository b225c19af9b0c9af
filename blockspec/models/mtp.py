"""Qwen3.5 native multi-token-prediction (MTP) head, stored under `mtp.*` in the checkpoint.

Predicting the token after next: normalise the embedding of the next token and the target's final-normed hidden
state at the current position (each with its own RMSNorm), project their concatenation [embedding, hidden] with `fc`,
run a full-attention decoder layer (own KV cache, same RoPE positions as the target), final norm, shared lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TargetConfig
from ..layers.norm import RMSNorm
from .qwen3_5 import DecoderLayer


class MTPHead(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(config, "full_attention")
                                    for _ in range(max(config.mtp_num_hidden_layers, 1)))
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, caches, positions, rope, visible) -> torch.Tensor:
        """embedded: embeddings of tokens at positions start+1.. ; hidden: final-normed target (or previous MTP step)
        hidden states at positions start.. . Returns the layer output before the head's final norm [T, hidden]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        delta = None
        for layer, cache in zip(self.layers, caches):
            x, delta = layer(x, delta, cache, positions, rope, visible)
        return x + delta
