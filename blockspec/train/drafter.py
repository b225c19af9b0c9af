"""`blockspec train-drafter`: train a DFlash2 drafter for a target blockspec loads, on the user's text.

What it learns: the target's own greedy choices. Each training sequence runs once through the frozen target
(blockspec's own model, as at inference), which gives the features of `target_layer_ids` and the target's argmax at
every position. The text is teacher-forced: the label of block row j after anchor a is the target's argmax at
position a + j - 1 given the real text before it. That costs one target pass per sequence instead of one generation
per anchor, and equals the target's greedy continuation wherever the text follows it (exactly so on text the target
generated itself, as drafter recipes usually train on).

One step: anchors a are sampled across the sequences; block = [token a, mask x (block - 1)] at positions a..a+block-1
reads the features of positions < a inside the sliding window; the loss is the cross-entropy of rows 1.. against the
labels, weighted toward early rows (row j by exp(-(j - 1) / loss_decay): a late row only counts if the earlier ones
were accepted), plus the same weighted cross-entropy of the candidate selector's scores over its top-k candidates
(predecessor: the previous label; rows whose label is not among the candidates are skipped). Embeddings and head
are the target's, frozen. The trainable module is the `dflash` package's DFlash2DraftModel (the published
architecture), so what is saved is its HF directory: blockspec and `dflash` load it as it is.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import load_target
from ..config import TargetConfig
from ..engine.state import DecodeState
from ..engine.target import EagerTarget
from ..errors import BlockspecError
from ..tokenizer import Tokenizer
from .data import split_corpus

STATE_FILE = "training_state.pt"


@dataclass
class DrafterTraining:
    """One training run: the `train-drafter` flags (see blockspec/cli.py for their meaning)."""

    target: str
    data: list[str]
    out: str
    layers: int = 1
    block_size: int = 8
    window: int = 2048
    target_layer_ids: list[int] | None = None  # None: spread evenly over the target's depth
    heads: int | None = None                    # None: the target's attention heads (and its kv heads, head_dim)
    intermediate_size: int | None = None        # None: the target's
    selector_rank: int = 256
    selector_top_k: int = 16
    steps: int = 1000
    tokens: int | None = None                   # stop after this many anchor-block tokens instead of `steps`
    lr: float = 6e-4
    batch_tokens: int = 4096                    # block rows per step (anchors = batch_tokens / block_size)
    seq_len: int = 2048
    loss_decay: float = 4.0
    heldout: float = 0.05
    checkpoint_every: int = 200
    eval_cuts: int = 200
    seed: int = 0
    resume: bool = False
    device: str = "auto"


def spread_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly from the second to the fourth-last (as the published drafters read)."""
    if num_layers <= 4:
        return sorted({round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count)})
    first, last = 1, num_layers - 3
    return sorted({round(first + i * (last - first) / max(count - 1, 1)) for i in range(count)})


def drafter_config(target: TargetConfig, run: DrafterTraining, mask_token_id: int) -> dict:
    """The HF config.json of the drafter to train (what DrafterConfig and dflash's DFlash2DraftModel read)."""
    layer_ids = run.target_layer_ids or spread_layer_ids(target.num_hidden_layers, 5)
    heads = run.heads or target.num_attention_heads
    kv_heads = target.num_key_value_heads if heads % target.num_key_value_heads == 0 else heads
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": target.hidden_size,
        "intermediate_size": run.intermediate_size or target.intermediate_size, "num_hidden_layers": run.layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": target.head_dim,
        "vocab_size": target.vocab_size, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "sliding_window": run.window,
        "use_sliding_window": True, "layer_types": ["sliding_attention"] * run.layers, "is_causal": False,
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"block_size": run.block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": layer_ids, "conv_kernel_size": 2, "conv_group_size": 16,
                          "selector_rank": run.selector_rank, "selector_top_k": run.selector_top_k}}


