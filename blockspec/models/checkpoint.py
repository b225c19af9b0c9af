"""Load a Hugging Face Qwen3.5 checkpoint directory straight into a TargetModel (no conversion step).

Accepts the text-only layout (`model.layers...`) and the multimodal one (`model.language_model.layers...`,
vision tower skipped), one `*.safetensors` file or several with `model.safetensors.index.json`.
`mtp.*` tensors are returned on the side for the native MTP head. A dense checkpoint's decoder-layer projections can
be quantized as they are read (`quantize`), so the dense model never exists whole on the device.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from ..config import SamplingSettings, TargetConfig
from ..errors import BlockspecError
from ..files import read_json
from ..layers.linear import pack_projections
from .progress import ShardProgress
from ..quant.awq import AWQScheme
from ..quant.fp8 import CompressedTensorsFp8Scheme, FP8Scheme
from ..quant.gptq import GPTQScheme
from ..quant.int4 import CompressedTensorsScheme, group_format
from .mtp import MTPHead
from .qwen3_5 import TargetModel

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
HEADER_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool, "U8": torch.uint8,
                 "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32,
                 "I64": torch.int64, "U64": torch.uint64}  # a safetensors header's dtype names
FLOAT32_SUFFIXES = ("A_log", "dt_bias", "norm.weight", "layernorm.weight")  # small; kept exact in float32


def compressed_tensors_reader(qc: dict):
    """float-quantized FP8 when every config group is, else pack-quantized int4 (which refuses other formats)."""
    groups = list((qc.get("config_groups") or {}).values())
    fp8 = bool(groups) and all(isinstance(g, dict) and group_format(g, qc) == CompressedTensorsFp8Scheme.FORMAT
                               for g in groups)
    return (CompressedTensorsFp8Scheme if fp8 else CompressedTensorsScheme).from_config(qc)


# the readers of quantized checkpoints, by quantization_config.quant_method (each: refuses what it cannot load before
# any tensor is read; its reader's holds(name, tensor) picks a projection's parts, read(parts, prefix) builds it)
READERS = {"compressed-tensors": compressed_tensors_reader, "gptq": GPTQScheme.from_config,
           "awq": AWQScheme.from_config, "fp8": FP8Scheme.from_config}
# names of quantized tensors of every format: refused in a checkpoint that declares no quantization_config
QUANTIZED_SUFFIXES = CompressedTensorsScheme.PARTS + (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale_inv")


GENERATION_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")  # what vLLM takes from generation_config.json


def generation_defaults(directory: str | Path) -> dict:
    """The sampling values of the checkpoint's generation_config.json that blockspec applies ({} without the file);
    a value out of range is left out, said in one line on stderr. Like vLLM, `do_sample` is not read."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = read_json(path)
    except BlockspecError as exc:
        print(f"blockspec: note: {exc}; its sampling values are not used", file=sys.stderr)
        return {}
    if not isinstance(raw, dict):
        print(f"blockspec: note: {path} holds a JSON {type(raw).__name__}, not an object; its sampling values are not "
              "used", file=sys.stderr)
        return {}
    values = {}
    for key in GENERATION_SAMPLING_KEYS:
        if raw.get(key) is not None:
            try:
                SamplingSettings.build({key: raw[key]}, source=str(path))
                values[key] = raw[key]
            except BlockspecError as exc:
                print(f"blockspec: note: {exc}; left out", file=sys.stderr)
    return values


def check_folder(flag: str, path: str | Path) -> Path:
    """An input folder (a checkpoint): a missing path, a file, or a folder that cannot be listed, refused in one line
    naming the flag."""
    path = Path(path)
    if not path.exists():
        raise BlockspecError(f"{flag} {path}: no such folder")
    if not path.is_dir():
        raise BlockspecError(f"{flag} {path}: is a file, not a folder (give the checkpoint's folder)")
    try:
        os.listdir(path)
    except OSError as exc:
        raise BlockspecError(f"{flag} {path}: cannot be read ({exc.strerror})") from None
    return path


def checkpoint_files(directory: Path) -> list[Path]:
    directory = check_folder("model", directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        raw = read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) and n for n in weight_map.values()):
            raise BlockspecError(f"{index}: corrupt index ('weight_map' must map tensor names to file names)")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise BlockspecError(f"{index} lists {missing[0]}, which is missing from {directory}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise BlockspecError(f"{directory}: no *.safetensors weights found")
    # without an index every file is read: a stray copy of a shard would load its tensors twice
    first = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except Exception as exc:
            raise unreadable(path, exc) from None
        for name in names:
            if name in first:
                raise BlockspecError(f"{directory}: tensor {name} is stored twice, in {first[name].name} and "
                                     f"{path.name} (remove the extra file, or add model.safetensors.index.json)")
            first[name] = path
    return files


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_dtype(directory: Path) -> torch.dtype:
    """The dtype the checkpoint stores its embedding table in (bfloat16 when it cannot tell): what weights trained
    for it are written in."""
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as f:
            name = next((n for n in f.keys() if n.endswith("embed_tokens.weight")), None)
            if name is not None:
                return SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype(), torch.bfloat16)
    return torch.bfloat16


