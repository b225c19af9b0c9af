"""Load a Hugging Face Qwen3.5 checkpoint directory straight into a TargetModel (no conversion step).

Accepts the text-only layout (`model.layers...`) and the multimodal one (`model.language_model.layers...`,
vision tower skipped), one `*.safetensors` file or several with `model.safetensors.index.json`.
`mtp.*` tensors are returned on the side for the native MTP head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import TargetConfig
from .errors import BlockspecError
from .models.qwen3_5 import TargetModel

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
FLOAT32_SUFFIXES = ("A_log", "dt_bias", "norm.weight", "layernorm.weight")  # small; kept exact in float32


def checkpoint_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise BlockspecError(f"model directory {directory} does not exist")
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise BlockspecError(f"{index}: corrupt index ({exc!r})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise BlockspecError(f"{index} lists {missing[0]}, which is missing from {directory}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise BlockspecError(f"{directory}: no *.safetensors weights found")
    return files


def read_tensors(files: list[Path], device: str | torch.device = "cpu"):
    """Yield (name, tensor) from every file, refusing unreadable files with their name."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError, Exception) as exc:  # safetensors raises its own error types
            if isinstance(exc, BlockspecError):
                raise
            raise BlockspecError(f"{path}: corrupt or unreadable safetensors file ({str(exc).splitlines()[0]})") \
                from None


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


def load_target(directory: str | Path, device="cpu", dtype=torch.float32):
    """Returns (model, mtp_tensors)."""
    directory = Path(directory)
    config = TargetConfig.from_file(directory / "config.json")
    files = checkpoint_files(directory)
    with torch.device("meta"):
        model = TargetModel(config)
    expected = dict(model.named_parameters())
    loaded, mtp = {}, {}
    for name, tensor in read_tensors(files, device):
        key = text_name(name)
        if key is None:
            continue
        if key.startswith("mtp."):
            mtp[key] = tensor
            continue
        if key not in expected:
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise BlockspecError(f"{directory}: unexpected tensor {name} (not part of a {config_label(config)})")
        want = tuple(expected[key].shape)
        if tuple(tensor.shape) != want:
            raise BlockspecError(f"{directory}: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        keep_fp32 = key.endswith(FLOAT32_SUFFIXES)
        loaded[key] = torch.nn.Parameter(tensor.to(device=device, dtype=torch.float32 if keep_fp32 else dtype),
                                         requires_grad=False)
    missing = [k for k in expected if k not in loaded]
    if missing:
        raise BlockspecError(f"{directory}: missing tensor {missing[0]} (shape {tuple(expected[missing[0]].shape)})"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    model.load_state_dict(loaded, assign=True, strict=True)
    model.requires_grad_(False).eval()
    return model, mtp


def config_label(config: TargetConfig) -> str:
    return f"{config.num_hidden_layers}-layer Qwen3.5 model of hidden size {config.hidden_size}"