def check_run(run: DrafterTraining) -> TargetConfig:
    """Refuse, in one line and before any work, what cannot be trained."""
    target = TargetConfig.from_file(Path(run.target) / "config.json")
    checks = [
        (run.layers < 1, f"--layers must be at least 1 (got {run.layers})"),
        (not 2 <= run.block_size <= 16, f"--block-size must be 2..16 (got {run.block_size})"),
        (run.window < run.block_size, f"--window {run.window} is shorter than the block ({run.block_size})"),
        (run.steps < 1 or (run.tokens is not None and run.tokens < 1), "--steps and --tokens must be at least 1"),
        (run.batch_tokens < run.block_size, f"--batch-tokens must hold one block ({run.block_size} tokens)"),
        (run.seq_len < 2 * run.block_size, f"--seq-len must be at least twice the block ({2 * run.block_size})"),
        (not run.lr > 0, f"--lr must be positive (got {run.lr})"),
        (not 0 <= run.heldout < 1, f"--heldout must be in [0, 1) (got {run.heldout})"),
        (target.hidden_size % 16 != 0, f"target hidden_size {target.hidden_size} is not a multiple of 16 "
                                       "(the drafter's convolution groups)"),
        (run.heads is not None and run.heads < 1, f"--heads must be at least 1 (got {run.heads})"),
        (run.selector_top_k > target.vocab_size, f"--selector-top-k {run.selector_top_k} exceeds the vocabulary"),
    ]
    for bad, why in checks:
        if bad:
            raise BlockspecError(why)
    bad_ids = [i for i in run.target_layer_ids or [] if not 0 <= i < target.num_hidden_layers]
    if bad_ids:
        raise BlockspecError(f"--target-layer-ids {run.target_layer_ids}: layer {bad_ids[0]} is outside the target's "
                             f"{target.num_hidden_layers} layers (0..{target.num_hidden_layers - 1})")
    out = Path(run.out)
    if out.exists() and not out.is_dir():
        raise BlockspecError(f"--out {out} exists and is not a directory")
    if run.resume and not (out / STATE_FILE).is_file():
        raise BlockspecError(f"--resume: {out / STATE_FILE} does not exist (nothing to resume)")
    if not run.resume and out.is_dir() and any(out.iterdir()):
        raise BlockspecError(f"--out {out} is not empty: choose a new directory or pass --resume")
    return target


def mask_token(tokenizer, vocab_size: int) -> int:
    """A token the drafter embeds as 'to be predicted': an end-of-text special token when the tokenizer has one."""
    for name in ("<|endoftext|>", "<|fim_pad|>", "<|im_end|>"):
        token = tokenizer.token_id(name)
        if token is not None and token < vocab_size:
            return token
    return vocab_size - 1


class TargetFeatures:
    """The frozen target run over whole sequences: the captured layers' outputs and its greedy labels."""

    def __init__(self, model, layer_ids, seq_len: int, device, dtype):
        self.state = DecodeState(model, seq_len, 16, device, dtype)
        self.target = EagerTarget(model, self.state, layer_ids)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor):
        self.state.reset()
        out = self.target.forward(ids)
        self.state.discard()
        return out.features, out.logits.argmax(-1)  # argmax[p]: the target's token for position p + 1


