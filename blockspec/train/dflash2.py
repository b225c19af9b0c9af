"""`blockspec train-drafter`: train a DFlash2 drafter for a target blockspec loads, on the user's text.

What it learns: the target's own greedy choices. Each training sequence runs once through the frozen target
(blockspec's own model, as at inference), which gives the features of `target_layer_ids` and the target's argmax at
every position. The text is teacher-forced: the label of block row j after anchor a is the target's argmax at
position a + j - 1 given the real text before it. That costs one target pass per sequence instead of one generation
per anchor, and equals the target's greedy continuation wherever the text follows it (exactly so on the target's own
greedy output, `blockspec regenerate --greedy`). Only trained labels count (train/data.py: a conversation's assistant
tokens, all of a text).

One step: anchors a are sampled across the sequences where the first label is trained; block = [token a, mask x
(block - 1)] at positions a..a+block-1 reads the features of positions < a inside the sliding window; the loss is
the cross-entropy of rows 1.. against the trained labels, weighted toward early rows (row j by exp(-(j - 1) /
loss_decay): a late row only counts if the earlier ones were accepted), plus the same weighted cross-entropy of the
candidate selector's scores over its top-k candidates (predecessor: the previous label; rows whose label is not
among the candidates are skipped). Embeddings and head are the target's, frozen. The trainable module is the
`dflash` package's DFlash2DraftModel (the published architecture), so what is saved is its HF directory: blockspec
and `dflash` load it as it is.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..config import TargetConfig
from ..errors import BlockspecError
from .block_attention import BlockLayout, attend, step_mask
from .data import on_device
from .ranks import Ranks


def spread_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly over the same relative depths as the published 27B drafter's (layers 5 to
    61 of 64: [5, 19, 33, 47, 61]). A fixed offset from the top instead (the last read layer three below the last)
    leaves a shallow target's top layers unread: on an 8-layer target that drafter read layers 1-5 and its first
    proposal was accepted 48% of the time where the MTP head, reading the last layer, reached 73%."""
    first, last = (num_layers - 1) * 5 / 63, (num_layers - 1) * 61 / 63
    return sorted({round(first + i * (last - first) / max(count - 1, 1)) for i in range(count)})


def drafter_config(target: TargetConfig, run, mask_token_id: int) -> dict:
    """The HF config.json of the drafter to train (what DrafterConfig and dflash's DFlash2DraftModel read)."""
    layer_ids = run.target_layer_ids or spread_layer_ids(target.num_hidden_layers, 5)
    heads = run.heads or target.num_attention_heads
    kv_heads = target.num_key_value_heads if heads % target.num_key_value_heads == 0 else heads
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": target.hidden_size,
        "intermediate_size": run.intermediate_size or target.intermediate_size, "num_hidden_layers": run.layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": target.head_dim,
        "vocab_size": target.vocab_size, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "sliding_window": run.window,
        "use_sliding_window": True, "layer_types": ["sliding_attention"] * run.layers, "is_causal": False,
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"block_size": run.block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": layer_ids, "conv_kernel_size": 2, "conv_group_size": 16,
                          "selector_rank": run.selector_rank, "selector_top_k": run.selector_top_k}}


def mask_token(tokenizer, vocab_size: int) -> int:
    """A token the drafter embeds as 'to be predicted': an end-of-text special token when the tokenizer has one."""
    for name in ("<|endoftext|>", "<|fim_pad|>", "<|im_end|>"):
        token = tokenizer.token_id(name)
        if token is not None and token < vocab_size:
            return token
    return vocab_size - 1


def anchor_positions(trained, block: int) -> list[int]:
    """The positions of a sequence that may anchor a block: a whole block after it, its first label trained
    (`trained`: per position, an array or a list)."""
    return (np.flatnonzero(np.asarray(trained[1:len(trained) - block + 2])) + 1).tolist()


