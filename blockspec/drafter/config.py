"""DrafterConfig: the parts of a DFlash2 drafter's HF config.json that the runtime needs.

Every problem is reported as one BlockspecError line naming the file and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from blockspec.config import MAX_PASS_TOKENS
from blockspec.errors import BlockspecError
from blockspec.files import read_json

ARCHITECTURE = "DFlash2DraftModel"


@dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    causal: bool  # within the noise block: True = position i sees block positions <= i only
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    num_target_layers: int | None = None  # the layer count of the target it was trained with, where recorded

    @classmethod
    def from_file(cls, path: str | Path) -> DrafterConfig:
        path = Path(path)
        raw = read_json(path, f"drafter config {path}")
        if not isinstance(raw, dict):
            raise BlockspecError(f"drafter config {path}: top level is not a JSON object")
        return cls.from_dict(raw, source=str(path))

    def run_at(self, block_size: int | None, source: str) -> DrafterConfig:
        """This drafter run with blocks of `block_size` rows (PredictConfig.dflash2_block_size; None: its own block),
        at most the block it was trained with: its rows past block_size are never computed."""
        if block_size is None:
            return self
        if block_size > self.block_size:
            raise BlockspecError(f"dflash2_block_size {block_size} exceeds the drafter's block size "
                                 f"{self.block_size} ({source})")
        return replace(self, block_size=block_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        read = _Reader(raw, source)
        architectures = raw.get("architectures")
        if not isinstance(architectures, list):
            read.fail("architectures", f"must be a list of names including {ARCHITECTURE!r} (found {architectures!r})")
        if ARCHITECTURE not in architectures:
            read.fail("architectures", f"must include {ARCHITECTURE!r} (found {architectures!r})")
        if not isinstance(raw.get("dflash_config"), dict):
            read.fail("dflash_config", "is missing or not an object")

        num_layers = read.integer("num_hidden_layers", minimum=1)
        hidden_size = read.integer("hidden_size", minimum=1)
        num_heads = read.integer("num_attention_heads", minimum=1)
        num_kv_heads = read.integer("num_key_value_heads", minimum=1)
        head_dim = read.integer("head_dim", minimum=2)
        vocab_size = read.integer("vocab_size", minimum=1)
        if num_heads % num_kv_heads:
            read.fail("num_key_value_heads", f"{num_kv_heads} does not divide num_attention_heads {num_heads}")
        if head_dim % 2:
            read.fail("head_dim", f"{head_dim} is odd; rotary embedding needs an even head_dim")
        if raw.get("hidden_act", "silu") != "silu":
            read.fail("hidden_act", f"only 'silu' is supported (found {raw['hidden_act']!r})")

        # Only sliding-window layers are supported: their context is bounded, so fixed buffers hold it exactly.
        layer_types = raw.get("layer_types")
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            read.fail("layer_types", f"must be a list of {num_layers} layer types (found {layer_types!r})")
        for index, layer_type in enumerate(layer_types):
            if layer_type != "sliding_attention":
                read.fail("layer_types", f"layer {index} is {layer_type!r}; only 'sliding_attention' is supported")
        if raw.get("use_sliding_window") is not True:
            read.fail("use_sliding_window", "must be true (without it the sliding layers have no window)")
        sliding_window = read.integer("sliding_window", minimum=1)
        # transformers: an explicit is_causal wins; otherwise sliding layers are causal.
        is_causal = raw.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            read.fail("is_causal", f"must be true, false or null (found {is_causal!r})")

        # a block is verified in one target pass, whose buffers and kernels hold MAX_PASS_TOKENS rows at most
        block_size = read.draft_integer("block_size", minimum=2, maximum=MAX_PASS_TOKENS)
        mask_token_id = read.draft_integer("mask_token_id", minimum=0)
        if mask_token_id >= vocab_size:
            read.fail("dflash_config.mask_token_id", f"{mask_token_id} is outside the vocabulary of {vocab_size}")
        layer_ids = read.draft_value("target_layer_ids")
        if (
            not isinstance(layer_ids, list)
            or not layer_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids)
        ):
            read.fail(
                "dflash_config.target_layer_ids", f"must be a non-empty list of layer indices (found {layer_ids!r})"
            )
        # the target's layer count the drafter was trained with, where its config records it
        num_target_layers = read.draft_value("num_target_layers", None)
        if num_target_layers is not None:
            num_target_layers = read.draft_integer("num_target_layers", minimum=1)
            if max(layer_ids) >= num_target_layers:
                read.fail("dflash_config.target_layer_ids", f"include {max(layer_ids)}, but num_target_layers is "
                          f"{num_target_layers}")
        group_size = read.draft_integer("conv_group_size", minimum=1)
        if hidden_size % group_size:
            read.fail("dflash_config.conv_group_size", f"{group_size} does not divide hidden_size {hidden_size}")
        top_k = read.draft_integer("selector_top_k", minimum=1)
        if top_k > vocab_size:
            read.fail("dflash_config.selector_top_k", f"{top_k} exceeds vocab_size {vocab_size}")
        softcap = read.draft_number("final_logit_softcapping", None)
        if softcap is not None and softcap < 0:
            read.fail("dflash_config.final_logit_softcapping", f"must be 0 or more (found {softcap!r}; 0: none)")
        eps = read.number("rms_norm_eps", 1e-6)
        if eps <= 0:
            read.fail("rms_norm_eps", f"must be above 0 (found {eps!r})")

        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=read.integer("intermediate_size", minimum=1),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=read.rope_theta(),
            sliding_window=sliding_window,
            causal=True if is_causal is None else is_causal,
            attention_bias=read.boolean("attention_bias", False),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(layer_ids),
            conv_kernel_size=read.draft_integer("conv_kernel_size", minimum=1),
            conv_group_size=group_size,
            selector_rank=read.draft_integer("selector_rank", minimum=1),
            selector_top_k=top_k,
            input_embedding_scale=read.draft_number("input_embedding_scale", 1.0),
            output_multiplier=read.draft_number("output_multiplier", 1.0),
            logit_softcap=softcap if softcap is not None and softcap > 0 else None,
            num_target_layers=num_target_layers,
        )


class _Reader:
    """Typed look-ups in the raw config that fail with the file and key named."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw = raw
        self.draft = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
        self.source = source

    def fail(self, key: str, problem: str):
        raise BlockspecError(f"drafter config {self.source}: key '{key}' {problem}")

    def integer(self, key: str, *, minimum: int) -> int:
        if key not in self.raw:
            self.fail(key, "is missing")
        return self._check_integer(key, self.raw[key], minimum)

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, f"must be a finite number (found {value!r})")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false (found {value!r})")
        return value

    # DFlash keys live in dflash_config; like the reference, fall back to the top level.
    def draft_value(self, key: str, default: Any = KeyError) -> Any:
        if key in self.draft:
            return self.draft[key]
        if key in self.raw:
            return self.raw[key]
        if default is KeyError:
            self.fail(f"dflash_config.{key}", "is missing")
        return default

    def draft_integer(self, key: str, *, minimum: int, maximum: int | None = None) -> int:
        return self._check_integer(f"dflash_config.{key}", self.draft_value(key), minimum, maximum)

    def draft_number(self, key: str, default: float | None) -> float | None:
        value = self.draft_value(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"dflash_config.{key}", f"must be a finite number (found {value!r})")
        return float(value)

    def rope_theta(self) -> float:
        params = self.raw.get("rope_parameters")
        if params is None:
            params = {"rope_theta": self.raw.get("rope_theta"), "rope_type": "default"}
            if self.raw.get("rope_scaling") not in (None, {}):
                self.fail("rope_scaling", "is not supported (plain rotary embedding only)")
        if not isinstance(params, dict):
            self.fail("rope_parameters", f"must be an object (found {params!r})")
        if params.get("rope_type", "default") != "default":
            self.fail("rope_parameters.rope_type", f"only 'default' is supported (found {params['rope_type']!r})")
        if params.get("partial_rotary_factor", 1.0) != 1.0 or self.raw.get("partial_rotary_factor", 1.0) != 1.0:
            self.fail("partial_rotary_factor", "only full rotary embedding (1.0) is supported")
        theta = params.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            self.fail("rope_parameters.rope_theta", f"must be a positive number (found {theta!r})")
        return float(theta)

    def _check_integer(self, key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"must be an integer (found {value!r})")
        if value < minimum:
            self.fail(key, f"must be at least {minimum} (found {value})")
        if maximum is not None and value > maximum:
            self.fail(key, f"must be at most {maximum} (found {value})")
        return value
