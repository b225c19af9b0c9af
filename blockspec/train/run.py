"""Running `blockspec train-drafter`: checks, the frozen target and the text, the kind's training loop, the
evaluations. The kinds: `dflash2` (train/dflash2.py) and `mtp` (train/mtp.py); the shared optimisation:
train/loop.py; several processes under torchrun: train/ranks.py (the target whole on every rank or its layers
sharded with FSDP2, the trained module under DistributedDataParallel, each step's sequences shared out)."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import MAX_SEED, TargetConfig
from ..engine import graphs
from ..engine.state import DecodeState
from ..engine.target import EagerTarget
from ..errors import BlockspecError
from ..models.checkpoint import check_folder, checkpoint_files, load_target, stored_dtype
from ..models.tokenizer import Tokenizer
from .data import Sequence, evaluation_corpus, split_corpus, text_files
from .evaluate import one_cycle_acceptance
from .loop import BEST, Trainer, check_output, check_resumed, check_weights, device_memory, fingerprint, output_folder, \
    plural, settings_to_save, staged, write_summary
from .ranks import Ranks, launched, process_group, rank_device


@dataclass
class DrafterTraining:
    """One training run: the `train-drafter` flags (see blockspec/cli.py for their meaning)."""

    target: str
    data: list[str]
    out: str
    suffixes: list[str] | None = None           # of the files taken from directories (None: data.TEXT_SUFFIXES)
    kind: str = "dflash2"                       # or "mtp": the target's native MTP head
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
    eval_data: list[str] | None = None          # evaluate on these texts instead of a held-out share of `data`
    checkpoint_every: int = 200
    eval_cuts: int = 200
    eval_every: int = 0                         # steps between held-out evaluations, the best in OUT/best (0: none)
    seed: int = 0
    resume: bool = False
    device: str = "auto"
    replace_mtp: bool = False                   # kind mtp: a target that has a head gets a new one, trained anew
    target_sharding: str = "auto"               # "replicate", "fsdp" (several processes) or "auto" (shards_target)
    compile: bool | None = None                 # the trained module's step through torch.compile (None: on CUDA)


# train-drafter's flags that shape a DFlash2 drafter or its loss, which --kind mtp does not read
DFLASH2_ONLY = ("--layers", "--block-size", "--window", "--target-layer-ids", "--heads", "--intermediate-size",
                "--selector-rank", "--selector-top-k", "--loss-decay")


def compiles(setting: bool | None, device: torch.device) -> bool:
    """Whether the trained module's step runs through torch.compile: as set, else on CUDA (a small drafter's eager
    step is bound by its launches: compiled, the demo pair's ran 2.3x on an H200) and not on the CPU."""
    return device.type == "cuda" if setting is None else setting


