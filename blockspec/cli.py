"""`blockspec generate | chat | serve | bench | demo | draft-vocabulary | train-target | train-drafter | regenerate`.

User errors print one line (`blockspec: error: ...`) and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from pathlib import Path

from . import __version__
from .cli_common import (OneLineParser, add_engine_args, check_output_path, check_seed, describe_sampling, engine_config,
                         format_stats, stream_text, utf8_text, write_output)
from .config import ServerSettings, unused_sampling
from .errors import BlockspecError

def parse_prompt_ids(text: str) -> list[int]:
    if not text.strip():
        return []
    ids = [t.strip() for t in text.split(",")]
    if not all(re.fullmatch(r"[0-9]+", t, re.ASCII) for t in ids):
        raise BlockspecError(f"--prompt-ids must be comma-separated token ids, integers from 0 (got {text!r})")
    return [int(t) for t in ids]


def prompt_tokens(engine, args) -> list[int]:
    """The --prompt text's tokens: as a chat's user turn with --chat."""
    if args.chat:
        return engine.tokenizer.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    return engine.tokenizer.encode(args.prompt)


def served_context(config) -> tuple[int, str, str]:
    """The context_length the load will serve: the config's, fitted to the checkpoint's config.json
    (engine/load.fit_context) where that is readable. With what to say of it in an error: where a lower limit came
    from, and how to make room (the context raised only below the checkpoint's positions)."""
    from .config import TargetConfig
    from .engine.load import fit_context

    context, limit, where = config.context_length, None, ""
    path = Path(config.model or "") / "config.json"
    try:
        readable = bool(config.model) and path.is_file()
    except OSError:  # a folder that cannot be read: the load refuses it, naming it
        readable = False
    if readable:  # a missing config.json is refused by the load
        target = TargetConfig.from_file(path)
        limit, fitted = target.max_position_embeddings, config.model_copy()
        fit_context(fitted, target, str(path))
        if fitted.context_length < context:
            context, where = fitted.context_length, f" (the max_position_embeddings of {path})"
    return context, where, "" if limit is not None and context >= limit else " or raise --context-length"


def check_reply_room(config):
    """max_tokens below the context_length served, which must also hold a prompt of one token or more: refused
    before the load (a prompt's own length is checked once it is tokenized)."""
    context, where, or_raise = served_context(config)
    if config.max_tokens >= context:
        raise BlockspecError(f"max_tokens {config.max_tokens} is not below context_length {context}{where}: "
                             f"no room is left for the prompt (lower --max-tokens{or_raise})")


def check_chat_template(config, command: str, system: str | None = None):
    """A chat needs the checkpoint's chat template: refused before the load where the tokenizer has none; so is a
    system prompt that leaves no room in the context for a message."""
    from .models.tokenizer import Tokenizer

    if not (config.model and (Path(config.model) / "tokenizer.json").is_file()):  # the load refuses the folder
        return
    tokenizer = Tokenizer(config.model)
    if tokenizer.chat_template is None:
        raise BlockspecError(f"{command} renders messages with the checkpoint's chat template, but {config.model} "
                             "has none (tokenizer_config.json's chat_template, or chat_template.jinja)")
    if system:
        ids = tokenizer.chat_prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": ""}])
        context, where, or_raise = served_context(config)
        if len(ids) >= context:
            raise BlockspecError(f"--system: {len(ids)} tokens with the chat template, but context_length is "
                                 f"{context}{where}: no room is left for a message (shorten it{or_raise})")


def note_unused_sampling(config):
    """The load notes settings that do nothing (engine/load.note_ignored_settings); the sampling keys that greedy
    decoding never reads are noted here, as only generate and chat decode every token at the config's settings."""
    for note in unused_sampling(config):
        print(f"blockspec: note: {note}", file=sys.stderr)


def stop_strings(strings: list[str] | None):
    """generate's and chat's --stop strings as Stops (models/text.py), or the one-line error naming the flag."""
    from .models.text import MAX_STOP_CHARS, MAX_STOPS, Stops

    strings = strings or []
    if "" in strings:
        raise BlockspecError("--stop must not be empty")
    if len(strings) > MAX_STOPS:
        raise BlockspecError(f"--stop may be given at most {MAX_STOPS} times (got {len(strings)})")
    if any(len(s) > MAX_STOP_CHARS for s in strings):
        raise BlockspecError(f"--stop takes at most {MAX_STOP_CHARS} characters")
    return Stops(tuple(dict.fromkeys(strings)))


def cmd_generate(args):
    from .engine.engine import Engine

    if (args.prompt is None) == (args.prompt_ids is None):
        raise BlockspecError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if args.chat and args.prompt_ids is not None:
        raise BlockspecError("--chat needs --prompt TEXT, not --prompt-ids")
    given_ids = None if args.prompt_ids is None else parse_prompt_ids(args.prompt_ids)  # refused before the load
    stops = stop_strings(args.stop)
    config = engine_config(args)
    check_reply_room(config)
    if args.chat:
        check_chat_template(config, "generate --chat")
    note_unused_sampling(config)
    engine = Engine(config)
    ids = given_ids if given_ids is not None else prompt_tokens(engine, args)
    if args.prompt is not None and not ids:
        raise BlockspecError("the prompt is empty: give some text")
    engine.check_request(ids, config.max_tokens)
    if args.json:
        from .engine.memory import report

        result = engine.generate(ids, config.max_tokens, stop=list(stops.strings))
        stats = {**result.stats, "memory": report(engine)}
        print(json.dumps({"tokens": result.tokens, "text": result.text, "stats": stats}))
    else:
        stream_text(engine, engine.stream(ids, config.max_tokens), stops=stops)
        print()
        print(format_stats(engine.last_stats), file=sys.stderr)


def cmd_demo(args):
    if args.max_tokens < 1:
        raise BlockspecError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if args.context_length is not None and args.context_length < 2:
        raise BlockspecError(f"--context-length must be at least 2 (got {args.context_length})")
    from .demo import run_demo, save_pair

    if args.save is not None:
        save_pair(args.save, args.max_tokens, args.context_length)
    else:
        run_demo(args.max_tokens, args.context_length)


def cmd_chat(args):
    from .chat import run_chat
    from .engine.engine import Engine

    if sys.stdin is None or sys.stdin.closed:
        raise BlockspecError("chat reads your messages from standard input, which is closed")
    stops = stop_strings(args.stop)
    config = engine_config(args)
    # a default max_tokens past a short context is not refused: chat limits each reply to the room left (chat.py)
    if "max_tokens" in config.model_fields_set:
        check_reply_room(config)
    check_chat_template(config, "chat", args.system)
    note_unused_sampling(config)
    run_chat(Engine(config), config.max_tokens, system=args.system, stops=stops)


def cmd_serve(args):
    values = {"host": args.host, "port": args.port, "queue_size": args.queue_size, "max_body_mb": args.max_body_mb,
              "receive_timeout_s": args.receive_timeout, "shutdown_grace_s": args.shutdown_grace,
              "allowed_hosts": args.allowed_hosts, "allowed_origins": args.allowed_origins, "api_key": args.api_key,
              "max_connections": args.max_connections}
    settings = ServerSettings(**{k: v for k, v in values.items() if v is not None})
    settings.check()
    from .server import bind_socket, reserve_files, serve  # a one-line hint when the 'serve' extras are missing
    from .engine.engine import Engine

    sock = bind_socket(settings.host, settings.port)  # a busy port is refused now, not after the model has loaded
    reserve_files(settings.max_connections)
    try:
        config = engine_config(args)
        if "max_tokens" in config.model_fields_set:  # a request's own max_tokens is checked as it comes
            check_reply_room(config)
        engine = Engine(config)
        print(f"blockspec: requests that leave out the sampling fields: {describe_sampling(engine.serving_defaults())}",
              flush=True)
        serve(engine, settings, sock=sock)
    finally:
        sock.close()


def comma_list(text: str) -> tuple[str, ...]:
    """argparse type of a comma-separated list of names, spaces around each dropped: an empty entry (',,', a
    trailing comma) or a name with a space in it is refused, never skipped."""
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if not name:
            raise argparse.ArgumentTypeError(f"{text!r} has an empty entry")
        if any(c.isspace() for c in name):
            raise argparse.ArgumentTypeError(f"{text!r}: {name!r} has a space in it")
    return names


def cmd_draft_vocabulary(args):
    """Count token frequencies over the user's texts and write the most frequent ids (a `draft_vocabulary` file)."""
    from .models.checkpoint import check_folder
    from .config import TargetConfig
    from .layers.draft_head import coverage, most_frequent_ids
    from .models.tokenizer import Tokenizer

    if args.size < 1:
        raise BlockspecError(f"--size must be at least 1, got {args.size}")
    target = TargetConfig.from_file(check_folder("--model", args.model) / "config.json")
    if args.size >= target.vocab_size:
        raise BlockspecError(f"--size {args.size} is not smaller than the vocabulary ({target.vocab_size} ids): "
                             "nothing to leave out (draft_vocabulary 0 proposes over every id)")
    texts = []
    for name in args.texts:
        try:
            texts.append(Path(name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise BlockspecError(f"--texts {name}: {getattr(exc, 'strerror', None) or exc}") from None
    tokenizer = Tokenizer(args.model, target.eos_token_ids)
    tokenizer.check_fits(target.vocab_size, args.model)
    token_lists = [tokenizer.encode(text) for text in texts]
    if not any(token_lists):
        raise BlockspecError(f"--texts {' '.join(args.texts)}: no tokens to count (the texts are empty)")
    # after the refusals above: a refused run makes no folder
    check_output_path("--out", args.out, [("--model", args.model), *(("--texts", name) for name in args.texts)])
    ids = most_frequent_ids(token_lists, args.size, target.vocab_size, tokenizer.eos_token_ids)
    try:
        write_output(args.out, json.dumps(ids))
    except OSError as exc:
        raise BlockspecError(f"--out {args.out}: {exc.strerror}") from None
    prefix = range(args.size)
    print(f"wrote {len(ids)} ids to {args.out}: they cover {100 * coverage(ids, token_lists):.1f}% of the "
          f"{sum(map(len, token_lists))} tokens of the texts (ids 0..{args.size - 1}: "
          f"{100 * coverage(prefix, token_lists):.1f}%)")


def training_fields(args, cls) -> dict:
    """The run's settings from the flags given: on --resume the saved run's, with the given ones checked against
    them (train/loop.py); otherwise the given ones (the dataclass has the defaults)."""
    from .train.loop import check_output, resumed_settings

    if args.steps is not None and args.tokens is not None:
        raise BlockspecError(f"--steps {args.steps} and --tokens {args.tokens}: give one of them (--tokens sets the "
                             "steps from the tokens a step trains on)")
    given = {k: v for k, v in vars(args).items() if k in cls.__dataclass_fields__ and v is not None}
    if not args.resume:
        return given
    check_output(Path(args.out), resume=True)
    settings = resumed_settings(Path(args.out), given, cls)
    return {k: v for k, v in settings.items() if k in cls.__dataclass_fields__}


def note_unused_training_flags(args, run):
    """A note on stderr for each flag given that the run does not read: a DFlash2 drafter's shape with --kind mtp,
    --heldout where nothing held out is evaluated. Not refused, and a default (or --heldout 0) never named, as the
    engine's notes (config.unused_settings): a script may give every run the same flags."""
    from .train.run import DFLASH2_ONLY

    def value(flag):
        key = flag[2:].replace("-", "_")
        given = getattr(args, key)
        return None if given == run.__dataclass_fields__[key].default else given
    unused = [f"{flag} {value(flag)} does nothing: --kind mtp trains the target's own MTP head, whose shape is the "
              "target's" for flag in DFLASH2_ONLY if run.kind == "mtp" and value(flag) is not None]
    if value("--heldout") and (run.eval_data or run.eval_cuts == 0):
        unused.append(f"--heldout {args.heldout} does nothing: {'--eval-data is' if run.eval_data else 'nothing is'} "
                      "evaluated on, so every text of --data trains")
    for note in unused:
        print(f"blockspec: note: {note}", file=sys.stderr)


def cmd_train_drafter(args):
    from .train.run import DrafterTraining, launched, train

    if args.target_layer_ids is not None:
        try:
            args.target_layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
        except ValueError:
            raise BlockspecError(f"--target-layer-ids must be comma-separated integers (got "
                                 f"{args.target_layer_ids!r})") from None
    run = DrafterTraining(**training_fields(args, DrafterTraining))
    note_unused_training_flags(args, run)
    if args.nproc is None:
        train(run)
        if launched()[1] > 1:
            end_rank_process()
        return 0
    return launch_processes(run, args.nproc, args.argv)


def end_rank_process():
    """A torchrun process's end once its run is done and written: what it printed flushed, then an exit without the
    interpreter's teardown, where torch's gloo threads at times abort a finished process ("terminate called without
    an active exception"), which torchrun reports as the run's failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_processes(run, processes: int, argv: list[str]) -> int:
    """`train-drafter --nproc N`: the same command under torchrun in N processes on this host (one a GPU), once it
    is checked here (one refusal, not N); its exit status."""
    import subprocess

    import torch

    from .engine.load import resolve_device
    from .train.run import check_run, launched

    if processes < 1:
        raise BlockspecError(f"--nproc must be at least 1 (got {processes})")
    if launched()[1] > 1:
        raise BlockspecError("--nproc starts torchrun itself: leave it out under torchrun")
    check_run(run, world=processes)
    if resolve_device(run.device).type == "cuda" and processes > torch.cuda.device_count():
        raise BlockspecError(f"--nproc {processes}: this host has {torch.cuda.device_count()} GPUs (one process a GPU)")
    rest, skip = [], False
    for arg in argv:  # the command as given, without --nproc
        if skip or arg == "--nproc" or arg.startswith("--nproc="):
            skip = arg == "--nproc"
            continue
        rest.append(arg)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), "-m", "blockspec", *rest]).returncode


def default(cls, name: str) -> str:
    """'(default: VALUE)' of a training flag: the flags themselves default to None, so that --resume can tell the
    ones given from the saved run's."""
    return f"(default: {getattr(cls, name)})"


def add_train_drafter_parser(sub):
    from .train.run import DrafterTraining as D

    p = sub.add_parser("train-drafter", help="train a DFlash2 drafter (or the native MTP head) for a target on your "
                       "text")
    p.add_argument("--target", required=True, metavar="DIR",
                   help="the target's checkpoint directory (frozen; its tokenizer too)")
    p.add_argument("--data", required=True, nargs="+", metavar="PATH",
                   help="text files, .jsonl files (a record a line: {\"messages\": [{\"role\", \"content\"}...]} "
                   "or ShareGPT's {\"conversations\": [{\"from\", \"value\"}...]}, rendered with the target's chat "
                   "template and trained on their assistant turns only; {\"prompt\": ..., \"completion\": ...}, "
                   "trained on the completion; or {\"text\": ...}), or directories of them")
    add_suffixes_arg(p)
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write: the drafter (config.json, "
                   "model.safetensors), or for --kind mtp a copy of the target with its mtp.* tensors")
    p.add_argument("--kind", choices=["dflash2", "mtp"], help="what to train " + default(D, "kind"))
    p.add_argument("--replace-mtp", action="store_true", default=None,
                   help="--kind mtp on a target that already has an MTP head: train a new head in its place")
    p.add_argument("--layers", type=int, metavar="N", help="drafter layers " + default(D, "layers"))
    p.add_argument("--block-size", type=int, metavar="N",
                   help="tokens per block (proposals + 1) " + default(D, "block_size"))
    p.add_argument("--window", type=int, metavar="N",
                   help="sliding window over the target's features " + default(D, "window"))
    p.add_argument("--target-layer-ids", metavar="IDS", help="comma-separated target layers the drafter reads "
                   "(default: five, spread evenly)")
    p.add_argument("--heads", type=int, metavar="N", help="attention heads (default: the target's)")
    p.add_argument("--intermediate-size", type=int, metavar="N", help="MLP width (default: the target's)")
    p.add_argument("--selector-rank", type=int, metavar="N",
                   help="candidate selector rank " + default(D, "selector_rank"))
    p.add_argument("--selector-top-k", type=int, metavar="K",
                   help="candidates per row " + default(D, "selector_top_k"))
    p.add_argument("--loss-decay", type=float, metavar="D",
                   help="row j weighs exp(-(j-1)/decay) " + default(D, "loss_decay"))
    p.add_argument("--eval-cuts", type=int, metavar="N", help="held-out contexts of each one-cycle acceptance "
                   "(at the end, and with --eval-every; 0: none) " + default(D, "eval_cuts"))
    p.add_argument("--eval-data", nargs="+", metavar="PATH", help="evaluate on these files or directories (as "
                   "--data; e.g. text like what the drafter will serve) instead of --heldout's share of --data, "
                   "which then all trains")
    p.add_argument("--eval-every", type=int, metavar="N", help="steps between held-out evaluations (and one at the "
                   "end); the weights of the best mean accepted length are kept in OUT/best (0: none) "
                   + default(D, "eval_every"))
    p.add_argument("--nproc", type=int, metavar="N",
                   help="train in N processes on this host, one a GPU: the same command under torchrun "
                   "(--nproc-per-node N --standalone), started for you")
    p.add_argument("--target-sharding", choices=["auto", "replicate", "fsdp"],
                   help="under torchrun: the frozen target whole on every GPU, or its layers sharded across them "
                   "with FSDP2 (auto: sharded when the target and the training state would take more than 3/4 of "
                   "one GPU) " + default(D, "target_sharding"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the drafter's loss (or the MTP head), forward and backward, through torch.compile: fused "
                   "kernels where a small drafter's step is bound by its launches; the first step pays the "
                   "compilation (default: on CUDA; the CPU runs eagerly)")
    add_training_args(p, D, "block tokens")
    p.set_defaults(func=cmd_train_drafter)


def add_suffixes_arg(p):
    p.add_argument("--suffixes", nargs="+", metavar="SUFFIX", help="file suffixes taken from directories (default: "
                   "common text and source suffixes)")


def add_training_args(p, defaults, unit: str):
    """The optimisation flags every training command takes (train/loop.py). On --resume, those left out are the
    saved run's."""
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps " + default(defaults, "steps"))
    p.add_argument("--tokens", type=int, metavar="N", help=f"train on this many {unit} instead of --steps")
    p.add_argument("--lr", type=float, metavar="LR",
                   help="peak learning rate (linear warm-up, cosine decay) " + default(defaults, "lr"))
    p.add_argument("--batch-tokens", type=int, metavar="N", help=f"{unit} per step " + default(defaults,
                                                                                             "batch_tokens"))
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens per training sequence " + default(defaults, "seq_len"))
    p.add_argument("--heldout", type=float, metavar="SHARE",
                   help="share of the texts held out for evaluation, rounded, at least one text when above 0 "
                   "(train-drafter: none with --eval-cuts 0 or --eval-data) " + default(defaults, "heldout"))
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="steps between checkpoints " + default(defaults, "checkpoint_every"))
    p.add_argument("--seed", type=check_seed, metavar="N",
                   help="seed of sampling and initialisation, 0..2^63-1 " + default(defaults, "seed"))
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out, with its settings (flags "
                   "that would change its model or optimisation are refused; --steps, --tokens, --checkpoint-every, "
                   "--eval-cuts and --eval-every may change)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"],
                   help="auto: the GPU if there is one " + default(defaults, "device"))


def cmd_train_target(args):
    from .train.target import TargetTraining, train_target

    train_target(TargetTraining(**training_fields(args, TargetTraining)))


def add_train_target_parser(sub):
    from .train.target import TargetTraining as T

    p = sub.add_parser("train-target", help="train a small Qwen3.5-architecture target (and its tokenizer) from "
                       "scratch on your text")
    p.add_argument("--data", required=True, nargs="+", metavar="PATH",
                   help="text files, .jsonl files (conversations or {\"text\": ...} records, as train-drafter's; a "
                   "conversation is trained on in full, as its ChatML text), or directories of them")
    add_suffixes_arg(p)
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    p.add_argument("--vocab", type=int, metavar="N", help="byte-level BPE vocabulary size " + default(T, "vocab"))
    p.add_argument("--hidden", type=int, metavar="N", help="hidden size " + default(T, "hidden"))
    p.add_argument("--layers", type=int, metavar="N",
                   help="layers (a multiple of 4: 3 DeltaNet + 1 attention) " + default(T, "layers"))
    p.add_argument("--heads", type=int, metavar="N",
                   help="attention heads (2 key/value heads) " + default(T, "heads"))
    p.add_argument("--intermediate", type=int, metavar="N", help="MLP width " + default(T, "intermediate"))
    add_training_args(p, T, "tokens")
    p.set_defaults(func=cmd_train_target)


def cmd_regenerate(args):
    from .train.regenerate import Regeneration, regenerate

    regenerate(Regeneration(**{k: v for k, v in vars(args).items()
                               if k in Regeneration.__dataclass_fields__ and v is not None}))


def add_regenerate_parser(sub):
    from .train.regenerate import Regeneration as R

    p = sub.add_parser("regenerate", help="write the target's own replies to prompts (conversations, or cuts of "
                       "text), as training data for train-drafter")
    p.add_argument("--target", required=True, metavar="DIR", help="the target's Hugging Face checkpoint directory")
    p.add_argument("--prompts", required=True, nargs="+", metavar="PATH",
                   help=".jsonl conversations (as train-drafter --data reads them; a last assistant turn is dropped "
                   "and generated anew, a conversation that ends with another turn is answered), text files (cut into "
                   "prompts of --prompt-tokens), or directories of them")
    add_suffixes_arg(p)
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="JSONL file to write (its folder must exist): "
                   "a {\"messages\": [...]} record per conversation, the reply last; a {\"prompt\": cut, "
                   "\"completion\": continuation} record per text cut; in the prompts' order")
    p.add_argument("--greedy", action="store_true", default=None,
                   help="greedy replies (default: sampled at the target's generation_config.json: temperature, "
                   "top-k, top-p, min-p; greedy without one)")
    p.add_argument("--temperature", type=float, metavar="T",
                   help="sample at this temperature (generation_config.json's top-k, top-p and min-p still apply)")
    p.add_argument("--max-prompts", type=int, metavar="N",
                   help="answer this many of the prompts, drawn with --seed (default: all)")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="longest reply " + default(R, "max_new_tokens"))
    p.add_argument("--prompt-tokens", type=int, metavar="N",
                   help="tokens of each text cut " + default(R, "prompt_tokens"))
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="prompts per generation pass " + default(R, "batch_size"))
    p.add_argument("--seed", type=check_seed, metavar="N", help="seed of sampling " + default(R, "seed"))
    p.add_argument("--device", choices=["cpu", "cuda", "auto"],
                   help="auto: the GPU if there is one " + default(R, "device"))
    p.set_defaults(func=cmd_regenerate)


