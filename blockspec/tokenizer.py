"""Tokenizer and chat template from the checkpoint's tokenizer.json / tokenizer_config.json."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import BlockspecError


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
        try:
            self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BlockspecError(f"{cfg_path}: not valid JSON ({exc})") from None
        template_file = directory / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.exists() else self.config.get("chat_template")
        eos = set(eos_token_ids)
        eos_token = self.config.get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if eos_token and self._tok.token_to_id(eos_token) is not None:
            eos.add(self._tok.token_to_id(eos_token))
        self.eos_token_ids = eos

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_id(self, token: str) -> int | None:
        """The id of a token written as it is in the vocabulary (a special token, say), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of many texts at once, on all cores (corpora for training)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the checkpoint's chat template with thinking disabled (templates that know `enable_thinking`)."""
        if not self.chat_template:
            raise BlockspecError("this checkpoint has no chat template (tokenizer_config.json: chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message):
            raise BlockspecError(f"chat template: {message}")

        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, enable_thinking=False,
                bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))
        except jinja2.TemplateError as exc:
            raise BlockspecError(f"chat template failed to render: {exc}") from None

    def _special(self, key: str) -> str:
        value = self.config.get(key) or ""
        return value.get("content", "") if isinstance(value, dict) else value