def check_run(run: DrafterTraining, world: int | None = None) -> TargetConfig:
    """Refuse, in one line and before any work, what cannot be trained in `world` processes (default: the ones
    torchrun started, or this one)."""
    world = world or launched()[1]
    target = TargetConfig.from_file(check_folder("--target", run.target) / "config.json")
    checks = [
        (run.kind not in ("dflash2", "mtp"), f"--kind must be dflash2 or mtp (got {run.kind!r})"),
        (run.kind == "mtp" and Path(run.out).resolve() == Path(run.target).resolve(),
         "--out must not be the target directory (the MTP head is written into a copy of it)"),
        (run.layers < 1, f"--layers must be at least 1 (got {run.layers})"),
        (run.intermediate_size is not None and run.intermediate_size < 1,
         f"--intermediate-size must be at least 1 (got {run.intermediate_size})"),
        (run.selector_rank < 1, f"--selector-rank must be at least 1 (got {run.selector_rank})"),
        (run.selector_top_k < 1, f"--selector-top-k must be at least 1 (got {run.selector_top_k})"),
        (not 0 < run.loss_decay < math.inf, f"--loss-decay must be positive and finite (got {run.loss_decay})"),
        (not 2 <= run.block_size <= 16, f"--block-size must be 2..16 (got {run.block_size})"),
        (run.window < run.block_size, f"--window {run.window} is shorter than the block ({run.block_size})"),
        (run.window > target.max_position_embeddings, f"--window {run.window} is longer than the target's "
                                                      f"max_position_embeddings {target.max_position_embeddings}"),
        (run.steps < 1 or (run.tokens is not None and run.tokens < 1), "--steps and --tokens must be at least 1"),
        (run.batch_tokens < run.block_size, f"--batch-tokens must hold one block ({run.block_size} tokens)"),
        (run.seq_len < 2 * run.block_size, f"--seq-len must be at least twice the block ({2 * run.block_size})"),
        (not 0 < run.lr < math.inf, f"--lr must be positive and finite (got {run.lr})"),
        (not 0 <= run.heldout < 1, f"--heldout must be in [0, 1) (got {run.heldout})"),
        (run.kind == "dflash2" and target.hidden_size % 16 != 0,
         f"target hidden_size {target.hidden_size} is not a multiple of 16 (the drafter's convolution groups)"),
        (run.heads is not None and run.heads < 1, f"--heads must be at least 1 (got {run.heads})"),
        (run.selector_top_k > target.vocab_size, f"--selector-top-k {run.selector_top_k} exceeds the vocabulary"),
        (run.checkpoint_every < 1, f"--checkpoint-every must be at least 1 (got {run.checkpoint_every})"),
        (run.eval_cuts < 0, f"--eval-cuts must be 0 or more (got {run.eval_cuts})"),
        (run.eval_every < 0, f"--eval-every must be 0 or more (got {run.eval_every})"),
        (run.eval_every > 0 and (run.eval_cuts == 0 or (run.heldout == 0 and not run.eval_data)),
         "--eval-every evaluates on held-out data: it needs --eval-cuts above 0, and --heldout above 0 or "
         "--eval-data"),
        (not 0 <= run.seed <= MAX_SEED, f"--seed must be in 0..2^63-1 (got {run.seed})"),
        (run.replace_mtp and run.kind != "mtp", "--replace-mtp applies to --kind mtp"),
        (run.target_sharding not in ("auto", "replicate", "fsdp"),
         f"--target-sharding must be auto, replicate or fsdp (got {run.target_sharding!r})"),
        (run.target_sharding == "fsdp" and world == 1,
         "--target-sharding fsdp shares the target between processes: start several with torchrun "
         "--nproc-per-node N"),
    ]
    for bad, why in checks:
        if bad:
            raise BlockspecError(why)
    count = step_sequences(run)
    if count % world:
        raise BlockspecError(f"{world} processes cannot share the {plural(count, 'sequence')} of a step evenly "
                             f"(--batch-tokens {run.batch_tokens}, --seq-len {run.seq_len}): run a number of "
                             f"processes that divides {count}, or give --batch-tokens for a multiple of {world}")
    ids = run.target_layer_ids
    if ids is not None and not ids:
        raise BlockspecError("--target-layer-ids is empty: give one target layer or more (or leave it out)")
    bad_ids = [i for i in ids or [] if not 0 <= i < target.num_hidden_layers]
    if bad_ids:
        raise BlockspecError(f"--target-layer-ids {ids}: layer {bad_ids[0]} is outside the target's "
                             f"{target.num_hidden_layers} layers (0..{target.num_hidden_layers - 1})")
    if ids and len(set(ids)) < len(ids):
        raise BlockspecError(f"--target-layer-ids {ids}: a layer is given twice")
    if run.kind == "dflash2":
        check_drafter_fits(run, target)
    check_step_fits(run, target, world)
    check_weights(Path(run.target))
    if run.eval_data:
        text_files(run.eval_data, run.suffixes, flag="--eval-data")
    check_output(run.out, run.resume)
    check_resumed(run, run_inputs(run))
    if run.kind == "mtp" and not run.replace_mtp and not run.resume:
        from .mtp import has_mtp_head

        if has_mtp_head(Path(run.target)):
            raise BlockspecError(f"--target {run.target} already has an MTP head: --kind mtp would train a new one "
                                 "from scratch in its place; pass --replace-mtp to do so")
    return target


def check_drafter_fits(run: DrafterTraining, target: TargetConfig):
    """The drafter's training state (fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter, its
    layers' projections and its fixed parts counted) must fit the device's memory: a run that cannot is refused now,
    not killed once the target has loaded."""
    heads = run.heads or target.num_attention_heads
    attention = 2 * (heads + target.num_key_value_heads) * target.head_dim
    layer = target.hidden_size * (attention + 3 * (run.intermediate_size or target.intermediate_size))
    fixed = target.hidden_size * target.hidden_size * len(run.target_layer_ids or range(5)) \
        + 2 * target.vocab_size * run.selector_rank
    state = 16 * (run.layers * layer + fixed)
    memory, where = device_memory(run.device)
    if state > memory:
        raise BlockspecError(f"--layers {run.layers}: the drafter's training state (weights, gradients, optimizer "
                             f"moments: {state / 2**30:.1f} GiB) exceeds the {where}'s memory "
                             f"({memory / 2**30:.1f} GiB); fewer --layers, or smaller --intermediate-size, --heads "
                             "or --selector-rank")


