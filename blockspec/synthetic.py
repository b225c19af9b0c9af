"""Synthetic checkpoints: random weights with the real shapes, built directly on the device, for speed measurement
without downloading 54 GB. Results measured with them are labelled synthetic wherever they are printed."""

from __future__ import annotations

import math

import torch

from .checkpoint import FLOAT32_SUFFIXES
from .config import TargetConfig
from .engine.weights import Quantizer, replace_linears
from .layers.linear import pack_projections

QWEN35_27B = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
    full_attention_interval=4, mtp_num_hidden_layers=1, rope_parameters={"rope_theta": 10_000_000.0,
                                                                          "partial_rotary_factor": 0.25})

# The published DFlash2 drafter for Qwen3.8-27B (see the DFlash2 issue).
DFLASH2_27B = dict(
    architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_size=5120, intermediate_size=17408,
    num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=248320,
    rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144, sliding_window=2048,
    use_sliding_window=True, layer_types=["sliding_attention"] * 5, is_causal=False, attention_bias=False,
    dflash_config={"block_size": 8, "mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61],
                   "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16})


def preset(name: str) -> dict:
    from .errors import BlockspecError
    from .tiny import TINY_CONFIG

    presets = {"qwen3.5-27b": QWEN35_27B, "tiny": TINY_CONFIG}
    if name not in presets:
        raise BlockspecError(f"unknown synthetic preset {name!r} (choose from {', '.join(presets)})")
    return {"model_type": "qwen3_5_text", **presets[name]}


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0):
    """In-place random init on the module's device: projections ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    zero-centred norms 0, DeltaNet decays in their usual range."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.fill_(1.0 if name.endswith(("linear_attn.norm.weight",)) else 0.0)
        else:
            std = 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1])
            p.normal_(0.0, std, generator=gen)


def synthetic_target(name: str, device, dtype, seed: int = 0, quantize: Quantizer | None = None,
                     mtp_head: bool = True):
    """A TargetModel with the preset's shapes and random weights, plus its MTP head (None without one, or with
    mtp_head False: not built, the model's weights the same). The decoder layers are built one at a time, each from
    its own generator, and with `quantize` (engine/weights.py `rtn`) their projections are quantized before the next
    layer is built, as a checkpoint's are while it is read: the dense model never exists whole, and the weights are
    the same with or without it."""
    from .models.mtp import MTPHead
    from .models.qwen3_5 import TargetModel

    config = TargetConfig.from_dict(preset(name), source=f"synthetic preset {name}")
    with torch.device("meta"):
        model = TargetModel(config)
        head = MTPHead(config) if config.mtp_num_hidden_layers and mtp_head else None
    layers, model.layers = model.layers, torch.nn.ModuleList()  # set aside: built below, one at a time
    for module in (model, head):
        if module is not None:
            materialize_(module, device, dtype)
            randomize_(module, seed)
    plant_permutation_(model, seed)
    for i, layer in enumerate(layers):
        materialize_(layer, device, dtype)
        randomize_(layer, layer_seed(seed, i))
        scale_outputs_(layer)
        if quantize is not None:
            replace_linears(layer, quantize)
    model.layers = layers
    pack_projections(model)  # as load_target leaves a model; the head is returned unpacked, as checkpoint tensors
    return model, head


def materialize_(module: torch.nn.Module, device, dtype):
    """A meta module's parameters allocated on `device` in `dtype` (uninitialized); the small exact ones float32,
    as when loading."""
    module.to(dtype).to_empty(device=device)
    for pname, p in module.named_parameters():
        if pname.endswith(FLOAT32_SUFFIXES):
            p.data = p.data.float()
    module.requires_grad_(False).eval()


def layer_seed(seed: int, index: int) -> int:
    """The seed of decoder layer `index`'s generator (the rest of the model and the MTP head take `seed` itself)."""
    return (seed + 1) * 1_000_003 + index


def synthetic_drafter(model, seed: int = 0):
    """The published DFlash2 drafter's shapes around `model` (a TargetModel), random weights, packed."""
    from .drafter.config import DrafterConfig
    from .drafter.model import DFlash2Drafter

    weight = model.embed_tokens.weight
    drafter = DFlash2Drafter(DrafterConfig.from_dict(synthetic_drafter_config(model.config)), embed=model.embed,
                             lm_head=model.logits, device=weight.device, dtype=weight.dtype)
    randomize_(drafter, seed)
    pack_projections(drafter)
    return drafter


@torch.no_grad()
def plant_permutation_(model, seed: int):
    """Make greedy decoding follow a fixed random permutation of the vocabulary with a wide logit margin: the head
    row of token perm(t) is the embedding of t, and the layers' outputs are scaled down (`scale_outputs_`, as each
    layer is built) so the embedding dominates the residual stream. Random weights alone give nearly flat logits,
    whose argmax flips with the rounding of differently shaped passes; forced-acceptance benchmarks need a
    trajectory every pass shape agrees on."""
    gen = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(model.config.vocab_size, generator=gen).to(model.embed_tokens.weight.device)
    head = model.lm_head.weight if model.lm_head is not None else None
    if head is not None:
        head[perm] = model.embed_tokens.weight


@torch.no_grad()
def scale_outputs_(layer, layer_scale: float = 0.05):
    """A decoder layer's output projections scaled down (plant_permutation_ says why)."""
    for name, p in layer.named_parameters():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            p.mul_(layer_scale)


def synthetic_drafter_config(target: TargetConfig) -> dict:
    """The published DFlash2 drafter's layout fitted to a target (its hidden size, vocabulary and depth)."""
    config = dict(DFLASH2_27B, hidden_size=target.hidden_size, vocab_size=target.vocab_size)
    if target.hidden_size != DFLASH2_27B["hidden_size"]:  # a tiny preset: shrink the drafter with it
        config.update(intermediate_size=2 * target.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, sliding_window=64)
        config["dflash_config"] = dict(config["dflash_config"], mask_token_id=target.vocab_size - 1,
                                       selector_rank=16, selector_top_k=8)
    n = target.num_hidden_layers
    if n != 64:  # spread five feature layers over a shallower target, as the published one does over 64
        layer_ids = sorted({round(1 + i * (n - 4) / 4) for i in range(5)} if n >= 8 else {0, n - 1})
        config["dflash_config"] = dict(config["dflash_config"], target_layer_ids=layer_ids)
    return config
