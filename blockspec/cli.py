"""Command line: `blockspec generate | demo | bench | chat | serve`.

User errors print one line (`blockspec: error: ...`) and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .config import PredictConfig
from .errors import BlockspecError

DTYPES = ["float32", "bfloat16", "float16"]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise BlockspecError(f"{self.prog}: {message}")


def add_engine_args(p: argparse.ArgumentParser, model_required=True):
    p.add_argument("--model", required=model_required and False, help="Hugging Face checkpoint directory")
    p.add_argument("--config", help="PredictConfig YAML file (command-line flags override it)")
    p.add_argument("--mode", choices=["none", "mtp", "dflash2"], help="decoding mode (default: none, or dflash2 "
                   "when a drafter is given)")
    p.add_argument("--drafter", help="DFlash2 drafter directory (sets dflash2_model)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype")
    p.add_argument("--context-length", type=int)
    p.add_argument("--prefill-chunk-size", type=int)
    p.add_argument("--max-tokens", type=int)
    add_weight_args(p)


def add_weight_args(p: argparse.ArgumentParser):
    """Quantization, packing and draft-head flags (values are checked by PredictConfig, which names the key)."""
    p.add_argument("--target-quantization", help="none | int4 (RTN group 128 at load)")
    p.add_argument("--vocabulary-quantization", help="none | int8 | int4: the shared head (group 128)")
    p.add_argument("--dflash2-quantization", help="none | int8: the drafter's projections (group 32)")
    p.add_argument("--fuse-kvq", action="store_true", default=None, help="pack q/k/v (and DeltaNet in_proj_*)")
    p.add_argument("--fuse-gate", action="store_true", default=None, help="pack MLP gate/up projections")
    p.add_argument("--draft-vocabulary", type=_count_or_path, metavar="N|FILE",
                   help="proposals (mtp, dflash2) over token ids 0..N-1 (+ EOS) or a JSON list of ids; 0: all")


def weight_overrides(args) -> dict:
    return {"target_quantization": args.target_quantization, "vocabulary_quantization": args.vocabulary_quantization,
            "dflash2_quantization": args.dflash2_quantization, "fuse_kvq": args.fuse_kvq, "fuse_gate": args.fuse_gate,
            "draft_vocabulary": args.draft_vocabulary}


def _count_or_path(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def engine_config(args) -> PredictConfig:
    overrides = {"model": args.model, "mode": args.mode, "dflash2_model": args.drafter, "device": args.device,
                 "compute_dtype": args.dtype, "context_length": args.context_length,
                 "prefill_chunk_size": args.prefill_chunk_size, "max_tokens": args.max_tokens,
                 **weight_overrides(args)}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.config:
        return PredictConfig.from_yaml(args.config, **overrides)
    return PredictConfig.build(overrides, source="command line")


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise BlockspecError(f"--prompt-ids must be comma-separated integers (got {text!r})") from None


def prompt_tokens(engine, args) -> list[int]:
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids)
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.chat_prompt([{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def stream_text(engine, tokens_iter, out=sys.stdout) -> list[int]:
    """Print text as tokens arrive (decoding the whole tail so multi-byte characters come out whole)."""
    tokens, shown = [], ""
    for token in tokens_iter:
        tokens.append(token)
        text = engine.tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    return tokens


def cmd_generate(args):
    from .engine.engine import Engine

    if (args.prompt is None) == (args.prompt_ids is None):
        raise BlockspecError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if args.chat and args.prompt_ids is not None:
        raise BlockspecError("--chat needs --prompt TEXT, not --prompt-ids")
    config = engine_config(args)
    engine = Engine(config)
    ids = prompt_tokens(engine, args)
    if args.prompt is not None and not ids:
        raise BlockspecError("the prompt is empty: give some text")
    engine.check_request(ids, config.max_tokens)
    if args.json:
        result = engine.generate(ids, config.max_tokens)
        print(json.dumps({"tokens": result.tokens, "text": result.text, "stats": result.stats}))
    else:
        stream_text(engine, engine.stream(ids, config.max_tokens))
        print()
        print(format_stats(engine.last_stats), file=sys.stderr)


def format_stats(stats: dict) -> str:
    line = (f"[{stats.get('mode', 'none')}] generated {stats['generated']} tokens, prefill {stats['prefill_s']:.3f} s, "
            f"decode {stats['decode_tokens_per_s']:.1f} tokens/s")
    if "acceptance_rate" in stats:
        line += (f", {stats['cycles']} cycles, mean accepted length {stats['mean_accepted_length']:.2f}, "
                 f"acceptance {100 * stats['acceptance_rate']:.1f}%")
    return line


def cmd_demo(args):
    from .engine.engine import Engine
    from .tiny import build_tiny_checkpoint, build_tiny_drafter

    print("blockspec demo: a tiny Qwen3.5-architecture model (4 layers: 3 Gated DeltaNet + 1 gated attention, "
          "hidden 64, one MTP layer, byte-level tokenizer) and a tiny DFlash2 drafter, built on the spot from seeded "
          "RANDOM weights, planted so that greedy text mostly walks the alphabet. The text means nothing; the point "
          "is the engine running end to end on the CPU, and every speculative mode giving plain greedy's tokens.\n")
    with tempfile.TemporaryDirectory(prefix="blockspec-demo-") as directory:
        target = build_tiny_checkpoint(f"{directory}/target", seed=0, planted=True)
        drafter = build_tiny_drafter(f"{directory}/drafter", target)
        outputs = {}
        for mode in ("none", "mtp", "dflash2"):
            engine = Engine(PredictConfig.build({"model": str(target), "mode": mode, "device": "cpu",
                                                 "compute_dtype": "float32", "context_length": 512,
                                                 "dflash2_model": str(drafter) if mode == "dflash2" else None}))
            ids = engine.tokenizer.encode(engine.tokenizer.chat_prompt(
                [{"role": "user", "content": "Recite the alphabet, please."}]))
            print(f"--- mode {mode} ---")
            outputs[mode] = stream_text(engine, engine.stream(ids, args.max_tokens, stop_at_eos=False))
            print()
            print(format_stats(engine.last_stats))
        same = outputs["none"] == outputs["mtp"] == outputs["dflash2"]
        print(f"\nmtp and dflash2 outputs identical to plain greedy: {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(1)


def cmd_chat(args):
    from .chat import run_chat
    from .engine.engine import Engine

    config = engine_config(args)
    run_chat(Engine(config), config.max_tokens, system=args.system)


def cmd_serve(args):
    from .server import serve  # fails with a one-line hint when the 'serve' extras are missing
    from .engine.engine import Engine

    config = engine_config(args)
    serve(Engine(config), host=args.host, port=args.port, queue_size=args.queue_size)


def cmd_draft_vocabulary(args):
    """Count token frequencies over the user's texts and write the most frequent ids (a `draft_vocabulary` file)."""
    from .config import TargetConfig
    from .layers.draft_head import coverage, most_frequent_ids
    from .tokenizer import Tokenizer

    if args.size < 1:
        raise BlockspecError(f"--size must be at least 1, got {args.size}")
    target = TargetConfig.from_file(Path(args.model) / "config.json")
    tokenizer = Tokenizer(args.model, target.eos_token_ids)
    texts = []
    for name in args.texts:
        try:
            texts.append(Path(name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise BlockspecError(f"--texts {name}: {getattr(exc, 'strerror', None) or exc}") from None
    token_lists = [tokenizer.encode(text) for text in texts]
    ids = most_frequent_ids(token_lists, args.size, target.vocab_size, tokenizer.eos_token_ids)
    try:
        Path(args.out).write_text(json.dumps(ids))
    except OSError as exc:
        raise BlockspecError(f"--out {args.out}: {exc.strerror}") from None
    prefix = range(min(args.size, target.vocab_size))
    print(f"wrote {len(ids)} ids to {args.out}: they cover {100 * coverage(ids, token_lists):.1f}% of the "
          f"{sum(map(len, token_lists))} tokens of the texts (ids 0..{args.size - 1}: "
          f"{100 * coverage(prefix, token_lists):.1f}%)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="blockspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = sub.add_parser("generate", help="greedy generation from a prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt")
    gen.add_argument("--prompt-ids", help="comma-separated token ids")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, stats")
    gen.set_defaults(func=cmd_generate)

    from .bench import add_bench_parser
    add_bench_parser(sub)

    demo = sub.add_parser("demo", help="run end to end on a tiny built-in random model (CPU)")
    demo.add_argument("--max-tokens", type=int, default=120)
    demo.set_defaults(func=cmd_demo)

    vocab = sub.add_parser("draft-vocabulary", help="write the ids most frequent in your texts, for draft_vocabulary")
    vocab.add_argument("--model", required=True, help="checkpoint directory (its tokenizer and config.json)")
    vocab.add_argument("--texts", nargs="+", required=True, help="UTF-8 text files like your traffic")
    vocab.add_argument("--size", type=int, default=32768, help="ids to keep (the EOS ids are added)")
    vocab.add_argument("--out", required=True, help="JSON file to write (pass it as --draft-vocabulary)")
    vocab.set_defaults(func=cmd_draft_vocabulary)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (chat template, streamed replies)")
    add_engine_args(chat)
    chat.add_argument("--system", help="system prompt")
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--queue-size", type=int, default=8, help="requests that may wait for the engine (more: 429)")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except BlockspecError as exc:
        print(f"blockspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