def run_inputs(run: DrafterTraining) -> dict:
    """What --resume checks the run's inputs by (train/loop.py check_resumed): the target's fingerprint. Its path is
    not saved (it may move); another target of the same shapes would otherwise go on training the run silently."""
    return {"target": fingerprint(Path(run.target))}


def check_step_fits(run: DrafterTraining, target: TargetConfig, world: int):
    """What one step holds at once, at the least (a process's share of its sequences: the captured target layers'
    features, or for kind mtp the logits of its rows), must fit the device's memory: a --batch-tokens that cannot is
    refused now, not once the target has loaded."""
    sequences = -(-step_sequences(run) // world)
    memory, where = device_memory(run.device)
    if run.kind == "dflash2":
        held, what = (sequences * run.seq_len * target.hidden_size * len(run.target_layer_ids or range(5))
                      * (2 if where == "GPU" else 4)), "target features"
    else:
        held, what = sequences * run.seq_len * target.vocab_size * 4, "logits"
    if held > memory:
        raise BlockspecError(f"--batch-tokens {run.batch_tokens}: a step's {what} would take {held / 2**30:.1f} GiB, "
                             f"more than the {where}'s memory ({memory / 2**30:.1f} GiB): fewer --batch-tokens")


class TargetFeatures:
    """The frozen target run over whole sequences: the captured layers' outputs and its greedy labels, and with
    `hidden` its last hidden states after the final norm (what the MTP head reads).

    With `graphed` (CUDA) the pass over a sequence of seq_len tokens is recorded once as a CUDA graph and replayed
    for every sequence: a training sequence always starts from an empty state at position 0, so the pass is the
    same work on new ids. Eager, a small target's pass is mostly launch overhead (docs/benchmarks.md, "Drafter
    training speed")."""

    def __init__(self, model, layer_ids, seq_len: int, device, dtype, graphed: bool = False, hidden: bool = False):
        self.model, self.hidden = model, hidden
        self.state = DecodeState(model, seq_len, 16, device, dtype)
        self.target = EagerTarget(model, self.state, layer_ids)
        self.seq_len, self.graphed = seq_len, graphed and torch.device(device).type == "cuda"
        self.graph = None  # (graph, its static outputs, its static ids)

    def _pass(self, ids: torch.Tensor):
        self.state.reset()
        out = self.target.forward(ids)
        self.state.discard()
        labels = out.logits.argmax(-1)  # labels[p]: the target's token for position p + 1
        return (out.features, labels, self.model.norm(out.hidden)) if self.hidden else (out.features, labels)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor):
        if not self.graphed or ids.shape[0] != self.seq_len:
            return self._pass(ids)
        if self.graph is None:
            static = torch.zeros(self.seq_len, dtype=torch.long, device=ids.device)
            self.graph = (*graphs.capture(lambda: self._pass(static)), static)
        graph, outputs, static = self.graph
        static.copy_(ids)
        graph.replay()
        # the graph's buffers are rewritten by the next replay (features are None when no layer is captured)
        return tuple(None if t is None else t.clone() for t in outputs)


def frozen_target(run: DrafterTraining, trained: torch.nn.Module, device: torch.device, dtype, ranks: Ranks):
    """(the target, whether its layers are sharded across the ranks): whole on this rank's device, or loaded on the
    CPU and sharded layer by layer onto the GPUs (Ranks.shard_layers) when shards_target says so."""
    sharded = ranks.world > 1 and shards_target(run, trained, device)
    model, _ = load_target(run.target, "cpu" if sharded else device, dtype)
    if sharded:
        ranks.shard_layers(model, device)
    return model, sharded


def shards_target(run: DrafterTraining, trained: torch.nn.Module, device: torch.device) -> bool:
    """--target-sharding: fsdp, replicate, or auto: sharded when the target's weights (as bf16) beside the trained
    module's training state (fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter) would take more
    than 3/4 of one GPU (the rest is for activations). A 27B target (54 GB) with the published drafter (1.9B
    parameters, 31 GB) stays whole on a 141 GB H200 and is sharded on 80 GB cards."""
    if run.target_sharding != "auto":
        return run.target_sharding == "fsdp"
    if device.type != "cuda":
        return False
    stored = sum(f.stat().st_size for f in checkpoint_files(Path(run.target)))
    weights = stored * 2 // stored_dtype(Path(run.target)).itemsize
    state = 16 * sum(p.numel() for p in trained.parameters())
    return weights + state > 0.75 * torch.cuda.get_device_properties(device).total_memory


