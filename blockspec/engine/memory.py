"""GPU memory: what a configuration needs, estimated from its shapes before anything is allocated, and what the
engine then holds and the process used.

The estimate builds the target, the MTP head, the DFlash2 drafter and the decode state on the meta device (no
memory) and sizes each projection in the layout it will have: dense in the compute dtype, or the int4 / int8 / FP8
layout's own buffers (quantized checkpoints keep their projections as stored; the rest is quantized at load as
configured). Loading passes through heavier moments than decoding: the target is read with its head dense (and its
layers dense, unless quantized at load: then each projection is quantized as it is read, one dense projection and
the quantizer's working copies of one block of it beside the projections already built), a quantized checkpoint's
stored parts come to the GPU one projection at a time beside the projections already built, the head is quantized
after the target is read (the dense head, its blocks and their concatenation at once), and the drafter is read dense
before its own quantization. What the check compares with the free memory is the larger of that loading peak and the
resident total (weights, caches, drafter context, a prefill chunk's activations, CUDA graph pools, library
workspace).

Measured figures come from PyTorch's caching allocator (peak allocated / reserved) and the driver
(`torch.cuda.mem_get_info`: the GPU memory held, by this process and any other); on the CPU they are None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import PredictConfig, TargetConfig
from ..drafter.config import DrafterConfig
from ..drafter.model import QUANTIZED_PROJECTIONS, DFlash2Drafter
from ..errors import BlockspecError
from ..layers.attention import KVCache
from ..layers.draft_head import draft_ids
from ..models.checkpoint import FLOAT32_SUFFIXES, checkpoint_quantization
from ..models.mtp import MTPHead
from ..models.qwen3_5 import TargetModel
from ..quant.fp8 import Fp8Linear
from ..quant.int4 import Int4Linear
from ..quant.int8 import Int8Linear
from .state import DecodeState
from .weights import QUANTIZE_BLOCK_ELEMENTS

GB = 1e9
# captured passes, per row of the longest (256 MB at 16 rows): their activations and float32 logits, the sampler's
# copies of those, commits
GRAPH_POOL_ROW_BYTES = 16 * 2 ** 20
LIBRARY_BYTES = 512 * 2 ** 20      # cuBLAS workspace, Triton kernels' modules, allocator rounding
# the RTN quantizers' float32 working copies of one block of weights (engine/weights.py by_row_blocks): 16.5 bytes a
# weight measured on the CPU (int4; int8 15, FP8 12)
QUANTIZE_WORKSPACE_BYTES = 17 * QUANTIZE_BLOCK_ELEMENTS


@dataclass
class Layout:
    """How a projection is stored: "dense" (the compute dtype), "int4" / "int8" (groups of `group_size`, with zero
    points unless `symmetric`) or "fp8" (e4m3 values, a scale per output and 128 inputs)."""
    kind: str = "dense"
    group_size: int = 128
    symmetric: bool = True


def linear_bytes(linear: nn.Linear, layout: Layout, dtype: torch.dtype) -> int:
    out_features, in_features = linear.out_features, linear.in_features
    if layout.kind in ("int4", "int8", "fp8"):
        scale_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
        if layout.kind == "fp8":
            module = Fp8Linear(in_features, out_features, device="meta")
        else:
            cls = Int4Linear if layout.kind == "int4" else Int8Linear
            module = cls(in_features, out_features, layout.group_size, layout.symmetric, linear.bias is not None,
                         scale_dtype=scale_dtype, device="meta")
        return sum(b.numel() * b.element_size() for b in module.buffers())
    return (out_features * in_features + (out_features if linear.bias is not None else 0)) * dtype.itemsize


def module_bytes(root: nn.Module, dtype: torch.dtype, layout_of=lambda name: Layout(),
                 skip=lambda name: False) -> int:
    """Bytes of a meta module's weights once loaded: each nn.Linear in layout_of(its name), other parameters in
    `dtype` (float32 for the small ones loading keeps exact); names `skip` accepts are left out."""
    total, linear_weights = 0, set()
    for name, module in root.named_modules():
        if type(module) is nn.Linear and not skip(name):
            total += linear_bytes(module, layout_of(name), dtype)
            linear_weights.update({f"{name}.weight", f"{name}.bias"})
    for name, p in root.named_parameters():
        if name not in linear_weights and not skip(name.rsplit(".", 1)[0]):
            total += p.numel() * (4 if name.endswith(FLOAT32_SUFFIXES) else dtype.itemsize)
    return total


def tensor_bytes(*holders) -> int:
    """Bytes of the distinct tensors held as attributes of `holders` (objects, or lists of them), e.g. caches;
    prefix reuse's snapshot buffers (`saved_*`) are counted apart, as prefix_snapshots."""
    seen, total = set(), 0
    objects = [o for h in holders for o in (h if isinstance(h, (list, tuple)) else [h])]
    for obj in objects:
        for name, t in vars(obj).items():
            if isinstance(t, torch.Tensor) and id(t) not in seen and not name.startswith("saved_"):
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def cache_bytes(state: DecodeState, proposer, snapshot_bytes: int = 0) -> dict:
    """What the engine holds per request besides its weights: the decode state (KV caches of the attention layers,
    DeltaNet states and their pending-pass buffers), the MTP head's KV caches, the drafter's context window, the
    prefix-reuse snapshots."""
    parts = {"decode_state": tensor_bytes(state.layers)}
    if snapshot_bytes:
        parts["prefix_snapshots"] = snapshot_bytes
    if getattr(proposer, "caches", None):
        parts["mtp_cache"] = tensor_bytes(proposer.caches)
    drafter = getattr(proposer, "drafter", None)
    if drafter is not None:
        parts["drafter_context"] = tensor_bytes(drafter.context)
    return parts


