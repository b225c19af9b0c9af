"""What the Hugging Face `quantization_config` readers (GPTQ, AWQ, block-wise FP8) share: one key checked against
the values blockspec loads (anything else refused in one line naming the key and its value, before any tensor is
read), transformers' `modules_to_not_convert` list (an entry names every module whose name contains it), and a
projection's tensors checked for presence, dtype and shape (refused in one line naming the tensor)."""

from __future__ import annotations

import torch

from ..errors import BlockspecError

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def config_value(qc: dict, key: str, allowed: tuple, default=None, what: str = ""):
    """qc[key] (or `default` when absent), refused unless it is one of `allowed`."""
    value = qc.get(key, default)
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        choices = ", ".join(repr(a) for a in allowed)
        raise BlockspecError(f"quantization_config.{key} {value!r} is not supported{' ' + what if what else ''} "
                             f"(blockspec loads {choices})")
    return value


def not_converted(qc: dict) -> tuple[str, ...]:
    """The entries of quantization_config.modules_to_not_convert (none when absent or null)."""
    entries = qc.get("modules_to_not_convert") or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise BlockspecError(f"quantization_config.modules_to_not_convert {entries!r} is not a list of module names")
    return tuple(entries)


def check_converted(prefix: str, entries: tuple[str, ...]) -> None:
    """Refuse quantized tensors for a module the config keeps unquantized (transformers' substring match)."""
    listed = next((e for e in entries if e in prefix), None)
    if listed is not None:
        raise BlockspecError(f"{prefix} is stored quantized, but quantization_config.modules_to_not_convert lists "
                             f"{listed!r}")


def part(parts: dict, prefix: str, suffix: str, dtypes: tuple, dims: int) -> torch.Tensor:
    """parts[prefix + suffix], refused in one line when missing or of another dtype or rank."""
    name = prefix + suffix
    t = parts.get(name)
    if t is None:
        raise BlockspecError(f"checkpoint is missing {name}")
    if t.dtype not in dtypes or t.dim() != dims:
        raise BlockspecError(f"{name} is {t.dtype} of shape {tuple(t.shape)}, expected {dims}-D "
                             + " or ".join(str(d) for d in dtypes))
    return t


def check_shape(parts: dict, name: str, expected: tuple, context: str) -> None:
    got = tuple(parts[name].shape)
    if got != expected:
        raise BlockspecError(f"{name} has shape {got}, expected {expected} ({context})")
