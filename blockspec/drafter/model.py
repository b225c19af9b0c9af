"""DFlash2 drafter: proposes block_size - 1 tokens from committed target features in one pass.

One drafter pass works on a block of block_size rows at absolute positions anchor .. anchor + block_size - 1:
the anchor token (last committed token, whose target features are not known yet) followed by mask tokens,
embedded with the target's table. Every layer attends to [bounded context K/V, the block's own K/V]; the
context K/V come from the committed target features (fc -> hidden_norm -> per-layer k/v projections).
The final-normed rows 1.. give logits through the target's head, and the candidate selector turns them
into proposals (a chain), or into a draft tree (layers/tree.py).

Its modules, in the order a pass meets them: each sublayer wrapped in a pair of dynamic causal convolutions
(`DynamicCausalConv`), attention over the context and the block (`DrafterAttention`), the layer (`DrafterLayer`),
the candidate selector (`CandidateSelector`), then the drafter (`DFlash2Drafter`); its bounded context of target
features lives in context.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from blockspec.drafter.config import DrafterConfig
from blockspec.drafter.context import DrafterContext
from blockspec.errors import BlockspecError
from blockspec.kernels.attention import masked_attention, prepare_attention_inputs
from blockspec.kernels.attention import rope_tables
from blockspec.kernels.drafter_conv import grouped_dynamic_causal_conv
from blockspec.kernels.drafter_selector import greedy_walk, sampled_walk
from blockspec.layers.mlp import SwiGLU
from blockspec.layers.norm import PlainRMSNorm as RMSNorm
from blockspec.layers.linear import pack_projections
from blockspec.layers.tree import DraftTree, build_tree, graft, transition_log_probs

WEIGHTS_FILE = "model.safetensors"
QUANTIZED_PROJECTIONS = re.compile(r"fc$|layers\.\d+\.(self_attn|mlp)\.")  # what dflash2_quantization quantizes
# Some checkpoints store the codebooks as bare tensors rather than Embedding weights.
_BARE_TENSOR_NAMES = {
    "candidate_selector.predecessor_codebook": "candidate_selector.predecessor_codebook.weight",
    "candidate_selector.successor_codebook": "candidate_selector.successor_codebook.weight",
}


class DynamicCausalConv(nn.Module):
    """A conv pair wrapped around one sublayer: `prepare` before it, `finish` after it (kernels/drafter_conv.py: each
    output row mixes the K rows up to it of the same block, with per-channel learned and per-group predicted taps).

    Both dynamic kernels are predicted from the sublayer's (normed) input, so `prepare` returns the one
    `finish` needs.
    """

    def __init__(self, channels: int, kernel_size: int, group_size: int, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = channels // group_size
        # [0] = taps before the sublayer, [1] = taps after it.
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, channels, dtype=dtype))
        self.kernel_projection = nn.Linear(channels, 2 * kernel_size * self.groups, bias=False, dtype=dtype)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        before = grouped_dynamic_causal_conv(x, dynamic[:, 0], self.base_kernel[0], self.group_size)
        return before, dynamic[:, 1]

    def finish(self, y: torch.Tensor, dynamic_after: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_causal_conv(y, dynamic_after, self.base_kernel[1], self.group_size)


@dataclass
class Selection:
    """A sampling walk's inputs (temperature, a 0-dim tensor, 0 = greedy; one uniform in (0, 1] per row, float64)
    and outputs: each row's candidate token ids and the probabilities q it drew from [rows, K]."""

    temperature: torch.Tensor
    uniforms: torch.Tensor
    candidates: torch.Tensor | None = None
    probs: torch.Tensor | None = None