@dataclass
class MemoryEstimate:
    resident: dict[str, int]          # part -> bytes while decoding
    loading: dict[str, int] = field(default_factory=dict)  # moment of loading -> bytes then

    @property
    def needed(self) -> int:
        return max([sum(self.resident.values()), *self.loading.values()])

    def as_dict(self) -> dict:
        return {"needed_bytes": self.needed, "resident_bytes": sum(self.resident.values()),
                "resident": dict(self.resident), "loading": dict(self.loading)}


def estimate(target: TargetConfig, config: PredictConfig, *, execution: str, max_partial: int,
             stored: Layout | None = None, drafter: DrafterConfig | None = None) -> MemoryEstimate:
    """The memory `config` needs with the target `target` (stored: the layout of a quantized checkpoint's
    projections, None for a dense one) and, for mode dflash2, the drafter `drafter`; max_partial: the rows of its
    longest pass (load.pass_rows)."""
    dtype, mode = config.torch_dtype, config.decode_mode
    snapshots = config.prefix_snapshots if config.prefix_reuse else 0  # prefix reuse's (engine/reuse.py)
    at_load = Layout(config.target_quantization, 128) if config.target_quantization != "none" else Layout()
    layers = stored or at_load
    head = Layout(config.vocabulary_quantization, 128) if config.vocabulary_quantization != "none" else Layout()
    with torch.device("meta"):
        model = TargetModel(target)

    def not_layers(name):  # the embedding table and the head are sized on their own
        return name.split(".")[0] not in ("layers", "norm")
    r = {"target_layers": module_bytes(model, dtype, lambda name: layers, not_layers),
         "embedding": model.embed_tokens.weight.numel() * dtype.itemsize}
    head_linear = model.lm_head if model.lm_head is not None else nn.Linear(target.hidden_size, target.vocab_size,
                                                                            bias=False, device="meta")
    if model.lm_head is not None or head.kind != "dense":  # tied and dense: the embedding table is the head
        r["head"] = linear_bytes(head_linear, head, dtype)
    dense = {"target_layers": module_bytes(model, dtype, skip=not_layers),
             "head": r.get("head", 0) and linear_bytes(head_linear, Layout(), dtype)}
    if mode == "mtp":
        with torch.device("meta"):
            mtp = MTPHead(target)
        r["mtp_head"] = module_bytes(mtp, dtype, lambda name: layers)
        r["prefix_snapshots"] = snapshots * target.hidden_size * dtype.itemsize  # the hidden row each keeps
        dense["mtp_head"] = module_bytes(mtp, dtype)
    drafter_dense = 0
    if mode == "dflash2" and drafter is not None:
        model_drafter = DFlash2Drafter(drafter, embed=None, lm_head=None, device="meta", dtype=dtype)
        quantized = Layout("int8", 32) if config.dflash2_quantization == "int8" else Layout()
        r["drafter"] = module_bytes(model_drafter, dtype,
                                    lambda name: quantized if QUANTIZED_PROJECTIONS.match(name) else Layout())
        drafter_dense = module_bytes(model_drafter, dtype)
        r["drafter_context"] = tensor_bytes(model_drafter.context)
        r["prefix_snapshots"] = model_drafter.context.allocate_snapshots(snapshots)
    if config.draft_vocabulary and mode != "none":
        rows = draft_ids(config.draft_vocabulary, target.vocab_size, target.eos_token_ids).numel()
        r["draft_head"] = rows * target.hidden_size * dtype.itemsize
    state = DecodeState(model, config.context_length, max_partial, "meta", dtype, in_place=mode == "none",
                        snapshots=snapshots)
    r["kv_cache"] = tensor_bytes([s for s in state.layers if isinstance(s, KVCache)])
    r["deltanet_state"] = tensor_bytes(state.gdn)
    if snapshots:  # copies of the DeltaNet states and of the drafter's context ring
        r["prefix_snapshots"] = r.get("prefix_snapshots", 0) + state.snapshot_bytes
    if mode == "mtp":
        r["mtp_cache"] = 2 * max(target.mtp_num_hidden_layers, 1) * config.context_length * \
            target.num_key_value_heads * target.head_dim * dtype.itemsize
    r["prefill_activations"] = prefill_bytes(target, min(config.prefill_chunk_size, config.context_length), dtype)
    if execution == "cuda-graphs":
        r["graph_pools"] = GRAPH_POOL_ROW_BYTES * max_partial
    r["libraries"] = LIBRARY_BYTES
    projections = [m for name, m in model.named_modules() if type(m) is nn.Linear and not not_layers(name)]
    if stored is not None:  # the stored parts of one projection beside the built ones (models/checkpoint.py)
        dense["largest_stored_projection"] = max(linear_bytes(m, stored, dtype) for m in projections)
    elif layers.kind != "dense":  # quantized as read: one dense projection beside the quantized ones
        dense["largest_projection"] = max(linear_bytes(m, Layout(), dtype) for m in projections)
    if drafter_dense and config.dflash2_quantization != "none":  # and one block of it being quantized
        drafter_dense += QUANTIZE_WORKSPACE_BYTES
    return MemoryEstimate(r, loading_peaks(r, dense, drafter_dense, stored, head.kind != "dense"))


