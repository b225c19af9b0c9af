"""`train-drafter --kind mtp`: the native MTP head of a target, trained on the target's own greedy choices.

MTP row p reads the embedding of token p + 1 and the target's final-normed hidden state at p, and predicts the
target's token for p + 2 (its argmax at p + 1, teacher-forced on the text, as for the DFlash2 drafter). All rows of a
sequence run at once under a causal mask; the loss is the mean over the rows whose label is trained (train/data.py: a
conversation's assistant tokens, all of a text). The trainable module is built from `transformers`' Qwen3.5 decoder
layer (the reference blockspec's own layers are tested against), with the checkpoint's `mtp.*` names, so the head
it writes into a copy of the target checkpoint is what blockspec's MTP mode loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BlockspecError
from .data import on_device
from .ranks import Ranks

MTP_FILE = "mtp.safetensors"
MTP_SUMMARY = "mtp_training.json"  # the head's run; the copied training.json stays the target's own


def text_config(target_dir: Path):
    """transformers' Qwen3_5TextConfig of the target, made for one full-attention layer (the MTP layer)."""
    try:
        from transformers import Qwen3_5TextConfig
    except ImportError:
        raise BlockspecError("train-drafter needs the 'train' extra: pip install 'blockspec[train]'") from None
    raw = json.loads((target_dir / "config.json").read_text())
    text = dict(raw.get("text_config", raw) if raw.get("model_type") == "qwen3_5" else raw)
    for key in ("architectures", "model_type", "transformers_version", "auto_map", "quantization_config"):
        text.pop(key, None)
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    config = Qwen3_5TextConfig(**text)
    config._attn_implementation = "sdpa"
    return config


class MTPModule(nn.Module):
    """The MTP head for training; parameter names as in the checkpoint (minus `mtp.`)."""

    def __init__(self, config, seed: int = 0):
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                                  Qwen3_5TextRotaryEmbedding)
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        torch.manual_seed(seed)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(config)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
                else:
                    p.zero_()  # zero-centred norms: scale 1

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embedded, hidden [B, T, h] (hidden final-normed), positions [B, T] -> final-normed outputs [B, T, h]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = self.rotary(x, positions[None].expand(3, -1, -1))  # the text's three rotary sections share positions
        for layer in self.layers:
            x = layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        return self.norm(x)

    def checkpoint_tensors(self, dtype) -> dict[str, torch.Tensor]:
        return {"mtp." + k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}


def has_mtp_head(target_dir: Path) -> bool:
    """Whether the checkpoint holds mtp.* tensors (read from the safetensors headers, not the tensors)."""
    from safetensors import safe_open

    from ..models.checkpoint import checkpoint_files

    for path in checkpoint_files(target_dir):
        with safe_open(str(path), framework="pt") as f:
            if any(name.startswith("mtp.") for name in f.keys()):
                return True
    return False


def copy_target(source: Path, out: Path, link: bool = False):
    """Copy the target checkpoint to `out` without any MTP head it has (shards holding mtp.* tensors are written
    again without them), declare one MTP layer in its config. The target's training.json comes along; the state of
    a training run and an earlier head's summary do not. With `link` the shards kept as they are are hard links
    where the file system allows (OUT/best from OUT, the run's own copy)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .loop import RUN_FILE, STATE_FILE

    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name in (MTP_FILE, MTP_SUMMARY, STATE_FILE, RUN_FILE):
            continue
        if path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
            continue
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            kept = [n for n in names if not n.startswith("mtp.")]
            if len(kept) == len(names):
                copy_shard(path, out / path.name, link)
            else:
                save_file({n: f.get_tensor(n) for n in kept}, str(out / path.name), metadata=f.metadata())
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config) if config.get("model_type") == "qwen3_5" else config
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = out / "model.safetensors.index.json"
    if index.exists():
        raw = json.loads(index.read_text())
        raw["weight_map"] = {k: v for k, v in raw["weight_map"].items() if not k.startswith("mtp.")}
        index.write_text(json.dumps(raw, indent=2))


def copy_shard(source: Path, destination: Path, link: bool):
    if link:
        destination.unlink(missing_ok=True)
        try:
            destination.hardlink_to(source)
            return
        except OSError:
            pass
    shutil.copy2(source, destination)


def save_head(head: MTPModule, out: Path, dtype: torch.dtype):
    """The head's tensors into the copy (its own file, listed in the index when the copy has one)."""
    from safetensors.torch import save_file

    tensors = head.checkpoint_tensors(dtype)
    save_file(tensors, str(out / (MTP_FILE + ".tmp")), metadata={"format": "pt"})
    (out / (MTP_FILE + ".tmp")).replace(out / MTP_FILE)
    index = out / "model.safetensors.index.json"
    if index.exists():
        raw = json.loads(index.read_text())
        raw["weight_map"].update({name: MTP_FILE for name in tensors})
        index.write_text(json.dumps(raw, indent=2))


def step_sequences(batch_tokens: int, seq_len: int) -> int:
    """Training sequences per step."""
    return max(1, batch_tokens // seq_len)


def mtp_step(head, model, target, sequences, batch_tokens: int, ranks: Ranks | None = None):
    """step_loss for the Trainer: a few training sequences (data.Sequence) through the frozen target (`target`: a
    train/run.py TargetFeatures with its hidden states), then every MTP
    row of them (row p: embedding of token p + 1, target hidden p; label: the target's argmax at p + 1, counted where
    trained). `head` is the MTPModule, or what runs it (DistributedDataParallel); every rank draws the step's
    sequences alike and runs its share of them, its loss and accuracy its part of the whole step's (train/ranks.py).
    The accuracy is the first proposal's: a block's first row."""
    ranks = ranks or Ranks()
    device = model.embed_tokens.weight.device
    per_step = step_sequences(batch_tokens, len(sequences[0].ids))
    sequences = [s for s in sequences if np.any(s.trained[1:-1])]
    if not sequences:
        raise BlockspecError("--data: no training sequence has a trained token for the MTP head")

    def step_loss(rng):
        embedded, hidden, labels, counted = [], [], [], []
        for picked in ranks.share([sequences[rng.randrange(len(sequences))] for _ in range(per_step)]):
            sequence = on_device(picked.ids, device)
            _, greedy, normed = target(sequence)
            embedded.append(model.embed(sequence[1:-1]))
            hidden.append(normed[:-2])
            labels.append(greedy[1:-1])
            counted.append(on_device(picked.trained[1:-1], device))
        embedded, hidden, labels, counted = map(torch.stack, (embedded, hidden, labels, counted))
        positions = torch.arange(embedded.shape[1], device=device)[None].expand(embedded.shape[0], -1)
        logits = model.logits(head(embedded.to(hidden.dtype), hidden, positions)).float()
        rows = ranks.total(counted.sum())
        loss = (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none") * counted.flatten()).sum() \
            / rows
        accuracy = ((logits.argmax(-1) == labels) & counted).sum() / rows
        return loss, {"first_row_accuracy": accuracy.detach()}, labels.numel()
    return step_loss
