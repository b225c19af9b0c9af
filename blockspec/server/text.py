"""Streaming detokenization: the text of a growing token list, given out piece by piece."""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# U+FFFD that the next tokens may still turn into a character: a character's incomplete bytes are at most 3, which a
# decoder replaces by one U+FFFD (byte-level BPE) or one per byte (byte-fallback tokens)
MAX_PENDING = 3


class IncrementalText:
    """Text pieces for a growing token list; the pieces concatenate to the decoding of all the tokens.

    A decoding that ends in U+FFFD may end in a character whose remaining bytes have not arrived yet: the last
    MAX_PENDING of its trailing U+FFFD are held back, everything before them is final and given out (a stream of
    bytes that never form characters is still given out as it comes, as U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.start = 0    # tokens[start:shown] is the latest text given out whole (decoded again for context)
        self.shown = 0
        self.partial = 0  # characters given out past tokens[start:shown]'s text while U+FFFD were held back

    def _piece(self, force: bool) -> str:
        before = self.tokenizer.decode(self.tokens[self.start:self.shown])
        after = self.tokenizer.decode(self.tokens[self.start:])
        pending = 0 if force else min(len(after) - len(after.rstrip(REPLACEMENT)), MAX_PENDING)
        given = len(before) + self.partial
        piece = after[given:len(after) - pending]
        if pending:
            self.partial += len(piece)
        else:
            self.start, self.shown, self.partial = self.shown, len(self.tokens), 0
        return piece

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        return self._piece(force=False)

    def finish(self) -> str:
        return self._piece(force=True) if self.shown < len(self.tokens) else ""
