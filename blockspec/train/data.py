"""Training data: text files, and JSONL files of records (conversations, or texts); tokenized with the target's
tokenizer, laid end to end and cut into fixed-length sequences whose positions are marked trained or not; a held-out
share (whole texts and conversations, chosen by the seed) for evaluation.

A `.jsonl` file holds one record a line (blank lines are skipped): a conversation, OpenAI style
`{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}` or ShareGPT style
`{"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}`, rendered with the target's chat
template; a completion `{"prompt": "...", "completion": "..."}` (what `blockspec regenerate` writes for text prompts),
the two tokenized apart and laid end to end; or `{"text": "..."}`, a text like a text file's. A conversation is
trained on its assistant turns only, a completion on its completion, a text everywhere.

Texts are laid end to end and cut into sequences. A conversation or a completion starts a sequence of its own, its
last one padded: the target then sees it from its start, as it does when it serves it, so where the reply is the
target's own greedy output (`blockspec regenerate --greedy`) every label equals the reply's next token. Padding costs
target passes, not drafter rows: a --seq-len near the records' length wastes least.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..engine.reuse import common_prefix
from ..errors import BlockspecError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".c", ".h", ".cpp", ".rs", ".go", ".js", ".ts",
                 ".java", ".sh", ".toml", ".yaml", ".yml", ".html", ".css", ".tex"}
RECORDS_SUFFIX = ".jsonl"
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


@dataclass
class Conversation:
    messages: list[dict]  # OpenAI style (ShareGPT's turned into it)
    path: Path
    line: int


@dataclass
class Completion:
    prompt: str
    completion: str  # what the loss is on
    path: Path | None = None  # where it was read (file, line), for the messages that name it
    line: int = 0


class Sequence(NamedTuple):
    """A training sequence: its token ids and, per position, whether the label there (the target's token for the
    next position) is trained on: the next token is an assistant's, or text. Arrays (int32, bool): a corpus of
    hundreds of millions of tokens holds 5 bytes a token, where Python lists of ints would take ~40."""

    ids: np.ndarray
    trained: np.ndarray


def text_files(paths: list[str], suffixes=None, flag: str = "--data") -> list[Path]:
    """Every text file the paths name (a directory: the files under it with one of `suffixes`, default
    TEXT_SUFFIXES), sorted; a missing path, or paths that hold no text file, refused in one line naming `flag`."""
    suffixes = set(suffixes or TEXT_SUFFIXES)
    files = set()
    for name in paths:
        path = Path(name)
        if path.is_file():
            files.add(path.resolve())
        elif path.is_dir():
            files |= {p.resolve() for p in path.rglob("*") if p.is_file() and p.suffix in suffixes}
        elif path.exists():  # a device or a pipe: read without end, or nothing
            raise BlockspecError(f"{flag} {name}: not a regular file or a folder")
        else:
            raise BlockspecError(f"{flag} {name}: no such file or directory")
    if not files:
        raise BlockspecError(f"{flag} {' '.join(paths)}: no text files found (suffixes: {', '.join(sorted(suffixes))})")
    return sorted(files)


def parse_record(line: str, where: str, need_assistant: bool = True) -> str | Completion | list[dict]:
    """One JSONL line: its text, its completion, or its conversation's messages; anything else refused in one line
    naming `where` (the flag, file:line)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BlockspecError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise BlockspecError(f"{where}: JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise BlockspecError(f"{where}: a JSON object expected, got {type(record).__name__}")
    if "\\u" in line:  # an escaped lone surrogate parses, but no tokenizer takes the string
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BlockspecError(f"{where}: a string holds an unpaired surrogate escape ({exc.reason})") from None
    kinds = [k for k in ("messages", "conversations", "text") if k in record]
    if "prompt" in record or "completion" in record:
        kinds.append("prompt and completion")
    if len(kinds) > 1:
        raise BlockspecError(f"{where}: one record holds {' and '.join(kinds)}: give each its own line")
    if "messages" in record:
        field, role_key, content_key, roles = "messages", "role", "content", ROLES
    elif "conversations" in record:
        field, role_key, content_key, roles = "conversations", "from", "value", SHAREGPT_ROLES
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise BlockspecError(f"{where}: \"text\" must be a string")
        return record["text"]
    elif "prompt" in record or "completion" in record:
        if not (isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str)):
            raise BlockspecError(f"{where}: a completion record needs a string \"prompt\" and a string \"completion\"")
        return Completion(record["prompt"], record["completion"])
    else:
        raise BlockspecError(f"{where}: no \"messages\", \"conversations\", \"prompt\" and \"completion\", or \"text\" "
                             "field")
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        raise BlockspecError(f"{where}: \"{field}\" must be a non-empty list of messages")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BlockspecError(f"{where}: message {i} is not a JSON object")
        role = turn.get(role_key)
        if not isinstance(role, str) or role not in roles:
            raise BlockspecError(f"{where}: message {i} has an unknown {role_key} {role!r} "
                                 f"(known: {', '.join(roles)})")
        if not isinstance(turn.get(content_key), str):
            raise BlockspecError(f"{where}: message {i} has no string \"{content_key}\"")
        # OpenAI style keeps its other fields (tool_calls, name...) for the template
        message = dict(turn) if field == "messages" else {"role": roles[role], "content": turn[content_key]}
        messages.append(message)
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BlockspecError(f"{where}: the conversation has no assistant turn (the loss is on assistant turns)")
    return messages


