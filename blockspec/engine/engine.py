"""Engine: a loaded target (plus optional drafter), its decode state, and the request checks. engine/load.py
builds its parts; here requests are checked and decoded."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import SAMPLING_KEYS, PredictConfig, SamplingSettings
from ..drafter.model import DFlash2Drafter
from ..errors import BlockspecError
from ..kernels import use
from ..models.checkpoint import generation_defaults
from ..models.qwen3_5 import TargetModel
from ..models.text import ReplyText, Stops
from .decode import DecodeStats, Proposer, decode
from .load import load


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stats: dict


class Engine:
    def __init__(self, config: PredictConfig, *, model=None, mtp_tensors=None,
                 drafter: DFlash2Drafter | Callable[[TargetModel], DFlash2Drafter] | None = None, tokenizer=None,
                 wrap_proposer: Callable[[Proposer], Proposer] | None = None):
        """Loads the config's model (engine/load.py `load`, which also takes the `model` / `mtp_tensors` /
        `drafter` / `tokenizer` that stand in for a checkpoint's, and the bench's `wrap_proposer`)."""
        parts = load(config, model=model, mtp_tensors=mtp_tensors, drafter=drafter, tokenizer=tokenizer,
                     wrap_proposer=wrap_proposer)
        self.config, self.mode, self.context_length = config, config.decode_mode, config.context_length
        self.device, self.execution, self.dtype = parts.device, parts.execution, parts.dtype
        self.model_name = Path(config.model).name if config.model else "synthetic"
        self.model, self.tokenizer, self.kernels = parts.model, parts.tokenizer, parts.kernels
        self.target_quantization, self.folded_norms = parts.target_quantization, parts.folded_norms
        self.sampler, self.proposer, self.state, self.prefix = parts.sampler, parts.proposer, parts.state, parts.prefix
        self.target = parts.target
        self.memory, self.load_times = parts.memory, parts.load_times
        self.last_stats: dict = {}

    @classmethod
    def load(cls, config: PredictConfig | str | Path, **overrides) -> "Engine":
        if isinstance(config, (str, Path)):
            config = PredictConfig.build({"model": str(config), **overrides})
        elif overrides:
            config = PredictConfig.build({**config.model_dump(exclude_unset=True), **overrides})
        return cls(config)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def check_request(self, prompt_ids, max_tokens: int):
        """Raise BlockspecError naming what a request's prompt or length gets wrong; do nothing else. (Sampling
        settings are checked by sampling_settings; an OpenAI request's other fields by server/requests.py.)"""
        if len(prompt_ids) == 0:
            raise BlockspecError("the prompt is empty: give at least one token")
        bad_ids = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad_ids:
            raise BlockspecError(f"token id {bad_ids[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if max_tokens < 1:
            raise BlockspecError(f"max_tokens must be at least 1 (got {max_tokens})")
        if len(prompt_ids) + max_tokens > self.context_length:
            raise BlockspecError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"context_length {self.context_length}")

    def sampling_settings(self, **overrides) -> SamplingSettings:
        """The config's sampling settings with a call's overrides (None: the config's value); a value out of range
        is refused in one line naming the field."""
        values = {**self.config.sampling.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        return SamplingSettings.build(values, source="sampling")

    @functools.cached_property
    def checkpoint_sampling(self) -> dict:
        """The sampling values of the checkpoint's generation_config.json, read once (a note on a bad file, once)."""
        return generation_defaults(self.config.model) if self.config.model else {}

    def serving_defaults(self) -> dict:
        """The sampling values a server request takes for the fields it leaves out: those set in the config (or by
        serve's flags), else the checkpoint's generation_config.json (as vLLM does), else none (greedy)."""
        defaults = dict(self.checkpoint_sampling)
        defaults.update({k: getattr(self.config, k) for k in SAMPLING_KEYS if k in self.config.model_fields_set})
        return defaults

    def stream(self, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True, *,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               min_p: float | None = None, seed: int | None = None, snapshot_at: int | None = None,
               cancelled: Callable[[], bool] | None = None):
        """Yield tokens one by one; closing the generator stops the work. Stats land in last_stats.
        `cancelled` is asked between prefill chunks: True ends the stream there, without a token (a server's client
        that left during a long prefill).
        The sampling arguments override the config's for this request (None: the config's).
        With prefix reuse, `snapshot_at` adds a snapshot at that prompt position, where a later prompt is expected
        to part from this one (a chat: the end of the conversation before the generation prompt, which the next
        turn renders differently; Tokenizer.conversation_length)."""
        settings = self.sampling_settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        self.check_request(prompt_ids, max_tokens)
        stats = DecodeStats()
        eos = self.tokenizer.eos_token_ids if stop_at_eos else set()
        self.sampler.begin(settings)
        # parameters never require grad, so no autograd graph is built; the kernel settings are this engine's only
        # while it works (between yields the caller may run another engine)
        steps = decode(self.target, self.proposer, [int(t) for t in prompt_ids], max_tokens, eos,
                       self.config.prefill_chunk_size, stats, self.sampler, self.prefix, snapshot_at, cancelled)
        try:
            while True:
                with use(self.kernels):
                    token = next(steps, None)
                if token is None:
                    return
                yield token
        finally:
            with use(self.kernels):
                steps.close()
            if self.state.pending:
                self.state.discard()
            self.last_stats = stats.as_dict(self.mode != "none")
            self.last_stats.update(mode=self.mode, execution=self.target.execution,
                                   target_quantization=self.target_quantization,
                                   vocabulary_quantization=self.config.vocabulary_quantization,
                                   sampling=self.sampler.describe())
            draft_head = getattr(self.proposer, "draft_head", None)
            if draft_head is not None:  # proposals only: acceptance, not output, depends on it
                self.last_stats["draft_vocabulary"] = draft_head.ids.numel()

    def forget_prefix(self):
        """Drop the kept conversation: the next request prefills its whole prompt."""
        if self.prefix is not None:
            self.prefix.clear()

    def generate(self, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True, *,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, seed: int | None = None, snapshot_at: int | None = None,
                 stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                 include_stop_str_in_output: bool = False) -> GenerationResult:
        """All of stream's tokens at once, with their text and stats. As vLLM's, `stop` strings and
        `stop_token_ids` end the reply at the token that completes the first of them, and the text ends before
        the stop string (after it with include_stop_str_in_output); stats' `stop_reason` is the string or id
        (None: no stop ended it)."""
        stops = Stops.build(stop, stop_token_ids, include_stop_str_in_output, self.vocab_size)
        reply, pieces = ReplyText(self.tokenizer, stops), []
        steps = self.stream(prompt_ids, max_tokens, stop_at_eos, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, seed=seed, snapshot_at=snapshot_at)
        try:
            for token in steps:
                pieces.append(reply.push([token]))
                if reply.stop_reason is not None:
                    break
        finally:
            steps.close()  # after a stop: the engine stops at its next token
        pieces.append(reply.finish())
        return GenerationResult(reply.tokens, "".join(pieces), {**self.last_stats, "stop_reason": reply.stop_reason})
