"""The user's small files (configs, tokenizer files, fixtures, vocabularies, run settings) read as text or JSON:
each way one can be wrong refused in one BlockspecError line that names the file.

A device or a pipe is refused before it is read (/dev/zero would be read without end); a folder, a missing or
unreadable file, bytes that are not UTF-8, text that is not JSON, and JSON nested deeper than the parser's
recursion limit each get their own line.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import BlockspecError


def read_text(path: str | Path, what: str | None = None) -> str:
    """The UTF-8 text of the file `path`; `what` names it in the error (default: the path)."""
    path, where = Path(path), what or str(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        raise BlockspecError(f"{where}: not a regular file")
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise BlockspecError(f"{where}: file not found") from None
    except OSError as exc:
        raise BlockspecError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise BlockspecError(f"{where}: not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | Path, what: str | None = None):
    """The JSON value in the file `path` (any type: the caller checks its shape); `what` as in read_text."""
    text, where = read_text(path, what), what or str(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BlockspecError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise BlockspecError(f"{where}: not valid JSON (nested too deeply)") from None