def sample_anchors(trained, count: int, block: int, rng) -> list[int]:
    """`count` distinct anchor positions (or all there are) of a sequence whose positions are `trained` or not."""
    positions = anchor_positions(trained, block)
    return sorted(rng.sample(positions, min(count, len(positions))))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def drafter_hidden(model, features: torch.Tensor, noise: torch.Tensor, anchors: torch.Tensor,
                   seq_len: int | None = None, block_sparse: bool = False) -> torch.Tensor:
    """The drafter's output rows [n, block, H] for n anchor blocks: `features` [L, F] are the target's captured
    features of sequences of `seq_len` tokens laid end to end (default: one sequence, L), `anchors` [n] index that
    stream, `noise` [n, block, H] is the embedded blocks.

    Equals dflash's own forward run block by block on each anchor's context (tests/test_train.py checks it), but
    projects the features (fc, keys, values) once instead of once per anchor, and runs every block's attention in one
    masked call (train/block_attention.py: a dense mask, or with block_sparse flex_attention's block mask, what
    training on CUDA runs): per step the drafter costs L + n * block rows instead of n * (window + block)."""
    n, block, _ = noise.shape
    length = features.shape[0]
    seq_len = seq_len or length
    context = model.hidden_norm(model.fc(features))[None]
    positions = ((anchors % seq_len)[:, None] + torch.arange(block, device=anchors.device)).reshape(1, -1)
    cos_c, sin_c = model.rotary_emb(context, (torch.arange(length, device=anchors.device) % seq_len)[None])
    cos_b, sin_b = model.rotary_emb(noise, positions)
    layout = BlockLayout(anchors, block, length, model.config.sliding_window, seq_len)
    mask = step_mask(layout, block_sparse)
    hidden = noise
    for layer in model.layers:
        attn = layer.self_attn
        d = attn.head_dim
        x, attention_kernel = layer.attention_conv.prepare(layer.input_layernorm(hidden))
        rows = x.reshape(1, n * block, -1)
        q = _rotate(attn.q_norm(attn.q_proj(rows).view(1, n * block, -1, d)), cos_b[:, :, None], sin_b[:, :, None])
        k = torch.cat([_rotate(attn.k_norm(attn.k_proj(context).view(1, length, -1, d)), cos_c[:, :, None],
                               sin_c[:, :, None]),
                       _rotate(attn.k_norm(attn.k_proj(rows).view(1, n * block, -1, d)), cos_b[:, :, None],
                               sin_b[:, :, None])], dim=1)
        v = torch.cat([attn.v_proj(context), attn.v_proj(rows)], dim=1).view(1, length + n * block, -1, d)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, attn.scaling)
        out = attn.o_proj(out.transpose(1, 2).reshape(n, block, -1))
        hidden = hidden + layer.attention_conv.finish(out, attention_kernel)
        x, mlp_kernel = layer.mlp_conv.prepare(layer.post_attention_layernorm(hidden))
        hidden = hidden + layer.mlp_conv.finish(layer.mlp(x), mlp_kernel)
    return model.norm(hidden)


def block_losses(model, head, embed, features, tokens, labels, anchors, decay: float, seq_len: int | None = None,
                 trained: torch.Tensor | None = None, total=lambda count: count):
    """(block cross-entropy, selector cross-entropy, per-row accuracy [block - 1]) of the anchor blocks of sequences
    of `seq_len` tokens laid end to end (default: one): `tokens` [L] their ids, `labels` [L] the target's greedy token
    after each position, `anchors` [n] positions in that stream, `trained` [L] (bool; default: all) the positions
    whose labels count: a row whose label is not trained is left out of its row's mean. With the ranks' `total`
    (train/ranks.py) the means are over the rows of every rank's blocks: each rank's figures are its part of the
    whole step's."""
    block = model.block_size
    offsets = torch.arange(block, device=tokens.device)
    ids = torch.full((anchors.shape[0], block), model.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, 0] = tokens[anchors]
    targets = labels[anchors[:, None] + offsets[None, :-1]]
    counted = (torch.ones_like(targets, dtype=torch.bool) if trained is None
               else trained[anchors[:, None] + offsets[None, :-1]])
    rows = total(counted.sum(0)).clamp_min(1)
    noise = embed(ids) * float(model.config.dflash_config.get("input_embedding_scale", 1.0))
    hidden = drafter_hidden(model, features, noise.to(features.dtype), anchors, seq_len,
                            block_sparse=features.is_cuda)[:, 1:]
    logits = model.compute_logits(hidden, head).float()
    weights = torch.exp(-torch.arange(block - 1, device=tokens.device) / decay)
    weights = weights / weights.sum()
    row_ce = (F.cross_entropy(logits.transpose(1, 2), targets, reduction="none") * counted).sum(0) / rows
    selector = model.candidate_selector
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
    previous = torch.cat([ids[:, :1], targets[:, :-1]], dim=1)
    query = selector.predecessor_codebook(previous) * selector.hidden_projection(hidden)
    scores = unary + torch.einsum("nbr,nbkr->nbk", query.float(), selector.successor_codebook(candidates).float())
    hit = candidates == targets[..., None]
    present = hit.any(-1) & counted
    picked = F.cross_entropy(scores.transpose(1, 2), hit.float().argmax(-1), reduction="none") * present
    selector_ce = picked.sum(0) / total(present.sum(0)).clamp_min(1)
    accuracy = ((logits.argmax(-1) == targets) & counted).sum(0) / rows
    return (weights * row_ce).sum(), (weights * selector_ce).sum(), accuracy