def step_sequences(run: DrafterTraining) -> int:
    """Training sequences per step (what the ranks share)."""
    from .dflash2 import step_shape
    from .mtp import step_sequences as mtp_sequences

    return step_shape(run)[0] if run.kind == "dflash2" else mtp_sequences(run.batch_tokens, run.seq_len)


def train(run: DrafterTraining, log=print) -> dict:
    """Train, checkpoint, evaluate; returns the summary (also written to OUT/training.json, or for kind mtp to
    OUT/mtp_training.json beside the copied target's own). Under torchrun, in every process: rank 0 writes and logs,
    every rank returns the same summary."""
    from ..engine.load import resolve_device

    target_config = check_run(run)
    device = rank_device(resolve_device(run.device))
    run = replace(run, compile=compiles(run.compile, device))
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise BlockspecError(f"local rank {device.index} has no GPU ({torch.cuda.device_count()} visible): run at "
                             "most one process per GPU")
    with process_group(device) as ranks, output_folder(Path(run.out)) if ranks.main else nullcontext():
        return _train(run, target_config, device, ranks, log if ranks.main else lambda *_: None)


def _train(run: DrafterTraining, target_config: TargetConfig, device: torch.device, ranks: Ranks, log) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = Tokenizer(run.target, target_config.eos_token_ids)
    tokenizer.check_fits(target_config.vocab_size, run.target)
    eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    # nothing is held out that no evaluation would read
    share = 0 if run.eval_data or not run.eval_cuts else run.heldout
    sequences, heldout = split_corpus(run.data, tokenizer, run.seq_len, share, run.seed, eos, run.suffixes)
    if run.eval_data:
        heldout = evaluation_corpus(run.eval_data, tokenizer, run.seq_len, eos, run.suffixes)
    if run.eval_every and not heldout:
        raise BlockspecError("--eval-every: the data leave no held-out sequence to evaluate on (more texts, or a "
                             "larger --heldout)")
    out = Path(run.out)
    stored = stored_dtype(Path(run.target))  # trained weights are written in the target's own dtype
    if run.kind == "dflash2":
        from .dflash2 import dflash2_step, drafter_config, mask_token, new_drafter, step_shape

        config = drafter_config(target_config, run, mask_token(tokenizer, target_config.vocab_size))
        layer_ids = config["dflash_config"]["target_layer_ids"]
        module = new_drafter(config, run.seed, device, torch.float32)  # fp32 master weights; autocast runs bf16
        model, sharded = frozen_target(run, module, device, dtype, ranks)
        features = TargetFeatures(model, layer_ids, run.seq_len, device, dtype, graphed=not sharded)
        step_loss = dflash2_step(module, model, features, sequences, run, ranks)
        def save(directory):
            with staged(directory) as staging:
                module.save_pretrained(staging, state_dict={k: v.to(stored) for k, v in module.state_dict().items()})
        rows = math.prod(step_shape(run)) * run.block_size
        what = f"a DFlash2 drafter reading target layers {layer_ids}"
    else:
        from .mtp import MTP_SUMMARY, MTPModule, copy_target, mtp_step, save_head, text_config

        module = MTPModule(text_config(Path(run.target)), run.seed).to(device)
        model, sharded = frozen_target(run, module, device, dtype, ranks)
        if ranks.main:
            copy_target(Path(run.target), out)  # again on --resume: the copy's files are rewritten as they were
        target = TargetFeatures(model, (), run.seq_len, device, dtype, graphed=not sharded, hidden=True)
        head = ranks.replicate(module, device)
        step_loss = mtp_step(torch.compile(head) if run.compile else head, model, target, sequences, run.batch_tokens,
                             ranks)

        def save(directory):
            if directory != out and not (directory / "config.json").is_file():
                copy_target(out, directory, link=True)  # OUT/best: a copy of the run's copy, with its own head
            save_head(module, directory, stored)
        rows = step_sequences(run) * (run.seq_len - 2)
        what = "an MTP head"
    trainer = Trainer(module, out, run.lr, device, save, run.checkpoint_every, run.seed, settings_to_save(run),
                      ranks, run_inputs(run))
    if run.resume:
        trainer.resume()
    steps = run.steps if run.tokens is None else math.ceil(run.tokens / rows)
    where = f"{device.type} x {ranks.world} processes" if ranks.world > 1 else str(device)
    if sharded:
        where += " (the target's layers sharded across them, FSDP2)"
    log(f"train-drafter: {len(sequences)} training / {len(heldout)} held-out sequences of {run.seq_len} tokens; "
        f"{sum(p.numel() for p in module.parameters()) / 1e6:.1f}M parameters of {what}; {plural(steps, 'step')} of "
        f"{rows} tokens on {where}")

    # evaluations run the frozen target itself when it is whole here, not a second copy of it
    shared = {} if sharded else {"target": model, "head": module if run.kind == "mtp" else None, "stored": stored}

    def measure() -> dict:  # --eval-every's evaluation, one line each as it comes (the bar shows only the last)
        measured = evaluate(run, out, heldout, device, **shared)
        log(f"step {trainer.step}: mean accepted length {measured['mean_accepted_length']:.3f} over "
            f"{measured['cuts']} held-out contexts")
        return measured
    tokens_per_s = trainer.fit(steps, step_loss, measure if run.eval_every else None, run.eval_every)
    summary = {"kind": run.kind, "steps": steps, "training_tokens_per_s": round(tokens_per_s, 1),
               "history": trainer.history}
    if trainer.evaluations:
        summary.update(evaluations=trainer.evaluations, best=trainer.best)
        log(f"best: step {trainer.best['step']} (mean accepted length {trainer.best['mean_accepted_length']:.3f}), "
            f"its weights in {out / BEST}")
    if run.eval_cuts and heldout:
        last = trainer.evaluations[-1] if trainer.evaluations else {}
        final = {k: v for k, v in last.items() if k != "step"} if last.get("step") == steps else None
        summary["evaluation"] = final or ranks.from_main(evaluate(run, out, heldout, device, **shared) if ranks.main
                                                          else None)
        log(f"held-out: mean accepted length {summary['evaluation']['mean_accepted_length']:.3f} per cycle over "
            f"{summary['evaluation']['cuts']} contexts")
    if ranks.main:
        write_summary(out, summary, MTP_SUMMARY if run.kind == "mtp" else "training.json")
    return summary


