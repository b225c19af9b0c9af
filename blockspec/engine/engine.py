"""Engine: a loaded target (plus optional drafter), its decode state, and the request checks."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import check_folder, generation_defaults, load_mtp_head, load_target
from ..config import SAMPLING_KEYS, PredictConfig, SamplingSettings
from ..drafter.model import QUANTIZED_PROJECTIONS, DFlash2Drafter
from ..errors import BlockspecError, UnsupportedRequest
from ..kernels import KernelSettings, use
from ..layers import folded_norm
from ..layers.draft_head import DraftHead, draft_ids
from ..models.qwen3_5 import TargetModel
from .weights import prepare, quantize_head, resident_bytes, rtn
from ..tokenizer import Tokenizer
from . import memory
from .decode import DecodeStats, Proposer, decode
from .dflash2 import DFlash2Proposer
from .mtp import MTPProposer
from .reuse import PrefixCache
from .sampling import Sampler
from .state import DecodeState
from .target import EagerTarget, GraphedTarget

MAX_VERIFY_TOKENS = 16  # longest chain pass (anchor + proposals) whose partial commit is supported


def pass_rows(config: PredictConfig) -> int:
    """The most tokens one verification pass of this config holds: a chain's, or a draft tree's root + nodes (the
    rows the DeltaNet states record for a partial or path commit)."""
    return max(MAX_VERIFY_TOKENS, config.dflash2_tree_budget + 1)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stats: dict


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BlockspecError("device 'cuda' requested but no CUDA GPU is available (use --device cpu)")
    return torch.device(name)


def resolve_execution(config: PredictConfig, device: torch.device) -> str:
    """"cuda-graphs" (the default on CUDA) or "eager" (compile_mode -1, and always on the CPU)."""
    if config.compile_mode == -1:
        return "eager"
    if device.type == "cuda":
        return "cuda-graphs"
    if "compile_mode" in config.model_fields_set:  # asked for by name: refused, never silently dropped
        raise BlockspecError("compile_mode 0 (CUDA graphs) needs a CUDA device; the CPU always runs eagerly: "
                             "remove compile_mode or set it to -1")
    return "eager"


class Engine:
    def __init__(self, config: PredictConfig, *, model=None, mtp_tensors=None,
                 drafter: DFlash2Drafter | Callable[[TargetModel], DFlash2Drafter] | None = None, tokenizer=None):
        """Loads config.model, unless `model` (a packed TargetModel already on the device, e.g. synthetic weights),
        its `mtp_tensors` and a `tokenizer` are given; mode dflash2 loads config.dflash2_model unless `drafter` (a
        packed DFlash2Drafter around this model, or a function building one from the prepared model: then it is
        built where a checkpoint's would be read, after the target's head is quantized) is given."""
        if not config.model and model is None:
            raise BlockspecError("no model given: set 'model' in the config or pass --model DIR")
        self.config = config
        self.mode = config.decode_mode
        self.check_config(drafter_given=drafter is not None)
        if model is None:
            check_folder("model", config.model)
        self.device = resolve_device(config.device)
        self.execution = resolve_execution(config, self.device)
        self.note_ignored_settings()
        self.memory: dict = {}  # resident bytes: weights of each model (loaded, after packing, final), caches, pools
        memory.use_expandable_segments(self.device)
        if model is None and self.device.type == "cuda":  # refused before any tensor is read
            estimate = memory.checkpoint_estimate(config, execution=self.execution, max_partial=pass_rows(config))
            memory.check_fits(estimate, config, torch.device("cuda", config.gpu_ranks[0]))
            self.memory["estimate"] = estimate.as_dict()
        if self.device.type == "cuda":
            torch.cuda.set_device(config.gpu_ranks[0])
            torch.cuda.empty_cache()  # what building a given model left cached is not loading's peak
            memory.reset_peak(self.device)
        self.dtype = config.torch_dtype
        self.model_name = Path(config.model).name if config.model else "synthetic"
        self.load_times: dict = {}
        if model is None:  # a dense checkpoint's layer projections are quantized as they are read
            model, mtp_tensors = load_target(config.model, self.device, self.dtype, progress=config.load_progress,
                                             quantize=rtn(config.target_quantization, 128, self.dtype),
                                             mtp_head=self.mode == "mtp")
        self.model = model
        self.prepare_target()
        self.tokenizer = tokenizer or Tokenizer(config.model, self.model.config.eos_token_ids)
        self.context_length = config.context_length
        self.sampler = Sampler(self.device)
        with use(self.kernels):
            self.proposer = self.build_proposer(mtp_tensors, drafter)
            snapshots = config.prefix_snapshots if config.prefix_reuse else 0
            self.state = DecodeState(self.model, config.context_length, pass_rows(config), self.device, self.dtype,
                                     in_place=self.proposer.max_proposals == 0, snapshots=snapshots)
            self.prefix = PrefixCache(self.state, self.proposer, snapshots) if snapshots else None
            if self.prefix is not None:
                self.memory["prefix_snapshots"] = {"count": snapshots, "bytes": self.prefix.bytes}
            self.memory["caches"] = memory.cache_bytes(self.state, self.proposer,
                                                       self.prefix.bytes if self.prefix is not None else 0)
            self.target = self.build_target()
        self.sampler.begin(config.sampling)  # the device's values follow the settings until a request begins its own
        self.last_stats: dict = {}
        if self.device.type == "cuda":  # what loading left cached (dense weights quantized since) goes back
            torch.cuda.empty_cache()
        self.memory["loading_peak"] = memory.peak(self.device)
        memory.reset_peak(self.device)  # from now on the peaks are decoding's

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

    def check_config(self, drafter_given: bool = False):
        """Refuse, before any model work, settings the chosen mode cannot serve exactly."""
        c = self.config
        if self.mode == "dflash2":
            if not c.dflash2_model and not drafter_given:
                raise BlockspecError("mode dflash2 needs a drafter: set dflash2_model or pass --drafter DIR")
        elif c.dflash2_model:
            raise BlockspecError(f"dflash2_model is set but mode is {self.mode!r}: unset dflash2_model or use "
                                 "mode dflash2 (the drafter is never loaded silently unused)")
        if c.dflash2_tree_budget and self.mode != "dflash2":  # refused, never silently ignored
            raise BlockspecError(f"dflash2_tree_budget: {c.dflash2_tree_budget} verifies trees of DFlash2 proposals, "
                                 f"but mode is {self.mode!r}: use mode dflash2 (--drafter DIR) or set it to 0")
        if c.draft_vocabulary and self.mode == "none":  # refused, never silently ignored
            raise BlockspecError(f"draft_vocabulary: {c.draft_vocabulary!r} restricts speculative proposals, but "
                                 "mode is 'none': use mode mtp or dflash2, or unset draft_vocabulary")
        if c.dflash2_quantization != "none" and self.mode != "dflash2":  # refused, never silently ignored
            raise BlockspecError(f"dflash2_quantization: {c.dflash2_quantization!r} quantizes a DFlash2 drafter, but "
                                 f"mode is {self.mode!r}: set dflash2_model (mode dflash2) or unset "
                                 "dflash2_quantization")
        if c.batch_size > 1 or c.beam_size > 1:
            raise UnsupportedRequest(f"batch_size {c.batch_size}: blockspec decodes one sequence at a time, in every "
                                     "mode (set batch_size: 1)" if c.batch_size > 1 else
                                     f"beam_size {c.beam_size}: beam search is not supported, in any mode "
                                     "(set beam_size: 1)")

    def note_ignored_settings(self):
        """Settings that are accepted but cannot be honoured: one line each on stderr, never an error."""
        for key in ("fuse_kvq", "fuse_gate"):
            if not getattr(self.config, key):
                print(f"blockspec: note: {key}: false is ignored: projections are always packed at load",
                      file=sys.stderr)

    def prepare_target(self):
        """Quantize the target's projections left dense (those of a model given dense: the loader quantizes a
        checkpoint's as it reads them) and its head as configured (engine/weights.py), and choose how the kernels
        launch."""
        c, start = self.config, time.perf_counter()
        stored = self.model.checkpoint_quantization
        if stored and c.target_quantization != stored and "target_quantization" in c.model_fields_set:
            raise BlockspecError(f"target_quantization: {c.target_quantization!r}, but {c.model} is a checkpoint "
                                 f"quantized to {stored}: leave target_quantization unset or set it to {stored!r}")
        self.target_quantization = stored or c.target_quantization
        # PDL where it measured a gain: an INT4 target's steps (kernels/pdl.py; FP8's and bf16's measured faster
        # without); fusion is what graphs record
        pdl_level = c.pdl_level if c.pdl_level is not None else (3 if self.target_quantization == "int4" else 0)
        self.kernels = KernelSettings(fusion=self.execution == "cuda-graphs", pdl_level=pdl_level,
                                      pdl_prefetch_mb=c.pdl_prefetch_mb)
        # a quantized checkpoint is used as stored: what it keeps unquantized stays dense
        self.target_quantizer = rtn(c.target_quantization if not stored else "none", 128, self.dtype)
        self.memory["target"] = prepare(self.model, self.target_quantizer, lambda name: name.startswith("layers."))
        quantize_head(self.model, c.vocabulary_quantization, self.dtype)
        self.folded_norms = folded_norm.enable(self.model, c.fold_norms)  # INT4 / FP8 on CUDA: norms in the projections
        self.memory["target"]["final_bytes"] = resident_bytes(self.model)
        self.load_times["prepare_target_s"] = round(time.perf_counter() - start, 3)

    def build_target(self):
        capture = self.proposer.capture_layers
        if self.execution == "eager":
            return EagerTarget(self.model, self.state, capture)
        torch.cuda.empty_cache()  # what loading left cached goes back first: the pools are measured alone
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        lengths = (1, 1 + self.proposer.max_proposals)
        tree = self.proposer.tree_budget
        target = GraphedTarget(self.model, self.state, capture, lengths=lengths,
                               tree_size=tree + 1 if tree else 0, tree_depth=self.proposer.max_proposals,
                               sampler=self.sampler, draft_width=max(self.proposer.draft_width, 1))
        self.sampler.capture_graphs(lengths, self.vocab_size, self.proposer.draft_width, target.pool)
        self.load_times["target_graphs_s"] = round(time.perf_counter() - start, 3)
        if hasattr(self.proposer, "capture_graphs"):
            start = time.perf_counter()
            self.proposer.capture_graphs(target.pool)
            self.load_times["proposer_graphs_s"] = round(time.perf_counter() - start, 3)
        self.memory["graph_pools_bytes"] = torch.cuda.memory_reserved() - reserved  # captures' pools and warm-ups
        return target

    def build_proposer(self, mtp_tensors, drafter) -> Proposer:
        c, model = self.config, self.model
        if self.mode == "none":
            return Proposer()
        draft_head = self.draft_head()
        if self.mode == "mtp":
            head = load_mtp_head(model, mtp_tensors, self.dtype, self.device)
            self.memory["mtp"] = prepare(head, self.target_quantizer)  # quantized as the target's projections
            return MTPProposer(model, head, c.self_speculative_num_tokens, self.context_length, self.device,
                               self.dtype, draft_head, self.sampler)
        if drafter is not None and not isinstance(drafter, DFlash2Drafter):
            drafter = drafter(model)
        if drafter is None:
            drafter = DFlash2Drafter.from_pretrained(
                c.dflash2_model, target_hidden_size=model.config.hidden_size, target_vocab_size=model.config.vocab_size,
                target_num_layers=model.config.num_hidden_layers, embed=model.embed, lm_head=model.logits,
                device=self.device, dtype=self.dtype)
        # norms, convolution controls and the selector stay native: only fc and the layers' projections
        self.memory["drafter"] = prepare(drafter, rtn(c.dflash2_quantization, 32, self.dtype),
                                         QUANTIZED_PROJECTIONS.match)
        return DFlash2Proposer(drafter, draft_head, self.sampler, c.dflash2_tree_budget, c.dflash2_tree_scores)

    def check_request(self, prompt_ids, max_tokens: int, *, n: int = 1, beam_size: int = 1, logprobs: bool = False,
                      images: bool = False, stop=None, attention_output: bool = False, prefix: bool = False,
                      constraints: bool = False):
        """Raise BlockspecError / UnsupportedRequest naming the field a request gets wrong; do nothing else.
        (Sampling settings are checked by sampling_settings.)"""
        # every refusal holds in every mode
        refusals = [
            (n != 1, f"n={n}: blockspec generates one sequence per request, in every mode"),
            (beam_size != 1, f"beam_size={beam_size}: beam search is not supported, in any mode"),
            (logprobs, "logprobs: not supported by blockspec, in any mode"),
            (images, "image inputs: blockspec serves text only, in every mode"),
            (stop, "stop sequences: not supported by blockspec, in any mode (EOS ends generation)"),
            (attention_output, "attention output: not supported by blockspec, in any mode"),
            (prefix, "target prefixes: not supported by blockspec, in any mode"),
            (constraints, "decode constraints: not supported by blockspec, in any mode"),
        ]
        for bad, why in refusals:
            if bad:
                raise UnsupportedRequest(why)
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

    def serving_defaults(self) -> dict:
        """The sampling values a server request takes for the fields it leaves out: those set in the config (or by
        serve's flags), else the checkpoint's generation_config.json (as vLLM does), else none (greedy)."""
        defaults = generation_defaults(self.config.model) if self.config.model else {}
        defaults.update({k: getattr(self.config, k) for k in SAMPLING_KEYS if k in self.config.model_fields_set})
        return defaults

    def stream(self, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True, proposer: Proposer = None, *,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               min_p: float | None = None, seed: int | None = None, snapshot_at: int | None = None,
               stop: Callable[[], bool] | None = None):
        """Yield tokens one by one; closing the generator stops the work. Stats land in last_stats.
        `stop` is asked between prefill chunks: True ends the stream there, without a token (a server's client that
        left during a long prefill).
        `proposer` replaces the engine's own for this request (one reading the same target features: the bench's
        forced acceptance). The sampling arguments override the config's for this request (None: the config's).
        With prefix reuse, `snapshot_at` adds a snapshot at that prompt position, where a later prompt is expected
        to part from this one (a chat: the end of the conversation before the generation prompt, which the next
        turn renders differently; Tokenizer.conversation_length)."""
        settings = self.sampling_settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        self.check_request(prompt_ids, max_tokens)
        prefix = self.prefix if proposer in (None, self.proposer) else None
        if prefix is None and self.prefix is not None:  # another proposer's request: the kept state goes stale
            self.prefix.clear()
        proposer = proposer or self.proposer
        stats = DecodeStats()
        eos = self.tokenizer.eos_token_ids if stop_at_eos else set()
        self.sampler.begin(settings)
        # parameters never require grad, so no autograd graph is built; the kernel settings are this engine's only
        # while it works (between yields the caller may run another engine)
        steps = decode(self.target, proposer, [int(t) for t in prompt_ids], max_tokens, eos,
                       self.config.prefill_chunk_size, stats, self.sampler, prefix, snapshot_at, stop)
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
            draft_head = getattr(proposer, "draft_head", None)
            if draft_head is not None:  # proposals only: acceptance, not output, depends on it
                self.last_stats["draft_vocabulary"] = draft_head.ids.numel()

    def forget_prefix(self):
        """Drop the kept conversation: the next request prefills its whole prompt."""
        if self.prefix is not None:
            self.prefix.clear()

    def draft_head(self):
        """The shared head over `draft_vocabulary` for the proposer (layers/draft_head.py; its bytes recorded in
        `memory`), or None: the full head."""
        spec = self.config.draft_vocabulary
        if not spec:
            return None
        config = self.model.config
        head = DraftHead.from_model(self.model, draft_ids(spec, config.vocab_size, config.eos_token_ids), self.dtype)
        self.memory["draft_head_bytes"] = head.nbytes()
        return head

    def generate(self, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True, proposer: Proposer = None, *,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, seed: int | None = None,
                 snapshot_at: int | None = None) -> GenerationResult:
        """All of stream's tokens at once, with their text and stats."""
        tokens = list(self.stream(prompt_ids, max_tokens, stop_at_eos, proposer, temperature=temperature,
                                  top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, snapshot_at=snapshot_at))
        return GenerationResult(tokens, self.tokenizer.decode(tokens), dict(self.last_stats))
