"""`blockspec bench`: the benchmark recipe. Per fixture: a 128-token warm-up, then R measured repetitions; the
median decode tokens/s (first token, prefill and warm-up excluded) beside the weight-bandwidth roofline.

With synthetic weights, `--forced-acceptance R` teacher-forces proposals from the plain-greedy trajectory so that a
fraction R of proposals is accepted while the proposer still runs at full cost: it measures the real cycle cost at a
chosen acceptance. Synthetic and forced results are labelled as such everywhere they are printed.

`--temperature` (with `--top-k`, `--top-p`, `--min-p`, `--seed`) samples every run; `--compare-greedy` runs each mode
greedily too and gives each sampled row its cost relative to the greedy one: a plain step's, or a speculative
cycle's (with forced acceptance both decode the same trajectory, the planted synthetic target being all but
certain of its next token, so the cycles compared do the same work).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .cli_common import (add_sampling_args, add_weight_args, check_output_path, describe_sampling, sampling_overrides,
                         utf8_text, weight_overrides, write_output)
from .config import DEFAULT_TREE_BUDGETS, PredictConfig, SamplingSettings
from .engine import memory
from .engine.decode import Proposer
from .errors import BlockspecError
from .files import read_json
from .kernels import pdl
from .kernels import use
from .models.checkpoint import check_folder
from .train.evaluate import one_cycle_acceptance, repeat_split, summarize_generations

WARMUP_TOKENS = 128
DEFAULT_FIXTURES = Path(__file__).parent / "data" / "fixtures.json"  # code, English mystery, zh->en translation


CODE_FIXTURE_FILES = 10     # source files taken as fixtures from a directory (or the standard library)
CODE_PROMPT_CHARS = 1500    # each one's prompt: its beginning, as raw text


def code_fixtures(path: str) -> list[dict]:
    """Source files as raw-text fixtures (no chat template): `stdlib` (the running interpreter's standard library,
    code no blockspec model was trained on) or a directory; 10 of its files chosen by a fixed seed."""
    from .train.data import text_files
    from .train.evaluate import standard_library_files

    if path == "stdlib":
        files = standard_library_files(CODE_FIXTURE_FILES)
    else:
        files = text_files([path], flag="--fixtures")
        files = sorted(random.Random(0).sample(files, min(CODE_FIXTURE_FILES, len(files))))
    stems = [file.stem for file in files]
    fixtures = []
    for file in files:  # the file's stem, or with its folder where two stems are alike (__init__)
        try:  # the standard library's few non-UTF-8 bytes are replaced; a user's folder must hold text
            text = file.read_text(encoding="utf-8", errors="replace" if path == "stdlib" else "strict")
        except UnicodeDecodeError as exc:
            raise BlockspecError(f"--fixtures {path}: {file} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise BlockspecError(f"--fixtures {path}: cannot read {file} ({exc.strerror or exc})") from None
        name = file.stem if stems.count(file.stem) == 1 else f"{file.parent.name}/{file.stem}"
        fixtures.append({"name": name, "prompt": text[:CODE_PROMPT_CHARS], "text": text, "chat": False})
    return fixtures


FIXTURE_KEYS = {"name": str, "prompt": str, "text": str, "chat": bool}  # text, chat: optional (code_fixtures')


def load_fixtures(path: str | None, prompt: str | None) -> list[dict]:
    if prompt is not None:
        if not prompt:
            raise BlockspecError("--prompt is empty: give some text")
        return [{"name": "prompt", "prompt": prompt}]
    if path == "":
        raise BlockspecError("--fixtures is empty: give a JSON file, a folder of source files, or 'stdlib'")
    if path is not None and (path == "stdlib" or Path(path).is_dir()):
        return code_fixtures(path)
    where = f"fixtures file {path or DEFAULT_FIXTURES}"
    fixtures = read_json(path or DEFAULT_FIXTURES, where)
    check_fixtures(fixtures, where)
    return fixtures


def check_fixtures(fixtures, where: str):
    """A fixtures file's list: each entry an object with a non-empty string "name" (unique) and "prompt"; optional
    "text" (the one-cycle text, default the prompt) and "chat" (false: the prompt is raw text, no chat template).
    Anything else is refused in one line naming the entry and the key."""
    shape = 'expected a JSON list of {"name": ..., "prompt": ...} objects'
    if not isinstance(fixtures, list):
        raise BlockspecError(f"{where}: {shape}, got {type(fixtures).__name__}")
    if not fixtures:
        raise BlockspecError(f"{where}: the list is empty; {shape}")
    names = {}
    for i, fixture in enumerate(fixtures):
        if not isinstance(fixture, dict):
            raise BlockspecError(f"{where}: entry {i} is {json.dumps(fixture)[:40]}, not an object; {shape}")
        unknown = [k for k in fixture if k not in FIXTURE_KEYS]
        if unknown:
            raise BlockspecError(f"{where}: entry {i}: unknown key {unknown[0]!r} (known: "
                                 f"{', '.join(FIXTURE_KEYS)})")
        for key, kind in FIXTURE_KEYS.items():
            if key not in fixture:
                if key in ("name", "prompt"):
                    raise BlockspecError(f"{where}: entry {i} has no {key!r}")
                continue
            value = fixture[key]
            if not isinstance(value, kind):
                raise BlockspecError(f"{where}: entry {i} {key!r} must be a {'string' if kind is str else 'boolean'}"
                                     f", got {json.dumps(value)[:40]}")
            if kind is str and not value:
                raise BlockspecError(f"{where}: entry {i} {key!r} is empty")
            if kind is str:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:  # a lone surrogate escape (\ud800): no tokenizer takes it
                    raise BlockspecError(f"{where}: entry {i} {key!r}: not valid UTF-8 (character {exc.start})") \
                        from None
        if fixture["name"] in names:
            raise BlockspecError(f"{where}: entry {i} 'name' {fixture['name']!r} is also entry "
                                 f"{names[fixture['name']]}'s: names must be unique")
        names[fixture["name"]] = i


class ForcedAcceptance(Proposer):
    """Runs the real proposer, then replaces its proposals: the first m are the plain-greedy continuation, the rest
    wrong, with m chosen so that accepted / proposed tracks `rate` (a deterministic running target)."""

    def __init__(self, inner: Proposer, vocab_size: int):
        self.inner, self.vocab = inner, vocab_size
        self.capture_layers, self.max_proposals = inner.capture_layers, inner.max_proposals
        self.aim(0.0, [])

    def aim(self, rate: float, trajectory: list[int]):
        """The acceptance to force and the plain-greedy continuation (prompt and tokens) it forces from."""
        self.rate, self.trajectory = rate, trajectory
        self.proposed = self.accepted = 0

    def reset(self):
        self.inner.reset()
        self.proposed = self.accepted = 0

    def observe(self, out, first, tokens, next_tokens, drafts=True):
        self.inner.observe(out, first, tokens, next_tokens, drafts)

    @property
    def tree_budget(self):
        return self.inner.tree_budget

    def forced(self, position, k):
        truth = self.trajectory[position + 1:position + 1 + k]
        n = len(truth)  # shorter near max_tokens: the rest of the block is never emitted
        m = max(0, min(n, round(self.rate * (self.proposed + n) - self.accepted)))
        self.proposed += n
        self.accepted += m
        return truth[:m] + [(t + 1) % self.vocab for t in truth[m:]]

    def propose(self, anchor, position, k):
        real = self.inner.propose(anchor, position, k)
        forced = torch.tensor(self.forced(position, k), dtype=torch.long, device=real.device)
        self.proposals = torch.cat([forced, real[forced.shape[0]:]])
        return self.proposals

    def propose_tree(self, anchor, position, branch=()):
        """The real tree with its chain (nodes 1..R, drafter/tree.py) forced as `propose` forces a chain: the
        other nodes keep the drafter's tokens (wrong for the trajectory on synthetic weights, so rarely taken), and
        a lookup branch's nodes stay empty (tree_lookup is 0 here: forced rates are a chain's), verified all the
        same."""
        tree = self.inner.propose_tree(anchor, position)
        self.chain = self.forced(position, min(self.max_proposals, tree.size - 1))
        tree.tokens[1:1 + len(self.chain)] = torch.tensor(self.chain, device=tree.tokens.device)
        return tree

    def draft(self):
        """Under sampling: each forced proposal drawn from a point mass on it (q = 1), which keeps the rule exact;
        the target then accepts a proposal with its own probability of it (~1 for the trajectory's token on the
        planted synthetic target, ~0 for the wrong ones). Shaped as the real proposer's, which it also reads."""
        return point_masses(*self.inner.draft(), self.proposals)

    def tree_draft(self):
        """As `draft`, for the forced chain of the last tree."""
        return point_masses(*self.inner.tree_draft(), self.chain)


