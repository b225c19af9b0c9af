"""Helpers shared by the command-line entry points (cli, bench, chat): engine flags and the config they build,
streamed text, the stats line. None of those entry points imports another."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import DEFAULT_TREE_BUDGETS, MAX_SEED, SAMPLING_KEYS, PredictConfig
from .errors import BlockspecError

DTYPES = ["float32", "bfloat16", "float16"]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: argparse's own when it has a value (flags that are off by default
    and options without a value show none), unless the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower()
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class OneLineParser(argparse.ArgumentParser):
    """Parse errors become one BlockspecError line (main prints it after its one 'blockspec: error:' prefix)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise BlockspecError(f"{message} (see {self.prog} --help)")


def config_default(key: str) -> str:
    """'(default: VALUE, config key KEY)': the default of a flag that overrides a PredictConfig key."""
    value = PredictConfig.model_fields[key].default
    return f"(default: {value}, config key {key})"


def add_engine_args(p: argparse.ArgumentParser, model_required=True, sampling_scope: str = "every request"):
    p.add_argument("--model", required=model_required and False, metavar="DIR",
                   help="Hugging Face checkpoint directory (config key model)")
    p.add_argument("--config", metavar="YAML", help="PredictConfig YAML file (command-line flags override it)")
    p.add_argument("--mode", choices=["none", "mtp", "dflash2"], help="decoding mode (default: none, or dflash2 "
                   "when a drafter is given; config key mode)")
    p.add_argument("--drafter", metavar="DIR", help="DFlash2 drafter directory (default: none, config key "
                   "dflash2_model)")
    p.add_argument("--tree-budget", type=int, metavar="N", help="dflash2: verify a tree of N draft nodes per cycle "
                   "(the greedy chain and the drafter's next most likely continuations); 0: the chain alone "
                   f"(default: {DEFAULT_TREE_BUDGETS['cuda']} on a GPU, {DEFAULT_TREE_BUDGETS['cpu']} on the CPU; "
                   "config key dflash2_tree_budget)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="where to run; auto: cuda when available "
                   + config_default("device"))
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype " + config_default("compute_dtype"))
    p.add_argument("--context-length", type=int, metavar="N", help="tokens the KV cache holds: prompt + reply must "
                   "fit " + config_default("context_length"))
    p.add_argument("--prefill-chunk-size", type=int, metavar="N", help="prompt tokens per prefill pass "
                   + config_default("prefill_chunk_size"))
    p.add_argument("--max-tokens", type=int, metavar="N", help="most tokens to generate (chat: per reply; serve: "
                   "the cap of a request without max_tokens) " + config_default("max_tokens"))
    p.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false", default=None,
                   help="prefill every prompt whole instead of resuming the last request's state where the prompt "
                   "starts with its tokens (default: reuse, config key prefix_reuse)")
    add_sampling_args(p, sampling_scope)
    add_weight_args(p)


def add_sampling_args(p: argparse.ArgumentParser, scope: str):
    """The sampling flags; their values are checked by PredictConfig, which names the key. Filters apply in this
    order: temperature, top-k, top-p, min-p (as vLLM and transformers)."""
    group = p.add_argument_group("sampling", f"how tokens are chosen ({scope}): temperature 0 is greedy; above 0 "
                                 "the filters apply in the order temperature, top-k, top-p, min-p")
    group.add_argument("--temperature", type=float, metavar="T", help="0: greedy; above 0: sample "
                       + config_default("temperature"))
    group.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens; 0: no limit "
                       + config_default("top_k"))
    group.add_argument("--top-p", type=float, metavar="P", help="sample among the most likely tokens whose "
                       "probability reaches P, in (0, 1] " + config_default("top_p"))
    group.add_argument("--min-p", type=float, metavar="P", help="drop tokens less likely than P times the most "
                       "likely one, in [0, 1] " + config_default("min_p"))
    group.add_argument("--seed", type=check_seed, metavar="N", help="seed of sampling, 0..2^63-1: the same seed "
                       "repeats a request's tokens (default: fresh randomness per request, config key seed)")


def sampling_overrides(args) -> dict:
    return {key: getattr(args, key) for key in SAMPLING_KEYS}