def loading_peaks(resident: dict, dense: dict, drafter_dense: int, stored: Layout | None,
                  head_quantized: bool) -> dict:
    """The heavier moments of loading (module docstring), each with what is held then."""
    weights = resident["embedding"] + resident["libraries"]
    if stored is not None:  # the built projections and one projection's stored parts (read to the host first)
        target = weights + resident["target_layers"] + dense["largest_stored_projection"] + dense["head"] + \
            resident.get("mtp_head", 0)
    elif "largest_projection" in dense:  # the quantized projections, one dense projection being quantized
        target = weights + resident["target_layers"] + dense["largest_projection"] + QUANTIZE_WORKSPACE_BYTES + \
            dense["head"] + dense.get("mtp_head", 0)
    else:
        target = weights + dense["target_layers"] + dense["head"] + dense.get("mtp_head", 0)
    loading = {"target_read": target}
    if head_quantized:  # the dense head, its quantized blocks and their concatenation
        loading["head_quantization"] = weights + resident["target_layers"] + dense["head"] + 2 * resident["head"] + \
            QUANTIZE_WORKSPACE_BYTES
    if drafter_dense:
        loading["drafter_read"] = sum(resident[k] for k in ("embedding", "target_layers", "head", "libraries")
                                      if k in resident) + drafter_dense
    return loading


