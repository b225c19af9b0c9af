"""Streaming detokenization: the text of a growing token list, given out piece by piece."""

from __future__ import annotations


class IncrementalText:
    """Text pieces for a growing token list. Text ending in U+FFFD (a multi-byte character whose remaining bytes
    have not arrived yet) is held back; the pieces concatenate to the decoding of all the tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.start = 0   # tokens[start:shown] is the latest text already given out (decoded again for context)
        self.shown = 0

    def _piece(self, force: bool) -> str:
        before = self.tokenizer.decode(self.tokens[self.start:self.shown])
        after = self.tokenizer.decode(self.tokens[self.start:])
        if after.endswith("\ufffd") and not force:
            return ""
        self.start, self.shown = self.shown, len(self.tokens)
        return after[len(before):]

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        return self._piece(force=False)

    def finish(self) -> str:
        return self._piece(force=True) if self.shown < len(self.tokens) else ""