def add_weight_args(p: argparse.ArgumentParser):
    """Quantization, packing, draft-head and execution flags (values are checked by PredictConfig, which names the
    key)."""
    p.add_argument("--target-quantization", metavar="none|int4|fp8",
                   help="int4: RTN group 128 at load; fp8: e4m3 with 128x128 block scales, at load "
                   + config_default("target_quantization"))
    p.add_argument("--vocabulary-quantization", metavar="none|int8|int4",
                   help="the shared head (group 128) " + config_default("vocabulary_quantization"))
    p.add_argument("--dflash2-quantization", metavar="none|int8",
                   help="the drafter's projections (group 32) " + config_default("dflash2_quantization"))
    p.add_argument("--fuse-kvq", action="store_true", default=None,
                   help="pack q/k/v (and DeltaNet in_proj_*): always on, accepted for existing recipes")
    p.add_argument("--fuse-gate", action="store_true", default=None,
                   help="pack MLP gate/up projections: always on, accepted for existing recipes")
    p.add_argument("--eager", action="store_true", default=None,
                   help="run eagerly instead of replaying CUDA graphs (compile_mode -1; debugging). Default on CUDA: "
                        "graphs; the CPU always runs eagerly")
    p.add_argument("--dflash2-block-size", type=int, metavar="N",
                   help="run the DFlash2 drafter with blocks of N rows (N - 1 proposals), at most the block it was "
                   "trained with (default: that block; config key dflash2_block_size)")
    p.add_argument("--tree-lookup", type=int, metavar="N", help="dflash2 with a tree: the last N of its nodes hold a "
                   "branch copied from the context, the tokens that followed the latest earlier occurrence of its "
                   "last tokens " + config_default("dflash2_tree_lookup"))
    p.add_argument("--draft-vocabulary", type=_count_or_path, metavar="N|FILE",
                   help="proposals (mtp, dflash2) over token ids 0..N-1 (+ EOS) or a JSON list of ids; 0: all "
                   + config_default("draft_vocabulary"))


def weight_overrides(args) -> dict:
    return {"target_quantization": args.target_quantization, "vocabulary_quantization": args.vocabulary_quantization,
            "dflash2_quantization": args.dflash2_quantization, "fuse_kvq": args.fuse_kvq, "fuse_gate": args.fuse_gate,
            "draft_vocabulary": args.draft_vocabulary, "compile_mode": -1 if args.eager else None,
            "dflash2_block_size": args.dflash2_block_size, "dflash2_tree_lookup": args.tree_lookup}


def _count_or_path(text: str) -> int | str:
    digits = text.lstrip("-")
    return int(text) if digits.isascii() and digits.isdigit() else text  # "٥" is a file name, not 5


def engine_config(args) -> PredictConfig:
    overrides = {"model": args.model, "mode": args.mode, "dflash2_model": args.drafter,
                 "dflash2_tree_budget": args.tree_budget, "device": args.device,
                 "compute_dtype": args.dtype, "context_length": args.context_length,
                 "prefill_chunk_size": args.prefill_chunk_size, "max_tokens": args.max_tokens,
                 "prefix_reuse": args.prefix_reuse,
                 **sampling_overrides(args), **weight_overrides(args), "load_progress": True}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.config:
        config = PredictConfig.from_yaml(args.config, **overrides)
    else:
        config = PredictConfig.build(overrides, source="command line")
    return config


def check_seed(text: str) -> int:
    """argparse type of the seed flags: an integer in 0..2^63-1 (what torch's generators take)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{seed} is outside 0..2^63-1")
    return seed


def utf8_text(text: str) -> str:
    """argparse type of text flags: bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer
    takes: refused, naming the first."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (character {exc.start})") from None
    return text


