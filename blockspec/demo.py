"""`blockspec demo`: the trained pair shipped with the package (data/demo_pair.zip) on the CPU.

The pair: a small Qwen3.5-architecture target with its own MTP head, and a DFlash2 drafter for it, trained on the
Python source files of installed packages, never on the standard library. The demo continues the beginning of a
standard-library module in modes none, mtp, dflash2 and dflash2 verifying a draft tree of DEMO_TREE_BUDGET nodes
(the same greedy tokens in each), then measures one speculative cycle from real contexts of other standard-library
modules: what each proposer, and the tree beside the chain, buys on unseen code.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sysconfig
import tempfile
import zipfile
import zlib
from pathlib import Path

import torch

from .cli_common import create_folders, format_stats, remove_folders, stream_text
from .config import PredictConfig, TargetConfig
from .errors import BlockspecError
from .train.evaluate import one_cycle_acceptance, standard_library_files

PAIR_ZIP = Path(__file__).parent / "data" / "demo_pair.zip"  # target/ and drafter/, deflated to fit the package
PAIR_FOLDERS = ("target", "drafter")

PROMPT_FILE = "textwrap.py"  # the prompt: this module's beginning (else the first module found)
PROMPT_TOKENS = 240          # ... its longest run of whole lines within this many tokens
PROMPT_TAIL_LINES = 5        # lines of the prompt's end shown, so the reader sees where the continuation starts
MIN_CONTEXT_LENGTH = 512

MEASURE_FILES = ("fractions.py", "shutil.py", "calendar.py", "random.py")  # contexts of the one-cycle measure
MEASURE_CUTS = 30
MEASURE_TOKENS = 256  # contexts are cut from each file's first tokens: short prefills keep the measure quick
MEASURE_SEED = 0
DEMO_TREE_BUDGET = 32  # nodes of the demo's draft tree (mode dflash2 verifying a tree beside the chain)
TREE = f"dflash2 tree {DEMO_TREE_BUDGET}"  # the tree engine's name in the demo's output

DESCRIPTION = """\
blockspec demo: a small model trained here and its two speculative proposers, on the CPU (float32).
  target:  17.3M parameters, Qwen3.5 architecture (8 layers: 6 Gated DeltaNet + 2 gated attention, hidden 384),
           byte-level BPE tokenizer of 8192 ids, with its own MTP head (mode mtp)
  drafter: a 6.8M-parameter DFlash2 drafter (3 layers reading target layers 1, 2, 4, 5, 7; mode dflash2)
