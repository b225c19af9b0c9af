"""`blockspec train-target`: a small target of the real hybrid architecture trained from scratch on the user's text,
for trying blockspec with real (if small) weights: Gated DeltaNet and gated attention layers in the 3:1 pattern,
partial RoPE, tied embeddings, one MTP layer declared (train it afterwards with `train-drafter --kind mtp`).

The data are text files and JSONL records (train/data.py); a conversation is trained on as the text its chat template
(ChatML, the one written with the checkpoint) renders, every token of it. The tokenizer is a byte-level BPE trained on
the same text (`tokenizers`), with the chat special tokens. The model is
`transformers`' Qwen3_5ForCausalLM (the reference blockspec's own layers are tested against); its DeltaNet layers
train through transformers' chunked PyTorch form when fla-core is not installed (fla-core's backward refuses to run on
Hopper with Triton < 3.7.1). The output directory is an ordinary checkpoint: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json. Deterministic given the seed and the data; --resume continues a run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import MAX_SEED
from ..errors import BlockspecError
from ..models.tokenizer import CHAT_TEMPLATE, render_chat
from .data import Completion, read_paths
from .loop import Trainer, check_output, check_resumed, device_memory, output_folder, plural, settings_to_save, \
    staged, token_count, write_summary
from .ranks import launched

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_SAMPLE_BYTES = 64 << 20  # the BPE merges are learnt on this much of the text (more changes them little)


@dataclass
class TargetTraining:
    """One run: the `train-target` flags (see blockspec/cli.py for their meaning)."""

    data: list[str]
    out: str
    suffixes: list[str] | None = None  # of the files taken from directories (None: data.TEXT_SUFFIXES)
    vocab: int = 8192
    hidden: int = 512
    layers: int = 8                 # a multiple of 4: three DeltaNet layers, then one attention layer
    heads: int = 8                  # attention heads (head_dim = hidden / heads); 2 key/value heads
    intermediate: int = 1536
    seq_len: int = 1024
    batch_tokens: int = 65536
    steps: int = 2000
    tokens: int | None = None
    lr: float = 3e-3
    heldout: float = 0.02
    checkpoint_every: int = 200
    seed: int = 0
    resume: bool = False
    device: str = "auto"


def check_run(run: TargetTraining):
    sizes = [("--vocab", run.vocab), ("--hidden", run.hidden), ("--layers", run.layers), ("--heads", run.heads),
             ("--intermediate", run.intermediate)]
    for flag, value in sizes:  # before the checks below divide by them
        if value < 1:
            raise BlockspecError(f"{flag} must be at least 1 (got {value})")
    checks = [
        (run.layers < 4 or run.layers % 4, f"--layers must be a positive multiple of 4 (got {run.layers})"),
        (run.hidden % run.heads or (run.hidden // run.heads) % 4,
         f"--hidden {run.hidden} must split into --heads {run.heads} heads of a multiple of 4"),
        (run.heads % 2, f"--heads must be even (2 key/value heads; got {run.heads})"),
        (run.hidden % 64, f"--hidden must be a multiple of 64 (got {run.hidden})"),
        (run.vocab < 256 + len(SPECIAL_TOKENS),
         f"--vocab must hold the 256 bytes and the special tokens (got {run.vocab})"),
        (run.seq_len < 16 or run.batch_tokens < run.seq_len, "--seq-len must be >= 16 and <= --batch-tokens"),
        (run.steps < 1 or (run.tokens is not None and run.tokens < 1), "--steps and --tokens must be at least 1"),
        (not 0 < run.lr < math.inf, f"--lr must be positive and finite (got {run.lr})"),
        (not 0 <= run.heldout < 1, f"--heldout must be in [0, 1) (got {run.heldout})"),
        (run.checkpoint_every < 1, f"--checkpoint-every must be at least 1 (got {run.checkpoint_every})"),
        (not 0 <= run.seed <= MAX_SEED, f"--seed must be in 0..2^63-1 (got {run.seed})"),
        (launched()[1] > 1, "train-target runs in one process: start it without torchrun (several processes are "
                            "for train-drafter)"),
    ]
    for bad, why in checks:
        if bad:
            raise BlockspecError(why)
    check_fits(run)
    check_output(run.out, run.resume)
    check_resumed(run)


def check_fits(run: TargetTraining):
    """The model's training state (fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter, counted low:
    the tied embedding, the MLPs and two hidden x hidden projections a layer) and a step's logits (fp32) must fit the
    device's memory: refused now, not once the tokenizer is trained and the model allocated."""
    parameters = run.vocab * run.hidden + run.layers * (3 * run.hidden * run.intermediate + 2 * run.hidden ** 2)
    logits = max(1, run.batch_tokens // run.seq_len) * run.seq_len * run.vocab * 4
    memory, where = device_memory(run.device)
    for flags, what, size in (("--vocab, --hidden, --layers or --intermediate", "the model's training state (weights, "
                               "gradients, optimizer moments)", 16 * parameters),
                              ("--batch-tokens or --vocab", "a step's logits", logits)):
        if size > memory:
            raise BlockspecError(f"{what} would take {size / 2**30:.1f} GiB, more than the {where}'s memory "
                                 f"({memory / 2**30:.1f} GiB): smaller {flags}")


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE of `vocab` ids over the texts (the 256 bytes always in it), plus the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sample, size = [], 0
    for text in texts:
        if size >= TOKENIZER_SAMPLE_BYTES:
            break
        sample.append(text)
        size += len(text)
    tokenizer.train_from_iterator(sample, trainer)
    return tokenizer


def model_config(run: TargetTraining, vocab: int, eos: int) -> dict:
    head_dim = run.hidden // run.heads
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": vocab,
        "hidden_size": run.hidden, "intermediate_size": run.intermediate, "num_hidden_layers": run.layers,
        "num_attention_heads": run.heads, "num_key_value_heads": 2, "head_dim": head_dim,
        "linear_num_key_heads": max(1, run.heads // 2), "linear_num_value_heads": run.heads,
        "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim, "linear_conv_kernel_dim": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(run.layers)],
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
        "max_position_embeddings": max(4096, 4 * run.seq_len), "eos_token_id": eos, "torch_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [head_dim // 16, head_dim // 32, head_dim // 32],
                            "mrope_interleaved": True}}