def read_tensors(files: list[Path], device: str | torch.device = "cpu", wanted: Callable[[str], bool] | None = None):
    """Yield (name, tensor) from every file (only the names `wanted` takes: the others are never read), refusing
    unreadable files with their name."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if wanted is None or wanted(name):
                        yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise unreadable(path, exc) from None


def last_file_of_modules(files: list[Path]) -> dict[str, int]:
    """Module prefix (a tensor name without its last part) -> index of the last file holding one of its tensors,
    from the files' headers alone."""
    last = {}
    for i, path in enumerate(files):
        try:
            with safe_open(str(path), framework="pt") as f:
                last.update((name.rsplit(".", 1)[0], i) for name in f.keys())
        except Exception as exc:
            raise unreadable(path, exc) from None
    return last


def unreadable(path: Path, exc: Exception) -> BlockspecError:
    if isinstance(exc, BlockspecError):
        return exc
    try:  # safetensors reports a file it may not open as missing: the operating system's reason is the true one
        with open(path, "rb"):
            pass
    except OSError as err:
        return BlockspecError(f"{path}: cannot be read ({err.strerror})")
    return BlockspecError(f"{path}: corrupt or unreadable safetensors file ({str(exc).splitlines()[0]})")


def text_name(name: str) -> str | None:
    """Map a checkpoint tensor name to TargetModel's parameter name; None for tensors blockspec does not use."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith("mtp.") or name == "lm_head.weight":
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def checkpoint_quantization(config_path: Path):
    """The reader of the checkpoint's quantization_config (READERS; the config checked), or None for a dense
    checkpoint."""
    raw = json.loads(config_path.read_text())  # TargetConfig.from_file has already checked it parses
    text = raw.get("text_config")
    qc = raw.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise BlockspecError(f"{config_path}: config key 'quantization_config' must be an object (got {qc!r})")
    method = qc.get("quant_method")
    if method not in READERS:
        raise BlockspecError(f"{config_path}: quantization_config.quant_method {method!r} is not supported (blockspec "
                             "loads dense checkpoints, compressed-tensors pack-quantized int4 and float-quantized "
                             "FP8, GPTQ and AWQ int4, and block-wise FP8 ones)")
    try:
        return READERS[method](qc)
    except BlockspecError as exc:
        raise BlockspecError(f"{config_path}: {exc}") from None


def not_mtp(name: str) -> bool:
    """Whether checkpoint tensor `name` is outside the MTP head."""
    return not name.startswith("mtp.")


def module_key(prefix: str) -> str | None:
    """TargetModel / MTP module name of checkpoint module `prefix` (None for modules blockspec does not use)."""
    key = text_name(prefix + ".weight")
    return None if key is None else key[:-len(".weight")]


def is_quantized_part(name: str, tensor: torch.Tensor, scheme) -> bool:
    """Whether a tensor belongs to a quantized projection: one the checkpoint's reader takes, or, without
    quantization_config, one that looks quantized (refused by quantized_linears)."""
    if scheme is not None:
        return scheme.holds(name, tensor)
    return name.endswith(QUANTIZED_SUFFIXES) or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantized_linears(parts: dict, sources: dict, scheme, device="cpu") -> dict[str, torch.nn.Module]:
    """Quantized projections built by the checkpoint's reader from their parts (`parts`: checkpoint name -> tensor
    for every name is_quantized_part picks; `sources`: name -> file), keyed by module_key, on `device`. The parts
    come to the device one projection at a time (and leave `parts`): the device never holds the stored parts of
    more than one projection beside the built ones."""
    by_module: dict[str, list[str]] = {}
    for name in parts:
        by_module.setdefault(name.rsplit(".", 1)[0], []).append(name)
    modules = {}
    for prefix, names in by_module.items():
        if scheme is None:
            raise BlockspecError(f"{sources[names[0]]}: tensor {names[0]} holds quantized weights, but config.json "
                                 "declares no quantization_config")
        anchor = prefix + scheme.anchor
        if anchor not in parts:
            raise BlockspecError(f"{sources[names[0]]}: tensor {names[0]} has no quantized {anchor} beside it")
        try:
            modules[module_key(prefix)] = scheme.read({n: parts.pop(n).to(device) for n in names}, prefix)
        except BlockspecError as exc:
            raise BlockspecError(f"{sources[anchor]}: {exc}") from None
    return modules


def swap_in(root: torch.nn.Module, name: str, module: torch.nn.Module, where: str) -> None:
    """Put a ready (quantized) projection in place of root's meta nn.Linear `name`, checking its shape."""
    try:
        old = root.get_submodule(name)
    except AttributeError:
        old = None
    if type(old) is not torch.nn.Linear:
        raise BlockspecError(f"{where}: unexpected quantized projection {name} (not a projection of this model)")
    got, want = (module.out_features, module.in_features), (old.out_features, old.in_features)
    if got != want:
        raise BlockspecError(f"{where}: quantized projection {name} has shape {got}, expected {want}")
    root.set_submodule(name, module)