Both were trained on the Python source files of installed packages, never on the standard library, which the
prompt and the contexts below come from. The model's text looks like Python but is not meant to be correct (a model
this small also falls into loops under greedy decoding). What the demo shows: every speculative mode gives plain
greedy's tokens, and what each proposer's drafts are worth on code it never saw.
"""

# The pair's one-cycle figures over 500 contexts of 10 standard-library modules, measured with `blockspec bench
# --model DIR/target --drafter DIR/drafter --mode mtp,dflash2 --tree-budget 0 --fixtures stdlib --one-cycle 500
# --context-length 1024` on a 2-core CPU (--device cpu --dtype float32) and on an H200 (bfloat16); the trees' with
# `python bench/tree_acceptance.py --model DIR/target --drafter DIR/drafter` (CPU, float32).
PAIR_FIGURES = ("the pair over 500 contexts of 10 standard-library modules (blockspec bench --fixtures stdlib "
                "--one-cycle 500 --context-length 1024):\n  CPU float32: mtp 2.466 (48.9 %), dflash2 3.068 (29.5 %); "
                "H200 bfloat16: mtp 2.366, dflash2 2.918\n"
                "  draft trees (bench/tree_acceptance.py, 500 contexts): chain 2.964, tree 16 3.750, tree 32 4.088;\n"
                "  with their lookup branch of 7 (the default): tree 16 4.358, tree 32 4.806\n"
                "the published DFlash2 drafter reaches ~5.5 tokens per cycle on the 27B target")


def extract_pair(directory: Path, destination: str = "") -> tuple[Path, Path]:
    """Unpack the shipped pair into directory/target and directory/drafter. A place that cannot be written (no
    permission, a full disk) is refused naming `destination` (default: the directory), not the zip."""
    if not PAIR_ZIP.is_file():
        raise BlockspecError(f"{PAIR_ZIP}: not found (the demo pair ships with blockspec: reinstall it)")
    try:
        with zipfile.ZipFile(PAIR_ZIP) as archive:
            try:
                archive.extractall(directory)
            except OSError as exc:  # the zip opened: what fails now is writing the files
                raise BlockspecError(f"{destination or directory}: cannot unpack the demo pair there "
                                     f"({exc.strerror or exc})") from None
    except OSError as exc:
        raise BlockspecError(f"{PAIR_ZIP}: cannot read it ({exc.strerror or exc})") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise BlockspecError(f"{PAIR_ZIP}: corrupt zip file ({exc})") from None
    target, drafter = (directory / folder for folder in PAIR_FOLDERS)
    if not (target / "config.json").is_file() or not (drafter / "config.json").is_file():
        raise BlockspecError(f"{PAIR_ZIP}: holds no target/config.json and drafter/config.json")
    return target, drafter


def standard_library_modules() -> tuple[Path, list[Path]]:
    """The prompt's module and the one-cycle measure's modules, from this interpreter's standard library."""
    files = standard_library_files()
    if len(files) < 2:
        root = sysconfig.get_paths()["stdlib"]
        raise BlockspecError(f"the standard library of this Python ({root}) holds {len(files)} module files of "
                             "4 kB or more: the demo's prompt and contexts come from there")
    by_name = {file.name: file for file in files}
    prompt = by_name.get(PROMPT_FILE, files[0])
    contexts = [by_name[name] for name in MEASURE_FILES if name in by_name]
    return prompt, contexts or [file for file in files if file != prompt][:len(MEASURE_FILES)]


def read_source(file: Path) -> str:
    return file.read_text(encoding="utf-8", errors="replace")


def prompt_text(text: str, tokenizer) -> str:
    """The text's beginning: its longest run of whole lines within PROMPT_TOKENS tokens, the last line's newline
    left out (the model writes it together with the next line's indentation, as one token)."""
    lines = text.splitlines(keepends=True)
    prompt = ""
    for count in range(1, len(lines) + 1):
        candidate = "".join(lines[:count]).removesuffix("\n")
        if len(tokenizer.encode(candidate)) > PROMPT_TOKENS:
            break
        prompt = candidate
    return prompt or tokenizer.decode(tokenizer.encode(text)[:PROMPT_TOKENS])  # a first line longer than that


