"""The decode loop every mode shares: propose k tokens, verify anchor + proposals in one target pass, accept the
longest prefix the target agrees with plus its own next token, commit exactly that through the state transaction.

Plain greedy is the same loop with a proposer that proposes nothing (k = 0): one token in, one token out.
Because every emitted token is the target's own argmax given committed state, output is identical to plain
greedy whatever the proposer does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Proposer:
    """Proposes nothing: plain greedy decoding. Speculative proposers override the three hooks."""

    name = "none"
    capture_layers: tuple[int, ...] = ()   # target layers whose outputs the proposer reads
    max_proposals = 0

    def reset(self):
        pass

    def observe(self, out, first: int, tokens: list[int], next_tokens: list[int]):
        """Committed target positions first..first+len(tokens)-1 held `tokens`; `next_tokens[i]` is the target's
        greedy token after position first+i. `out` holds the pass's hidden states / features (row i = position
        first+i)."""

    def propose(self, anchor: int, position: int, k: int) -> list[int]:
        return []


@dataclass
class DecodeStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generated: int = 0
    cycles: int = 0
    proposed: int = 0
    accepted_per_cycle: list[int] = field(default_factory=list)

    def as_dict(self, speculative: bool) -> dict:
        after_first = max(self.generated - 1, 0)
        stats = {"prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                 "generated": self.generated,
                 "decode_tokens_per_s": round(after_first / self.decode_s, 3) if self.decode_s > 0 else 0.0}
        if speculative:
            accepted = sum(self.accepted_per_cycle)
            stats.update(cycles=self.cycles, accepted_per_cycle=list(self.accepted_per_cycle),
                         mean_accepted_length=round((accepted + self.cycles) / self.cycles, 4) if self.cycles else 0.0,
                         acceptance_rate=round(accepted / self.proposed, 4) if self.proposed else 0.0)
        return stats


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prefill(target, prompt: torch.Tensor, chunk: int, proposer: Proposer) -> int:
    """Chunked prefill of the prompt; returns the first generated token (greedy)."""
    for begin in range(0, prompt.shape[0], chunk):
        ids = prompt[begin:begin + chunk]
        out = target.forward(ids, all_logits=False)
        target.state.commit(ids.shape[0])
        last = begin + ids.shape[0] >= prompt.shape[0]
        first_token = int(out.logits[-1].argmax()) if last else None
        following = prompt[begin + 1:begin + ids.shape[0] + 1].tolist() + ([first_token] if last else [])
        proposer.observe(out, begin, ids.tolist(), following)
    return first_token


def decode(target, proposer: Proposer, prompt: list[int], max_tokens: int, eos: set[int], chunk: int,
           stats: DecodeStats):
    """Generator of greedy tokens; `target` is an EagerTarget or GraphedTarget; `stats` is filled as it goes."""
    state, device = target.state, target.device
    state.reset()
    proposer.reset()
    start = time.perf_counter()
    anchor = prefill(target, torch.tensor(prompt, device=device), chunk, proposer)
    _sync(device)
    stats.prefill_s = time.perf_counter() - start
    stats.generated = 1
    yield anchor
    begin = time.perf_counter()
    try:
        while stats.generated < max_tokens and anchor not in eos:
            position = state.length
            useful = min(proposer.max_proposals, max_tokens - stats.generated - 1)  # proposals that can be emitted
            # a full block whenever the cache has room, even near max_tokens: the pass length stays one captured
            # by a CUDA graph (a shorter block would run eagerly); tokens past max_tokens are never emitted
            full = position + proposer.max_proposals < state.capacity
            k = proposer.max_proposals if useful > 0 and full else max(0, min(useful, state.capacity - position - 1))
            proposals = proposer.propose(anchor, position, k) if k > 0 else []
            out, predicted = target.verify([anchor] + proposals)
            accepted = 0
            while accepted < len(proposals) and proposals[accepted] == predicted[accepted]:
                accepted += 1
            state.commit(accepted + 1)
            emitted = predicted[:accepted + 1]
            proposer.observe(out, position, [anchor] + proposals[:accepted], emitted)
            if proposer.max_proposals:
                stats.cycles += 1
                stats.proposed += min(len(proposals), useful)
                stats.accepted_per_cycle.append(min(accepted, useful))
            for token in emitted:
                stats.generated += 1
                stats.decode_s = time.perf_counter() - begin
                yield token
                if token in eos or stats.generated >= max_tokens:
                    return
            anchor = emitted[-1]
    finally:
        _sync(device)
        stats.decode_s = time.perf_counter() - begin
