"""A tiny Qwen3.5 checkpoint (and DFlash2 drafter) made deterministically on the spot, for the tests.

Its weights are random (seeded), so its text is meaningless: it runs the engine end to end (loading a real
checkpoint layout, chat template, tokenizer, prefill, decoding, stats) without any download. `blockspec demo`
runs a trained pair instead (blockspec/demo.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

TINY_CONFIG = dict(
    vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    mtp_num_hidden_layers=1, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: one token per byte (ids 0..255) plus the chat special tokens (256..258)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def random_target_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with the checkpoint's names and shapes (text-only layout), including one MTP layer."""
    from .config import TargetConfig
    from .models.qwen3_5 import TargetModel
    from .models.mtp import MTPHead

    target_config = TargetConfig.from_dict({"model_type": "qwen3_5_text", **config})
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = TargetModel(target_config)
        mtp = MTPHead(target_config) if target_config.mtp_num_hidden_layers else None
    named = [("model." + k if not k.startswith("lm_head") else k, p) for k, p in model.named_parameters()]
    if mtp is not None:
        named += [("mtp." + k, p) for k, p in mtp.named_parameters()]
    tensors = {}
    for name, p in named:
        if name.endswith("A_log"):
            t = torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif "norm" in name.rsplit(".", 2)[-2]:
            t = 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            t = torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else fan_in ** -0.5)
        tensors[name] = t.contiguous()
    return tensors


CYCLE = "abcdefghijklmnopqrstuvwxyz "


def cycle_ids(tok: Tokenizer) -> list[int]:
    return [tok.token_to_id(_BYTE_LEVEL_CHARS[ord(c)]) for c in CYCLE]


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _bytes_to_unicode()


def plant(tensors: dict[str, torch.Tensor], config: dict, tok: Tokenizer, seed: int, target_noise: float,
          mtp_noise: float) -> None:
    """Overwrite random weights so that greedy decoding mostly walks the cycle 'abc...z ' (and the MTP head mostly
    predicts it), while the layers' perturbation (target_noise) makes the trajectory depend on context.

    Embedding rows are random except channel 0, a shared constant (the tiny DFlash2 drafter keys on it); the head
    row of each cycle character is the embedding of its predecessor, so argmax(logits) = successor when the
    layers' contribution is small. Every other token behaves like some cycle character.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    ids = cycle_ids(tok)
    embed = torch.randn(vocab, hidden, generator=gen)
    for t in range(vocab):
        if t not in ids:  # behaves like cycle character number t % len(ids)
            embed[t] = embed[ids[t % len(ids)]] + 0.3 * torch.randn(hidden, generator=gen)
    embed[:, 0] = 20.0
    head = torch.zeros(vocab, hidden)
    for i, t in enumerate(ids):
        head[t] = embed[ids[i - 1]]
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t.mul_(mtp_noise if name.startswith("mtp.") else target_noise)
    if "mtp.fc.weight" in tensors:
        fc = mtp_noise * torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5
        fc[:, :hidden] += torch.eye(hidden)  # [embedding, hidden] -> mostly the next token's embedding
        tensors["mtp.fc.weight"] = fc
        for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
            tensors[name].zero_()


def build_tiny_checkpoint(directory: str | Path, seed: int = 0, planted: bool = False, target_noise: float = 1.5,
                          mtp_noise: float = 0.5, **overrides) -> Path:
    """planted=True: weights planted so that the text mostly walks 'abc...z ' and the MTP head often guesses right
    (speculative decoding then has something to accept); otherwise purely random weights."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **overrides}
    tok = byte_tokenizer()
    eos = tok.token_to_id("<|im_end|>")
    full = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "eos_token_id": eos,
            "torch_dtype": "float32", **config}
    (directory / "config.json").write_text(json.dumps(full, indent=2))
    tensors = random_target_tensors(config, seed)
    if planted:
        plant(tensors, config, tok, seed, target_noise, mtp_noise)
    save_file(tensors, str(directory / "model.safetensors"))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))
    return directory


def build_tiny_drafter(directory: str | Path, target_dir: str | Path, seed: int = 0, window: int = 16,
                       noise: float = 0.0) -> Path:
    """A tiny DFlash2 drafter for a planted tiny target (build_tiny_checkpoint(planted=True)).

    Planted so that its proposals walk the target's cycle 'abc...z ' from the anchor: its final norm keeps only
    channel 0 (the embeddings' shared constant), so its logits favour every cycle character equally, and the
    selector's codebooks score the successor of the previous pick highest. `noise` perturbs the codebooks to make
    some proposals wrong. Everything else is random. The sliding window is small so that long runs exceed it.
    """

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab, layers = target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    tok = byte_tokenizer()
    ids = cycle_ids(tok)
    rank = 32
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "sliding_window": window, "use_sliding_window": True,
        "layer_types": ["sliding_attention"] * 2, "is_causal": False, "attention_bias": False, "hidden_act": "silu",
        "dflash_config": {"block_size": 8, "mask_token_id": tok.token_to_id("<|endoftext|>"),
                          "target_layer_ids": sorted({0, layers // 2, layers - 1}), "conv_kernel_size": 2,
                          "conv_group_size": 16, "selector_rank": rank, "selector_top_k": 32}}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed + 7)
    n_feat = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (hidden, n_feat * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (64, hidden), p + "self_attn.k_proj.weight": (32, hidden),
                       p + "self_attn.v_proj.weight": (32, hidden), p + "self_attn.o_proj.weight": (hidden, 64),
                       p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                       p + "mlp.gate_proj.weight": (2 * hidden, hidden), p + "mlp.up_proj.weight": (2 * hidden, hidden),
                       p + "mlp.down_proj.weight": (hidden, 2 * hidden), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + conv + ".base_kernel"] = (2, 2, hidden)
            shapes[p + conv + ".kernel_projection.weight"] = (2 * 2 * (hidden // 16), hidden)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            tensors[name] = torch.randn(shape, generator=gen) * 0.3 * fan_in ** -0.5
    norm = torch.zeros(hidden)
    norm[0] = 1.0  # keep the shared constant channel only
    tensors["norm.weight"] = norm
    projection = torch.zeros(rank, hidden)
    projection[:, 0] = 1.0
    predecessor, successor = torch.zeros(vocab, rank), torch.zeros(vocab, rank)
    for i, t in enumerate(ids):
        successor[t, i] = 4.0
    for t in range(vocab):  # every token's successor is the cycle character after the one it behaves like
        i = ids.index(t) if t in ids else t % len(ids) - 1
        predecessor[t, (i + 1) % len(ids)] = 1.0
    predecessor += noise * torch.randn(vocab, rank, generator=gen)
    tensors.update({"candidate_selector.hidden_projection.weight": projection,
                    "candidate_selector.predecessor_codebook.weight": predecessor,
                    "candidate_selector.successor_codebook.weight": successor})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory
