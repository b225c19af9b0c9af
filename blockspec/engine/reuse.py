"""Prefix reuse: the engine keeps the last request's committed state, and a request whose prompt starts with some of
the kept tokens prefills only the rest.

Kept are the committed tokens (prompt, then every token a verification committed, including accepted proposals past
max_tokens: the caches hold them; never the last emitted token, which no pass has run yet) and snapshots of the
state at some of their positions: at the end of each prefill and at the end of each generation, in `count` slots
allocated at load, the oldest used slot overwritten first. A snapshot holds what cannot be cut back by length:
  DeltaNet    conv histories and recurrent states (DecodeState.save);
  DFlash2     the drafter's context ring, whose older rows later positions overwrite (DrafterContext.save);
  MTP         the target's hidden state at the last position: MTP row p pairs it with the token at p + 1, which the
              new prompt may change, so that row is recomputed on restore (MTPProposer.restore).
Attention KV caches and the MTP cache are cut back by length: their entries before the snapshot's position still
hold the kept tokens' keys and values. A request resumes from the latest snapshot at or before the common prefix
(and before its last prompt token, whose logits give the first generated token) and prefills from there; its
prefill (drafter context, MTP rows) and decoding then run exactly as on a freshly loaded engine. Without such a
snapshot the state is reset as for a new engine, and the kept tokens are forgotten: nothing of a conversation
leaks into a request that does not share it.
"""

from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, state, proposer, count: int):
        """`state`: the engine's DecodeState; `proposer`: its own proposer; `count` snapshot slots (>= 1)."""
        self.state, self.proposer, self.count = state, proposer, count
        self.bytes = state.snapshot_bytes + proposer.allocate_snapshots(count)
        self.tokens: list[int] = []                          # the kept committed tokens
        self.positions: list[int | None] = [None] * count    # each slot's committed length (None: empty)
        self.used = [0] * count                              # when each slot was last saved or restored
        self.clock = 0

    def clear(self):
        """Forget the kept conversation (the next request starts afresh)."""
        self.tokens = []
        self.positions = [None] * self.count

    def resume(self, prompt: list[int]) -> int:
        """Bring the state to the longest kept prefix of `prompt` a snapshot allows; returns its length, the prompt
        tokens that need no prefill (0: the state was reset as for a new engine)."""
        shared = common_prefix(self.tokens, prompt[:-1])  # the last prompt token always runs: its logits are needed
        self.tokens = self.tokens[:shared]
        self.positions = [p if p is not None and p <= shared else None for p in self.positions]
        usable = [(p, slot) for slot, p in enumerate(self.positions) if p]
        if not usable:
            self.clear()
            self.state.reset()
            self.proposer.reset()
            return 0
        position, slot = max(usable)
        self.state.restore(slot, position)
        self.proposer.restore(slot, position, prompt[position])
        self.touch(slot)
        return position

    def save(self, tokens: list[int], out, row: int):
        """Keep `tokens`, the committed ones (as many as the state's length), and a snapshot at their end; row `row`
        of `out` (the last pass's output) is the last committed position."""
        self.tokens = list(tokens)
        position = self.state.length
        if position != len(tokens):
            raise RuntimeError(f"{len(tokens)} kept tokens, but {position} positions are committed")
        if position in self.positions:  # saved before, for the same tokens
            self.touch(self.positions.index(position))
            return
        slot = next((s for s, p in enumerate(self.positions) if p is None), None)
        if slot is None:
            slot = min(range(self.count), key=self.used.__getitem__)
        self.state.save(slot)
        self.proposer.save(slot, out, row)
        self.positions[slot] = position
        self.touch(slot)

    def touch(self, slot: int):
        self.clock += 1
        self.used[slot] = self.clock
