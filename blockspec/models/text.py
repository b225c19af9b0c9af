"""Streaming detokenization: the text of a growing token list, given out piece by piece, and a reply's text ended
by its stop strings and stop tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BlockspecError

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


MAX_STOPS = 64         # stop strings, and stop token ids, a reply may have
MAX_STOP_CHARS = 1024  # characters of a stop string (as many are held back when streaming)


class StopsError(BlockspecError):
    """Stops refused: the message names the setting, `field` is its name (OpenAI's `stop`, vLLM's
    `stop_token_ids`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Stops:
    """What ends a reply besides EOS and max_tokens: OpenAI's `stop` strings, vLLM's `stop_token_ids` and
    `include_stop_str_in_output`."""

    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()
    include_string: bool = False  # the stop string (or stop token's text) that ended the reply is part of it

    @classmethod
    def build(cls, stop, token_ids, include_string: bool, vocab_size: int, type_name=None):
        """Stops from a request's values, as OpenAI and vLLM take them (`stop`: None, a string or a list of strings;
        `stop_token_ids`: None or a list of ids), or StopsError naming what is wrong (type_name(value) says what a
        value of the wrong type is: by default its Python type, 'a list')."""
        type_name = type_name or _python_type
        if stop is None or isinstance(stop, str):
            strings = [] if stop is None else [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            strings = stop
        else:
            got = type_name(stop) if not isinstance(stop, list) else \
                f"{type_name([])} holding {next(type_name(s) for s in stop if not isinstance(s, str))}"
            raise StopsError(f"'stop' must be a string or {type_name([])} of strings (got {got})", "stop")
        if "" in strings:
            raise StopsError("'stop' must not hold an empty string", "stop")
        if len(strings) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in strings):
            raise StopsError(f"'stop' may hold at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters "
                             "each", "stop")
        ids = [] if token_ids is None else token_ids
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
            raise StopsError(f"'stop_token_ids' must be {type_name([])} of token ids, integers in "
                             f"0..{vocab_size - 1}", "stop_token_ids")
        if len(ids) > MAX_STOPS:
            raise StopsError(f"'stop_token_ids' may hold at most {MAX_STOPS} ids", "stop_token_ids")
        if not isinstance(include_string, bool):
            raise StopsError(f"'include_stop_str_in_output' must be a boolean (got {type_name(include_string)})",
                             "include_stop_str_in_output")
        return cls(tuple(dict.fromkeys(strings)), frozenset(ids), include_string)


def _python_type(value) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class ReplyText:
    """A reply's text given out piece by piece (IncrementalText), ended by the first stop (Stops): a stop string is
    matched in the text as it grows, across tokens (the first one completed ends the reply, as in vLLM), and neither
    it (unless include_string) nor anything after it is given out; text that may still become the start of a stop
    string is held back until it cannot; of the stop strings one token completes, the first in the list (vLLM's
    order). A stop token ends the reply before its own text (after it with include_string, as in vLLM), whatever
    stop string it completes. `tokens` holds the tokens up to the stop, the stop token included, `stop_reason` the
    string or token id that ended it (None: none did)."""

    def __init__(self, tokenizer, stops: Stops = Stops()):
        self.text = IncrementalText(tokenizer)
        self.stops = stops
        self.hold = max(map(len, stops.strings), default=1) - 1  # characters that may begin a stop string
        self.pending = ""  # text not given out yet: a match starts in it (the text before it holds none)
        self.stop_reason: str | int | None = None
        self.unshown: list[int] = []  # the stop token, when its text is left out

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens + self.unshown

    def push(self, tokens: list[int]) -> str:
        """The text that may be given out once `tokens` follow (none after a stop; tokens past it are dropped)."""
        if not (self.stops.strings or self.stops.token_ids):
            return self.text.push(tokens)
        piece = ""
        for token in tokens:  # one at a time: a stop ends the reply at the token that completes it
            if self.stop_reason is not None:
                break
            if token in self.stops.token_ids:  # before the stop strings, as vLLM checks them
                self.stop_reason = token
                if self.stops.include_string:
                    self.pending += self.text.push([token])
                else:
                    self.unshown = [token]
                self.pending += self.text.finish()
                piece += self._give(len(self.pending))
            else:
                searched = len(self.pending)
                self.pending += self.text.push([token])
                piece += self._scan(searched)
        return piece

    def finish(self) -> str:
        """The rest of the text once the reply has ended (nothing after a stop)."""
        if self.stop_reason is not None:
            return ""
        searched = len(self.pending)
        self.pending += self.text.finish()
        piece = self._scan(searched)
        return piece if self.stop_reason is not None else piece + self._give(len(self.pending))

    def _scan(self, searched: int) -> str:
        """After the pending text grew past `searched` characters: the piece to give out, ending the reply at the
        first stop string of the list that ends in the new text (it may begin before `searched`), where it first
        does."""
        found = next(((at, s) for s in self.stops.strings
                      if (at := self.pending.find(s, max(0, searched - len(s) + 1))) >= 0), None)
        if found is None:
            return self._give(len(self.pending) - self.hold)
        at, string = found
        self.stop_reason = string
        return self._give(at + len(string) if self.stops.include_string else at)

    def _give(self, end: int) -> str:
        end = max(end, 0)
        piece, self.pending = self.pending[:end], self.pending[end:]
        return piece