def sample_blocks(features, tokens, labels, count: int, block: int, window: int, mask_id: int, rng):
    """`count` anchor blocks of one sequence: (context features [n, L, F], its validity [n, L], block ids [n, block],
    positions [n, L + block], labels [n, block - 1], anchor positions [n])."""
    length = tokens.shape[0]
    anchors = torch.tensor(sorted(rng.sample(range(1, length - block + 2), min(count, length - block + 1))))
    context = int(min(window - 1, anchors.max()))  # the block's first row sees window - 1 earlier positions
    offsets = torch.arange(-context, 0)
    source = anchors[:, None] + offsets[None, :]
    valid = source >= 0
    ctx = features[source.clamp_min(0)]
    ids = torch.full((anchors.shape[0], block), mask_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    positions = torch.cat([source, anchors[:, None] + torch.arange(block)[None, :]], dim=1).clamp_min(0)
    targets = labels[anchors[:, None] + torch.arange(block - 1)[None, :]]
    return ctx, valid, ids, positions, targets, anchors


def attention_mask(valid: torch.Tensor, block: int, window: int) -> torch.Tensor:
    """Bool [n, 1, block, L + block]: block row i (position a + i) sees context row j (position a - L + j) when it
    holds a real position inside the window, and every row of its own block (DFlash2's block is not causal)."""
    n, context = valid.shape
    distance = torch.arange(block)[:, None] + context - torch.arange(context)[None, :]
    sees_context = valid[:, None, :] & (distance < window)[None]
    return torch.cat([sees_context, torch.ones(n, block, block, dtype=torch.bool)], dim=-1)[:, None]


def block_losses(model, head, embed, batch, decay: float):
    """(block cross-entropy, selector cross-entropy, per-row accuracy [block - 1]) of one batch of anchor blocks."""
    ctx, valid, ids, positions, targets, _ = batch
    block = ids.shape[1]
    noise = embed(ids) * float(model.config.dflash_config.get("input_embedding_scale", 1.0))
    mask = attention_mask(valid, block, model.config.sliding_window).to(ctx.device)
    hidden = model(target_hidden=ctx, noise_embedding=noise, position_ids=positions, attention_mask=mask)[:, 1:]
    logits = model.compute_logits(hidden, head).float()
    weights = torch.exp(-torch.arange(block - 1, device=ctx.device) / decay)
    weights = weights / weights.sum()
    row_ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(0)
    selector = model.candidate_selector
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
    previous = torch.cat([ids[:, :1], targets[:, :-1]], dim=1)
    query = selector.predecessor_codebook(previous) * selector.hidden_projection(hidden)
    scores = unary + torch.einsum("nbr,nbkr->nbk", query.float(), selector.successor_codebook(candidates).float())
    hit = candidates == targets[..., None]
    present = hit.any(-1)
    picked = F.cross_entropy(scores.transpose(1, 2), hit.float().argmax(-1), reduction="none") * present
    selector_ce = picked.sum(0) / present.sum(0).clamp_min(1)
    accuracy = (logits.argmax(-1) == targets).float().mean(0)
    return (weights * row_ce).sum(), (weights * selector_ce).sum(), accuracy


def new_drafter(config: dict, seed: int, device, dtype):
    """dflash's DFlash2DraftModel with initial weights: Qwen3's init, the convolutions starting as the identity."""
    try:
        from dflash.model import DFlash2DraftModel
        from transformers import Qwen3Config
    except ImportError:
        raise BlockspecError("train-drafter needs the 'train' extra: pip install 'blockspec[train]'") from None
    torch.manual_seed(seed)
    model = DFlash2DraftModel(Qwen3Config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0  # tap 0 is the row itself: the convolution starts as the identity
            elif name.endswith("kernel_projection.weight"):
                p.zero_()
    return model.to(device=device, dtype=dtype)


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


def save(model, out: Path, optimizer, step: int, run: DrafterTraining, history: list):
    """The HF drafter directory (config.json, model.safetensors) plus what --resume needs, written whole each time
    (a file is replaced only once its successor is complete)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    state = {"step": step, "optimizer": optimizer.state_dict(), "run": asdict(run), "history": history,
             "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}
    torch.save(state, out / (STATE_FILE + ".tmp"))
    (out / (STATE_FILE + ".tmp")).replace(out / STATE_FILE)


@torch.enable_grad()  # whatever the caller's grad mode (the target itself stays frozen)
def train_drafter(run: DrafterTraining, log=print) -> dict:
    """Train, save, evaluate; returns the summary (also written to OUT/training.json)."""
    target_config = check_run(run)
    from ..engine.engine import resolve_device

    device = resolve_device(run.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = Tokenizer(run.target, target_config.eos_token_ids)
    eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    train, heldout = split_corpus(run.data, tokenizer, run.seq_len, run.heldout, run.seed, eos)
    model, _ = load_target(run.target, device, dtype)
    config = drafter_config(target_config, run, mask_token(tokenizer, target_config.vocab_size))
    layer_ids = config["dflash_config"]["target_layer_ids"]
    features = TargetFeatures(model, layer_ids, run.seq_len, device, dtype)
    out = Path(run.out)
    drafter = new_drafter(config, run.seed, device, torch.float32)  # fp32 master weights; autocast computes bf16
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.01)
    start, history = 0, []
    rng = random.Random(run.seed)
    if run.resume:
        from dflash.model import DFlash2DraftModel

        state = torch.load(out / STATE_FILE, weights_only=False)
        drafter = DFlash2DraftModel.from_pretrained(out).to(device=device, dtype=torch.float32)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.01)
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        rng = random.Random(run.seed + start)
    per_step = max(1, run.batch_tokens // run.block_size)
    steps = run.steps if run.tokens is None else math.ceil(run.tokens / (per_step * run.block_size))
    log(f"train-drafter: {len(train)} training / {len(heldout)} held-out sequences of {run.seq_len} tokens; "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M drafter parameters reading target layers "
        f"{layer_ids}; {steps} steps of {per_step} blocks on {device}")
    head, embed = model.logits, model.embed
    drafter.train()
    progress = _progress(range(start, steps), start, steps)
    began, rows_done = time.perf_counter(), 0
    for step in progress:
        sequence = torch.tensor(train[rng.randrange(len(train))], device=device)
        feats, labels = features(sequence)
        batch = sample_blocks(feats.cpu(), sequence.cpu(), labels.cpu(), per_step, run.block_size, run.window,
                              config["dflash_config"]["mask_token_id"], rng)
        batch = tuple(t.to(device) for t in batch)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, run.lr)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            block_ce, selector_ce, accuracy = block_losses(drafter, head, embed, (batch[0].to(dtype),) + batch[1:],
                                                           run.loss_decay)
        loss = block_ce + selector_ce
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        rows_done += batch[2].numel()
        figures = {"loss": loss.item(), "block_ce": block_ce.item(), "selector_ce": selector_ce.item(),
                   "first_row_accuracy": accuracy[0].item()}
        history.append({"step": step + 1, **{k: round(v, 4) for k, v in figures.items()}})
        if hasattr(progress, "set_postfix"):
            progress.set_postfix(loss=f"{figures['loss']:.3f}", acc1=f"{figures['first_row_accuracy']:.2f}",
                                 tok_s=f"{rows_done / (time.perf_counter() - began):.0f}")
        if (step + 1) % run.checkpoint_every == 0 or step + 1 == steps:
            save(drafter, out, optimizer, step + 1, run, history)
    summary = {"steps": steps, "history": history,
               "training_tokens_per_s": round(rows_done / max(time.perf_counter() - began, 1e-9), 1)}
    if run.eval_cuts and heldout:
        summary["evaluation"] = one_cycle_acceptance(run.target, out, heldout, run.eval_cuts, run.block_size,
                                                     run.seed, str(device))
        log(f"held-out: mean accepted length {summary['evaluation']['mean_accepted_length']:.3f} per cycle "
            f"(block {run.block_size}) over {summary['evaluation']['cuts']} contexts")
    (out / "training.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    return summary


def one_cycle_acceptance(target: str, drafter: str | Path, sequences: list[list[int]], cuts: int, block: int,
                         seed: int, device: str = "auto", mode: str = "dflash2") -> dict:
    """One speculative cycle from each of `cuts` real prefixes (random cut points of held-out sequences): prefill
    the prefix, propose a full block, verify. Returns the mean accepted length (accepted + 1) and its spread."""
    from ..engine.engine import Engine

    engine = Engine.load(target, mode=mode, dflash2_model=str(drafter) if mode == "dflash2" else None, device=device,
                         compute_dtype="float32" if device == "cpu" else "bfloat16",
                         context_length=max(len(s) for s in sequences) + 2 * block)
    rng = random.Random(seed)
    lengths = []
    for _ in range(cuts):
        sequence = sequences[rng.randrange(len(sequences))]
        cut = rng.randrange(1, len(sequence))
        stats = engine.generate(sequence[:cut], block + 1, stop_at_eos=False).stats
        lengths.append(stats["accepted_per_cycle"][0] + 1)
    mean = sum(lengths) / len(lengths)
    return {"cuts": len(lengths), "mean_accepted_length": round(mean, 4),
            "histogram": {n: lengths.count(n) for n in sorted(set(lengths))}}


def _progress(steps, start, total):
    try:
        from tqdm import tqdm
    except ImportError:
        return steps
    return tqdm(steps, initial=start, total=total, unit="step", dynamic_ncols=True)
