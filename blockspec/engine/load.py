"""Building an engine's parts from its config: the settings' own checks, the memory check, the target loaded and
prepared (quantized, norms folded), the proposer, the decode state and prefix cache, and the CUDA graphs.

`load` returns `LoadedParts`; `Engine` (engine.py) keeps them and serves requests. The `model=` / `drafter=` /
`tokenizer=` arguments stand in for what a checkpoint would give (synthetic weights, a drafter built around the
prepared target). What loading measured goes into one `MemoryReport` (engine/memory.py: resident bytes of each
model, caches, graph pools, the estimate, the loading peak) and one `LoadTimes`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import MAX_VERIFY_TOKENS, PredictConfig, TargetConfig, device_type, unused_settings
from ..drafter.config import DrafterConfig
from ..drafter.model import QUANTIZED_PROJECTIONS, DFlash2Drafter, check_fits_target
from ..errors import BlockspecError, UnsupportedRequest
from ..kernels import KernelSettings, use
from ..layers import folded_norm
from ..layers.draft_head import DraftHead, draft_ids
from ..models.checkpoint import check_folder, load_mtp_head, load_target
from ..models.qwen3_5 import TargetModel
from ..models.tokenizer import Tokenizer
from . import memory
from .decode import Proposer
from .dflash2 import DFlash2Proposer
from .memory import MemoryReport
from .mtp import MTPProposer
from .reuse import PrefixCache
from .sampling import Sampler
from .state import DecodeState
from .target import EagerTarget, GraphedTarget
from .weights import prepare, quantize_head, resident_bytes, rtn


def pass_rows(tree_budget: int) -> int:
    """The most tokens one verification pass holds: a chain's, or a draft tree's root + nodes (the rows the DeltaNet
    states record for a partial or path commit)."""
    return max(MAX_VERIFY_TOKENS, tree_budget + 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device(device_type(name))
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


def check_lookup(config: PredictConfig, proposals: int):
    """Refuse a lookup branch (as set) longer than the drafter's proposals, or one that leaves the tree no room for
    the chain."""
    lookup, budget = config.tree_lookup(proposals), config.tree_budget
    if not lookup:
        return
    if lookup > proposals:
        raise BlockspecError(f"dflash2_tree_lookup: {lookup} exceeds the drafter's {proposals} proposals a block "
                             "(a branch is never deeper than the chain)")
    if budget - lookup < proposals:
        raise BlockspecError(f"dflash2_tree_lookup: {lookup} leaves {budget - lookup} of dflash2_tree_budget "
                             f"{budget}'s nodes to the drafter, fewer than its chain of {proposals}: raise the "
                             f"budget to at least {proposals + lookup} or lower the lookup")


def check_config(config: PredictConfig, drafter_given: bool = False):
    """Refuse, before any model work, settings the chosen mode cannot serve exactly."""
    c, mode = config, config.decode_mode
    if mode == "dflash2":
        if not c.dflash2_model and not drafter_given:
            raise BlockspecError("mode dflash2 needs a drafter: set dflash2_model or pass --drafter DIR")
    elif c.dflash2_model:
        raise BlockspecError(f"dflash2_model is set but mode is {mode!r}: unset dflash2_model or use "
                             "mode dflash2 (the drafter is never loaded silently unused)")
    if c.dflash2_block_size is not None:  # refused, never silently ignored
        if mode != "dflash2" or drafter_given:
            raise BlockspecError(f"dflash2_block_size: {c.dflash2_block_size} sets the blocks of a DFlash2 drafter "
                                 f"loaded from dflash2_model, but mode is {mode!r}"
                                 + (" with a drafter built in code" if mode == "dflash2" else ""))
        path = Path(c.dflash2_model) / "config.json"
        DrafterConfig.from_file(path).run_at(c.dflash2_block_size, str(path))
    if c.dflash2_tree_budget and mode != "dflash2":  # refused, never silently ignored
        raise BlockspecError(f"dflash2_tree_budget: {c.dflash2_tree_budget} verifies trees of DFlash2 proposals, "
                             f"but mode is {mode!r}: use mode dflash2 (--drafter DIR) or set it to 0")
    if c.dflash2_tree_lookup:  # refused, never silently ignored
        if mode != "dflash2" or not c.tree_budget:
            raise BlockspecError(f"dflash2_tree_lookup: {c.dflash2_tree_lookup} gives nodes of a DFlash2 draft tree "
                                 "to a branch from the context, but " + (f"mode is {mode!r}" if mode != "dflash2" else
                                 "dflash2_tree_budget is 0 (no tree)") + ": set it to 0")
        if c.dflash2_model and not drafter_given:
            path = Path(c.dflash2_model) / "config.json"
            check_lookup(c, DrafterConfig.from_file(path).run_at(c.dflash2_block_size, str(path)).block_size - 1)
    if c.draft_vocabulary and mode == "none":  # refused, never silently ignored
        raise BlockspecError(f"draft_vocabulary: {c.draft_vocabulary!r} restricts speculative proposals, but "
                             "mode is 'none': use mode mtp or dflash2, or unset draft_vocabulary")
    if c.dflash2_quantization != "none" and mode != "dflash2":  # refused, never silently ignored
        raise BlockspecError(f"dflash2_quantization: {c.dflash2_quantization!r} quantizes a DFlash2 drafter, but "
                             f"mode is {mode!r}: set dflash2_model (mode dflash2) or unset dflash2_quantization")
    if c.batch_size > 1 or c.beam_size > 1:
        raise UnsupportedRequest(f"batch_size {c.batch_size}: blockspec decodes one sequence at a time, in every "
                                 "mode (set batch_size: 1)" if c.batch_size > 1 else
                                 f"beam_size {c.beam_size}: beam search is not supported, in any mode "
                                 "(set beam_size: 1)")


def fit_context(config: PredictConfig, target: TargetConfig, source: str):
    """context_length within the target's max_position_embeddings (the positions it was trained for): a value set
    past it is refused, as vLLM refuses such a max_model_len; the default is lowered to it (config changed in
    place, so the engine reports the length it serves)."""
    limit = target.max_position_embeddings
    if config.context_length <= limit:
        return
    if "context_length" in config.model_fields_set:
        raise BlockspecError(f"context_length {config.context_length} exceeds the model's max_position_embeddings "
                             f"{limit} ({source}): lower context_length")
    config.context_length = limit


def check_draft_vocabulary(config: PredictConfig, target: TargetConfig):
    """draft_vocabulary checked against the target's vocabulary before the target loads (build_draft_head reads it
    again): a file's ids read, a count refused unless it leaves ids out (the rule of `blockspec draft-vocabulary
    --size`: a draft over every id is draft_vocabulary 0)."""
    spec = config.draft_vocabulary
    if not spec or config.decode_mode == "none":
        return
    if isinstance(spec, int) and spec >= target.vocab_size:
        raise BlockspecError(f"draft_vocabulary: {spec} is not smaller than the vocabulary ({target.vocab_size} "
                             "ids): nothing to leave out (draft_vocabulary 0 proposes over every id)")
    draft_ids(spec, target.vocab_size, target.eos_token_ids)


def check_drafter(config: PredictConfig, target: TargetConfig):
    """dflash2_model's drafter checked against the target and the passes before either loads (from_pretrained
    checks it again as it reads it)."""
    if config.decode_mode != "dflash2" or not config.dflash2_model:
        return
    path = Path(config.dflash2_model) / "config.json"
    drafter = DrafterConfig.from_file(path).run_at(config.dflash2_block_size, str(path))
    check_fits_target(drafter, Path(config.dflash2_model), target.hidden_size, target.vocab_size,
                       target.num_hidden_layers)
    rows = pass_rows(config.tree_budget)
    if not config.tree_budget and drafter.block_size > rows:
        raise BlockspecError(f"drafter {path}: dflash_config.block_size {drafter.block_size} makes chain passes of "
                             f"{drafter.block_size} tokens, but a chain pass holds at most {rows}: set "
                             f"dflash2_block_size {rows} or less, or a tree budget")


def check_mtp(config: PredictConfig, target: TargetConfig, source: str):
    """Mode mtp refused where the target's config declares no MTP layer (mtp_num_hidden_layers 0)."""
    if config.decode_mode == "mtp" and target.mtp_num_hidden_layers < 1:
        raise BlockspecError(f"mode mtp needs the checkpoint's native MTP head, but {source} sets "
                             f"mtp_num_hidden_layers {target.mtp_num_hidden_layers} (use --mode none, or a DFlash2 "
                             "drafter with --mode dflash2)")


def note_ignored_settings(config: PredictConfig):
    """Settings that are accepted but cannot be honoured, or were given and do nothing in this run
    (config.unused_settings): one line each on stderr, never an error."""
    for key in ("fuse_kvq", "fuse_gate"):
        if not getattr(config, key):
            print(f"blockspec: note: {key}: false is ignored: projections are always packed at load", file=sys.stderr)
    for note in unused_settings(config):
        print(f"blockspec: note: {note}", file=sys.stderr)


@dataclass
class LoadTimes:
    """Seconds of an engine's loading steps; None where a step did not run (graphs: eager execution)."""
    prepare_target_s: float | None = None   # quantizing and folding the loaded target
    target_graphs_s: float | None = None    # capturing the target's (and the sampler's) CUDA graphs
    proposer_graphs_s: float | None = None  # capturing the proposer's

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class LoadedParts:
    """What `load` builds: the engine's model, tokenizer, kernels' settings, sampler, proposer, state and target."""
    config: PredictConfig
    device: torch.device
    execution: str  # "cuda-graphs" or "eager"
    dtype: torch.dtype
    tree_budget: int = 0  # the DFlash2 cycles' draft-tree budget (PredictConfig.tree_budget)
    model: TargetModel = None
    tokenizer: Tokenizer = None
    target_quantization: str = "none"
    folded_norms: int = 0  # norms folded into the projections (layers/folded_norm.py)
    kernels: KernelSettings = None
    sampler: Sampler = None
    proposer: Proposer = None
    state: DecodeState = None
    prefix: PrefixCache | None = None
    target: EagerTarget | GraphedTarget = None
    memory: MemoryReport = field(default_factory=MemoryReport)
    load_times: LoadTimes = field(default_factory=LoadTimes)

    @property
    def pass_rows(self) -> int:
        return pass_rows(self.tree_budget)


def load(config: PredictConfig, *, model=None, mtp_tensors=None,
         drafter: DFlash2Drafter | Callable[[TargetModel], DFlash2Drafter] | None = None, tokenizer=None,
         wrap_proposer: Callable[[Proposer], Proposer] | None = None) -> LoadedParts:
    """Loads config.model, unless `model` (a packed TargetModel already on the device, e.g. synthetic weights),
    its `mtp_tensors` and a `tokenizer` are given; mode dflash2 loads config.dflash2_model unless `drafter` (a
    packed DFlash2Drafter around this model, or a function building one from the prepared model: then it is built
    where a checkpoint's would be read, after the target's head is quantized) is given. `wrap_proposer` turns the
    built proposer into the one requests use, running it inside (the bench's forced acceptance); graphs and
    snapshots stay the built one's."""
    if not config.model and model is None:
        raise BlockspecError("no model given: set 'model' in the config or pass --model DIR")
    check_config(config, drafter_given=drafter is not None)
    if model is None:
        check_folder("model", config.model)
        source = str(Path(config.model) / "config.json")
        target_config = TargetConfig.from_file(Path(source))
    else:
        source, target_config = "the given model", model.config
    fit_context(config, target_config, source)
    check_draft_vocabulary(config, target_config)
    check_mtp(config, target_config, source)
    if drafter is None:
        check_drafter(config, target_config)
    if tokenizer is None:  # read before the weights: a tokenizer with ids the model lacks is refused now
        tokenizer = Tokenizer(config.model, target_config.eos_token_ids)
        tokenizer.check_fits(target_config.vocab_size, config.model)
    device = resolve_device(config.device)
    parts = LoadedParts(config, device, resolve_execution(config, device), config.torch_dtype,
                        config.tree_budget)
    note_ignored_settings(config)
    memory.use_expandable_segments(device)
    if model is None:  # refused before any tensor is read
        estimate = memory.checkpoint_estimate(config, execution=parts.execution, max_partial=parts.pass_rows)
        if device.type == "cuda":
            memory.check_fits(estimate, config, torch.device("cuda", config.gpu_ranks[0]))
            parts.memory.estimate = estimate.as_dict()
        else:
            memory.check_fits_host(estimate, config)
    if device.type == "cuda":
        torch.cuda.set_device(config.gpu_ranks[0])
        torch.cuda.empty_cache()  # what building a given model left cached is not loading's peak
        memory.reset_peak(device)
    if model is None:  # a dense checkpoint's layer projections are quantized as they are read
        model, mtp_tensors = load_target(config.model, device, parts.dtype, progress=config.load_progress,
                                         quantize=rtn(config.target_quantization, 128, parts.dtype),
                                         mtp_head=config.decode_mode == "mtp")
    parts.model = model
    target_quantizer = prepare_target(parts)
    parts.tokenizer = tokenizer
    parts.sampler = Sampler(device)
    with use(parts.kernels):
        parts.proposer = build_proposer(parts, target_quantizer, mtp_tensors, drafter)
        snapshots = config.prefix_snapshots if config.prefix_reuse else 0
        parts.state = DecodeState(model, config.context_length, parts.pass_rows, device, parts.dtype,
                                  in_place=parts.proposer.max_proposals == 0, snapshots=snapshots)
        parts.prefix = PrefixCache(parts.state, parts.proposer, snapshots) if snapshots else None
        if parts.prefix is not None:
            parts.memory.prefix_snapshots = {"count": snapshots, "bytes": parts.prefix.bytes}
        parts.memory.caches = memory.cache_bytes(parts.state, parts.proposer,
                                                 parts.prefix.bytes if parts.prefix is not None else 0)
        parts.target = build_target(parts)
    if wrap_proposer is not None:
        parts.proposer = wrap_proposer(parts.proposer)
    parts.sampler.begin(config.sampling)  # the device's values follow the settings until a request begins its own
    if device.type == "cuda":  # what loading left cached (dense weights quantized since) goes back
        torch.cuda.empty_cache()
    parts.memory.loading_peak = memory.peak(device)
    memory.reset_peak(device)  # from now on the peaks are decoding's
    return parts


def prepare_target(parts: LoadedParts):
    """Quantize the target's projections left dense (those of a model given dense: the loader quantizes a
    checkpoint's as it reads them) and its head as configured (engine/weights.py), and choose how the kernels
    launch. Returns the quantizer of the target's projections (the MTP head's take it too)."""
    c, model, start = parts.config, parts.model, time.perf_counter()
    stored = model.checkpoint_quantization
    if stored and c.target_quantization != stored and "target_quantization" in c.model_fields_set:
        raise BlockspecError(f"target_quantization: {c.target_quantization!r}, but {c.model} is a checkpoint "
                             f"quantized to {stored}: leave target_quantization unset or set it to {stored!r}")
    parts.target_quantization = stored or c.target_quantization
    # PDL where it measured a gain: an INT4 or FP8 target's steps (kernels/pdl.py; bf16's measured faster without);
    # fusion is what graphs record
    pdl_level = c.pdl_level if c.pdl_level is not None else (0 if parts.target_quantization == "none" else 3)
    parts.kernels = KernelSettings(fusion=parts.execution == "cuda-graphs", pdl_level=pdl_level,
                                   pdl_prefetch_mb=c.pdl_prefetch_mb, persistent_mlp=c.persistent_mlp)
    # a quantized checkpoint is used as stored: what it keeps unquantized stays dense
    quantizer = rtn(c.target_quantization if not stored else "none", 128, parts.dtype)
    parts.memory.target = prepare(model, quantizer, lambda name: name.startswith("layers."))
    quantize_head(model, c.vocabulary_quantization, parts.dtype)
    parts.folded_norms = folded_norm.enable(model, c.fold_norms)  # INT4 / FP8 on CUDA: norms in the projections
    parts.memory.target["final_bytes"] = resident_bytes(model)
    parts.load_times.prepare_target_s = round(time.perf_counter() - start, 3)
    return quantizer


def build_proposer(parts: LoadedParts, target_quantizer, mtp_tensors, drafter) -> Proposer:
    c, model, mode = parts.config, parts.model, parts.config.decode_mode
    if mode == "none":
        return Proposer()
    draft_head = build_draft_head(parts)
    if mode == "mtp":
        head = load_mtp_head(model, mtp_tensors, parts.dtype, parts.device)
        parts.memory.mtp = prepare(head, target_quantizer)  # quantized as the target's projections
        return MTPProposer(model, head, c.self_speculative_num_tokens, c.context_length, parts.device, parts.dtype,
                           draft_head, parts.sampler)
    if drafter is not None and not isinstance(drafter, DFlash2Drafter):
        drafter = drafter(model)
    if drafter is None:
        drafter = DFlash2Drafter.from_pretrained(
            c.dflash2_model, target_hidden_size=model.config.hidden_size, target_vocab_size=model.config.vocab_size,
            target_num_layers=model.config.num_hidden_layers, embed=model.embed, lm_head=model.logits,
            device=parts.device, dtype=parts.dtype, block_size=c.dflash2_block_size)
    # norms, convolution controls and the selector stay native: only fc and the layers' projections
    parts.memory.drafter = prepare(drafter, rtn(c.dflash2_quantization, 32, parts.dtype), QUANTIZED_PROJECTIONS.match)
    proposals = drafter.block_size - 1
    check_lookup(c, proposals)
    return DFlash2Proposer(drafter, draft_head, parts.sampler, parts.tree_budget, c.dflash2_tree_scores,
                           c.tree_lookup(proposals) if parts.tree_budget else 0)


def build_draft_head(parts: LoadedParts):
    """The shared head over `draft_vocabulary` for the proposer (layers/draft_head.py; its bytes recorded in
    `memory`), or None: the full head."""
    spec = parts.config.draft_vocabulary
    if not spec:
        return None
    config = parts.model.config
    head = DraftHead.from_model(parts.model, draft_ids(spec, config.vocab_size, config.eos_token_ids), parts.dtype)
    parts.memory.draft_head_bytes = head.nbytes()
    return head


def build_target(parts: LoadedParts):
    proposer = parts.proposer
    if parts.execution == "eager":
        return EagerTarget(parts.model, parts.state, proposer.capture_layers)
    torch.cuda.empty_cache()  # what loading left cached goes back first: the pools are measured alone
    start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
    lengths = (1, 1 + proposer.max_proposals)
    tree = proposer.tree_budget
    target = GraphedTarget(parts.model, parts.state, proposer.capture_layers, lengths=lengths,
                           tree_size=tree + 1 if tree else 0, tree_depth=proposer.max_proposals,
                           sampler=parts.sampler, draft_width=max(proposer.draft_width, 1))
    parts.sampler.capture_graphs(lengths, parts.model.config.vocab_size, proposer.draft_width, target.pool)
    parts.load_times.target_graphs_s = round(time.perf_counter() - start, 3)
    if hasattr(proposer, "capture_graphs"):
        start = time.perf_counter()
        proposer.capture_graphs(target.pool)
        parts.load_times.proposer_graphs_s = round(time.perf_counter() - start, 3)
    parts.memory.graph_pools_bytes = torch.cuda.memory_reserved() - reserved  # captures' pools and warm-ups
    return target
