"""Qwen3.5 hybrid text model (Qwen3.5 / 3.6 / 3.8-27B): Gated DeltaNet and gated attention layers, SwiGLU MLPs.

Parameter names mirror the Hugging Face checkpoint (minus its `model.` / `model.language_model.` prefix) so that
loading is a plain name-to-tensor mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import TargetConfig
from ..kernels.attention import rope_tables
from ..kernels.linear import linear_float32
from ..layers.attention import GatedAttention
from ..layers.folded_norm import MAX_FOLDED_ROWS, FoldedNorm
from ..layers.gdn import GatedDeltaNet
from ..layers.mlp import SwiGLU
from ..layers.norm import RMSNorm
from ..layers.tree import TreeLayout


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig, layer_type: str):
        super().__init__()
        c = config
        self.is_attention = layer_type == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                            c.rms_norm_eps)
        else:
            self.linear_attn = GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                                             c.linear_key_head_dim, c.linear_value_head_dim,
                                             c.linear_conv_kernel_dim, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.fold, self.fold_into = False, None  # norms folded into the projections (layers/folded_norm.py)

    def forward(self, x, delta, layer_state, positions, rope, visible, tree=None):
        """The residual stream is x + delta, delta being the previous layer's MLP output (None for the first):
        each residual add is left to the next norm, which does both in one kernel. Returns (x, delta) likewise.
        Folded norms (passes of <= MAX_FOLDED_ROWS tokens): delta may be a FoldedNorm (x already holds the sum, the
        norm is begun), and the layer returns one when it folds the next layer's input norm."""
        h = delta if isinstance(delta, FoldedNorm) else None
        if h is None:
            x, h = self.input_layernorm.add_forward(x, delta)
        if self.is_attention:
            mixed = self.self_attn.attend(h, layer_state, positions, rope, visible, tree)
            out_proj = self.self_attn.o_proj
        else:
            mixed, out_proj = self.linear_attn.mix(h, layer_state, tree), self.linear_attn.out_proj
        fold = self.fold and x.shape[0] <= MAX_FOLDED_ROWS
        if fold:
            x, h = out_proj.add_norm(mixed, x, self.post_attention_layernorm)
        else:
            x, h = self.post_attention_layernorm.add_forward(x, out_proj(mixed))
        if fold and self.fold_into is not None:
            return self.mlp.add_norm(h, x, self.fold_into)
        return x, self.mlp.down_proj(self.mlp.activate(h))


@dataclass
class TargetOutput:
    logits: torch.Tensor            # [T, vocab] float32
    hidden: torch.Tensor            # [T, hidden]: last layer output, before the final norm (what MTP reads)
    features: torch.Tensor | None   # [T, len(capture) * hidden]: outputs of the captured layers (what DFlash2 reads)


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.rotary_dim = config.rotary_dim  # channels RoPE rotates, read by every pass
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                           bias=False)
        self.mtp = None  # set by blockspec.models.mtp when the checkpoint has an MTP head
        self.checkpoint_quantization = None  # "int4": loaded from a compressed-tensors checkpoint (checkpoint.py)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits on every path (step, verification, prefill, proposers): the head accumulates in float32
        and its sums are not rounded to the compute dtype (kernels/linear.py says why)."""
        head = self.lm_head
        if head is None:
            return linear_float32(normed, self.embed_tokens.weight)
        if not isinstance(head, nn.Linear):  # quantized: vocabulary_quantization, or stored so
            return head(normed, out_dtype=torch.float32)
        return linear_float32(normed, head.weight)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_tables(positions, self.rotary_dim, self.config.rope_theta, dtype)

    def forward(self, ids: torch.Tensor, caches: list, *, start: int | None = None,
                positions: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                all_logits: bool = True, tree: TreeLayout | None = None) -> TargetOutput:
        """Run ids [T] at positions start.. on the per-layer caches (DecodeState.layers, whose transaction the caller
        opened). `positions` replaces `start` under CUDA-graph capture: a static buffer the caller fills before each
        replay, the whole KV cache passed and the position as data. `tree`: the ids are a draft tree's nodes laid
        out from the committed length (layers/tree.py); its positions are used."""
        visible = None
        if tree is not None:
            positions = tree.positions
            visible = start + ids.shape[0] if start is not None else None
        elif positions is None:
            positions = torch.arange(start, start + ids.shape[0], device=ids.device)
            visible = start + ids.shape[0]
        x = self.embed(ids)
        rope = self.rope(positions, x.dtype)
        captured, delta = {}, None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, caches[i], positions, rope, visible, tree)
            if i in capture:
                captured[i] = x if isinstance(delta, FoldedNorm) else x + delta
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        x, normed = self.norm.add_forward(x, delta)
        return TargetOutput(self.logits(normed if all_logits else normed[-1:]), x, features)
