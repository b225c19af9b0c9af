"""Interactive terminal chat: `blockspec chat`.

Replies stream to stdout; everything else (banner, per-turn stats, notices) goes to stderr, so piping stdin in and
stdout out gives just the conversation's replies. The history is re-rendered with the checkpoint's chat template
every turn and kept within context_length by dropping the oldest turns (said on stderr); the engine prefills only
what the previous turn left unshared (engine/reuse.py), given where each prompt's conversation ends.
"""

from __future__ import annotations

import sys

from .cli_common import describe_sampling, format_stats, stream_text
from .errors import BlockspecError

COMMANDS = "/reset (forget the conversation), /exit (or end of input) to leave"


class ChatSession:
    def __init__(self, engine, max_tokens: int, system: str | None = None, out=None, err=None, stops=None):
        self.engine = engine
        self.max_tokens = max_tokens
        self.stops = stops  # models/text.py Stops: a reply ends before the first stop string, which it leaves out
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[tuple[dict, dict]] = []   # (user message, assistant message)
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def note(self, text: str):
        print(f"[{text}]", file=self.err, flush=True)

    def encode(self, messages: list[dict]) -> list[int]:
        return self.engine.tokenizer.chat_prompt_ids(messages)

    def reset(self):
        self.turns.clear()
        self.engine.forget_prefix()
        self.note("conversation reset")

    def fit(self, user: dict) -> tuple[list[int], int] | None:
        """Prompt ids and max_tokens for this turn, dropping the oldest turns when the context would overflow;
        None (and a message) when the message cannot fit even alone."""
        context = self.engine.context_length
        alone = self.encode(self.system + [user])
        if len(alone) >= context:
            self.note(f"message too long: {len(alone)} tokens with the chat template, but context_length is "
                      f"{context}; it was not sent (the conversation is unchanged)")
            return None
        dropped = 0
        while True:
            history = [m for turn in self.turns[dropped:] for m in turn]
            ids = alone if dropped == len(self.turns) else self.encode(self.system + history + [user])
            if len(ids) + self.max_tokens <= context or dropped == len(self.turns):
                break
            dropped += 1
        if dropped:
            del self.turns[:dropped]
            self.note(f"context full: dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit "
                      f"context_length {context} ({len(self.turns)} earlier turn{'s' if len(self.turns) != 1 else ''}"
                      " kept)")
        max_tokens = min(self.max_tokens, context - len(ids))
        if max_tokens < self.max_tokens:
            self.note(f"reply limited to {max_tokens} tokens by context_length {context}")
        return ids, max_tokens

    def turn(self, text: str):
        user = {"role": "user", "content": text}
        fitted = self.fit(user)
        if fitted is None:
            return
        ids, max_tokens = fitted
        self.engine.check_request(ids, max_tokens)
        messages = self.system + [m for turn in self.turns for m in turn] + [user]
        snapshot_at = self.engine.tokenizer.conversation_length(messages, ids)
        tokens_iter = self.engine.stream(ids, max_tokens, snapshot_at=snapshot_at)
        try:
            tokens, reply = stream_text(self.engine, tokens_iter, out=self.out, stops=self.stops)
        except KeyboardInterrupt:
            tokens_iter.close()
            print(file=self.out, flush=True)
            self.note("interrupted; this turn is not kept")
            return
        finally:
            tokens_iter.close()
        print(file=self.out, flush=True)
        self.turns.append((user, {"role": "assistant", "content": reply}))
        used = len(ids) + len(tokens)
        stats = self.engine.last_stats
        print(f"{format_stats(stats)}; {stats.get('cached_tokens', 0)} prompt tokens cached; "
              f"context {used}/{self.engine.context_length}",
              file=self.err, flush=True)


class Utf8Lines:
    """readline() over a binary stream (piped stdin's bytes): each line decoded as UTF-8; a line that is not UTF-8
    is skipped with a note naming it (text-mode stdin raises UnicodeDecodeError on it, or, decoding with
    surrogateescape, hands the tokenizer lone surrogates it rejects: either ended the session with a traceback)."""

    def __init__(self, stream, note):
        self.stream, self.note, self.number = stream, note, 0

    def readline(self) -> str:
        while True:
            line = self.stream.readline()
            if not line:
                return ""
            self.number += 1
            try:
                return line.decode("utf-8")
            except UnicodeDecodeError:
                self.note(f"line {self.number} is not UTF-8 text; ignored")


def read_message(stdin, interactive: bool, note=None) -> str | None:
    """One message: a line; lines ending with a backslash continue on the next. None at end of input."""
    lines = []
    while True:
        if interactive:
            try:
                line = input("you> " if not lines else "...> ")
                line.encode("utf-8")  # input() keeps bytes that are not UTF-8 as lone surrogates
            except UnicodeError:  # bytes typed or pasted that are not UTF-8: skip that line
                (note or print)("that line is not UTF-8 text; ignored")
                continue
            except EOFError:  # Ctrl-D: end the prompt's line, so the shell's prompt starts on a line of its own
                print(flush=True)
                return "\n".join(lines) if lines else None
        else:
            line = stdin.readline()
            if not line:
                return "\n".join(lines) if lines else None
            line = line.rstrip("\r\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def run_chat(engine, max_tokens: int, system: str | None = None, stdin=None, stops=None) -> None:
    stdin = stdin or sys.stdin
    interactive = stdin.isatty() and sys.stdout.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    session = ChatSession(engine, max_tokens, system, stops=stops)
    if not interactive and hasattr(stdin, "buffer"):  # decode each line ourselves: a bad one is skipped, not fatal
        stdin = Utf8Lines(stdin.buffer, session.note)
    speculative = f", mode {engine.mode}" if engine.mode != "none" else ""
    sampling = describe_sampling(engine.config.sampling.model_dump())
    print(f"blockspec chat: {engine.model_name}{speculative}, context {engine.context_length} tokens, up to "
          f"{max_tokens} tokens per reply, sampling: {sampling}. Commands: {COMMANDS}.", file=sys.stderr, flush=True)
    while True:
        try:
            text = read_message(stdin, interactive, session.note)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return
        if text is None:
            return
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            session.reset()
            continue
        if command.startswith("/") and " " not in command:
            session.note(f"unknown command {command}; commands: {COMMANDS}")
            continue
        try:
            session.turn(text)
        except BlockspecError as exc:  # a request the engine refuses: say so, keep the session
            session.note(f"error: {exc}")
