"""W4A16 weight-only quantization with groups of 128 along the input dimension.

Conventions (those of compressed-tensors' pack-quantized format):
  signed code q in [-8, 7];  w ~= (q - zp) * scale  per group of `group_size` consecutive inputs of one output row;
  symmetric: zp = 0, scale = max|w| / 7.5 (the 15 steps of the signed range over 2 * max|w|), q = clamp(round(w/s));
  asymmetric: min <= 0 <= max forced, scale = (max - min) / 15, zp = round(clamp(-8 - min/scale, -8, 7)),
              q = clamp(round(w/s + zp), -8, 7).
  Rounding is round-half-to-even (torch.round). Every element inside the group's range is within scale/2.

`Int4Linear` keeps the codes in the q16 layout of kernels/quant_matmul.py (unsigned codes u = q + 8, zero points stored
as unsigned z = zp + 8): buffers `qweight` int16 [N, Kp/4], `scales` [Kp/512, N, 4] and `zeros` (same, or None), Kp = K
padded to a multiple of 512. Its forward runs the Triton kernel on CUDA (bf16/fp16 activations) and dequantize + matmul
elsewhere.
`from_compressed_tensors` reads a `pack-quantized` checkpoint module (`weight_packed`, `weight_scale`,
`weight_shape`, optional `weight_zero_point`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BlockspecError
from .linear import DEFAULT_GROUP_SIZE, QuantLinear

BITS = 4
QMIN, QMAX = -8, 7


# ----------------------------------------------------------------------------------------------------------
# Plain PyTorch reference: quantize / dequantize
# ----------------------------------------------------------------------------------------------------------

def _check_group(k: int, group_size: int) -> None:
    if group_size <= 0:
        raise BlockspecError(f"group size must be positive, got {group_size}")
    if k <= 0:
        raise BlockspecError("weight has no input features")


def _round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale in `dtype`, never below the exact value (so |w| <= 7.5 * stored scale still holds)."""
    scale = scale.to(torch.float64)
    s = scale.to(dtype)
    low = s.to(torch.float64) < scale
    if bool(low.any()):
        s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    return s


def quantize(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True,
             scale_dtype: torch.dtype = torch.bfloat16):
    """Round-to-nearest int4 quantization of weight [N, K] in groups along K.

    Returns (q int8 [N, K] in [-8, 7], scale [N, ceil(K/g)] in scale_dtype, zero_point int8 [N, ceil(K/g)] or None).
    A last partial group (K not a multiple of g) is quantized over the columns it has.
    """
    if weight.dim() != 2:
        raise BlockspecError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_group(k, group_size)
    groups = -(-k // group_size)
    w = weight.to(torch.float32)
    kp = groups * group_size
    # pad with copies of the group's first element so min/max only see real values
    wg = F.pad(w, (0, kp - k)).view(n, groups, group_size)
    if kp != k:
        valid = (torch.arange(kp, device=w.device) < k).view(1, groups, group_size)
        first = wg[:, :, :1].expand_as(wg)
        wg = torch.where(valid, wg, first)
    wmin = wg.amin(dim=2).clamp(max=0.0).to(torch.float64)
    wmax = wg.amax(dim=2).clamp(min=0.0).to(torch.float64)
    tiny = torch.finfo(scale_dtype).tiny
    if symmetric:
        scale = torch.maximum(-wmin, wmax) / ((QMAX - QMIN) / 2)
        scale = _round_scale_up(scale.clamp(min=tiny), scale_dtype)
        zp = None
        q = torch.round(wg / scale.to(torch.float32)[:, :, None]).clamp(QMIN, QMAX)
    else:
        scale = _round_scale_up(((wmax - wmin) / (QMAX - QMIN)).clamp(min=tiny), scale_dtype)
        sf = scale.to(torch.float32)
        zp = torch.round((QMIN - wmin.to(torch.float32) / sf).clamp(QMIN, QMAX))
        q = torch.round(wg / sf[:, :, None] + zp[:, :, None]).clamp(QMIN, QMAX)
        zp = zp.to(torch.int8)
    q = q.view(n, kp)[:, :k].to(torch.int8)
    return q, scale, zp


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
               group_size: int = DEFAULT_GROUP_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zp) * scale with per-group scale [N, ceil(K/g)] and zero point (signed, same shape) -> [N, K]."""
    n, k = q.shape
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]
    v = q.to(torch.float32)
    if zero_point is not None:
        v = v - zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]
    return (v * s).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------------------

class Int4Linear(QuantLinear):
    """A QuantLinear with int4 codes (module docstring): signed codes in [-8, 7], symmetric or with zero points."""

    bits = BITS

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                   bias: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """Round-to-nearest quantization of a dense weight [out, in] at load time."""
        if not weight.is_floating_point():
            raise BlockspecError("from_float needs a floating-point weight")
        q, scale, zp = quantize(weight.detach(), group_size, symmetric, scale_dtype)
        return cls.from_quantized(q, scale, zp, group_size, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        return cls.from_float(linear.weight, group_size, symmetric, linear.bias, scale_dtype)


# ----------------------------------------------------------------------------------------------------------
# compressed-tensors `pack-quantized`
# ----------------------------------------------------------------------------------------------------------

def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int) -> torch.Tensor:
    """Unsigned codes from compressed-tensors int32 packing along `dim` (value i of a word at bits [i*b, i*b+b))."""
    if packed.dtype != torch.int32:
        raise BlockspecError(f"packed tensor must be int32, got {packed.dtype}")
    per = 32 // num_bits
    mask = (1 << num_bits) - 1
    p = packed if dim == 1 else packed.t()
    parts = [(p >> (num_bits * i)) & mask for i in range(per)]
    codes = torch.stack(parts, dim=2).reshape(p.shape[0], p.shape[1] * per)
    if codes.shape[1] < size:
        raise BlockspecError(f"packed tensor holds {codes.shape[1]} values along dim {dim}, need {size}")
    codes = codes[:, :size]
    return codes if dim == 1 else codes.t()


def _quant_config(config: dict) -> dict:
    qc = config.get("quantization_config", config) if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        raise BlockspecError("missing quantization_config")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise BlockspecError(f"quant_method {method!r} is not supported (need compressed-tensors)")
    return qc


def _matches(name: str, target: str) -> bool:
    """compressed-tensors target/ignore entry: an exact module name, or "re:<pattern>" matched from the start."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def is_ignored(prefix: str, config: dict) -> bool:
    """True when the checkpoint keeps `prefix` unquantized (its `ignore` list names it)."""
    qc = _quant_config(config)
    return any(_matches(prefix, t) for t in qc.get("ignore", []) or [])


def scheme_for(prefix: str, config: dict, fmt: str = "pack-quantized") -> dict:
    """The config group's `weights` arguments that apply to module `prefix` (a Linear), of format `fmt`."""
    qc = _quant_config(config)
    if is_ignored(prefix, config):
        raise BlockspecError(f"{prefix} is listed in the checkpoint's quantization ignore list")
    best, best_rank = None, -1
    for name, group in (qc.get("config_groups") or {}).items():
        for target in group.get("targets", []) or []:
            if target == "Linear":
                rank = 0
            elif _matches(prefix, target):
                rank = 1
            else:
                continue
            if rank > best_rank:
                best, best_rank = (name, group), rank
    if best is None:
        raise BlockspecError(f"no quantization config group targets {prefix}")
    name, group = best
    return group_weights(name, group, qc, fmt)


def group_format(group: dict, qc: dict) -> str | None:
    return group.get("format") or qc.get("format")


def group_weights(name: str, group: dict, qc: dict, fmt: str = "pack-quantized") -> dict:
    """A config group's `weights` arguments, refusing another format than `fmt`, and activation quantization but
    float-quantized's dynamic one (which runs in the compute dtype, as block-wise FP8's)."""
    got = group_format(group, qc)
    if got != fmt:
        raise BlockspecError(f"compressed-tensors format {got!r} of config group {name} is not supported "
                             f"(need {fmt})")
    activations = group.get("input_activations")
    if activations is not None and not (fmt == "float-quantized" and activations.get("dynamic") is True):
        raise BlockspecError(f"config group {name} quantizes activations"
                             + (" with static scales; blockspec loads dynamic ones (run as W8A16)"
                                if fmt == "float-quantized" else "; only weight-only (W4A16) is supported"))
    w = group.get("weights")
    if not isinstance(w, dict):
        raise BlockspecError(f"config group {name} has no weight quantization arguments")
    return w


def _weight_scheme(w: dict, where: str) -> tuple[str, int, bool]:
    """(strategy, group size, symmetric) of `weights` arguments we can load; refuses anything else."""
    num_bits = int(w.get("num_bits") or 0)
    if w.get("type", "int") != "int" or num_bits != BITS:
        raise BlockspecError(f"{where}: only int{BITS} weights are supported here, got {w.get('type')} {num_bits}-bit")
    if w.get("dynamic", False):
        raise BlockspecError(f"{where}: dynamic weight quantization is not supported")
    strategy = w.get("strategy")
    if strategy == "group":
        group_size = int(w.get("group_size") or 0)
        if group_size != DEFAULT_GROUP_SIZE:
            raise BlockspecError(f"{where}: group size {group_size} is not supported (need {DEFAULT_GROUP_SIZE})")
    elif strategy == "channel":
        group_size = DEFAULT_GROUP_SIZE  # one scale per row: replicate it over groups of 128 (same weight)
    else:
        raise BlockspecError(f"{where}: quantization strategy {strategy!r} is not supported (group or channel)")
    return strategy, group_size, bool(w.get("symmetric", True))