def point_masses(ids: torch.Tensor, probs: torch.Tensor, tokens):
    """Draft (ids, q) [R, C] whose first len(tokens) rows are a point mass on each token (a list or a tensor)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=ids.device)
    ids, probs, n = ids.clone(), probs.clone(), tokens.shape[0]
    ids[:n] = tokens[:, None]
    probs[:n] = 0
    probs[:n, 0] = 1
    return ids, probs


def tree_budgets(text: str) -> list[int]:
    """--tree-budget: comma-separated budgets, each 0 (the chain) .. MAX_PASS_TOKENS - 1."""
    from .config import MAX_PASS_TOKENS

    try:
        budgets = [int(b) for b in str(text).split(",")]
    except ValueError:
        raise BlockspecError(f"--tree-budget must be a number or comma-separated numbers (got {text!r})") from None
    bad = [b for b in budgets if not 0 <= b < MAX_PASS_TOKENS]
    if bad:
        raise BlockspecError(f"--tree-budget {bad[0]}: each budget must be 0 (the chain) .. {MAX_PASS_TOKENS - 1}")
    return list(dict.fromkeys(budgets))


def parse_rates(text: str | None, n_fixtures: int) -> list[float] | None:
    """One rate for every fixture, or one per fixture (comma-separated, in fixture order)."""
    if text is None:
        return None
    try:
        rates = [float(r) for r in str(text).split(",")]
    except ValueError:
        raise BlockspecError(f"--forced-acceptance must be a number or comma-separated numbers (got {text!r})") \
            from None
    if len(rates) == 1:
        rates *= n_fixtures
    if len(rates) != n_fixtures or not all(0 <= r <= 1 for r in rates):
        raise BlockspecError(f"--forced-acceptance: give one rate in [0, 1] or one per fixture ({n_fixtures})")
    return rates


def measure_read_bandwidth(device) -> float | None:
    """Device read bandwidth in GB/s (sum over a 4 GiB buffer), measured in the same run as the benchmark: the best
    of 5 rounds of 5 sums, since a slow round (seen as low as 3.7 TB/s against 4.2 on the H200) would inflate every
    roofline percentage."""
    if device.type != "cuda":
        return None
    x = torch.empty(2 ** 31, dtype=torch.bfloat16, device=device).normal_()
    for _ in range(3):
        x.sum()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start, reps = time.perf_counter(), 5
        for _ in range(reps):
            x.sum()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / reps)
    del x
    torch.cuda.empty_cache()  # measured before any model: the memory figures are the engines' alone
    return 2 ** 31 * 2 / best / 1e9


def bytes_per_plain_step(engine) -> int:
    """Bytes one 1-token target pass must read: every weight (quantized ones are buffers) except the embedding table
    (one row), plus DeltaNet recurrent states read and written."""
    total = 0
    for name, p in list(engine.model.named_parameters()) + list(engine.model.named_buffers()):
        if name == "embed_tokens.weight":
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    if engine.model.lm_head is None:
        total += engine.model.embed_tokens.weight.numel() * engine.model.embed_tokens.weight.element_size()
    total += sum(2 * s.recurrent.numel() * 4 for s in engine.state.gdn)
    return total


def build_engine(args, mode: str, tree_budget: int = 0):
    from .engine.engine import Engine

    overrides = {**weight_overrides(args), "mode": mode, "device": args.device, "compute_dtype": args.dtype,
                 "dflash2_tree_budget": tree_budget if mode == "dflash2" else None,
                 "context_length": args.context_length, "dflash2_model": args.drafter if mode == "dflash2" else None,
                 "load_progress": True}
    if args.compile_mode is not None:
        overrides["compile_mode"] = args.compile_mode
    if args.pdl_level is not None:
        overrides["pdl_level"] = args.pdl_level
    if mode != "dflash2":
        overrides.pop("dflash2_quantization")  # apply to the dflash2 rows only
        overrides.pop("dflash2_block_size")
    if mode != "dflash2" or not tree_budget:
        overrides.pop("dflash2_tree_lookup")  # the tree rows only
    if mode == "none":
        overrides.pop("draft_vocabulary")  # the speculative rows only
    forced = args.forced_acceptance is not None and mode != "none"
    if forced:  # each request from a fresh state, as the forced proposals are aimed per request
        overrides["prefix_reuse"] = False
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not args.synthetic:
        return Engine(PredictConfig.build({"model": args.model, **overrides}, source="bench"))
    from .engine.load import resolve_device
    from .engine.weights import rtn
    from .fixtures.synthetic import synthetic_drafter, synthetic_target
    from .fixtures.tiny import build_tiny_checkpoint
    from .models.tokenizer import Tokenizer

    config = PredictConfig.build(overrides, source="bench")
    device = resolve_device(config.device)
    memory.use_expandable_segments(device)  # as the engine does: the weights are built before it
    needed = check_synthetic_fits(args.synthetic, config, device)
    seed = args.seed or 0
    # target_quantization: each layer's projections quantized as it is built, as a checkpoint's as it is read
    model, head = synthetic_target(args.synthetic, device, config.torch_dtype, seed=seed,
                                   quantize=rtn(config.target_quantization, 128, config.torch_dtype),
                                   mtp_head=mode == "mtp")
    # each proposer's weights exist only in its mode, and the drafter is built where a checkpoint's is read: after
    # the target's head is quantized (what memory.estimate describes)
    mtp = {"mtp." + k: v for k, v in head.state_dict().items()} if head is not None else {}
    del head
    drafter = (lambda target: synthetic_drafter(target, seed)) if mode == "dflash2" else None
    with tempfile.TemporaryDirectory(prefix="blockspec-synthetic-tok-") as tok_dir:
        build_tiny_checkpoint(tok_dir)  # only its byte-level tokenizer and chat template are used
        tokenizer = Tokenizer(tok_dir)
    vocab = model.config.vocab_size
    engine = Engine(config, model=model, mtp_tensors=mtp, drafter=drafter, tokenizer=tokenizer,
                    wrap_proposer=(lambda proposer: ForcedAcceptance(proposer, vocab)) if forced else None)
    engine.memory.estimate = needed.as_dict()
    return engine


def available_ram() -> int | None:
    """Bytes of RAM the system can give without swapping (psutil's figure, else /proc/meminfo's MemAvailable; None
    where neither is there)."""
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return None
    return psutil.virtual_memory().available


def check_synthetic_fits(name: str, config: PredictConfig, device) -> memory.MemoryEstimate:
    """The synthetic weights are built where they run: refused first if the estimate exceeds the GPU's free memory,
    or on the CPU the RAM available (a build past it is killed by the system, without a word)."""
    from .config import TargetConfig
    from .drafter.config import DrafterConfig
    from .engine.load import pass_rows, resolve_execution
    from .fixtures.synthetic import preset, synthetic_drafter_config

    target = TargetConfig.from_dict(preset(name), source=f"synthetic preset {name}")
    drafter = DrafterConfig.from_dict(synthetic_drafter_config(target)) if config.decode_mode == "dflash2" else None
    needed = memory.estimate(target, config, execution=resolve_execution(config, device),
                             max_partial=pass_rows(config.tree_budget), drafter=drafter)
    if device.type == "cuda":
        memory.check_fits(needed, config, device)
        return needed
    available = available_ram()
    if available is not None and needed.needed > available:
        raise BlockspecError(f"estimated memory needed {needed.needed / memory.GB:.1f} GB, but only "
                             f"{available / memory.GB:.1f} GB of RAM is available: {memory.remedies(needed, config)}")
    return needed


def fixture_ids(engine, fixture: dict) -> list[int]:
    """A fixture's prompt tokens: as a chat's user turn unless the fixture says "chat": false."""
    if fixture.get("chat") is False:
        return engine.tokenizer.encode(fixture["prompt"])
    return engine.tokenizer.chat_prompt_ids([{"role": "user", "content": fixture["prompt"]}])


def run_fixture(engine, ids, args, trajectory, rate, sampling: dict):
    if rate is not None and engine.mode != "none":  # the engine's proposer is a ForcedAcceptance (build_engine)
        engine.proposer.aim(rate, trajectory)
    engine.generate(ids, min(WARMUP_TOKENS, args.max_tokens), stop_at_eos=False, **sampling)  # warm-up
    return [engine.generate(ids, args.max_tokens, stop_at_eos=not args.synthetic, **sampling)
            for _ in range(args.repeats)]


def sampling_variants(args) -> list[dict]:
    """The sampling of each run of a fixture: greedy ({}), the flags' settings, or both (--compare-greedy)."""
    given = {k: v for k, v in sampling_overrides(args).items() if v is not None}
    settings = SamplingSettings.build(given, source="bench")  # a value out of range: one line naming it
    if args.compare_greedy and settings.greedy:
        raise BlockspecError("--compare-greedy compares sampling with greedy decoding: give --temperature above 0")
    if settings.greedy:
        return [{}]
    return ([{}] if args.compare_greedy else []) + [given]


