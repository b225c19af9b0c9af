"""`blockspec regenerate`: the target's own responses to prompts, written as training data for its drafter.

Prompts are JSONL conversations (train/data.py's records: one that ends with an assistant turn has that turn
dropped; the prompt is the conversation before it, or the whole of one that ends with another turn, rendered with
the target's chat template and generation prompt as the engine's chat renders it), completion records (their
prompt) or texts (text files, `{"text": ...}` records), each cut into consecutive prompts of `prompt_tokens` tokens.
The output holds one record per prompt, in the prompts' order: the conversation with the target's reply as its last
assistant turn (OpenAI style), or `{"prompt": the cut, "completion": its continuation}`; `train-drafter --data`
reads it back, training on the replies and continuations only.

Generation runs transformers' `generate` on the HF model, many prompts per pass (left padded, the longest first),
greedy or sampled at the target's generation_config.json (temperature, top-k, top-p, min-p: what blockspec's own
engine applies from it; without a temperature, greedy; --temperature replaces its temperature). --max-prompts keeps
that many prompts, drawn with the seed from all of them (a corpus cut into more prompts than one wants answered). The output file is written under a temporary name beside it
and renamed once complete: a failure leaves no partial file.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import MAX_SEED, TargetConfig
from ..errors import BlockspecError
from ..files import read_json
from ..models.checkpoint import check_dense_checkpoint, check_folder, generation_defaults
from ..models.tokenizer import Tokenizer
from .data import Completion, Conversation, check_chat_template, read_paths, text_files
from .loop import check_weights, plural, write_refused


@dataclass
class Regeneration:
    """One run: the `regenerate` flags (see blockspec/cli.py for their meaning)."""

    target: str
    prompts: list[str]
    out: str
    suffixes: list[str] | None = None  # of the files taken from directories (None: data.TEXT_SUFFIXES)
    greedy: bool = False
    temperature: float | None = None   # None: generation_config.json's (with its top-k, top-p, min-p)
    max_prompts: int | None = None     # None: every prompt; else this many of them, drawn with the seed
    max_new_tokens: int = 512
    prompt_tokens: int = 256
    batch_size: int = 16
    seed: int = 0
    device: str = "auto"


@dataclass
class Prompt:
    ids: list[int]
    messages: list[dict] | None  # a conversation's, before the regenerated turn; None: a text's cut


def check_out(out: Path):
    """A .jsonl file in an existing, writable folder."""
    if out.suffix != ".jsonl":
        raise BlockspecError(f"--out {out}: give a .jsonl file (train-drafter --data reads records from .jsonl files)")
    if out.is_dir():
        raise BlockspecError(f"--out {out}: is a folder; give a file name")
    if out.parent.is_file():
        raise BlockspecError(f"--out {out}: {out.parent} is a file, not a folder")
    if not out.parent.is_dir():
        raise BlockspecError(f"--out {out}: the folder {out.parent} does not exist")
    unwritable = write_refused(out.parent)
    if unwritable:
        raise BlockspecError(f"--out {out}: cannot write in the folder {out.parent} ({unwritable})")


def check_run(run: Regeneration) -> TargetConfig:
    target = TargetConfig.from_file(check_folder("--target", run.target) / "config.json")
    checks = [
        (run.max_new_tokens < 1, f"--max-new-tokens must be at least 1 (got {run.max_new_tokens})"),
        (run.prompt_tokens < 1, f"--prompt-tokens must be at least 1 (got {run.prompt_tokens})"),
        (run.batch_size < 1, f"--batch-size must be at least 1 (got {run.batch_size})"),
        (not 0 <= run.seed <= MAX_SEED, f"--seed must be in 0..2^63-1 (got {run.seed})"),
        (run.max_prompts is not None and run.max_prompts < 1, f"--max-prompts must be at least 1 (got "
                                                              f"{run.max_prompts})"),
        (run.temperature is not None and not 0 < run.temperature <= 100,
         f"--temperature must be in (0, 100] (got {run.temperature}; --greedy for greedy replies)"),
        (run.greedy and run.temperature is not None, "--greedy and --temperature exclude each other"),
    ]
    for bad, why in checks:
        if bad:
            raise BlockspecError(why)
    check_out(Path(run.out))
    if Path(run.out).resolve() in text_files(run.prompts, run.suffixes, flag="--prompts"):  # read, then replaced
        raise BlockspecError(f"--out {run.out}: is one of the --prompts files; give another file to write")
    check_weights(Path(run.target))
    check_dense_checkpoint(run.target)
    settings = Path(run.target) / "generation_config.json"
    raw = read_json(settings) if settings.exists() else {}  # transformers reads it too, as it loads the target
    if not isinstance(raw, dict):
        raise BlockspecError(f"{settings}: a JSON object expected, got {type(raw).__name__}")
    return target


def prompts_of(units: list, tokenizer, prompt_tokens: int) -> list[Prompt]:
    """A conversation's prompt (its messages without a last assistant turn), a completion record's prompt, each
    text's cuts."""
    prompts = []
    for unit in units:
        if isinstance(unit, Conversation):
            messages = unit.messages[:-1] if unit.messages[-1]["role"] == "assistant" else unit.messages
            if not messages:
                raise BlockspecError(f"--prompts {unit.path}:{unit.line}: the conversation is only the assistant "
                                     "turn that is generated anew: give the turns it answers")
            try:
                prompts.append(Prompt(tokenizer.chat_prompt_ids(messages), messages))
            except BlockspecError as exc:
                raise BlockspecError(f"--prompts {unit.path}:{unit.line}: {exc}") from None
        elif isinstance(unit, Completion):
            ids = tokenizer.encode(unit.prompt)
            if not ids:
                raise BlockspecError(f"--prompts {unit.path}:{unit.line}: the prompt is empty")
            prompts.append(Prompt(ids, None))
        else:
            ids = tokenizer.encode(unit)
            prompts += [Prompt(ids[i:i + prompt_tokens], None) for i in range(0, len(ids), prompt_tokens)]
    return prompts