def new_drafter(config: dict, seed: int, device, dtype):
    """dflash's DFlash2DraftModel with initial weights: Qwen3's init, the convolutions starting as the identity."""
    try:
        from dflash.model import DFlash2DraftModel
        from transformers import Qwen3Config
    except ImportError:
        raise BlockspecError("train-drafter needs the 'train' extra: pip install 'blockspec[train]'") from None
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it trains: a 27B-sized drafter takes minutes to initialise on a CPU
        model = DFlash2DraftModel(Qwen3Config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0  # tap 0 is the row itself: the convolution starts as the identity
            elif name.endswith("kernel_projection.weight"):
                p.zero_()
    return model.to(device=device, dtype=dtype)


def step_shape(run) -> tuple[int, int]:
    """(sequences per step, anchors per sequence): one anchor per block length of text on average, so a step's
    rows come from batch_tokens / seq_len sequences rather than densely from one."""
    per_sequence = max(1, min(run.batch_tokens, run.seq_len) // run.block_size)
    return max(1, run.batch_tokens // (per_sequence * run.block_size)), per_sequence


class DrafterLoss(torch.nn.Module):
    """The drafter with block_losses as its forward: the module DistributedDataParallel wraps (it averages the
    gradients of what runs through its forward). The target's head and embedding are used, not held as modules."""

    def __init__(self, drafter, model, decay: float, seq_len: int, total):
        super().__init__()
        self.drafter, self.head, self.embed = drafter, model.logits, model.embed
        self.decay, self.seq_len, self.total = decay, seq_len, total

    def forward(self, features, tokens, labels, anchors, trained):
        return block_losses(self.drafter, self.head, self.embed, features, tokens, labels, anchors, self.decay,
                            self.seq_len, trained, self.total)


def dflash2_step(drafter, model, features, sequences, run, ranks: Ranks | None = None):
    """step_loss for the Trainer: a few training sequences (data.Sequence) through the frozen target, then anchor
    blocks of each (step_shape; anchored where the first label is trained) through the drafter in one pass. Every
    rank draws the step's sequences and anchors alike and runs its share of them (train/ranks.py)."""
    ranks = ranks or Ranks()
    block, length = run.block_size, len(sequences[0].ids)
    count, per_sequence = step_shape(run)
    device = model.embed_tokens.weight.device
    sequences = [s for s in sequences if np.any(s.trained[1:length - block + 2])]  # one anchor at least
    if not sequences:
        raise BlockspecError("--data: no training sequence has a trained token to anchor a block on")
    losses = ranks.replicate(DrafterLoss(drafter, model, run.loss_decay, length, ranks.total), device)
    if run.compile:  # the step's shapes are fixed (step_shape): one compilation serves every step
        losses = torch.compile(losses)

    def step_loss(rng):
        picked = [sequences[rng.randrange(len(sequences))] for _ in range(count)]
        drawn = [sample_anchors(s.trained, per_sequence, block, rng) for s in picked]
        picked, drawn = ranks.share(picked), ranks.share(drawn)
        tokens = on_device([s.ids for s in picked], device)
        feats, labels = zip(*(features(row) for row in tokens))
        anchors = on_device([i * length + a for i, positions in enumerate(drawn) for a in positions], device)
        trained = on_device([s.trained for s in picked], device).reshape(-1)
        block_ce, selector_ce, accuracy = losses(torch.cat(feats), tokens.reshape(-1), torch.cat(labels), anchors,
                                                 trained)
        figures = {"block_ce": block_ce.detach(), "selector_ce": selector_ce.detach(),
                   "first_row_accuracy": accuracy[0]}  # read once the step is done (Trainer.fit)
        return block_ce + selector_ce, figures, anchors.numel() * block
    return step_loss