RANDOM_ACCEPTANCE_NOTE = ("note: synthetic weights are random, so their speculative proposals are random too and "
                          "acceptance is ~0; pass --forced-acceptance R to measure the cycle at a chosen acceptance")


def check_arguments(args) -> tuple[list[str], list[dict], list[float] | None]:
    """Everything the run needs from its flags, checked before any model work: modes, fixtures, forced rates, and
    that the result files can be written (see cli_common.check_output_path) and drawn."""
    if not args.synthetic and not args.model:
        raise BlockspecError("give --model DIR or --synthetic PRESET")
    if args.synthetic and args.model is not None:
        raise BlockspecError("--model and --synthetic both given: --synthetic builds random weights in place of the "
                             "checkpoint; give one of them")
    if args.synthetic and args.drafter is not None:
        raise BlockspecError("--drafter and --synthetic both given: --synthetic builds its own drafter for mode "
                             "dflash2; drop --drafter (or use --model)")
    if args.prompt is not None and args.fixtures is not None:
        raise BlockspecError("--prompt and --fixtures both given: --prompt replaces the fixtures; give one of them")
    if args.bandwidth is not None and not (math.isfinite(args.bandwidth) and args.bandwidth > 0):
        raise BlockspecError(f"--bandwidth must be a positive number of GB/s (got {args.bandwidth}); leave it out "
                             "to measure it")
    if args.repeats < 1 or args.max_tokens < 1:
        raise BlockspecError("--repeats and --max-tokens must be at least 1")
    modes = args.mode.split(",")
    fixtures = load_fixtures(args.fixtures, args.prompt)
    bad = [m for m in modes if m not in ("none", "mtp", "dflash2")]
    if bad:
        raise BlockspecError(f"--mode {bad[0]!r}: choose none, mtp or dflash2 (comma-separated for several)")
    if args.one_cycle < 0:
        raise BlockspecError(f"--one-cycle must be 0 or more (got {args.one_cycle})")
    if args.one_cycle and args.synthetic:
        raise BlockspecError("--one-cycle measures real acceptance: it needs --model (and --drafter), not --synthetic")
    if args.one_cycle and modes == ["none"]:
        raise BlockspecError("--one-cycle measures the acceptance of proposals: add mtp or dflash2 to --mode")
    if args.forced_acceptance is not None and not args.synthetic:
        raise BlockspecError("--forced-acceptance needs --synthetic weights (it replaces real proposals)")
    if args.forced_acceptance is not None and modes == ["none"]:
        raise BlockspecError("--forced-acceptance sets the acceptance of proposals: add mtp or dflash2 to --mode")
    rates = parse_rates(args.forced_acceptance, len(fixtures))
    if args.model:
        check_folder("--model", args.model)
    if args.drafter is not None and "dflash2" not in modes:
        raise BlockspecError(f"--drafter is used by mode dflash2 only, but --mode is {args.mode!r}: add dflash2 to "
                             "--mode or drop --drafter")
    if args.drafter is not None:
        if not args.drafter:
            raise BlockspecError("--drafter is empty: give the DFlash2 drafter's folder")
        check_folder("--drafter", args.drafter)
    for flag, value, neutral, wanted in (
            ("--dflash2-block-size", args.dflash2_block_size, None, "dflash2"),
            ("--tree-lookup", args.tree_lookup, 0, "dflash2"),
            ("--dflash2-quantization", args.dflash2_quantization, "none", "dflash2"),
            ("--draft-vocabulary", args.draft_vocabulary, 0, "mtp or dflash2")):
        if value not in (None, neutral) and not set(modes) & set(wanted.split(" or ")):
            raise BlockspecError(f"{flag} {value} applies to mode {wanted} only, but --mode is {args.mode!r}: add "
                                 f"{wanted} to --mode or drop {flag}")
    if "dflash2" in modes and not args.synthetic and args.drafter is None:
        raise BlockspecError("--mode dflash2 needs a drafter: give --drafter DIR")
    if args.one_cycle and args.model:
        check_one_cycle_texts(args.model, fixtures)
    if args.tree_budget is not None and tree_budgets(args.tree_budget) != [0] and "dflash2" not in modes:
        raise BlockspecError(f"--tree-budget {args.tree_budget}: trees verify DFlash2 proposals: add dflash2 to --mode")
    if args.tree_lookup and args.tree_budget is not None and tree_budgets(args.tree_budget) == [0]:
        raise BlockspecError(f"--tree-lookup {args.tree_lookup} gives nodes of a draft tree to a branch from the "
                             "context, but --tree-budget is 0 (the chain): give a budget or drop --tree-lookup")
    sampling_variants(args)
    if args.png_out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BlockspecError("--png-out needs matplotlib, which is not installed: pip install 'blockspec[plot]'") \
                from None
        if Path(args.png_out).suffix.lower() != ".png":
            raise BlockspecError(f"--png-out {args.png_out}: the chart is written as a PNG image; give a file name "
                                 "ending in .png")
        if args.json_out and os.path.abspath(args.json_out) == os.path.abspath(args.png_out):
            raise BlockspecError(f"--json-out and --png-out name the same file ({args.png_out}): give two names")
    inputs = [(flag, getattr(args, name, None)) for flag, name in (
        ("--model", "model"), ("--drafter", "drafter"), ("--fixtures", "fixtures"), ("--config", "config"),
        ("--draft-vocabulary", "draft_vocabulary"))]
    for flag, path in (("--json-out", args.json_out), ("--png-out", args.png_out)):
        if path:
            check_output_path(flag, path, inputs)
    return modes, fixtures, rates