def check_output_path(flag: str, path: str, inputs=()) -> Path:
    """Before long work, make sure a file can be written at `path` (missing parent folders are created to try it); a
    folder, or a place that cannot be written, is refused in one line naming the flag, and so is one of the run's
    `inputs` ((flag, file or folder, or None) pairs) or a place inside an input folder, which the result would
    overwrite. Leaves no new file or folder behind, whatever comes of it: the writer creates the folders when it
    writes (`write_output`), so a run refused later makes none."""
    if not path or path.endswith(("/", os.sep)):  # Path() would drop the separator and write onto what it names
        raise BlockspecError(f"{flag} '{path}': give a file name (the path is empty or ends in a separator)")
    target = os.path.realpath(path)
    for name, given in inputs:
        if not given:
            continue
        source = os.path.realpath(given)
        if target == source or os.path.isdir(source) and target.startswith(source.rstrip(os.sep) + os.sep):
            what = "is" if target == source else "is inside"
            raise BlockspecError(f"{flag} {path}: {what} the run's input {name} {given}, which it would overwrite; "
                                 "give another file to write")
    path = Path(path)
    # os.path's checks, not Path's: a name too long for the file system is a place that cannot be written, where
    # Path.exists raises
    if os.path.isdir(path):
        raise BlockspecError(f"{flag} {path}: is a folder; give a file name")
    existing = next(folder for folder in [path.parent, *path.parent.parents] if os.path.exists(folder))
    if not existing.is_dir():
        raise BlockspecError(f"{flag} {path}: {existing} is a file, not a folder")
    try:
        created = create_folders(path.parent)
    except OSError as exc:
        raise BlockspecError(f"{flag} {path}: cannot create the folder {path.parent} "
                             f"({exc.strerror or exc})") from None
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise BlockspecError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
    finally:
        if not existed and os.path.exists(path):
            path.unlink()
        remove_folders(created)
    return path


def write_output(path: str | Path, text: str) -> None:
    """Write a result file checked by check_output_path, creating its missing folders now."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def create_folders(folder: Path) -> list[Path]:
    """Create folder and its missing parents; returns those created, deepest first (what remove_folders takes).
    When one cannot be created, those created before it are removed and the error propagates."""
    missing = [parent for parent in [folder, *folder.parents] if not os.path.exists(parent)]
    created = []
    try:
        for parent in reversed(missing):
            parent.mkdir()
            created.insert(0, parent)
    except BaseException:
        remove_folders(created)
        raise
    return created


def remove_folders(folders: list[Path]) -> None:
    """Remove the folders, deepest first, each only while empty: whatever was put in one since keeps it and the
    folders above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def stream_text(engine, tokens_iter, out=sys.stdout, stops=None) -> tuple[list[int], str]:
    """Print text as tokens arrive (models/text.py ReplyText: multi-byte characters come out whole, and each token
    decodes only the text since the last one given out whole); with `stops` (models/text.py Stops) the text ends
    before the first stop string and the generation at the token that completes it. Returns the tokens generated
    (through a stop's) and the text printed."""
    from .models.text import ReplyText, Stops

    reply, printed = ReplyText(engine.tokenizer, stops or Stops()), []
    try:
        for token in tokens_iter:
            printed.append(reply.push([token]))
            if printed[-1]:
                out.write(printed[-1])
                out.flush()
            if reply.stop_reason is not None:
                break
    finally:
        if hasattr(tokens_iter, "close"):
            tokens_iter.close()  # after a stop: the engine stops at its next token
    printed.append(reply.finish())
    out.write(printed[-1])
    out.flush()
    return reply.tokens, "".join(printed)


def describe_sampling(sampling: dict) -> str:
    """'greedy', or the settings of a sampled request, e.g. 'temperature 0.7, top-k 20, top-p 0.8, seed 5' (filters
    that do nothing left out)."""
    if not sampling.get("temperature"):
        return "greedy"
    parts = [f"temperature {sampling['temperature']:g}"]
    for key, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
        if sampling.get(key, neutral) != neutral:
            parts.append(f"{key.replace('_', '-')} {sampling[key]:g}")
    seed = sampling.get("seed")
    return ", ".join(parts + [f"seed {seed}" if seed is not None else "fresh seed per request"])


def format_stats(stats: dict) -> str:
    mode = stats.get("mode", "none") + (f", tree of {stats['tree_budget']}" if stats.get("tree_budget") else "") + (
        f" (lookup {stats['tree_lookup']})" if stats.get("tree_lookup") else "")
    line = (f"[{mode}] generated {stats['generated']} tokens, prefill {stats['prefill_s']:.3f} s, "
            f"decode {stats['decode_tokens_per_s']:.1f} tokens/s")
    if "acceptance_rate" in stats:
        line += (f", {stats['cycles']} cycles, mean accepted length {stats['mean_accepted_length']:.2f}, "
                 f"acceptance {100 * stats['acceptance_rate']:.1f}%")
    return line