def prefill_bytes(target: TargetConfig, chunk: int, dtype: torch.dtype) -> int:
    """Activations of one prefill chunk (an upper bound of the widest layer's live tensors): the residual stream
    and norms, the packed input projection's output and its convolution, the MLP's gate/up and product."""
    c = target
    deltanet = 2 * (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads *
                    c.linear_value_head_dim) + c.linear_num_value_heads * (c.linear_value_head_dim + 2)
    attention = 2 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim
    width = 4 * c.hidden_size + max(deltanet, attention, 3 * c.intermediate_size)
    return chunk * width * max(dtype.itemsize, 4) + c.vocab_size * 4


def checkpoint_estimate(config: PredictConfig, *, execution: str, max_partial: int) -> MemoryEstimate:
    """estimate() for config.model (and config.dflash2_model) from their config.json files, no tensor read."""
    directory = Path(config.model)
    target = TargetConfig.from_file(directory / "config.json")
    scheme = checkpoint_quantization(directory / "config.json")
    stored = None
    if scheme is not None:
        stored = Layout(scheme.kind, getattr(scheme, "group_size", 128) if scheme.kind == "int4" else 128,
                        symmetric=False)  # zero points counted: an upper bound over the int4 formats
    drafter = None
    if config.decode_mode == "dflash2" and config.dflash2_model:
        path = Path(config.dflash2_model) / "config.json"
        drafter = DrafterConfig.from_file(path).run_at(config.dflash2_block_size, str(path))
    return estimate(target, config, execution=execution, max_partial=max_partial, stored=stored, drafter=drafter)


def free_and_total(device: torch.device) -> tuple[int, int]:
    return torch.cuda.mem_get_info(device)


BIGGEST_PARTS = 3
# what the decode state and the proposers hold per request, sized by context_length (MemoryEstimate.resident keys)
CACHE_PARTS = ("kv_cache", "deltanet_state", "mtp_cache", "drafter_context", "prefix_snapshots")


def available_host_bytes() -> int | None:
    """The memory the host can still give without swapping: MemAvailable of /proc/meminfo, else the free physical
    pages; None where neither is known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_host(needed: MemoryEstimate, config: PredictConfig) -> None:
    """Refuse, in one line, a CPU run whose caches and states alone exceed the host's available memory (allocating
    them would fail, or swap, after the weights are read)."""
    available = available_host_bytes()
    caches = sum(needed.resident.get(part, 0) for part in CACHE_PARTS)
    if available is None or caches <= available:
        return
    raise BlockspecError(f"estimated memory for the caches and states at context_length {config.context_length}: "
                         f"{caches / GB:.1f} GB, but only {available / GB:.1f} GB of the host's memory is available: "
                         "lower context_length")


def check_fits(needed: MemoryEstimate, config: PredictConfig, device: torch.device) -> None:
    """Refuse, in one line, a configuration whose estimate exceeds the GPU's free memory."""
    free, _ = free_and_total(device)
    if needed.needed <= free:
        return
    if max(needed.loading.values(), default=0) > sum(needed.resident.values()):
        moment = max(needed.loading, key=needed.loading.get)
        what = (f"{moment.replace('_', ' ')} at load; {sum(needed.resident.values()) / GB:.1f} GB resident after")
    else:
        biggest = sorted(needed.resident.items(), key=lambda kv: -kv[1])[:BIGGEST_PARTS]
        what = ", ".join(f"{name.replace('_', ' ')} {n / GB:.1f} GB" for name, n in biggest)
    raise BlockspecError(f"estimated GPU memory needed {needed.needed / GB:.1f} GB ({what}), but only "
                         f"{free / GB:.1f} GB of {device} is free: {remedies(needed, config)}")