def sampling_settings(run: Regeneration) -> dict:
    """transformers' generation settings: greedy, or sampled at the target's generation_config.json (its temperature
    replaced by --temperature)."""
    values = {} if run.greedy else generation_defaults(run.target)
    if run.temperature is not None:
        values["temperature"] = run.temperature
    if not values.get("temperature"):
        return {"do_sample": False}
    return {"do_sample": True, "temperature": values["temperature"], "top_k": values.get("top_k", 0),
            "top_p": values.get("top_p", 1.0), "min_p": values.get("min_p")}


def describe(settings: dict, temperature_given: bool) -> str:
    if not settings["do_sample"]:
        return "greedy"
    shown = [f"{k.replace('_', '-')} {settings[k]:g}" for k in ("temperature", "top_k", "top_p", "min_p")
             if settings.get(k) is not None]
    where = "--temperature and generation_config.json" if temperature_given else "generation_config.json"
    return f"sampled at {where}: " + ", ".join(shown)


def load_model(target: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    # the sampling values are sampling_settings' (generation_config.json's, checked): none of the file's unchecked
    # ones may come in as transformers' defaults
    model.generation_config = GenerationConfig()
    return model


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], settings: dict, max_new_tokens: int, eos: set[int],
                   pad: int) -> list[list[int]]:
    """Each prompt's new tokens, up to (not including) the first end-of-sequence token."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), pad_token_id=pad, **settings)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    return [row[:next((i for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def regenerate(run: Regeneration, log=print) -> dict:
    """Check everything, read the prompts, then load the target and write the records; returns a summary."""
    target = check_run(run)
    try:
        import transformers  # noqa: F401  (checked before any work)
    except ImportError:
        raise BlockspecError("regenerate needs the 'train' extra: pip install 'blockspec[train]'") from None
    from ..engine.load import resolve_device

    tokenizer = Tokenizer(run.target, target.eos_token_ids)
    tokenizer.check_fits(target.vocab_size, run.target)
    if not tokenizer.eos_token_ids:
        raise BlockspecError(f"--target {run.target}: no end-of-sequence token (config.json: eos_token_id)")
    units = read_paths(run.prompts, run.suffixes, need_assistant=False, flag="--prompts")
    check_chat_template(units, tokenizer, flag="--prompts")
    prompts = prompts_of(units, tokenizer, run.prompt_tokens)
    longest = max((len(p.ids) for p in prompts), default=0)
    if longest + run.max_new_tokens > target.max_position_embeddings:
        raise BlockspecError(f"--max-new-tokens {run.max_new_tokens}: with the longest prompt ({longest} tokens) the "
                             f"replies would run past the target's {target.max_position_embeddings} positions "
                             "(config.json: max_position_embeddings): lower --max-new-tokens"
                             + (f", or --prompt-tokens ({run.prompt_tokens}), the length of the texts' prompts"
                                if any(p.messages is None for p in prompts) else ""))
    if run.max_prompts is not None and len(prompts) > run.max_prompts:  # drawn with the seed, kept in their order
        prompts = [prompts[i] for i in sorted(random.Random(run.seed).sample(range(len(prompts)), run.max_prompts))]
    settings = sampling_settings(run)
    device = resolve_device(run.device)
    conversations = sum(p.messages is not None for p in prompts)
    how = describe(settings, run.temperature is not None)
    log(f"regenerate: {plural(len(prompts), 'prompt')} ({conversations} conversations, {len(prompts) - conversations} "
        f"text cuts), {how}, up to {plural(run.max_new_tokens, 'new token')} each, {run.batch_size} per pass on "
        f"{device}")
    model = load_model(run.target, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(run.seed)
    eos, pad = tokenizer.eos_token_ids, min(tokenizer.eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i].ids))
    replies: list[list[int] | None] = [None] * len(prompts)
    for start in _progress(range(0, len(order), run.batch_size), len(order), run.batch_size):
        batch = order[start:start + run.batch_size]
        for i, new in zip(batch, generate_batch(model, [prompts[i].ids for i in batch], settings,
                                                run.max_new_tokens, eos, pad)):
            replies[i] = new
    records = []
    for prompt, new in zip(prompts, replies):
        if prompt.messages is None:
            records.append({"prompt": tokenizer.decode(prompt.ids), "completion": tokenizer.decode(new)})
        else:
            records.append({"messages": prompt.messages + [{"role": "assistant", "content": tokenizer.decode(new)}]})
    write_atomically(Path(run.out), records)
    generated = sum(map(len, replies))
    ended = sum(len(new) < run.max_new_tokens for new in replies)
    log(f"wrote {plural(len(records), 'record')} to {run.out}: {plural(generated, 'token')} generated, "
        f"{ended} of {len(records)} replies ended by the target")
    return {"records": len(records), "generated_tokens": generated, "ended": ended}


def write_atomically(out: Path, records: list[dict]):
    """The records as JSONL at `out`, written under a temporary name in its folder and renamed when complete."""
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        temporary.replace(out)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _progress(batches, total: int, size: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return batches
    bar = tqdm(total=total, unit="prompt", dynamic_ncols=True)

    def advancing():
        for start in batches:
            yield start
            bar.update(min(size, total - start))
        bar.close()
    return advancing()