def add_serve_parser(sub):
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add_engine_args(serve, sampling_scope="the defaults of requests that leave them out; unset: the checkpoint's "
                    "generation_config.json, else greedy")
    serve.add_argument("--host", default=ServerSettings.host, help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=ServerSettings.port, help="TCP port to listen on (0: any free port)")
    serve.add_argument("--queue-size", type=int, default=ServerSettings.queue_size, metavar="N",
                       help="requests that may wait for the engine (more: HTTP 429)")
    serve.add_argument("--max-body-mb", type=float, default=ServerSettings.max_body_mb, metavar="MB",
                       help="largest request body; larger ones are refused (HTTP 413) before they are read")
    serve.add_argument("--receive-timeout", type=float, default=ServerSettings.receive_timeout_s, metavar="S",
                       help="seconds a client has to send its request: the headers from connecting (then the "
                            "connection is closed), the body after them (then HTTP 408)")
    serve.add_argument("--max-connections", type=int, default=ServerSettings.max_connections, metavar="N",
                       help="connections open at once; past it the one idle the longest is closed (all busy: "
                            "HTTP 503)")
    serve.add_argument("--shutdown-grace", type=float, default=ServerSettings.shutdown_grace_s, metavar="S",
                       help="on SIGTERM, seconds the running request may go on before it is stopped")
    serve.add_argument("--allowed-hosts", type=comma_list, metavar="NAMES",
                       help="comma-separated Host header names (no port: any port matches) accepted besides "
                            "loopback addresses, localhost and --host; bound to a loopback address the Host header "
                            "is always checked, elsewhere only when this is given (*: any) (default: none)")
    serve.add_argument("--allowed-origins", type=comma_list, metavar="ORIGINS",
                       help="comma-separated web page origins (scheme://host:port) allowed to call the server "
                            "from a browser (*: any) (default: none, same-origin only)")
    serve.add_argument("--api-key", metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every /v1 request (default: none)")
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="blockspec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = sub.add_parser("generate", help="generation from a prompt (greedy, or sampled)")
    add_engine_args(gen)
    gen.add_argument("--prompt", metavar="TEXT", type=utf8_text, help="the prompt text (or --prompt-ids)")
    gen.add_argument("--prompt-ids", metavar="IDS", help="the prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    gen.add_argument("--stop", metavar="TEXT", type=utf8_text, action="append",
                     help="end the generation where TEXT first appears, without it (repeatable: the first one met)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, stats")
    gen.set_defaults(func=cmd_generate)

    from .bench import add_bench_parser
    add_bench_parser(sub)

    demo = sub.add_parser("demo", help="run the small trained model and drafters shipped with blockspec on the CPU")
    demo.add_argument("--max-tokens", type=int, default=48, metavar="N", help="tokens each mode generates")
    demo.add_argument("--context-length", type=int, metavar="N",
                      help="tokens the KV cache holds (default: max(512, prompt + max-tokens))")
    demo.add_argument("--save", metavar="DIR", help="instead of running the demo, write its model to DIR/target "
                      "and its DFlash2 drafter to DIR/drafter (DIR new or empty), and print generate / chat / serve "
                      "commands that use them")
    demo.set_defaults(func=cmd_demo)

    vocab = sub.add_parser("draft-vocabulary", help="write the ids most frequent in your texts, for draft_vocabulary")
    vocab.add_argument("--model", required=True, metavar="DIR",
                       help="checkpoint directory (its tokenizer and config.json)")
    vocab.add_argument("--texts", nargs="+", required=True, metavar="FILE", help="UTF-8 text files like your traffic")
    vocab.add_argument("--size", type=int, default=32768, metavar="N", help="ids to keep (the EOS ids are added)")
    vocab.add_argument("--out", required=True, metavar="FILE",
                       help="JSON file to write (pass it as --draft-vocabulary; missing folders are created)")
    vocab.set_defaults(func=cmd_draft_vocabulary)

    add_train_drafter_parser(sub)
    add_train_target_parser(sub)
    add_regenerate_parser(sub)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (chat template, streamed replies)")
    add_engine_args(chat)
    chat.add_argument("--system", metavar="TEXT", type=utf8_text, help="system prompt (default: none)")
    chat.add_argument("--stop", metavar="TEXT", type=utf8_text, action="append",
                      help="end each reply where TEXT first appears, without it (repeatable: the first one met)")
    chat.set_defaults(func=cmd_chat)

    add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    try:
        try:
            argv = sys.argv[1:] if argv is None else list(argv)
            args = build_parser().parse_args(argv)
            args.argv = argv
            status = args.func(args)  # an exit status (train-drafter --nproc: torchrun's), or what the command made
            if isinstance(status, int) and status:
                return status
        finally:
            sys.stdout.flush()  # output still buffered fails here, where it is handled, not at interpreter exit
    except BlockspecError as exc:
        print(f"blockspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as the Python docs' note on SIGPIPE does
        silence_stdout()
        return 1
    except OSError as exc:  # stdout cannot be written (/dev/full, a full disk): one line, like the other errors
        if exc.filename is not None or not (exc.errno in (errno.ENOSPC, errno.EDQUOT) or stdout_failing()):
            raise
        silence_stdout()
        print(f"blockspec: error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def stdout_failing() -> bool:
    """Whether flushing stdout fails now (what failed to go out is still in its buffer): then an OSError without a
    file name came from writing stdout. A full disk is reported the same way whichever output it stopped."""
    try:
        sys.stdout.flush()
    except OSError:
        return True
    return False


def silence_stdout():
    """Point stdout's descriptor at /dev/null, so what is still buffered cannot fail again when Python exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (stdout captured in-process)
        pass


if __name__ == "__main__":
    sys.exit(main())