def check_one_cycle_texts(model: str, fixtures: list[dict]) -> None:
    """--one-cycle cuts the fixtures' texts (a cut leaves a token before it): refused in one line, before any model
    loads, when no text holds two tokens of the model's tokenizer."""
    from .models.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    if not any(len(tokenizer.encode(f.get("text", f["prompt"]))) >= 2 for f in fixtures):
        raise BlockspecError("--one-cycle cuts the fixtures' texts, but none holds two tokens: give longer texts")


def bench(args) -> dict:
    """Run the benchmark and print its table as it goes: the label, a header, then one row per mode and fixture."""
    modes, fixtures, rates = check_arguments(args)
    variants = sampling_variants(args)
    label = ("SYNTHETIC weights " + args.synthetic if args.synthetic else "model " + str(args.model)) + (
        ", FORCED acceptance " + "/".join(f"{r:.1%}" for r in rates) if rates else "")
    label += "".join(f", {k} {v}" for k, v in weight_overrides(args).items() if v not in (None, "none"))
    label += "".join(f", sampling {describe_sampling(v)}" for v in variants if v)
    results = {"label": label, "rows": [], "max_tokens": args.max_tokens, "repeats": args.repeats,
               "context_length": args.context_length, "torch": torch.__version__}
    trajectories = {}
    from .engine.load import resolve_device
    device = resolve_device(args.device)
    bandwidth = args.bandwidth or measure_read_bandwidth(device)
    budgets = tree_budgets(args.tree_budget) if args.tree_budget is not None else [DEFAULT_TREE_BUDGETS[device.type]]
    runs = [(m, b) for m in ["none"] + [m for m in modes if m != "none"] for b in (budgets if m == "dflash2" else [0])]
    # the name columns as wide as the longest name the rows will hold
    widths = {"mode": max(len(f"{m}:{b}" if b else m) for m, b in runs),
              "fixture": max(len(f["name"]) for f in fixtures)}
    for mode, budget in runs:
        if mode not in modes and args.forced_acceptance is None:
            continue
        start = time.perf_counter()
        engine = build_engine(args, mode, budget)
        name = f"{mode}:{budget}" if budget else mode  # the rows' mode: dflash2 with a tree of `budget` nodes
        results.setdefault("load_times", {})[name] = {"total_s": round(time.perf_counter() - start, 3),
                                                      **engine.load_times.as_dict()}
        if "device" not in results:
            results["device"] = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
            results["read_bandwidth_gb_s"] = bandwidth
            results["bytes_per_plain_step"] = bytes_per_plain_step(engine)
            results["execution"] = engine.target.execution
            results["label"] += f", {engine.target.execution}"
            with use(engine.kernels):
                level = pdl.settings(engine.device)[0]
            results["pdl_level"] = level  # programmatic dependent launch (kernels/pdl.py); 0 = off
            if level:
                results["label"] += f", PDL level {level}"
            print(results["label"])  # complete once the first engine is built: before the rows it describes
            if args.synthetic and rates is None and any(m != "none" for m in modes):
                results["note"] = RANDOM_ACCEPTANCE_NOTE
                print(RANDOM_ACCEPTANCE_NOTE)
            print(format_header(widths), flush=True)
            for fixture in fixtures:  # each fits the context before any is measured
                try:
                    engine.check_request(fixture_ids(engine, fixture), args.max_tokens)
                except BlockspecError as exc:
                    raise BlockspecError(f"fixture {fixture['name']!r}: {exc}") from None
        for fixture in fixtures:
            ids = fixture_ids(engine, fixture)
            rate = rates[fixtures.index(fixture)] if rates else None
            for sampling in variants:
                measured = run_fixture(engine, ids, args, trajectories.get(fixture["name"]), rate, sampling)
                if mode == "none" and fixture["name"] not in trajectories:
                    trajectories[fixture["name"]] = ids + measured[0].tokens
                if mode not in modes:
                    continue
                row = summarize(name, fixture["name"], measured, results)
                if mode != "none" and rate is None:
                    row["repeats_split"] = summarize_generations([repeat_split(
                        ids, measured[0].tokens, measured[0].stats["accepted_per_cycle"])])
                results["rows"].append(row)
                print(format_row(row, widths), flush=True)
        if args.one_cycle and mode != "none" and mode in modes:
            sequences = [engine.tokenizer.encode(f.get("text", f["prompt"])) for f in fixtures]
            for sampling in variants:  # "MODE" greedy, "MODE sampled" with the flags' sampling
                key = f"{name} sampled" if sampling else name
                measured = results.setdefault("one_cycle", {})[key] = one_cycle_acceptance(
                    engine, sequences, args.one_cycle, args.seed, sampling)
                print(f"{key}: one cycle from {measured['cuts']} real contexts: mean accepted length "
                      f"{measured['mean_accepted_length']:.3f}, acceptance {measured['acceptance_rate']:.1%}",
                      flush=True)
        results.setdefault("memory", {})[name] = memory.report(engine)  # decoding's peak: after every fixture
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def summarize(mode, fixture, runs, results) -> dict:
    speeds = [r.stats["decode_tokens_per_s"] for r in runs]
    tps = statistics.median(speeds)
    cycles = [r.stats["decode_s"] / r.stats["cycles"] * 1e3 for r in runs if r.stats.get("cycles")]
    row = {"mode": mode, "fixture": fixture, "decode_tokens_per_s": tps, "runs_tokens_per_s": speeds,
           "tree_budget": runs[0].stats.get("tree_budget", 0),
           "nodes_per_cycle": runs[0].stats.get("nodes_per_cycle"),
           "generated": runs[0].stats["generated"], "prefill_s": statistics.median(r.stats["prefill_s"] for r in runs),
           "acceptance_rate": runs[0].stats.get("acceptance_rate"),
           "mean_accepted_length": runs[0].stats.get("mean_accepted_length"),
           "cycle_ms": round(statistics.median(cycles), 3) if cycles else None,
           "step_ms": round(1e3 / tps, 3) if tps else None, "sampling": runs[0].stats["sampling"]}
    greedy = row["sampling"]["temperature"] == 0
    earlier = [r for r in results["rows"] if r["fixture"] == fixture]
    plain = next((r for r in earlier if r["mode"] == "none" and (r["sampling"]["temperature"] == 0) == greedy), None)
    if row["cycle_ms"] and plain:  # one speculative cycle relative to one plain decode step, same run
        row["cycle_vs_plain_step"] = round(row["cycle_ms"] / plain["step_ms"], 3)
    same_greedy = next((r for r in earlier if r["mode"] == mode and r["sampling"]["temperature"] == 0), None)
    if not greedy and same_greedy:  # --compare-greedy: this sampled cycle (plain: step) against the greedy one
        key = "cycle_ms" if row["cycle_ms"] else "step_ms"
        row["cost_vs_greedy"] = round(row[key] / same_greedy[key], 4)
    bandwidth = results.get("read_bandwidth_gb_s")
    gb_s = tps * results["bytes_per_plain_step"] / 1e9
    row["weight_gb_s"] = round(gb_s, 3)  # plain-step bytes x tokens/s (for speculative modes: effective)
    row["roofline_pct"] = round(100 * gb_s / bandwidth, 1) if bandwidth else None
    return row