@contextlib.contextmanager
def one_thread():
    """The pair's matrices gain nothing from a second thread, and on a busy CPU a thread waiting for a core stalls
    every operation (the whole demo ran 4x slower with two threads on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_engines(target: Path, drafter: Path, context_length: int) -> dict:
    """An engine per mode on the CPU in float32: mtp drafts with the target's own head, dflash2 with the drafter
    (its chain, and TREE: a draft tree of DEMO_TREE_BUDGET nodes)."""
    from .engine.engine import Engine

    def engine(mode, budget=0):
        return Engine(PredictConfig.build({
            "model": str(target), "mode": mode, "device": "cpu", "compute_dtype": "float32",
            "context_length": context_length,
            **({"dflash2_model": str(drafter), "dflash2_tree_budget": budget} if mode == "dflash2" else {})}))
    return {"none": engine("none"), "mtp": engine("mtp"), "dflash2": engine("dflash2"),
            TREE: engine("dflash2", DEMO_TREE_BUDGET)}


def show_prompt(file: Path, prompt: str, token_count: int, max_tokens: int) -> None:
    """Where the prompt comes from and its last lines."""
    tail = prompt.splitlines()[-PROMPT_TAIL_LINES:]
    print(f"prompt: the first {token_count} tokens (whole lines) of {file.name}, from this Python's standard library "
          f"({file}); it ends with\n" + "\n".join(f"  | {line}" for line in tail)
          + f"\nEach mode below repeats that last line, then continues it greedily for {max_tokens} tokens.\n")


def continue_in_every_mode(engines: dict, ids: list[int], last_line: str, max_tokens: int) -> dict:
    """Stream each mode's greedy continuation of ids after the prompt's last (partial) line; returns the tokens per
    mode."""
    outputs = {}
    for mode, engine in engines.items():
        print(f"--- mode {mode} ---\n{last_line}", end="")
        outputs[mode] = stream_text(engine, engine.stream(ids, max_tokens, stop_at_eos=False))[0]
        print()
        print(format_stats(engine.last_stats))
    return outputs


def measure_one_cycle(engines: dict, files: list[Path]) -> None:
    """One speculative cycle from MEASURE_CUTS real contexts of the files, for mtp and dflash2; printed beside the
    pair's figures over 500 contexts."""
    tokenizer = engines["none"].tokenizer
    sequences = [tokenizer.encode(read_source(file))[:MEASURE_TOKENS] for file in files]
    # the chain and the tree from each context's one prefill (the tree engine's sweep of budgets)
    chain, tree = one_cycle_acceptance(engines[TREE], sequences, MEASURE_CUTS, seed=MEASURE_SEED,
                                       tree_budgets=[0, DEMO_TREE_BUDGET]).values()
    measured = {"mtp": one_cycle_acceptance(engines["mtp"], sequences, MEASURE_CUTS, seed=MEASURE_SEED),
                "dflash2": chain, TREE: tree}
    lengths = ", ".join(f"{mode} {m['mean_accepted_length']:.2f}" for mode, m in measured.items())
    rates = ", ".join(f"{100 * m['acceptance_rate']:.1f} %" for m in measured.values())
    names = ", ".join(file.name for file in files)
    print(f"\none speculative cycle from {MEASURE_CUTS} real contexts of standard-library code ({names}):\n"
          f"  {lengths} tokens per cycle (acceptance {rates})\n{PAIR_FIGURES}")