def load_target(directory: str | Path, device="cpu", dtype=torch.float32, progress: bool = False,
                quantize: Callable[[nn.Linear], nn.Module] | None = None, mtp_head: bool = True):
    """Returns (model, mtp), the model's projections packed (layers/linear.py): mtp maps `mtp.*` tensor names to
    tensors and, for a quantized checkpoint, the names of quantized MTP projections to their modules.
    `model.checkpoint_quantization` is "int4" for a compressed-tensors, GPTQ or AWQ checkpoint, "fp8" for a
    block-wise FP8 one (the projections stored unquantized stay dense), else None. progress: a bar over the shards
    on stderr for a large checkpoint (progress.py).
    quantize (engine/weights.py `rtn`): each projection of the decoder layers of a dense checkpoint is replaced by
    quantize(its nn.Linear) as soon as its tensor is read, so the device holds one dense projection at a time beside
    the quantized ones (packing then concatenates them; FP8 blocks stay each projection's own, as an FP8 checkpoint
    stores them). A quantized checkpoint ignores it: its projections are used as stored, each built on `device` once
    the last file holding its parts is read (the host holds one file's stored parts at most).
    mtp_head False: the MTP head's tensors are not even read (mtp comes back empty)."""
    directory = Path(directory)
    config = TargetConfig.from_file(directory / "config.json")
    scheme = checkpoint_quantization(directory / "config.json")
    files = checkpoint_files(directory)
    with torch.device("meta"):
        model = TargetModel(config)
    expected = dict(model.named_parameters())
    # quantized as they are read (Qwen3.5's have no bias: one with a bias would load dense, quantized after loading)
    quantized_at_load = set() if quantize is None or scheme is not None else {
        f"{name}.weight" for name, m in model.named_modules()
        if name.startswith("layers.") and type(m) is nn.Linear and m.bias is None}
    loaded, mtp, parts, sources = {}, {}, {}, {}
    # a quantized projection is built once the last file holding one of its parts is read: the host holds at most
    # a file's worth of stored parts (not the whole checkpoint: 30 GB for an FP8 27B)
    last_file = last_file_of_modules(files) if scheme is not None else {}
    with ShardProgress(files, progress) as shown:
        for index, path in enumerate(files):
            # on the host: each goes to the device when it is built
            for name, tensor in read_tensors([path], wanted=None if mtp_head else not_mtp):
                shown.tensor_read(tensor.numel() * tensor.element_size())
                if is_quantized_part(name, tensor, scheme):
                    if module_key(name.rsplit(".", 1)[0]) is not None:
                        parts[name], sources[name] = tensor, path
                    continue
                key = text_name(name)
                if key is None:
                    continue
                if key.startswith("mtp."):
                    mtp[key] = tensor
                    continue
                if key not in expected and key == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                check_dense_tensor(directory, path, name, tensor.dtype, tuple(tensor.shape), expected, config)
                if key in quantized_at_load:
                    swap_in(model, key[:-len(".weight")], quantize(dense_linear(tensor, device, dtype)), str(path))
                    continue
                keep_fp32 = key.endswith(FLOAT32_SUFFIXES)
                loaded[key] = torch.nn.Parameter(tensor.to(device=device,
                                                           dtype=torch.float32 if keep_fp32 else dtype),
                                                 requires_grad=False)
            shown.shard_read(path)
            complete = [n for n in parts if last_file.get(n.rsplit(".", 1)[0]) == index]
            for key, module in quantized_linears({n: parts.pop(n) for n in complete}, sources, scheme,
                                                 device).items():
                if key.startswith("mtp."):
                    mtp[key] = module
                else:
                    swap_in(model, key, module, str(directory))
    if parts:  # quantized-looking tensors of a checkpoint without a quantization_config: refused
        quantized_linears(parts, sources, scheme, device)
    expected = dict(model.named_parameters())  # quantized projections hold buffers, not parameters
    extra = [k for k in loaded if k not in expected]
    if extra:
        raise BlockspecError(f"{directory}: tensor {extra[0]} belongs to a projection stored quantized")
    check_complete(directory, expected, loaded)
    model.load_state_dict(loaded, assign=True, strict=False)  # the quantized projections were swapped in whole
    model.checkpoint_quantization = None if scheme is None else scheme.kind
    pack_projections(model)
    model.requires_grad_(False).eval()
    return model, mtp