class CandidateSelector(nn.Module):
    """Picks each proposal among the top-K tokens of its row, given the previous pick.

    score(prev -> cand at row i) = logit_i[cand] + < predecessor[prev] * P h_i , successor[cand] >
    The walk starts from the anchor token (the last committed token). Greedy, it takes each row's best score; with a
    `Selection` at temperature T > 0 (sampling), it draws each row's pick from q = softmax(scores / T) over the row's
    candidates, given the pick before it, by inverse CDF with one uniform per row, and reports q: the distribution the
    proposal was really drawn from, which the speculative-sampling rule needs (as the reference selector, dflash's
    CandidateSelector.select, draws and reports it).
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.successor_codebook = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False, dtype=dtype)

    def transition_scores(
        self, unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor, projected: torch.Tensor
    ) -> torch.Tensor:
        """Scores [K] of moving from token `previous` ([1]) to each of `candidates` ([K], logits `unary`)."""
        query = self.predecessor_codebook(previous)[0] * projected  # [rank]
        return unary + self.successor_codebook(candidates) @ query

    def _candidates(self, hidden, logits, vocabulary):
        """Each row's top-K (unary logits, token ids) and the selector's projection of the row's hidden state."""
        # Unsorted, like the reference: candidate order decides exact score ties (common in bf16).
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        if vocabulary is not None:
            candidates = vocabulary[candidates]
        return unary, candidates, self.hidden_projection(hidden)

    def _walk(self, unary, candidates, projected, anchor, selection):
        codebooks = self.predecessor_codebook.weight, self.successor_codebook.weight
        if selection is None:
            return greedy_walk(unary, candidates, projected, anchor.reshape(1), *codebooks)
        chosen, selection.probs = sampled_walk(unary, candidates, projected, anchor.reshape(1), *codebooks,
                                               selection.temperature, selection.uniforms)
        selection.candidates = candidates
        return chosen

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             vocabulary: torch.Tensor | None = None, selection: Selection | None = None) -> torch.Tensor:
        """hidden [n, H], logits [n, V], anchor [1] -> chosen tokens [n]. No host synchronisation. With a draft
        vocabulary, logits column j is token vocabulary[j] (layers/draft_head.py). With a `selection`, the walk
        samples at its temperature and fills its candidates and probs."""
        unary, candidates, projected = self._candidates(hidden, logits, vocabulary)
        return self._walk(unary, candidates, projected, anchor, selection)

    def tree(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, budget: int,
             vocabulary: torch.Tensor | None = None, marginal: bool = False,
             selection: Selection | None = None) -> DraftTree:
        """A draft tree of `budget` nodes (layers/tree.py) holding the walk's chain: the greedy walk's, or with a
        `selection` the sampled walk's (its candidates and probs filled as `walk` fills them); no host
        synchronisation."""
        unary, candidates, projected = self._candidates(hidden, logits, vocabulary)
        chain = self._walk(unary, candidates, projected, anchor, selection)
        table = transition_log_probs(unary, candidates, projected, anchor, self.predecessor_codebook.weight,
                                     self.successor_codebook.weight, marginal=marginal)
        return build_tree(table, candidates, anchor, chain, budget)


class DrafterAttention(nn.Module):
    PACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # packed at load (layers/linear.py): forward uses qkv_proj

    def __init__(self, config: DrafterConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias, dtype=dtype)
        self.qkv_proj = None
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)

    def write_context(self, x: torch.Tensor, cos, sin, slots, keys, values):
        """K (normed, rotated) and V of context rows x [T, hidden] into this layer's buffers [slots, kv_heads,
        head_dim] at `slots`."""
        rows = x.shape[0]
        _, k, v = self.qkv_proj(x)  # q's rows are unused here: one matmul still beats two
        kv_shape = (rows, self.num_kv_heads, self.head_dim)
        prepare_attention_inputs(None, k.view(kv_shape), v.view(kv_shape), None, self.k_norm.weight,
                                 self.k_norm.eps, cos, sin, slots, keys, values, zero_centred=False)

    def forward(self, x, cos, sin, keys, values, visible, block_slots):
        """keys / values: this layer's context buffers; the block's own K/V go to their `block_slots`, and `visible`
        [T, slots] says which slots each row sees."""
        rows = x.shape[0]
        q, k, v = self.qkv_proj(x)
        kv_shape = (rows, self.num_kv_heads, self.head_dim)
        q = prepare_attention_inputs(q.view(rows, self.num_heads, self.head_dim), k.view(kv_shape), v.view(kv_shape),
                                     self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, block_slots,
                                     keys, values, zero_centred=False)
        out = masked_attention(q, keys, values, visible, self.head_dim**-0.5)
        return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    """Pre-norm attention and MLP sublayers, each wrapped in a dynamic causal conv pair."""

    def __init__(self, config: DrafterConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.attention_conv = DynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, dtype=dtype)
        self.self_attn = DrafterAttention(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp_conv = DynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, dtype=dtype)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, dtype=dtype)

    def forward(self, x, cos, sin, keys, values, visible, block_slots):
        h, after = self.attention_conv.prepare(self.input_layernorm(x))
        h = self.self_attn(h, cos, sin, keys, values, visible, block_slots)
        x = x + self.attention_conv.finish(h, after)
        h, after = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), after)


