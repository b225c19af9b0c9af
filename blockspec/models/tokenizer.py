"""Tokenizer and chat template from the checkpoint's tokenizer.json / tokenizer_config.json."""

from __future__ import annotations

import json
import re
import secrets
import threading
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ..errors import BlockspecError
from ..files import read_json, read_text


# ChatML, the format of Qwen's chat templates, with its special tokens: the template of the checkpoints this package
# makes itself (train-target's, the tests' tiny ones)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")


@lru_cache(maxsize=4)
def _compiled(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise BlockspecError(f"chat template: {message}")

    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "") -> str:
    """A chat template rendered on `messages`, thinking disabled (templates that know `enable_thinking`); compiled
    once per template (training data renders many conversations)."""
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          enable_thinking=False, bos_token=bos_token, eos_token=eos_token)
    except BlockspecError:
        raise
    except Exception as exc:  # checkpoint code run on the caller's messages: any failure refuses the messages
        raise BlockspecError(f"chat template failed to render these messages: {type(exc).__name__}: {exc}") from None


class TooManyTokens(BlockspecError):
    """A text certainly longer than the tokens allowed for it, found without tokenizing it."""


class Tokenizer:
    def __init__(self, directory: str | Path, eos_token_ids=()):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise BlockspecError(f"{path}: file not found (the checkpoint needs tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise BlockspecError(f"{path}: unreadable tokenizer ({str(exc).splitlines()[0]})") from None
        cfg_path = directory / "tokenizer_config.json"
        self.config = read_json(cfg_path) if cfg_path.exists() else {}
        if not isinstance(self.config, dict):
            raise BlockspecError(f"{cfg_path}: a JSON object expected, got {type(self.config).__name__}")
        template_file = directory / "chat_template.jinja"
        self.chat_template = read_text(template_file) if template_file.exists() else self.config.get("chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise BlockspecError(f"{cfg_path}: 'chat_template' must be a string (got "
                                 f"{type(self.chat_template).__name__})")
        eos = set(eos_token_ids)
        eos_token = self.config.get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if eos_token is not None and not isinstance(eos_token, str):
            raise BlockspecError(f"{cfg_path}: 'eos_token' must be a token's text or an object with its 'content' "
                                 f"(got {json.dumps(self.config.get('eos_token'))[:40]})")
        if eos_token and self._tok.token_to_id(eos_token) is not None:
            eos.add(self._tok.token_to_id(eos_token))
        self.eos_token_ids = eos
        # encode_special_tokens is a setting of the shared tokenizer object: each encoding sets it under this lock
        self._encoding = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def check_fits(self, vocab_size: int, directory: str | Path):
        """Refuse a tokenizer with ids the model has no rows for (one from another model beside its weights)."""
        if self.vocab_size > vocab_size:
            raise BlockspecError(f"{directory}: tokenizer.json has {self.vocab_size} ids, more than the model's "
                                 f"vocab_size {vocab_size} (config.json): the tokenizer is not this model's")

    def token_id(self, token: str) -> int | None:
        """The id of a token written as it is in the vocabulary (a special token, say), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, split_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of text. split_special_tokens: a special token's text (`<|im_end|>`) is encoded as the
        ordinary text it is, never as the control token. max_tokens: a text certainly longer than that raises
        TooManyTokens before any tokenizing (a multi-megabyte text costs no tokenization)."""
        if max_tokens is not None:
            self._check_length(text, max_tokens)
        return self._encode([text], split_special_tokens)[0]

    def _encode(self, texts: list[str], split_special_tokens: bool, convert=None) -> list:
        # encode_batch_fast releases the GIL while it works (encode holds it): a long text does not stop the
        # caller's other threads (the server's event loop)
        with self._encoding:
            self._tok.encode_special_tokens = split_special_tokens
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids if convert is None else convert(e.ids) for e in encodings]

    @cached_property
    def _longest_token(self) -> int | None:
        """The most characters of (normalized) text one token covers, where the tokenizer guarantees a bound:
        byte-level BPE covers every character and no token covers more than its vocabulary entry's length (one
        character per byte). None for other tokenizers (an unknown word may become one token)."""
        pre_tokenizer = self._tok.pre_tokenizer
        byte_level = pre_tokenizer is not None and '"ByteLevel"' in pre_tokenizer.__getstate__().decode()
        return max(map(len, self._tok.get_vocab())) if byte_level else None

    def _check_length(self, text: str, max_tokens: int):
        longest = self._longest_token
        if longest is None or len(text) <= max_tokens * longest:
            return
        normalizer = self._tok.normalizer  # composing normalizers (NFC) may shorten the text first
        chars = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
        fewest = -(-chars // longest)
        if fewest > max_tokens:
            raise TooManyTokens(f"the prompt is at least {fewest} tokens long ({len(text)} characters), more than "
                                f"the {max_tokens} that fit")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of many texts at once, on all cores (corpora for training)."""
        return self._encode(texts, split_special_tokens=False)

    def encode_batch_arrays(self, texts: list[str], chunk: int = 1024) -> list[np.ndarray]:
        """encode_batch() as int32 arrays, `chunk` texts at a time: a corpus's ids as Python ints, or the tokenizer's
        encodings of all of it at once (tokens, offsets), would take tens of bytes a token."""
        as_array = lambda ids: np.array(ids, dtype=np.int32)  # noqa: E731
        return [a for i in range(0, len(texts), chunk)
                for a in self._encode(texts[i:i + chunk], split_special_tokens=False, convert=as_array)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat_prompt_ids(self, messages: list[dict], max_tokens: int | None = None,
                        generation_prompt: bool = True) -> list[int]:
        """The chat prompt's token ids (generation prompt added, unless generation_prompt is False), its control
        tokens coming from the template alone: a special token's text inside a message (a user typing `<|im_end|>`)
        is encoded as ordinary text, so that no message can forge a turn boundary. max_tokens: as for encode."""
        control, control_text = self._control_tokens
        if not control:
            return self.encode(self.chat_prompt(messages, generation_prompt), max_tokens=max_tokens)
        names = list(control)
        # a random private-use marker: no client can guess it, and one that did would only have text put back as
        # text (never a control token)
        marker = f"\ue000{secrets.token_hex(8)}:"
        hidden = self._map_strings(messages, lambda s: control_text.sub(
            lambda m: f"{marker}{names.index(m.group())}\ue001", s))
        text = self.chat_prompt(hidden, generation_prompt)
        # the tokenizer encodes the text between special tokens piece by piece: so do we, with the template's own
        # special tokens as the only boundaries, each piece's hidden text put back and encoded as text
        shown = re.compile(re.escape(marker) + "([0-9]+)\ue001")
        pieces = [shown.sub(lambda m: names[int(m.group(1))], piece) for piece in control_text.split(text)]
        if max_tokens is not None:
            self._check_length("".join(pieces), max_tokens)
        encoded = self._encode(pieces, True)
        ids = encoded[0]
        for token, piece in zip(control_text.findall(text), encoded[1:]):
            ids += [control[token], *piece]
        return ids

    def conversation_length(self, messages: list[dict], prompt_ids: list[int]) -> int | None:
        """How many of prompt_ids (the chat prompt of `messages`) render the conversation itself, before the
        generation prompt: the part the next turn's prompt starts with, where a template renders the reply it asked
        for differently (Qwen's drops the empty thinking block). None where the rendering is not a prefix, or where
        the template renders a conversation only with its generation prompt (it raises without one): no snapshot is
        placed then, and the request goes on."""
        try:
            ids = self.chat_prompt_ids(messages, generation_prompt=False)
        except BlockspecError:
            return None
        return len(ids) if prompt_ids[:len(ids)] == ids else None

    @cached_property
    def _control_tokens(self) -> tuple[dict[str, int], re.Pattern]:
        """The special tokens (text -> id) and a pattern finding them in text, the longest first (as the tokenizer
        matches them)."""
        control = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        longest_first = sorted(control, key=len, reverse=True)
        return control, re.compile("|".join(map(re.escape, longest_first)))

    @classmethod
    def _map_strings(cls, value, change):
        """value with change() applied to every string in it, however deep (dict keys and roles left as they are)."""
        if isinstance(value, str):
            return change(value)
        if isinstance(value, list):
            return [cls._map_strings(v, change) for v in value]
        if isinstance(value, dict):
            return {k: v if k == "role" else cls._map_strings(v, change) for k, v in value.items()}
        return value

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the checkpoint's chat template with thinking disabled (templates that know `enable_thinking`)."""
        if not self.chat_template:
            raise BlockspecError("this checkpoint has no chat template (tokenizer_config.json: chat_template)")
        return render_chat(self.chat_template, messages, add_generation_prompt, bos_token=self._special("bos_token"),
                           eos_token=self._special("eos_token"))

    def _special(self, key: str) -> str:
        value = self.config.get(key) or ""
        return value.get("content", "") if isinstance(value, dict) else value