def check_dense_tensor(directory: Path, path: Path, name: str, dtype: torch.dtype, shape: tuple, expected: dict,
                       config: TargetConfig) -> None:
    """Refuse stored dense tensor `name` (TargetModel key in `expected`, name -> parameter) unless the model has it,
    in a float type and its shape."""
    key = text_name(name)
    if key not in expected:
        raise BlockspecError(f"{directory}: unexpected tensor {name} (not part of a {config_label(config)})")
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise BlockspecError(f"{path}: tensor {name} is {dtype}, which config.json's quantization_config does not "
                             "describe (dense weights are float16, bfloat16 or float32)")
    want = tuple(expected[key].shape)
    if shape != want:
        raise BlockspecError(f"{directory}: tensor {name} has shape {shape}, expected {want}")


def check_complete(directory: Path, expected: dict, stored) -> None:
    """Refuse a checkpoint that lacks one of the model's parameters (`expected`: name -> parameter)."""
    missing = [k for k in expected if k not in stored]
    if missing:
        stored_name = missing[0] if missing[0].startswith("lm_head") else "model." + missing[0]  # text layout
        raise BlockspecError(f"{directory}: missing tensor {stored_name} (shape {tuple(expected[missing[0]].shape)})"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def check_dense_checkpoint(directory: str | Path) -> None:
    """A dense checkpoint's tensors against config.json's model from the files' headers alone (nothing read): what
    load_target refuses as it loads, refused before a loader that would not (transformers' fills a missing tensor
    with random values and raises with a page of report on a wrong shape). Quantized checkpoints: not checked."""
    directory = Path(directory)
    config = TargetConfig.from_file(directory / "config.json")
    if checkpoint_quantization(directory / "config.json") is not None:
        return
    with torch.device("meta"):
        expected = dict(TargetModel(config).named_parameters())
    stored = set()
    for path in checkpoint_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                headers = [(name, f.get_slice(name)) for name in f.keys()]
                headers = [(name, part.get_dtype(), tuple(part.get_shape())) for name, part in headers]
        except Exception as exc:  # safetensors raises its own error types
            raise unreadable(path, exc) from None
        for name, dtype, shape in headers:
            key = text_name(name)
            if key is None or key.startswith("mtp.") or (
                    key == "lm_head.weight" and key not in expected and config.tie_word_embeddings):
                continue
            stored_dtype = HEADER_DTYPES.get(dtype, torch.uint8)  # a type unknown here: refused as not a float
            check_dense_tensor(directory, path, name, stored_dtype, shape, expected, config)
            stored.add(key)
    check_complete(directory, expected, stored)


def dense_linear(weight: torch.Tensor, device, dtype) -> nn.Linear:
    """An nn.Linear holding `weight` on `device` in `dtype`."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    return linear


def config_label(config: TargetConfig) -> str:
    return f"{config.num_hidden_layers}-layer Qwen3.5 model of hidden size {config.hidden_size}"


def load_mtp_head(model: TargetModel, tensors: dict, dtype, device) -> MTPHead:
    """The native MTP head from the `mtp.*` tensors load_target returned, its projections packed."""
    if not tensors:
        raise BlockspecError("mode mtp needs the checkpoint's native MTP head, but it has no mtp.* tensors "
                             "(use --mode none, or a DFlash2 drafter with --mode dflash2)")
    with torch.device("meta"):
        head = MTPHead(model.config)
    for name, module in tensors.items():
        if isinstance(module, torch.nn.Module):  # a projection stored quantized
            swap_in(head, name[len("mtp."):], module, "MTP head")
    expected = {"mtp." + k: p for k, p in head.named_parameters()}
    loaded = {}
    for name, param in expected.items():
        if name not in tensors:
            raise BlockspecError(f"MTP head: missing tensor {name} (shape {tuple(param.shape)})")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise BlockspecError(f"MTP head: tensor {name} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
        keep_fp32 = name.endswith("norm.weight")
        loaded[name[4:]] = torch.nn.Parameter(t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype),
                                              requires_grad=False)
    head.load_state_dict(loaded, assign=True, strict=False)  # quantized projections were swapped in whole
    pack_projections(head)
    return head.requires_grad_(False).eval()
