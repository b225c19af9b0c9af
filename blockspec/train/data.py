"""Training text: files or directories of UTF-8 text, tokenized with the target's tokenizer and cut into
fixed-length sequences; a held-out share (whole files, chosen by the seed) for evaluation."""

from __future__ import annotations

import random
from pathlib import Path

from ..errors import BlockspecError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".c", ".h", ".cpp", ".rs", ".go", ".js", ".ts",
                 ".java", ".sh", ".toml", ".yaml", ".yml", ".html", ".css", ".tex"}


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
        else:
            raise BlockspecError(f"{flag} {name}: no such file or directory")
    if not files:
        raise BlockspecError(f"{flag} {' '.join(paths)}: no text files found (suffixes: {', '.join(sorted(suffixes))})")
    return sorted(files)


def read_texts(files: list[Path]) -> list[str]:
    texts, seen = [], set()
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text after all: skipped, like any binary file under a directory
        except OSError as exc:
            raise BlockspecError(f"--data {path}: {exc.strerror}") from None
        if text.strip() and text not in seen:  # identical files (vendored copies) count once
            seen.add(text)
            texts.append(text)
    if not texts:
        raise BlockspecError("--data: every file is empty or not UTF-8 text")
    return texts


def sequences(texts: list[str], tokenizer, length: int, eos: int | None) -> list[list[int]]:
    """The texts' tokens, each text followed by `eos`, concatenated and cut into sequences of `length` tokens."""
    stream: list[int] = []
    for ids in tokenizer.encode_batch(texts):
        stream += ids + ([eos] if eos is not None else [])
    return [stream[i:i + length] for i in range(0, len(stream) - length + 1, length)]


def split_corpus(paths: list[str], tokenizer, length: int, heldout: float, seed: int, eos: int | None,
                 suffixes=None):
    """(training sequences, held-out sequences): whole texts are held out, so no held-out text is seen in
    training."""
    texts = read_texts(text_files(paths, suffixes))
    random.Random(seed).shuffle(texts)
    held = max(1, round(heldout * len(texts))) if heldout > 0 and len(texts) > 1 else 0
    train, evaluation = sequences(texts[held:], tokenizer, length, eos), sequences(texts[:held], tokenizer, length,
                                                                                    eos)
    if not train:
        raise BlockspecError(f"--data: fewer than {length} tokens of training text (lower --seq-len or add data)")
    return train, evaluation
