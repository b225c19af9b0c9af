"""A draft vocabulary: the shared head restricted to a set of token ids, used for proposals only.

Why: each MTP draft reads the whole head (248k rows x 5120 on the 27B: 2.54 GB in bf16, ~0.65 ms on the H200), so
3 drafts cost 0.14x a plain step; a DFlash2 proposal reads it once for its 7 rows (~0.6 of its ~2.1 ms). Drafting
over N likely tokens reads N / vocab of it. The target's verification
still scores the full vocabulary, so the output is unchanged (lossless, greedy or sampled: a sampled draft's q spans
the set only); only acceptance falls, by how often the target's token lies outside the set (the idea of SGLang's speculative token map and of FR-Spec).

Which ids (`draft_vocabulary`, modes mtp and dflash2): a number N takes ids 0..N-1 (byte-level BPE vocabularies
such as Qwen's number tokens in merge order, frequent pieces first) plus the end-of-sequence ids; a path names a JSON
list of ids (say, counted on one's own traffic).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import BlockspecError
from ..files import read_json
from ..kernels.linear import linear_float32


def draft_ids(spec: int | str, vocab_size: int, eos_ids=()) -> torch.Tensor:
    """The sorted ids `spec` names (see the module docstring); a bad file or id is refused in one line."""
    key = "draft_vocabulary"
    if isinstance(spec, int):
        ids = set(range(min(spec, vocab_size))) | {int(i) for i in eos_ids if 0 <= int(i) < vocab_size}
    else:
        ids = read_json(spec, f"{key}: {spec}")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in ids):
            raise BlockspecError(f"{key}: {spec} must hold a non-empty JSON list of token ids (integers)")
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise BlockspecError(f"{key}: {spec} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
        ids = set(ids)
    return torch.tensor(sorted(ids), dtype=torch.long)  # ascending: ties resolve to the lowest id, as a full argmax


def most_frequent_ids(token_lists, size: int, vocab_size: int, eos_ids=()) -> list[int]:
    """The `size` ids most frequent in token_lists (ties: the lower id), plus the end-of-sequence ids, sorted: a
    draft vocabulary counted on the user's own texts (`blockspec draft-vocabulary`)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        counts += torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices[:size].tolist()  # stable: equal counts keep id order
    return sorted(set(order) | {int(i) for i in eos_ids if 0 <= int(i) < vocab_size})


def coverage(ids, token_lists) -> float:
    """Share of the tokens of token_lists that lie in `ids` (the most a draft can be right over that set)."""
    allowed = set(ids)
    total = sum(len(t) for t in token_lists)
    return sum(tok in allowed for tokens in token_lists for tok in tokens) / max(total, 1)


def head_rows(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the model's shared head (TargetModel.logits) as a dense [len(ids), hidden] weight; a quantized
    head gives its dequantized rows, so drafts follow the head the target uses."""
    head = model.lm_head
    if head is None:  # tied: the head is the embedding table
        return model.embed_tokens.weight[ids.to(model.embed_tokens.weight.device)].to(dtype)
    if not isinstance(head, nn.Linear):  # quantized (a QuantLinear)
        return head.dequantize(dtype, rows=ids.to(next(head.buffers()).device))
    return head.weight[ids.to(head.weight.device)].to(dtype)


class DraftHead(nn.Module):
    """Greedy token over the draft vocabulary: ids[argmax(x @ rows^T)]."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("ids", ids.to(weight.device))
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    @classmethod
    def from_model(cls, model, ids: torch.Tensor, dtype: torch.dtype) -> DraftHead:
        return cls(ids, head_rows(model, ids, dtype))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the draft vocabulary's ids, in their (ascending) order, as the full head's."""
        return linear_float32(normed, self.weight)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return self.ids[self.logits(normed).argmax(-1)]

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