def run_demo(max_tokens: int, context_length: int | None) -> None:
    """The demo: the three modes' continuations of a standard-library prompt, then the one-cycle measure. Exits
    with code 1 when a speculative mode's tokens differ from plain greedy's."""
    from .models.tokenizer import Tokenizer

    prompt_file, measured_files = standard_library_modules()
    with tempfile.TemporaryDirectory(prefix="blockspec-demo-") as directory, one_thread():
        target, drafter = extract_pair(Path(directory))
        tokenizer = Tokenizer(target)
        prompt = prompt_text(read_source(prompt_file), tokenizer)
        ids = tokenizer.encode(prompt)
        positions = TargetConfig.from_file(target / "config.json").max_position_embeddings
        if len(ids) + max_tokens > positions:
            raise BlockspecError(f"--max-tokens {max_tokens}: the demo's prompt ({len(ids)} tokens) and its "
                                 f"continuation need {len(ids) + max_tokens} positions, but the demo's target holds "
                                 f"{positions}: give --max-tokens {positions - len(ids)} or less")
        if context_length is not None and context_length > positions:
            raise BlockspecError(f"--context-length {context_length}: the demo's target holds {positions} positions "
                                 "at most")
        context_length = context_length or max(MIN_CONTEXT_LENGTH, len(ids) + max_tokens)
        if len(ids) + max_tokens > context_length:
            raise BlockspecError(f"--context-length {context_length}: the demo's prompt ({len(ids)} tokens) + "
                                 f"--max-tokens {max_tokens} need at least {len(ids) + max_tokens}")
        print(DESCRIPTION)
        show_prompt(prompt_file, prompt, len(ids), max_tokens)
        engines = load_engines(target, drafter, context_length)
        outputs = continue_in_every_mode(engines, ids, prompt[prompt.rfind("\n") + 1:], max_tokens)
        same = all(tokens == outputs["none"] for tokens in outputs.values())
        print(f"\nmtp, dflash2 and {TREE} outputs identical to plain greedy: {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(1)
        measure_one_cycle(engines, measured_files)


def check_positions(target: Path, max_tokens: int, context_length: int | None) -> None:
    """The saved pair's commands refused where they would ask for more positions than its target holds."""
    positions = TargetConfig.from_file(target / "config.json").max_position_embeddings
    if max(max_tokens + 1, context_length or 0) > positions:
        given = f"--max-tokens {max_tokens}" + (f" --context-length {context_length}" if context_length else "")
        raise BlockspecError(f"{given}: the demo's target holds {positions} positions")


def save_pair(directory: str, max_tokens: int, context_length: int | None) -> None:
    """Unpack the pair into DIR/target and DIR/drafter (DIR new or empty); print commands that use them.

    The pair is unpacked into a temporary folder first, so that a save cut short never leaves a truncated pair
    that looks whole. A new DIR is that folder, unpacked beside DIR's place and renamed to DIR in one step. An
    existing empty DIR stays the same folder (its mode, its owner, a shell inside it): the pair is unpacked in it
    and its drafter, then its target, are moved in, so DIR/target appears only beside a whole drafter. Refused or
    interrupted, the save leaves DIR as it was and removes what it made, the missing parent folders included."""
    flag = f"--save {directory}"
    if not directory:
        raise BlockspecError("--save is empty: give a new or empty folder")
    if context_length is not None and max_tokens >= context_length:  # the printed commands would be refused
        raise BlockspecError(f"--max-tokens {max_tokens} is not below --context-length {context_length}: the saved "
                             "pair's commands would leave no room for a prompt")
    directory = Path(directory)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise BlockspecError(f"{flag}: exists and is not a folder; give a new or empty folder")
    existed = os.path.isdir(directory)
    if existed and any(directory.iterdir()):
        raise BlockspecError(f"{flag}: the folder is not empty; give a new or empty folder")
    place = directory.resolve()  # a link to an empty folder: the pair goes where it points
    home = place if existed else place.parent  # where the temporary folder is made
    try:
        created = create_folders(home)
    except OSError as exc:
        raise BlockspecError(f"{flag}: cannot create the folder {home} ({exc.strerror or exc})") from None
    try:
        partial = Path(tempfile.mkdtemp(prefix=f"{place.name}.partial-", dir=home))  # also checks home is writable
    except OSError as exc:
        remove_folders(created)
        raise BlockspecError(f"{flag}: cannot write in {home} ({exc.strerror or exc})") from None
    moved = []
    try:
        if existed:
            extract_pair(partial, flag)
            check_positions(partial / "target", max_tokens, context_length)
            for folder in ("drafter", "target"):  # the target last: alone, it would pass for a model
                os.rename(partial / folder, place / folder)
                moved.append(place / folder)
        else:
            pair = partial / "pair"  # mkdtemp's folder is private: DIR is made like any new folder
            pair.mkdir()
            extract_pair(pair, flag)
            check_positions(pair / "target", max_tokens, context_length)
            os.rename(pair, place)  # fails, changing nothing, when DIR has been filled meanwhile
    except BaseException as exc:  # refused, or interrupted (Ctrl-C)
        for folder in [partial, *moved]:
            shutil.rmtree(folder, ignore_errors=True)
        remove_folders(created)
        if isinstance(exc, OSError):
            raise BlockspecError(f"{flag}: cannot write there ({exc.strerror or exc})") from None
        raise
    partial.rmdir()
    target, drafter = (directory / folder for folder in PAIR_FOLDERS)
    target_flag = f"--model {shlex.quote(str(target.resolve()))}"
    model = f"{target_flag} --drafter {shlex.quote(str(drafter.resolve()))}"
    cpu = "--device cpu --dtype float32"
    context = f" --context-length {context_length}" if context_length else ""
    prompt = f"--prompt {shlex.quote('def read_lines(path):')} --max-tokens {max_tokens}"
    print(f"saved the demo's pair to {target} (a 17.3M-parameter model trained on installed packages' Python code, "
          f"with its MTP head) and {drafter} (its DFlash2 drafter). Its text looks like Python but is not meant to be "
          "correct, and it knows no chat: give it code to continue. Try them:\n"
          f"  blockspec generate {model} {prompt}{context} {cpu}\n"
          f"  blockspec generate {target_flag} --mode mtp {prompt}{context} {cpu}\n"
          f"  blockspec chat {model}{context} {cpu}\n"
          f"  blockspec serve {model}{context} {cpu}    # needs pip install 'blockspec[serve]'\n"
          "With --drafter they run mode dflash2; --mode mtp (without --drafter) drafts with the model's own MTP head; "
          "without either they decode plainly.")