def evaluate(run: DrafterTraining, out: Path, heldout: list[Sequence], device: torch.device, target=None,
             head: torch.nn.Module | None = None, stored: torch.dtype | None = None) -> dict:
    """One-cycle acceptance of what was just written, on the held-out sequences (train/evaluate.py): the drafter's
    chain (no draft tree, whatever the default budget), so that it compares with an MTP head's; on a GPU an eager
    engine (no graph capture nor compilation at each evaluation). `target`: the frozen target already loaded (whole
    on this device), which the engine then runs instead of a second copy (a 27B would not fit twice beside the
    training); `head`: kind mtp's trained head, whose tensors (as written, in `stored`) the engine takes in place of
    the copy's file."""
    from ..config import PredictConfig
    from ..engine.engine import Engine

    gpu = {"gpu_ranks": [device.index], "compile_mode": -1} if device.type == "cuda" else {}  # rank_device's GPU
    chain = {"dflash2_model": str(out), "dflash2_tree_budget": 0} if run.kind == "dflash2" else {}
    # a whole training sequence and a few cycles past it, within the target's positions (a sequence longer than
    # the context is measured in pieces, evaluate.one_cycle_acceptance)
    positions = TargetConfig.from_file(Path(run.target) / "config.json").max_position_embeddings
    config = PredictConfig.build({"model": str(out if run.kind == "mtp" else run.target), "mode": run.kind,
                                  "device": device.type, **gpu, **chain,
                                  "compute_dtype": "float32" if device.type == "cpu" else "bfloat16",
                                  "context_length": min(run.seq_len + 4 * run.block_size, positions)})
    given = {}  # what stands in for the checkpoint's tensors
    if target is not None:
        given["model"] = modules_over_the_same_tensors(target)
        if head is not None:
            given["mtp_tensors"] = head.checkpoint_tensors(stored)
    engine = Engine(config, **given)
    return one_cycle_acceptance(engine, [s.ids.tolist() for s in heldout], run.eval_cuts, run.seed,
                                trained=[s.trained.tolist() for s in heldout])


def modules_over_the_same_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree that holds the model's own tensors, none copied: the engine wraps and replaces the
    copy's projections as it loads, and the frozen target the training runs stays as it was."""
    tensors = {id(t): t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)}
    tensors.update({id(t): t for t in (*model.parameters(), *model.buffers())})
    return copy.deepcopy(model, tensors)