def hide_fla_where_its_backward_refuses(device: torch.device):
    """fla-core's chunked gated-delta-rule backward refuses to run on Hopper with Triton < 3.7.1 (the forward, what
    inference uses, is fine). transformers picks fla when it imports its Qwen3.5 model, so before that import fla is
    hidden and the DeltaNet layers train through transformers' PyTorch chunked form."""
    import sys

    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return
    try:
        import triton
        if tuple(int(x) for x in triton.__version__.split(".")[:3]) >= (3, 7, 1):
            return
    except (ImportError, ValueError):
        return
    sys.modules.setdefault("fla", None)


def train_target(run: TargetTraining, log=print) -> dict:
    check_run(run)
    from ..engine.load import resolve_device

    device = resolve_device(run.device)
    hide_fla_where_its_backward_refuses(device)
    try:
        import transformers  # noqa: F401  (checked before any work)
    except ImportError:
        raise BlockspecError("train-target needs the 'train' extra: pip install 'blockspec[train]'") from None

    out = Path(run.out)
    texts = [unit if isinstance(unit, str) else unit.prompt + unit.completion if isinstance(unit, Completion)
             else render_chat(CHAT_TEMPLATE, unit.messages, add_generation_prompt=False)
             for unit in read_paths(run.data, run.suffixes)]
    held = min(len(texts) - 1, max(1, round(run.heldout * len(texts)))) if run.heldout > 0 and len(texts) > 1 else 0
    generator = torch.Generator().manual_seed(run.seed)
    order = torch.randperm(len(texts), generator=generator).tolist()
    train_texts, heldout_texts = [texts[i] for i in order[held:]], [texts[i] for i in order[:held]]
    with output_folder(out):
        return _train(run, out, device, train_texts, heldout_texts, log)


def _train(run: TargetTraining, out: Path, device, train_texts: list[str], heldout_texts: list[str], log) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out.mkdir(parents=True, exist_ok=True)
    if run.resume:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(train_texts, run.vocab)
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))
    vocab, eos, separator = tokenizer.get_vocab_size(), tokenizer.token_to_id("<|im_end|>"), \
        tokenizer.token_to_id("<|endoftext|>")
    config = model_config(run, vocab, eos)
    stream = torch.tensor([t for encoded in tokenizer.encode_batch(train_texts) for t in encoded.ids + [separator]])
    if stream.numel() < run.seq_len:
        raise BlockspecError(f"--data: {stream.numel()} tokens of training text, fewer than one sequence "
                             f"({run.seq_len})")
    torch.manual_seed(run.seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in config.items()
                                                    if k not in ("architectures", "model_type")})).to(device)
    rows = max(1, run.batch_tokens // run.seq_len)
    stream = stream.to(device)

    def step_loss(rng):
        starts = [rng.randrange(stream.numel() - run.seq_len + 1) for _ in range(rows)]
        batch = torch.stack([stream[s:s + run.seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
        return loss, {"bits_per_token": loss.detach() / math.log(2)}, rows * run.seq_len

    def save(directory: Path):
        with staged(directory) as staging:
            model.save_pretrained(staging)
            raw = json.loads((staging / "config.json").read_text())
            raw.update({k: config[k] for k in ("mtp_num_hidden_layers", "eos_token_id", "layer_types")})
            (staging / "config.json").write_text(json.dumps(raw, indent=2))

    trainer = Trainer(model, out, run.lr, device, save, run.checkpoint_every, run.seed, settings_to_save(run))
    if run.resume:
        trainer.resume()
    steps = run.steps if run.tokens is None else math.ceil(run.tokens / (rows * run.seq_len))
    capped = f" (--vocab {run.vocab}: the text yields no more merges)" if vocab < run.vocab else ""
    log(f"train-target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocabulary {vocab}"
        f"{capped}, {token_count(stream.numel())} of training text from {plural(len(train_texts), 'text')} "
        f"({len(heldout_texts)} held out); {plural(steps, 'step')} of {rows} x {run.seq_len} tokens on {device}")
    summary = {"steps": steps, "training_tokens_per_s": round(trainer.fit(steps, step_loss), 1),
               "parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab}
    summary["history"] = trainer.history
    if heldout_texts:
        summary["heldout_bits_per_token"] = heldout_loss(model, tokenizer, heldout_texts, run.seq_len, device)
        log(f"held-out: {summary['heldout_bits_per_token']:.3f} bits per token")
    write_summary(out, summary)
    return summary


@torch.no_grad()
def heldout_loss(model, tokenizer, texts: list[str], seq_len: int, device) -> float:
    ids = torch.tensor([t for encoded in tokenizer.encode_batch(texts) for t in encoded.ids], device=device)
    windows = [ids[i:i + seq_len] for i in range(0, max(ids.numel() - seq_len, 0) + 1, seq_len)][:64]
    losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows if w.numel() > 1]
    return round(sum(losses) / len(losses) / math.log(2), 4)