def read_records(path: Path, need_assistant: bool = True,
                 flag: str = "--data") -> list[str | Completion | Conversation]:
    try:
        # a BOM, as some editors write, is not JSON; a record ends at "\n" alone (universal newlines: "\r\n" too),
        # not at the other line breaks of str.splitlines, which JSON text may hold unescaped (U+2028, U+0085, ...)
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError as exc:
        raise BlockspecError(f"{flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise BlockspecError(f"{flag} {path}: {exc.strerror}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            record = parse_record(line, f"{flag} {path}:{number}", need_assistant)
            if isinstance(record, list):
                record = Conversation(record, path, number)
            elif isinstance(record, Completion):
                record.path, record.line = path, number
            records.append(record)
    return records


def read_paths(paths: list[str], suffixes=None, need_assistant: bool = True,
               flag: str = "--data") -> list[str | Completion | Conversation]:
    """read_data of the files the paths name (text_files); a file named itself must be UTF-8 text."""
    named = {Path(name).resolve() for name in paths if Path(name).is_file()}
    return read_data(text_files(paths, suffixes, flag), need_assistant, flag, named)


def read_data(files: list[Path], need_assistant: bool = True, flag: str = "--data",
              named: set[Path] = frozenset()) -> list[str | Completion | Conversation]:
    """The texts, completions and conversations of the files, in order: a .jsonl file's records (each line checked),
    every other file's text (one that is not UTF-8 text is refused when `named` holds it, and skipped when it was
    found under a directory, like any binary file there; identical texts count once)."""
    units, seen = [], set()
    for path in files:
        if path.suffix == RECORDS_SUFFIX:
            units += [u for u in read_records(path, need_assistant, flag) if not isinstance(u, str) or u.strip()]
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            if path in named:
                raise BlockspecError(f"{flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            continue
        except OSError as exc:
            raise BlockspecError(f"{flag} {path}: {exc.strerror}") from None
        if text.strip() and text not in seen:  # identical files (vendored copies) count once
            seen.add(text)
            units.append(text)
    if not units:
        raise BlockspecError(f"{flag}: every file is empty or not UTF-8 text")
    return units


def check_chat_template(units: list, tokenizer, flag: str = "--data"):
    """Conversations need the target's chat template: refused, naming the first one's file, when it has none."""
    first = next((u for u in units if isinstance(u, Conversation)), None)
    if first is not None and not tokenizer.chat_template:
        raise BlockspecError(f"{flag} {first.path}: conversations are rendered with the target's chat template, and "
                             "the target has none (tokenizer_config.json: chat_template)")


def conversation_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The conversation's token ids as the chat template renders it (control tokens from the template alone, as in
    the engine's chat) and, per token, whether it is an assistant's. An assistant turn runs from where the prompt
    the engine would give for it (the conversation before it with the generation prompt) parts from the rendering, to
    the end-of-turn token that closes it (included: the target learns to stop)."""
    ids = tokenizer.chat_prompt_ids(messages, generation_prompt=False)
    mine = [False] * len(ids)
    end = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = max(end, common_prefix(tokenizer.chat_prompt_ids(messages[:i]), ids))
        end = next((p + 1 for p in range(start, len(ids)) if ids[p] in tokenizer.eos_token_ids), len(ids))
        mine[start:end] = [True] * (end - start)
    return ids, mine


class Unit(NamedTuple):
    """A text's, completion's or conversation's tokens (int32) and, per token, whether the loss is on it (bool);
    `alone`: it starts a sequence of its own (a completion, a conversation), else it is laid end to end with the
    texts."""
    ids: np.ndarray
    mine: np.ndarray
    alone: bool


def unit_tokens(units: list, tokenizer, eos: int | None, flag: str = "--data") -> list[Unit]:
    """Each text's, completion's or conversation's tokens followed by `eos`, with the tokens the loss is on (a
    text's: all; a completion's: its completion's)."""
    texts = [part for u in units if not isinstance(u, Conversation)
             for part in ((u.prompt, u.completion) if isinstance(u, Completion) else (u,))]
    encoded = iter(tokenizer.encode_batch_arrays(texts))
    separator = np.array([eos] if eos is not None else [], dtype=np.int32)
    out = []
    for u in units:
        if isinstance(u, str):
            ids = next(encoded)
            out.append(Unit(np.concatenate([ids, separator]), np.ones(len(ids) + len(separator), bool), False))
        elif isinstance(u, Completion):
            prompt, completion = next(encoded), next(encoded)
            out.append(Unit(np.concatenate([prompt, completion, separator]),
                            np.repeat([False, True, False], [len(prompt), len(completion), len(separator)]), True))
        else:
            try:
                ids, mine = conversation_tokens(tokenizer, u.messages)
            except BlockspecError as exc:
                raise BlockspecError(f"{flag} {u.path}:{u.line}: {exc}") from None
            out.append(Unit(np.concatenate([np.array(ids, np.int32), separator]),
                            np.concatenate([np.array(mine, bool), np.zeros(len(separator), bool)]), True))
    return out


def on_device(rows: list, device: torch.device) -> torch.Tensor:
    """A step's host data (ints, or lists or arrays of them of one length) as a tensor on `device` (integers as
    int64), copied through pinned memory
    without a wait: a copy from pageable memory waits until the device has run all that is queued (the step before),
    and the host's work on this step would no longer overlap the device's."""
    rows = torch.from_numpy(np.asarray(rows))  # a list of equal arrays stacks into one
    if not rows.dtype.is_floating_point and rows.dtype != torch.bool:
        rows = rows.long()
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows


def sequences(units: list[Unit], length: int, pad: int = 0) -> list[Sequence]:
    """The texts' tokens concatenated and cut into sequences of `length` tokens, then each unit that stands alone
    cut into its own, the last padded with `pad` (untrained); a position is trained when the token after it is.
    Sequences with no trained position are left out."""
    def cut(ids, mine, padded):
        """Views of the tokens (copies only where padded); the label at a position is the next token."""
        trained = np.concatenate([mine[1:], [False]])
        end = len(ids) if padded else len(ids) - length + 1
        for i in range(0, max(end, 0), length):
            part, marks = ids[i:i + length], trained[i:i + length]
            if len(part) < length:
                part = np.concatenate([part, np.full(length - len(part), pad, np.int32)])
                marks = np.concatenate([marks, np.zeros(length - len(marks), bool)])
            if marks.any():
                yield Sequence(part, marks)

    streamed = [u for u in units if not u.alone]
    out = list(cut(np.concatenate([u.ids for u in streamed] or [np.zeros(0, np.int32)]),
                   np.concatenate([u.mine for u in streamed] or [np.zeros(0, bool)]), False))
    for unit in units:
        if unit.alone:
            out += cut(unit.ids, unit.mine, True)
    return out


def split_corpus(paths: list[str], tokenizer, length: int, heldout: float, seed: int, eos: int | None,
                 suffixes=None) -> tuple[list[Sequence], list[Sequence]]:
    """(training sequences, held-out sequences): whole texts and conversations are held out, so none held out is
    seen in training. Every record is checked, and the chat template found, before any tokenizing."""
    units = read_paths(paths, suffixes)
    check_chat_template(units, tokenizer)
    random.Random(seed).shuffle(units)
    held = min(len(units) - 1, max(1, round(heldout * len(units)))) if heldout > 0 and len(units) > 1 else 0
    pad = eos if eos is not None else 0
    train = sequences(unit_tokens(units[held:], tokenizer, eos), length, pad)
    evaluation = sequences(unit_tokens(units[:held], tokenizer, eos), length, pad)
    if not train:
        raise BlockspecError(f"--data: fewer than {length} tokens of training data (lower --seq-len or add data)")
    return train, evaluation


def evaluation_corpus(paths: list[str], tokenizer, length: int, eos: int | None,
                      suffixes=None) -> list[Sequence]:
    """Sequences of data kept for evaluation only (train-drafter --eval-data): all of it, read and checked as
    --data is."""
    units = read_paths(paths, suffixes, flag="--eval-data")
    check_chat_template(units, tokenizer, flag="--eval-data")
    out = sequences(unit_tokens(units, tokenizer, eos, "--eval-data"), length, eos if eos is not None else 0)
    if not out:
        raise BlockspecError(f"--eval-data: fewer than {length} tokens to evaluate on (lower --seq-len or add data)")
    return out
