"""The decode loop every mode shares: propose k tokens, verify anchor + proposals in one target pass, accept a prefix
of the proposals plus one token of the target's, commit exactly that through the state transaction.

Plain decoding is the same loop with a proposer that proposes nothing (k = 0): one token in, one token out.
Acceptance follows the request's sampling (engine/sampling.py): greedy keeps the longest prefix equal to the
target's argmax plus the target's next argmax, so output is identical to plain greedy whatever the proposer does;
sampled requests apply the speculative-sampling rule, so output is distributed exactly as plain sampling.
With a draft tree (DFlash2's tree budget) a cycle verifies the tree's nodes in one pass instead of a chain, walks
the tree and keeps the accepted path (`tree_cycle`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..models.qwen3_5 import TargetOutput
from ..layers.tree import ContextLookup
from .reuse import PrefixCache
from .sampling import Sampler, leading_matches


class Proposer:
    """Proposes nothing: plain decoding. Speculative proposers override the hooks."""

    name = "none"
    capture_layers: tuple[int, ...] = ()   # target layers whose outputs the proposer reads
    max_proposals = 0
    draft_width = 0                        # token ids each proposal's distribution spans (draft())
    tree_budget = 0                        # draft nodes of a tree (propose_tree); 0: chains
    tree_lookup = 0                        # of its nodes, the lookup branch's (layers/tree.py ContextLookup)

    def reset(self):
        pass

    def observe(self, out, first: int, tokens: list[int], next_tokens: list[int], drafts: bool = True):
        """Committed target positions first..first+len(tokens)-1 held `tokens`; `next_tokens[i]` is the token that
        follows position first+i (the prompt's, or the one emitted there). `out` holds the pass's hidden states /
        features (row i = position first+i). drafts=False: no proposal follows (a prefill chunk before the last), so
        nothing is drafted and no uniform drawn: a request's random stream does not depend on its chunking."""

    def allocate_snapshots(self, count: int) -> int:
        """Room, allocated once, for `count` snapshots of what the proposer keeps across positions (engine/reuse.py);
        returns their bytes."""
        return 0

    def save(self, slot: int, out, row: int):
        """Snapshot `slot` of the proposer's committed state; row `row` of `out` is the last committed position."""

    def restore(self, slot: int, position: int, token: int):
        """Back to the state saved in `slot` with `position` positions committed; `token` is the prompt's token at
        `position`, the first one prefilled next."""
        self.reset()

    def propose(self, anchor: int, position: int, k: int) -> torch.Tensor:
        """k proposals for positions position+1.., int64 [k] on the device, where the verification pass reads them
        (nothing is read back here); under sampling each drawn from the proposer's distribution. They may live in
        the CUDA graphs' shared pool: valid until the target's next pass, which copies them in first."""
        raise NotImplementedError

    def propose_tree(self, anchor: int, position: int, branch: list[int] = ()):
        """A DraftTree of tree_budget nodes (layers/tree.py) for positions position + 1 .., on the device; its last
        tree_lookup nodes graft `branch` on (the tokens a ContextLookup predicts after the anchor)."""
        raise NotImplementedError

    def draft(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Under sampling: the distribution each of the last proposals was drawn from, as (token ids, probabilities)
        [proposals, draft_width] on the device (the speculative-sampling rule's q), in memory of their own: a CUDA
        graph's outputs live in the pool the target's graphs share, which the next target pass overwrites."""
        return None


@dataclass
class DecodeStats:
    cached_tokens: int = 0  # prompt tokens not prefilled: a kept prefix reused (engine/reuse.py)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generated: int = 0
    cycles: int = 0
    proposed: int = 0
    accepted_per_cycle: list[int] = field(default_factory=list)
    tree_budget: int = 0
    tree_lookup: int = 0  # of its nodes, the lookup branch's
    tree_nodes: int = 0  # draft nodes verified in tree cycles (a cycle too close to the context's end runs a chain)

    def as_dict(self, speculative: bool) -> dict:
        after_first = max(self.generated - 1, 0)
        stats = {"cached_tokens": self.cached_tokens, "prefill_s": round(self.prefill_s, 6),
                 "decode_s": round(self.decode_s, 6), "generated": self.generated,
                 "decode_tokens_per_s": round(after_first / self.decode_s, 3) if self.decode_s > 0 else 0.0}
        if speculative:
            accepted = sum(self.accepted_per_cycle)
            stats.update(cycles=self.cycles, accepted_per_cycle=list(self.accepted_per_cycle),
                         mean_accepted_length=round((accepted + self.cycles) / self.cycles, 4) if self.cycles else 0.0,
                         acceptance_rate=round(accepted / self.proposed, 4) if self.proposed else 0.0)
            if self.tree_budget:
                stats.update(tree_budget=self.tree_budget, tree_lookup=self.tree_lookup,
                             nodes_per_cycle=round(self.tree_nodes / self.cycles, 4) if self.cycles else 0.0)
        return stats


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prefill(target, prompt: torch.Tensor, start: int, chunk: int, proposer: Proposer,
            sampler: Sampler | None = None, checkpoint: tuple[int, Callable] | None = None,
            stop: Callable[[], bool] | None = None):
    """Chunked prefill of prompt[start:] (the state holds the first `start` positions); returns the first generated
    token (greedy without a sampler), and the last pass's output with the row of the last prompt position.
    checkpoint (position, call): a chunk ends at that position (when it lies past start) and call(out, row) runs
    there. stop: asked before each chunk after the first; when it answers True prefill returns None, the state
    holding part of the prompt."""
    length = prompt.shape[0]
    ends = {*range(start + chunk, length, chunk), length}
    if checkpoint is not None and start < checkpoint[0] < length:
        ends.add(checkpoint[0])
    begin = start
    for end in sorted(ends):
        if stop is not None and begin > start and stop():
            return None
        ids = prompt[begin:end]
        out = target.forward(ids, all_logits=False)
        target.state.commit(ids.shape[0])
        last = end == length
        first_token = None
        if last:
            first_token = int(out.logits[-1].argmax()) if sampler is None else sampler.first_token(out.logits[-1:])
        following = prompt[begin + 1:end + 1].tolist() + ([first_token] if last else [])
        proposer.observe(out, begin, ids.tolist(), following, last)
        if checkpoint is not None and end == checkpoint[0]:
            checkpoint[1](out, ids.shape[0] - 1)
        begin = end
    return first_token, out, ids.shape[0] - 1


def tree_cycle(target, proposer: Proposer, anchor: int, position: int, sampler: Sampler | None,
               lookup: ContextLookup | None):
    """Propose a draft tree, verify it in one target pass, walk it (engine/sampling.py walk) and keep its accepted
    path. The greedy walk and the path's staging run in the pass's CUDA graph, a sampled walk in a graph of its own
    (engine/target.py): after the cycle's one read back (the accepted count, the bonus, the path's tokens) the host
    only replays the commit. `lookup`: the committed context's, with a tree_lookup. Returns (the pass's output at
    the kept rows, the accepted tokens, the emitted tokens: the accepted ones and the bonus)."""
    tree = proposer.propose_tree(anchor, position,
                                 lookup.branch(anchor, proposer.tree_lookup) if proposer.tree_lookup else ())
    depth = proposer.max_proposals
    sampled = sampler is not None and not sampler.greedy
    features, result = target.run_tree(tree, depth, *((sampler, proposer.tree_draft()) if sampled else ()))
    values = result.tolist()  # the cycle's one read back
    accepted, bonus = values[:2]
    tokens = values[3 + depth:4 + depth + accepted]
    target.state.commit_path(accepted + 1)
    # the drafter's context reads the kept rows' features alone (trees are DFlash2's): no rows of logits or hidden
    return TargetOutput(None, None, features), tokens[1:], tokens[1:] + [bonus]


def decode(target, proposer: Proposer, prompt: list[int], max_tokens: int, eos: set[int], chunk: int,
           stats: DecodeStats, sampler: Sampler | None = None, prefix: PrefixCache | None = None,
           snapshot_at: int | None = None, stop: Callable[[], bool] | None = None):
    """Generator of tokens; `target` is an EagerTarget or GraphedTarget; `sampler` holds the request's sampling
    (begun; None: greedy); `prefix` the kept conversation to resume from and keep this request in (None: start
    afresh, keep nothing), with a snapshot at prompt position `snapshot_at` too; `stats` is filled as it goes.
    `stop` (prefill's) ends the generator without a token when it answers True between prefill chunks: a caller
    that stops at a token boundary cannot stop a long prefill, which yields nothing until its end."""
    state, device = target.state, target.device
    greedy = sampler is None or sampler.greedy
    stats.tree_budget, stats.tree_lookup = proposer.tree_budget, proposer.tree_lookup
    start = time.perf_counter()
    committed = list(prompt)  # the tokens of the committed positions: the prompt, then each cycle's kept block
    lookup = ContextLookup(prompt) if proposer.tree_lookup else None
    try:
        if prefix is None:
            state.reset()
            proposer.reset()
            stats.cached_tokens = 0
        else:
            stats.cached_tokens = prefix.resume(prompt)
        checkpoint = None
        if prefix is not None and snapshot_at is not None:
            checkpoint = (snapshot_at, lambda out, row: prefix.save(prompt[:snapshot_at], out, row))
        prefilled = prefill(target, torch.tensor(prompt, device=device), stats.cached_tokens, chunk, proposer,
                            sampler, checkpoint, stop)
        if prefilled is None:  # stopped: the state holds part of the prompt, so nothing of it may be kept
            if prefix is not None:
                prefix.clear()
            return
        anchor, out, row = prefilled
        if prefix is not None:
            prefix.save(committed, out, row)
    except BaseException:
        if prefix is not None:
            prefix.clear()
        raise
    _sync(device)
    stats.prefill_s = time.perf_counter() - start
    stats.generated = 1
    yield anchor
    begin = time.perf_counter()
    failed = False  # an error inside a pass leaves the state uncommitted: nothing of it may be kept
    try:
        while stats.generated < max_tokens and anchor not in eos:
            position = state.length
            useful = min(proposer.max_proposals, max_tokens - stats.generated - 1)  # proposals that can be emitted
            # a full block whenever the cache has room, even near max_tokens: the pass length stays one captured
            # by a CUDA graph (a shorter block would run eagerly); tokens past max_tokens are never emitted
            full = position + proposer.max_proposals < state.capacity
            k = proposer.max_proposals if useful > 0 and full else max(0, min(useful, state.capacity - position - 1))
            if proposer.tree_budget and useful > 0 and position + proposer.tree_budget < state.capacity:
                out, kept, emitted = tree_cycle(target, proposer, anchor, position, sampler, lookup)
                proposed = proposer.max_proposals
                stats.tree_nodes += proposer.tree_budget
            else:
                proposals = proposer.propose(anchor, position, k) if k > 0 else None
                # taken before the target's pass: the proposer's graph outputs share the target graphs' memory pool
                draft = proposer.draft() if proposals is not None and len(proposals) and not greedy else None
                out, predicted, block = target.run(anchor, proposals)
                # greedy: the target's argmax; sampled: the speculative-sampling rule's (accepted, token), on the
                # device; read back once with the proposals (the pass's own copy of them)
                result = predicted if greedy else sampler.accept(out.logits, block, draft)
                n = block.shape[0] - 1  # proposals (a proposer may give fewer than k)
                values = (torch.cat([result, block[1:]]) if n > 0 else result).tolist()
                proposals = values[len(values) - n:] if n > 0 else []
                if greedy:
                    accepted = leading_matches(proposals, values[:n + 1])
                    emitted = values[:accepted + 1]
                else:
                    accepted = values[0]
                    emitted = proposals[:accepted] + [values[1]]
                state.commit(accepted + 1)
                kept, proposed = proposals[:accepted], len(proposals)
            accepted = len(kept)
            proposer.observe(out, position, [anchor] + kept, emitted)
            committed += [anchor] + kept  # kept even past max_tokens: the caches hold them
            if lookup is not None:
                lookup.extend([anchor] + kept)
            row = accepted
            if proposer.max_proposals:
                stats.cycles += 1
                stats.proposed += min(proposed, useful)
                stats.accepted_per_cycle.append(min(accepted, useful))
            for token in emitted:
                stats.generated += 1
                stats.decode_s = time.perf_counter() - begin
                yield token
                if token in eos or stats.generated >= max_tokens:
                    return
            anchor = emitted[-1]
    except BaseException as exc:
        failed = not isinstance(exc, GeneratorExit)  # closed at a yield: every pass so far is committed
        raise
    finally:
        _sync(device)
        stats.decode_s = time.perf_counter() - begin
        # a stream still open when the interpreter exits is closed during its teardown, where nothing is worth
        # keeping, and a snapshot written then makes torch abort the process as it frees the tensors
        if prefix is not None and not sys.is_finalizing():
            if failed:
                prefix.clear()
            else:
                prefix.save(committed, out, row)