def remedies(needed: MemoryEstimate, config: PredictConfig) -> str:
    """What to lower, biggest first among the parts the settings control."""
    hints = []
    r = needed.resident
    if r.get("kv_cache", 0) + r.get("mtp_cache", 0) > 0.1 * needed.needed:
        hints.append(f"lower context_length ({config.context_length})")
    if config.target_quantization == "none" and "target_quantization" not in config.model_fields_set:
        hints.append("set target_quantization int4 or fp8")
    if config.vocabulary_quantization == "none":
        hints.append("set vocabulary_quantization int8")
    if "drafter" in r and config.dflash2_quantization == "none":
        hints.append("set dflash2_quantization int8")
    if r.get("draft_head", 0) > 0.05 * needed.needed:
        hints.append(f"lower draft_vocabulary ({config.draft_vocabulary})")
    return "; ".join(hints) or "free memory on the GPU (other processes) or use a larger one"


def use_expandable_segments(device: torch.device) -> None:
    """PyTorch's allocator maps memory into segments that grow and shrink instead of caching fixed-size ones, unless
    PYTORCH_CUDA_ALLOC_CONF configures it otherwise. Why: loading quantizes projection by projection, and the fixed
    segments its temporaries leave behind stay reserved: on the H200 the 27B INT4 target + int8 head + int8 DFlash2
    drafter at 32k held 36.6 GB of the GPU with fixed segments and 29.5-29.7 GB with these (25.0-26.3 GB allocated), at
    the same decoding speed. Called before the first allocation; affects segments created afterwards."""
    if device.type == "cuda" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # the accelerator-wide setter where this torch has it (torch.cuda's is deprecated for it)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> dict:
    """The peak GPU memory so far (since reset_peak): PyTorch's allocated and reserved bytes, and the bytes of the
    GPU held now (total - free: the allocator keeps what it reserved, so after the work this is its peak, plus the
    CUDA context and any other process). None on the CPU."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "gpu_held_bytes": None}
    free, total = free_and_total(device)
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device), "gpu_held_bytes": total - free}


@dataclass
class MemoryReport:
    """What an engine's loading measured of its memory, in bytes; None where it does not apply. The fields are in the
    order loading records them, which as_dict (the bench's JSON) keeps."""
    target: dict | None = None            # weights.prepare's record: loaded, packed, final bytes (mtp, drafter too)
    draft_head_bytes: int | None = None   # the shared head over a draft vocabulary (built before the proposer)
    mtp: dict | None = None
    drafter: dict | None = None
    prefix_snapshots: dict | None = None  # {"count", "bytes"} of the prefix cache's snapshots
    caches: dict | None = None            # bytes of each cache (cache_bytes)
    graph_pools_bytes: int | None = None  # the CUDA graphs' pools and warm-ups
    loading_peak: dict | None = None      # peak() at the end of loading
    estimate: dict | None = None          # MemoryEstimate.as_dict(); last: the bench sets it after loading

    def held_bytes(self) -> int:
        """The weights and caches held while decoding."""
        models = (m["final_bytes"] for m in (self.target, self.mtp, self.drafter) if m is not None)
        return sum(models) + (self.draft_head_bytes or 0) + sum((self.caches or {}).values())

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


def report(engine) -> dict:
    """engine.memory (weights per model, caches, graph pools, the estimate) with the peak so far and, on CUDA, the
    workspace: peak allocated bytes beyond the weights and caches (activations, sampling, scratch)."""
    out = {**engine.memory.as_dict(), **peak(engine.device)}
    if out["peak_allocated_bytes"] is not None:
        out["workspace_peak_bytes"] = out["peak_allocated_bytes"] - engine.memory.held_bytes()
    return out