def check_quantization_config(config: dict) -> None:
    """Refuse a compressed-tensors config any of whose groups we cannot load (before reading any tensor)."""
    qc = _quant_config(config)
    groups = qc.get("config_groups") or {}
    if not groups:
        raise BlockspecError("quantization_config has no config_groups")
    for name, group in groups.items():
        _weight_scheme(group_weights(name, group, qc), f"config group {name}")


def from_compressed_tensors(tensors: dict, prefix: str, config: dict) -> Int4Linear:
    """Build an Int4Linear for module `prefix` from a compressed-tensors pack-quantized checkpoint.

    tensors: name -> tensor (at least `<prefix>.weight_packed`, `.weight_scale`, `.weight_shape`, and
    `.weight_zero_point` for asymmetric schemes; `.bias` if present). config: config.json dict (or its
    quantization_config).
    """
    strategy, group_size, symmetric = _weight_scheme(scheme_for(prefix, config), prefix)

    def get(name, required=True):
        t = tensors.get(f"{prefix}.{name}")
        if t is None and required:
            raise BlockspecError(f"checkpoint is missing {prefix}.{name}")
        return t

    packed = get("weight_packed")
    scale = get("weight_scale")
    shape = get("weight_shape")
    shape = [int(v) for v in torch.as_tensor(shape).flatten().tolist()]
    if len(shape) != 2:
        raise BlockspecError(f"{prefix}.weight_shape must hold 2 values, got {shape}")
    n, k = shape
    if packed.dim() != 2 or packed.shape[0] != n or packed.shape[1] != -(-k // 8):
        raise BlockspecError(f"{prefix}.weight_packed has shape {tuple(packed.shape)}, expected ({n}, {-(-k // 8)})")
    groups = -(-k // group_size)
    scale = scale.reshape(n, -1) if scale.dim() == 1 else scale
    if strategy == "channel":
        if tuple(scale.shape) != (n, 1):
            raise BlockspecError(f"{prefix}.weight_scale has shape {tuple(scale.shape)}, expected ({n}, 1)")
        scale = scale.expand(n, groups)
    elif tuple(scale.shape) != (n, groups):
        raise BlockspecError(f"{prefix}.weight_scale has shape {tuple(scale.shape)}, expected ({n}, {groups})")
    g_idx = get("weight_g_idx", required=False)
    if g_idx is not None:
        expect = torch.arange(k, device=g_idx.device) // group_size
        if not torch.equal(g_idx.to(torch.int64).flatten(), expect):
            raise BlockspecError(f"{prefix}: activation-ordered groups (weight_g_idx) are not supported")
    q = unpack_int32(packed, BITS, k, dim=1).to(torch.int32) - 8
    zp = None
    if not symmetric:
        zpp = get("weight_zero_point")
        zcols = 1 if strategy == "channel" else groups
        if zpp.dtype != torch.int32 or zpp.dim() != 2 or tuple(zpp.shape) != (-(-n // 8), zcols):
            raise BlockspecError(f"{prefix}.weight_zero_point has shape {tuple(zpp.shape)} {zpp.dtype}, "
                                 f"expected int32 ({-(-n // 8)}, {zcols})")
        zp = unpack_int32(zpp, BITS, n, dim=0).to(torch.int32) - 8
        if strategy == "channel":
            zp = zp.expand(n, groups)
    bias = tensors.get(f"{prefix}.bias")
    return Int4Linear.from_quantized(q.to(torch.int8), scale, None if zp is None else zp.to(torch.int8),
                                     group_size, bias)


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """The checkpoint reader of a compressed-tensors pack-quantized config (the interface of models/checkpoint.py's
    readers: from_config refuses what cannot load before any tensor is read; holds / read take the tensors)."""
    config: dict

    kind = "int4"
    anchor = ".weight_packed"
    PARTS = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")

    @classmethod
    def from_config(cls, qc: dict) -> "CompressedTensorsScheme":
        check_quantization_config(qc)
        return cls(qc)

    def holds(self, name: str, value: torch.Tensor) -> bool:
        return name.endswith(self.PARTS)

    def read(self, parts: dict, prefix: str) -> Int4Linear:
        return from_compressed_tensors(parts, prefix, self.config)


def from_unsigned(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Linear:
    """An Int4Linear from unsigned codes [N, K] in [0, 15] with per-group scales and unsigned zero points [N, groups]
    (w = (u - z) * s, the GPTQ / AWQ convention); zero points all equal to 8 give the symmetric layout (no zeros)."""
    symmetric = bool((zeros == 1 << (BITS - 1)).all())
    zp = None if symmetric else (zeros.to(torch.int32) - (1 << (BITS - 1))).to(torch.int8)
    return Int4Linear.from_quantized((codes.to(torch.int32) - (1 << (BITS - 1))).to(torch.int8), scales, zp,
                                     group_size)


__all__ = ["Int4Linear", "CompressedTensorsScheme", "quantize", "dequantize", "from_compressed_tensors",
           "from_unsigned", "unpack_int32", "scheme_for",
           "is_ignored", "check_quantization_config"]