COLUMNS = [  # header, width, how a row's value is shown ("-" when the row has none)
    ("mode", -10, lambda r: r["mode"]),
    ("fixture", -12, lambda r: r["fixture"]),
    ("tok/s", 9, lambda r: f"{r['decode_tokens_per_s']:.2f}"),
    ("GB/s", 8, lambda r: f"{r['weight_gb_s']:.1f}"),
    ("roofline", 9, lambda r: None if r["roofline_pct"] is None else f"{r['roofline_pct']:.1f}%"),
    ("accept", 7, lambda r: None if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%"),
    ("cycle ms", 9, lambda r: f"{r['cycle_ms']:.2f}" if r.get("cycle_vs_plain_step") else None),
    ("x plain", 8, lambda r: f"{r['cycle_vs_plain_step']:.3f}" if r.get("cycle_vs_plain_step") else None),
    ("generated", 10, lambda r: str(r["generated"])),
    ("prefill s", 10, lambda r: f"{r['prefill_s']:.3f}"),
    ("sampling", -8, lambda r: "greedy" if r["sampling"]["temperature"] == 0 else "sampled"),
    ("x greedy", 9, lambda r: f"{r['cost_vs_greedy']:.4f}" if "cost_vs_greedy" in r else None),
]
# mode: dflash2:N a tree of N draft nodes per cycle; tok/s: median decode tokens/s; GB/s: the weight bandwidth that
# speed implies (plain-step bytes x tokens/s);
# roofline: % of the read bandwidth measured in the same run; accept: accepted / proposed; cycle ms, x plain: one
# speculative cycle and its cost in plain decode steps (of the same sampling); x greedy (--compare-greedy): a sampled
# cycle's (plain: step's) cost relative to the greedy one of the same mode and fixture


def _cells(values, widths: dict) -> str:
    """One line of the table; `widths` widens the named left-aligned columns (mode, fixture) to fit their values."""
    cells = []
    for v, (name, w, _) in zip(values, COLUMNS):
        cells.append(f"{v:<{max(-w, widths.get(name, 0))}}" if w < 0 else f"{v:>{w}}")
    return "  ".join(cells).rstrip()


def format_header(widths: dict | None = None) -> str:
    return _cells([name for name, _, _ in COLUMNS], widths or {})


def format_row(row, widths: dict | None = None) -> str:
    return _cells([(show(row) or "-") for _, _, show in COLUMNS], widths or {})


def draw_chart(results, path):
    import matplotlib  # there: check_arguments refused --png-out without it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixtures = list(dict.fromkeys(r["fixture"] for r in results["rows"]))
    modes = list(dict.fromkeys(r["mode"] for r in results["rows"]))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(fixtures) + 2), 4.5))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        values = [next((r["decode_tokens_per_s"] for r in results["rows"]
                        if r["mode"] == mode and r["fixture"] == f), 0) for f in fixtures]
        ax.bar([j + i * width for j in range(len(fixtures))], values, width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(fixtures))], fixtures,
                  rotation=30 if len(fixtures) > 4 else 0, ha="right" if len(fixtures) > 4 else "center")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(results["label"], fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over one
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked before the run, created now (check_output_path)
    fig.savefig(path)
    plt.close(fig)


def cmd_bench(args):
    results = bench(args)
    save_results(results, args)
    return results


def save_results(results, args):
    """Write --json-out and --png-out. Their paths were checked before the run; should a write still fail (a full
    disk), the results are saved to a temporary file, named in the one-line error, rather than lost."""
    saved = None
    if args.json_out:
        try:
            write_output(args.json_out, json.dumps(results, indent=2))
            saved = args.json_out
        except OSError as exc:
            raise BlockspecError(f"--json-out {args.json_out}: {exc.strerror or exc}; the results were saved to "
                                 f"{rescue(results)}") from None
    if args.png_out:
        try:
            draw_chart(results, args.png_out)
        except OSError as exc:
            raise BlockspecError(f"--png-out {args.png_out}: {exc.strerror or exc}; the results are in "
                                 f"{saved or rescue(results)}") from None


def rescue(results) -> str:
    handle, name = tempfile.mkstemp(prefix="blockspec-bench-", suffix=".json")
    with open(handle, "w") as out:
        out.write(json.dumps(results, indent=2))
    return name


def add_bench_parser(sub):
    p = sub.add_parser("bench", help="benchmark decoding modes on fixtures (tokens/s vs the roofline)")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (or --synthetic)")
    p.add_argument("--drafter", metavar="DIR", help="DFlash2 drafter directory, for mode dflash2 (default: none)")
    p.add_argument("--synthetic", metavar="PRESET", help="random weights with real shapes: qwen3.5-27b or tiny")
    p.add_argument("--mode", default="none", help="none, mtp, dflash2, or several comma-separated")
    p.add_argument("--tree-budget", metavar="N[,N...]", help="dflash2: draft nodes verified as a tree per cycle, one "
                   "engine per budget (rows dflash2:N); 0: the chain (default: the engine's, "
                   f"{DEFAULT_TREE_BUDGETS['cuda']} on a GPU, {DEFAULT_TREE_BUDGETS['cpu']} on the CPU)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens generated per measured run")
    p.add_argument("--repeats", type=int, default=3, metavar="R", help="measured runs per fixture (the median is "
                   "reported)")
    p.add_argument("--context-length", type=int, default=4096, metavar="N", help="tokens the KV cache holds")
    p.add_argument("--prompt", metavar="TEXT", type=utf8_text, help="one prompt instead of the fixtures")
    p.add_argument("--fixtures", metavar="FILE", help="JSON list of {\"name\", \"prompt\"} objects (default: the "
                   "packaged code, English and translation prompts), or a directory of source files, or 'stdlib' (the "
                   "interpreter's standard library): 10 files, each one's first 1500 characters as a raw prompt")
    p.add_argument("--one-cycle", type=int, default=0, metavar="CUTS", help="also measure real acceptance: one "
                   "speculative cycle from each of CUTS random prefixes of the fixtures' texts (e.g. 500), with the "
                   "runs' sampling (JSON one_cycle: MODE greedy, 'MODE sampled')")
    p.add_argument("--forced-acceptance", help="synthetic only: accepted fraction of proposals, one rate or one per "
                   "fixture, e.g. 0.553,0.297,0.516 (the published DFlash2 rates for code, English, translation)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto", help="where to run; auto: cuda when "
                   "available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="compute dtype")
    p.add_argument("--compile-mode", type=int, choices=[-1, 0], default=None,
                   help="0: CUDA graphs (the default on CUDA), -1: eager (as --eager)")
    p.add_argument("--pdl-level", type=int, choices=[0, 1, 2, 3], default=None, help="programmatic dependent launch "
                   "level (default: the engine's choice for the target's weights; kernels/pdl.py)")
    p.add_argument("--bandwidth", type=float, help="card read bandwidth in GB/s (default: measured now)")
    add_sampling_args(p, "every run; --seed also seeds the synthetic weights, 0 when not given")
    p.add_argument("--compare-greedy", action="store_true", help="with --temperature above 0: run each mode greedily "
                   "too, and report each sampled cycle's (plain: step's) cost relative to the greedy one")
    add_weight_args(p)  # --target-quantization, --fuse-kvq, --eager ... as for generate
    p.add_argument("--json-out", metavar="FILE", help="write the results as JSON (missing folders are created; "
                   "checked before the run)")
    p.add_argument("--png-out", metavar="FILE", help="draw tokens/s per fixture and mode (needs matplotlib: pip "
                   "install 'blockspec[plot]'; missing folders are created; checked before the run)")
    p.set_defaults(func=cmd_bench)