class DFlash2Drafter(nn.Module):
    """Weights are uninitialised after construction; `from_pretrained` (or `load_weights`) fills them.

    The device and dtype are fixed at construction (the context buffers are not module buffers).
    """

    def __init__(
        self,
        config: DrafterConfig,
        *,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        c = self.config = config
        self.block_size = c.block_size
        self.mask_token_id = c.mask_token_id
        self.target_layer_ids = list(c.target_layer_ids)
        self.device = torch.device(device)
        self.dtype = dtype
        with torch.device("meta"):  # no time spent initialising weights that are loaded next
            self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False, dtype=dtype)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
            self.layers = nn.ModuleList(DrafterLayer(c, dtype) for _ in range(c.num_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
            self.candidate_selector = CandidateSelector(
                c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k, dtype=dtype
            )
        self.to_empty(device=self.device)
        self.requires_grad_(False)
        # The target's functions are not submodules: their weights belong to the target.
        self.__dict__["_embed"] = embed
        self.__dict__["_lm_head"] = lm_head
        self.vocabulary = None  # token ids of the head's columns when it covers a draft vocabulary (set_head)
        self.context = DrafterContext(
            c.num_layers, c.num_kv_heads, c.head_dim, c.sliding_window, block=c.block_size, device=self.device,
            dtype=dtype)
        self._block_offsets = torch.arange(c.block_size, device=self.device)
        self._masks = torch.full((c.block_size - 1,), c.mask_token_id, device=self.device, dtype=torch.long)

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        target_hidden_size: int,
        target_vocab_size: int,
        target_num_layers: int,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int | None = None,
    ) -> DFlash2Drafter:
        """The drafter in `directory`, run with blocks of `block_size` rows (None: the block it was trained with;
        DrafterConfig.run_at)."""
        directory = Path(directory)
        config = DrafterConfig.from_file(directory / "config.json").run_at(block_size, str(directory / "config.json"))
        check_fits_target(config, directory, target_hidden_size, target_vocab_size, target_num_layers)
        drafter = cls(config, embed=embed, lm_head=lm_head, device=device, dtype=dtype)
        drafter.load_weights(directory / WEIGHTS_FILE)
        return drafter

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        """Fill the weights from a checkpoint file (its names), then pack the projections (layers/linear.py)."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise BlockspecError(f"drafter weights {path} do not exist")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as stored:
                names = {_BARE_TENSOR_NAMES.get(name, name): name for name in stored.keys()}
                parameters = dict(self.named_parameters())
                for name, parameter in parameters.items():  # check everything before copying anything
                    expected = tuple(parameter.shape)
                    if name not in names:
                        raise BlockspecError(
                            f"drafter weights {path}: missing tensor '{name}' (expected shape {expected})"
                        )
                    stored_slice = stored.get_slice(names[name])
                    if stored_slice.get_dtype() not in ("F16", "BF16", "F32"):
                        raise BlockspecError(
                            f"drafter weights {path}: tensor '{names[name]}' is stored as {stored_slice.get_dtype()}, "
                            "expected float16, bfloat16 or float32"
                        )
                    shape = tuple(stored_slice.get_shape())
                    if shape != expected:
                        raise BlockspecError(
                            f"drafter weights {path}: tensor '{names[name]}' has shape {shape}, "
                            f"the config implies {expected}"
                        )
                deeper = next((n for n in names if n.startswith("layers.")
                               and n.split(".")[1].isdigit() and int(n.split(".")[1]) >= self.config.num_layers), None)
                if deeper is not None:  # weights of more layers than the config builds: not this config's drafter
                    raise BlockspecError(f"drafter weights {path}: tensor '{names[deeper]}' is of a layer past "
                                         f"num_hidden_layers {self.config.num_layers} (config.json)")
                for name, parameter in parameters.items():
                    parameter.copy_(stored.get_tensor(names[name]))
        except BlockspecError:
            raise
        except Exception as exc:  # safetensors reports corrupt files with its own exception types
            raise BlockspecError(f"drafter weights {path} cannot be read: {exc}") from None
        pack_projections(self)

    # ---------------------------------------------------------------- context

    def reset(self) -> None:
        """Start a new request; the context buffers are reused."""
        self.context.reset()

    @torch.no_grad()
    def append_context(self, features: torch.Tensor, start_position: int) -> None:
        """Commit target features [n, len(target_layer_ids) * hidden] for positions start .. start + n - 1."""
        width = len(self.target_layer_ids) * self.config.hidden_size
        if features.dim() != 2 or features.shape[1] != width:
            raise ValueError(f"context features must be [n, {width}], got {list(features.shape)}")
        if start_position != self.context.length:
            raise ValueError(f"context append at {start_position}, but {self.context.length} positions are committed")
        rows = features.shape[0]
        kept = min(rows, self.context.capacity)  # older rows would be overwritten at once
        if kept == 0:
            return
        first = start_position + rows - kept
        self.encode_context(features[rows - kept:], torch.arange(first, first + kept, device=self.device))
        self.context.commit(start_position, rows)

    @torch.no_grad()
    def encode_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the context K/V of features [n, width] at absolute `positions` (a device tensor, so that a CUDA
        graph can replay it at any position); append_context checks and keeps the committed length."""
        hidden = self.hidden_norm(self.fc(features.to(device=self.device, dtype=self.dtype)))
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        slots = self.context.record(positions)
        for index, layer in enumerate(self.layers):
            layer.self_attn.write_context(hidden, cos, sin, slots, self.context.keys[index], self.context.values[index])

    # ---------------------------------------------------------------- drafting

    def visible_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool [block, capacity + block]: which keys (context slots, then block rows) each block row sees.

        Same rule as the reference mask, in absolute positions: query t sees key p when t - p < window
        and, when causal, p <= t (otherwise also p - t < window). Context slots must precede the block.
        """
        window = self.config.sliding_window
        key_positions = torch.cat([self.context.positions, positions])
        distance = positions[:, None] - key_positions[None, :]
        visible = distance < window
        visible &= (distance >= 0) if self.config.causal else (distance > -window)
        capacity = self.context.capacity
        visible[:, :capacity] &= (self.context.positions < positions[0])[None, :]
        return visible

    @torch.no_grad()
    def forward_block(self, anchor_token: torch.Tensor | int, anchor_position: torch.Tensor | int) -> torch.Tensor:
        """Final-normed hidden states [block_size, hidden] of the block starting at anchor_position."""
        anchor = self._anchor(anchor_token)
        tokens = torch.cat([anchor, self._masks])
        x = (self._embed(tokens) * self.config.input_embedding_scale).to(self.dtype)
        positions = self._block_offsets + anchor_position
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        visible = self.visible_keys(positions)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.context.keys[index], self.context.values[index], visible,
                      self.context.block_slots)
        return self.norm(x)

    def set_head(self, lm_head: Callable[[torch.Tensor], torch.Tensor], vocabulary: torch.Tensor) -> None:
        """Propose over a draft vocabulary: lm_head's column j is token vocabulary[j] (layers/draft_head.py)."""
        if vocabulary.numel() < self.config.selector_top_k:
            raise BlockspecError(f"draft_vocabulary: {vocabulary.numel()} ids, fewer than the drafter's selector "
                                 f"takes per row (selector_top_k {self.config.selector_top_k})")
        self.__dict__["_lm_head"] = lm_head
        self.vocabulary = vocabulary

    @torch.no_grad()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden) * self.config.output_multiplier
        if self.config.logit_softcap is not None:
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        return logits

    @torch.no_grad()
    def propose(self, anchor_token: torch.Tensor | int, anchor_position: torch.Tensor | int,
                selection: Selection | None = None) -> torch.Tensor:
        """Proposals [block_size - 1] for positions anchor_position + 1 ...; the context must end at anchor_position.
        With a `selection` the selector samples at its temperature and reports what it drew from (selector.py)."""
        if isinstance(anchor_position, int) and anchor_position != self.context.length:
            raise ValueError(f"proposal at {anchor_position}, but the context holds {self.context.length} positions")
        anchor = self._anchor(anchor_token)
        hidden = self.forward_block(anchor, anchor_position)[1:]
        return self.candidate_selector.walk(hidden, self.draft_logits(hidden), anchor, self.vocabulary, selection)

    @torch.no_grad()
    def propose_tree(self, anchor_token: torch.Tensor | int, anchor_position: torch.Tensor | int, budget: int,
                     marginal: bool = False, selection: Selection | None = None,
                     branch: torch.Tensor | None = None) -> DraftTree:
        """A draft tree of `budget` nodes for positions anchor_position + 1 ... (layers/tree.py), from one pass;
        with a `selection` its chain is the sampled walk's (selector.py); with a `branch` ([W + 1]: W tokens, then
        how many of them are the branch) its last W nodes graft the branch on (layers/tree.py graft)."""
        if isinstance(anchor_position, int) and anchor_position != self.context.length:
            raise ValueError(f"proposal at {anchor_position}, but the context holds {self.context.length} positions")
        anchor = self._anchor(anchor_token)
        hidden = self.forward_block(anchor, anchor_position)[1:]
        if branch is None:
            return self.candidate_selector.tree(hidden, self.draft_logits(hidden), anchor, budget, self.vocabulary,
                                                marginal, selection)
        width = branch.shape[0] - 1
        return graft(self.candidate_selector.tree(hidden, self.draft_logits(hidden), anchor, budget - width,
                                                  self.vocabulary, marginal, selection), branch)

    def _anchor(self, token: torch.Tensor | int) -> torch.Tensor:
        if isinstance(token, int):
            return torch.tensor([token], device=self.device, dtype=torch.long)
        return token.reshape(1).to(device=self.device, dtype=torch.long)


def check_fits_target(
    config: DrafterConfig, directory: Path, hidden_size: int, vocab_size: int, num_layers: int
) -> None:
    where = f"drafter {directory}"
    if config.vocab_size != vocab_size:
        raise BlockspecError(f"{where}: vocab_size {config.vocab_size} does not match the target's {vocab_size}")
    if config.hidden_size != hidden_size:
        raise BlockspecError(
            f"{where}: hidden_size {config.hidden_size} does not match the target's {hidden_size} "
            "(the drafter shares the target's embeddings and head)"
        )
    if not 0 <= config.mask_token_id < vocab_size:
        raise BlockspecError(
            f"{where}: mask_token_id {config.mask_token_id} is outside the target's vocabulary of {vocab_size}"
        )
    for layer_id in config.target_layer_ids:
        if not 0 <= layer_id < num_layers:
            raise BlockspecError(
                f"{where}: target_layer_ids {list(config.target_layer_ids)} include {layer_id}, "
                f"but the target has {num_layers} layers (0..{num_layers - 1})"
            )
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        raise BlockspecError(f"drafter {directory / 'config.json'}: num_target_layers {config.num_target_layers} (the "
                             f"target it was trained with) does not match the target's {num_layers} layers")
