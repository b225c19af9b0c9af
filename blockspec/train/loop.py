"""The optimisation every training kind shares: AdamW over fp32 master weights (bf16 autocast on CUDA), linear
warm-up then cosine decay, gradient clipping at 1 (the norm before it recorded), a progress bar with loss, first-row
accuracy and tokens/s, checkpoints every N steps and at the end, `--resume` from the last one (weights, optimizer,
step, history, evaluations, random state), and with an evaluation every N steps the best weights kept in OUT/best.
In several processes (train/ranks.py) rank 0 writes, logs and evaluates; every rank keeps the same history."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from ..errors import BlockspecError
from ..files import read_json
from .ranks import Ranks

STATE_FILE = "training_state.pt"
BEST = "best"  # OUT/best: the weights of the best evaluation (--eval-every)
RUN_FILE = "training_run.json"  # the settings of the run saved beside it, which --resume continues with
# Settings a resumed run may change: how long it trains, how often it checkpoints, how often and how much it evaluates.
# The inputs (paths, device, where the target lives) are given again on every run and are not saved.
RESUMABLE_CHANGES = {"steps", "tokens", "checkpoint_every", "eval_cuts", "eval_every"}
NOT_SAVED = {"target", "data", "eval_data", "suffixes", "out", "resume", "device", "replace_mtp", "target_sharding",
             "compile"}


def check_output(out: str | Path, resume: bool):
    """A run writes into a new or empty directory, or continues the one saved there (--resume); a directory that
    cannot be made or written is refused now, not after the loading."""
    if str(out) == "":  # Path("") is the current folder
        raise BlockspecError("--out is empty: give a folder")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BlockspecError(f"--out {out}: is a file, not a folder")
    existing = next(folder for folder in [out, *out.parents] if folder.exists())
    if not existing.is_dir():
        raise BlockspecError(f"--out {out}: {existing} is a file, not a folder")
    unwritable = write_refused(existing)
    if unwritable:
        raise BlockspecError(f"--out {out}: cannot write in {existing} ({unwritable})")
    if resume and not (out / STATE_FILE).is_file():
        raise BlockspecError(f"--resume: {out / STATE_FILE} does not exist (nothing to resume)")
    if resume and not zipfile.is_zipfile(out / STATE_FILE):  # what torch.save writes, its index last
        raise BlockspecError(f"--resume: {out / STATE_FILE} is truncated or not a saved training state")
    if not resume and out.is_dir() and any(out.iterdir()):
        raise BlockspecError(f"--out {out} is not empty: choose a new directory or pass --resume")


def write_refused(folder: Path) -> str | None:
    """Why a file cannot be written in `folder` (None: it can), found by writing one, which is then removed: the
    permission bits alone say yes to root, and to file systems that refuse every file (/proc)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def saved_settings(out: Path, cls=None) -> dict:
    """The settings of the run saved in `out` ({} when it predates RUN_FILE), each of the type of `cls`'s field (the
    run's dataclass) when given."""
    path = out / RUN_FILE
    if not path.exists():
        return {}
    saved = read_json(path, f"--resume {path}")
    if not isinstance(saved, dict):
        raise BlockspecError(f"--resume: {path} must hold a JSON object of settings, not {type(saved).__name__}")
    unknown = sorted(set(saved) - {field.name for field in dataclasses.fields(cls)}) if cls else []
    if unknown:  # another command's run (train-target's in train-drafter's --out, or the reverse)
        raise BlockspecError(f"--resume: {path} holds settings this command does not have ({', '.join(unknown)}): "
                             "it is another command's run")
    for field in dataclasses.fields(cls) if cls else ():
        if field.name in saved and not of_type(saved[field.name], field.type):
            raise BlockspecError(f"--resume: {path}: \"{field.name}\" must be {field.type} "
                                 f"(got {saved[field.name]!r})")
    return saved


def of_type(value, annotation: str) -> bool:
    """Whether a JSON value is of a dataclass field's type (its annotation as written: "int | None", "list[int]")."""
    for kind in (part.strip() for part in annotation.split("|")):
        if kind.startswith("list[") and isinstance(value, list):
            if all(of_type(v, kind[5:-1]) for v in value):
                return True
        elif {"None": value is None, "bool": isinstance(value, bool), "str": isinstance(value, str),
              "int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool)}.get(kind):
            return True
    return False


def settings_to_save(run) -> dict:
    return {k: v for k, v in dataclasses.asdict(run).items() if k not in NOT_SAVED}


def resumed_settings(out: Path, given: dict, cls=None) -> dict:
    """The settings a resumed run continues with: the saved run's (checked against `cls`'s fields), with the flags
    given again (`given`); a given value that would change the saved model or its optimisation is refused in one
    line."""
    saved = saved_settings(out, cls)
    for key, value in given.items():
        if key in saved and key not in RESUMABLE_CHANGES and value != saved[key]:
            flag = "--" + key.replace("_", "-")
            raise BlockspecError(f"--resume: {flag} {value} differs from the run saved in {out} ({flag} {saved[key]}); "
                                 f"leave {flag} out to continue that run")
    if "steps" in given and "tokens" not in given:
        saved.pop("tokens", None)  # a new --steps replaces the saved --tokens
    return {**saved, **given}


# what a saved run's state holds (Trainer.checkpoint), checked before a resumed run builds anything
STATE_PARTS = {"module": dict, "optimizer": dict, "step": int, "history": list, "rng": tuple,
               "torch_rng": torch.Tensor}


def check_resumed(run, inputs: dict | None = None):
    """A resumed run's settings (however given) must be the saved run's, except RESUMABLE_CHANGES; its state must
    load, its inputs (Trainer's `inputs`, e.g. the target's fingerprint) be the saved run's, and --steps must not
    stop before the step it is at."""
    if not run.resume:
        return
    out = Path(run.out)
    resumed_settings(out, settings_to_save(run), type(run))
    try:  # mapped, not read: the weights and moments are read again once the model is built
        state = torch.load(out / STATE_FILE, weights_only=False, map_location="cpu", mmap=True)
    except Exception as exc:  # torch raises what the pickle or the archive reader met
        raise BlockspecError(f"--resume: {out / STATE_FILE} cannot be loaded ({str(exc).splitlines()[0]})") from None
    wrong = "the top level" if not isinstance(state, dict) else next(
        (f"'{key}'" for key, kind in STATE_PARTS.items()
         if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool)), None)
    if wrong is not None:
        raise BlockspecError(f"--resume: {out / STATE_FILE} is not a saved run's state ({wrong} is missing or of "
                             "another type)")
    step, saved_inputs = state["step"], state.get("inputs") or {}
    if step < 0 or not isinstance(saved_inputs, dict):
        raise BlockspecError(f"--resume: {out / STATE_FILE} is not a saved run's state (step {step})")
    for key, value in (inputs or {}).items():
        if key in saved_inputs and saved_inputs[key] != value:
            raise BlockspecError(f"--resume: --{key} {getattr(run, key)} is not the {key} the run saved in {out} "
                                 f"trained with (its config.json or weights differ): give that {key}, or start a new "
                                 "run in another --out")
    if run.tokens is None:
        check_not_past(out, step, run.steps)


def fingerprint(checkpoint: Path) -> str:
    """sha256 of a checkpoint's config.json and, of each weights file, its name, its size and 16 slices of 4 KB spread
    over it: the same for a copy or a move of the checkpoint, another for another checkpoint of the same shapes,
    without reading a 27B checkpoint whole (minutes)."""
    from ..models.checkpoint import checkpoint_files

    digest = hashlib.sha256((checkpoint / "config.json").read_bytes())
    for path in checkpoint_files(checkpoint):
        size = path.stat().st_size
        digest.update(f"{path.name} {size}".encode())
        with open(path, "rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                digest.update(f.read(4096))
    return digest.hexdigest()


def check_not_past(out: Path, step: int, steps: int):
    if step > steps:
        raise BlockspecError(f"--resume: the run saved in {out} is at step {step}, past the {steps} steps asked "
                             "(--steps, --tokens): give more, or leave them out to finish that run")


def device_memory(setting: str) -> tuple[int, str]:
    """(bytes of memory, "GPU" or "host") of the device a run's --device names."""
    from ..engine.load import resolve_device

    if resolve_device(setting).type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "GPU"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host"


def check_weights(directory: Path):
    """Every weights file of the checkpoint readable (its header, against the file's size): a truncated one is
    refused in one line before any work, as the engine's loading refuses it."""
    from safetensors import safe_open

    from ..models.checkpoint import checkpoint_files, unreadable

    for path in checkpoint_files(directory):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own error types
            raise unreadable(path, exc) from None


@contextmanager
def staged(folder: Path):
    """A folder to write a checkpoint's files into; once all are written, each is moved into `folder` (os.replace):
    an interrupt leaves every file there whole, the last checkpoint's or this one's (save_pretrained writes in
    place)."""
    staging = folder / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        for path in sorted(staging.iterdir()):
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_atomically(path: Path, text: str):
    """`text` into `path` through a temporary file beside it, renamed when complete."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


@contextmanager
def output_folder(out: Path):
    """Leaves no folder behind when the run stops before its first checkpoint (a refusal, an error, Ctrl-C): a
    retry then starts as this run did. A folder that existed before, or holds a checkpoint, is kept."""
    created = not out.exists()
    try:
        yield
    except BaseException:
        if created and out.is_dir() and not (out / STATE_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


def write_summary(out: Path, summary: dict, name: str = "training.json", points: int = 100):
    """OUT/`name`: the run's summary with its learning curve (every step's figures, thinned to `points` rows, the
    last step always kept)."""
    history = summary.get("history", [])
    stride = max(1, math.ceil(len(history) / points))
    curve = history[::stride] + ([history[-1]] if history and (len(history) - 1) % stride else [])
    record = {**{k: v for k, v in summary.items() if k != "history"}, "learning_curve": curve}
    write_atomically(out / name, json.dumps(record, indent=2))


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def token_count(count: int) -> str:
    """'812 tokens', '45.3k tokens', '12.1M tokens'."""
    if count < 10_000:
        return plural(count, "token")
    return f"{count / 1e3:.1f}k tokens" if count < 10_000_000 else f"{count / 1e6:.1f}M tokens"


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


class Trainer:
    """`step_loss(rng) -> (loss, figures, tokens)` is this rank's part of a step (figures: numbers or 0-dim tensors,
    read once the next step is queued, or before a checkpoint): over the ranks the parts of the loss, of each figure
    and of the tokens sum to the whole step's (train/ranks.py), and `module` runs under DistributedDataParallel,
    which averages the gradients, so the loss is scaled by the world size before its backward pass: the gradient is
    the whole step's loss's, as one process computes it."""

    def __init__(self, module: torch.nn.Module, out: Path, lr: float, device: torch.device,
                 save_weights: Callable[[Path], None], checkpoint_every: int, seed: int, settings: dict,
                 ranks: Ranks | None = None, inputs: dict | None = None):
        """`settings`: the run's, saved for --resume (RUN_FILE); `inputs`: what identifies its inputs (e.g. {"target":
        its fingerprint}), saved in the state, which a resumed run's must equal (check_resumed)."""
        self.module, self.out, self.lr, self.device = module, out, lr, device
        self.save_weights, self.checkpoint_every, self.settings = save_weights, checkpoint_every, settings
        self.inputs = inputs or {}
        self.ranks = ranks or Ranks()
        # fused on CUDA: one kernel for all parameters instead of a few per parameter (docs/benchmarks.md,
        # "Drafter training speed")
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01,
                                           fused=device.type == "cuda")
        self.step, self.history = 0, []
        self.evaluations, self.best = [], None  # {"step", what `evaluate` measured}; the best of them
        self.rng = random.Random(seed)

    def resume(self):
        state = torch.load(self.out / STATE_FILE, weights_only=False, map_location=self.device)
        try:
            self.module.load_state_dict(state["module"])
        except RuntimeError as exc:  # a run saved before RUN_FILE, resumed with other shapes
            first = str(exc).strip().splitlines()[-1].strip()
            raise BlockspecError(f"--resume: the run saved in {self.out} has other shapes than these settings "
                                 f"({first}); give the --target and flags it was started with") from None
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.rng.setstate(state["rng"])
            torch.set_rng_state(state["torch_rng"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise BlockspecError(f"--resume: the state saved in {self.out} does not fit this run's optimizer or "
                                 f"random generators ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})") from None
        self.step, self.history = state["step"], state["history"]
        self.evaluations, self.best = state.get("evaluations", []), state.get("best")

    def checkpoint(self, evaluate: Callable[[], dict] | None = None):
        """The kind's own output (its weights where blockspec loads them); with `evaluate`, their evaluation (rank
        0's, on every rank) and, when its mean accepted length is the best yet, the same weights in OUT/best; then
        the state --resume needs. Each file is replaced only once its successor is complete; rank 0 writes."""
        if self.ranks.main:
            self.out.mkdir(parents=True, exist_ok=True)
            with quiet_saving():
                self.save_weights(self.out)
        if evaluate is not None:
            measured = {"step": self.step, **self.ranks.from_main(evaluate() if self.ranks.main else None)}
            self.evaluations.append(measured)
            if self.best is None or measured["mean_accepted_length"] > self.best["mean_accepted_length"]:
                self.best = {"step": self.step, "mean_accepted_length": measured["mean_accepted_length"]}
                if self.ranks.main:
                    (self.out / BEST).mkdir(exist_ok=True)
                    with quiet_saving():
                        self.save_weights(self.out / BEST)
                    ordinary_modes(self.out / BEST)
        if not self.ranks.main:
            return
        state = {"step": self.step, "module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "history": self.history, "evaluations": self.evaluations, "best": self.best,
                 "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(), "inputs": self.inputs}
        write_atomically(self.out / RUN_FILE, json.dumps(self.settings, indent=2))
        torch.save(state, self.out / (STATE_FILE + ".tmp"))
        (self.out / (STATE_FILE + ".tmp")).replace(self.out / STATE_FILE)
        ordinary_modes(self.out)

    @torch.enable_grad()  # whatever the caller's grad mode (the target itself stays frozen)
    def fit(self, steps: int, step_loss: Callable[[random.Random], tuple[torch.Tensor, dict, int]],
            evaluate: Callable[[], dict] | None = None, eval_every: int = 0) -> float:
        """Run until `steps`; step_loss(rng) -> (loss, figures to record, tokens trained on), this rank's part.
        With `evaluate` (-> a dict with "mean_accepted_length"), the weights are evaluated every `eval_every` steps
        and at the last. Returns tokens/s (all ranks')."""
        check_not_past(self.out, self.step, steps)
        self.module.train()
        progress = _progress(range(self.step, steps), self.step, steps, self.ranks.main)
        began, tokens = time.perf_counter(), 0
        queued = None  # the last step's (step, figure names, figures summed over the ranks, their copy's event)

        def record():
            """Read the queued step's figures into the history and the progress bar."""
            nonlocal tokens, queued
            step, names, totals, copied = queued
            if copied is not None:
                copied.synchronize()
            *whole, norm, count = totals.tolist()
            queued, tokens = None, tokens + int(count)
            figures = {**dict(zip(["loss", *names], whole)), "grad_norm": norm}
            if not math.isfinite(figures["loss"]):  # before any checkpoint of the weights it left behind
                raise BlockspecError(f"training diverged: the loss of step {step} is {figures['loss']} (a lower --lr "
                                     f"may help); {self.out} holds the last checkpoint written before it, if any")
            self.history.append({"step": step, **{k: round(v, 4) for k, v in figures.items()}})
            if hasattr(progress, "set_postfix"):
                shown = {"loss": f"{figures['loss']:.3f}"}
                if "first_row_accuracy" in figures:
                    shown["acc"] = f"{figures['first_row_accuracy']:.3f}"
                shown["tok_s"] = f"{tokens / (time.perf_counter() - began):.0f}"
                if self.evaluations:  # the last evaluation's mean accepted length
                    shown["accepted"] = f"{self.evaluations[-1]['mean_accepted_length']:.3f}"
                progress.set_postfix(shown, refresh=False)  # in this order; shown at the bar's own pace

        for step in progress:
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, self.lr)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                loss, figures, count = step_loss(self.rng)
            self.optimizer.zero_grad(set_to_none=True)
            (loss * self.ranks.world).backward()
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)  # the whole step's gradient's
            self.optimizer.step()
            # summed over the ranks, so the norm enters as a share: every rank's is the whole step's gradient's;
            # numbers are written on the device (torch.full), not copied from the host, which would wait for it
            parts = torch.stack([v.detach().to(self.device, torch.float64).reshape(()) if torch.is_tensor(v) else
                                 torch.full((), float(v), dtype=torch.float64, device=self.device)
                                 for v in (loss, *figures.values(), norm / self.ranks.world, count)])
            # a step's figures are read once the next step is queued, from a copy queued behind the step: a read
            # in stream order would hold the host until the device had caught up, and a launch-bound step's host
            # work would no longer overlap the device's
            totals, copied = self.ranks.total(parts), None
            if totals.is_cuda:
                totals, copied = totals.to("cpu", non_blocking=True), torch.cuda.Event()
                copied.record()
            if queued is not None:
                record()
            queued = (step + 1, list(figures), totals, copied)
            self.step = step + 1
            evaluating = evaluate is not None and eval_every > 0 and (self.step % eval_every == 0 or self.step == steps)
            if self.step % self.checkpoint_every == 0 or self.step == steps or evaluating:
                record()  # a checkpoint holds the history to its step
                self.checkpoint(evaluate if evaluating else None)
        self.module.eval()
        return tokens / max(time.perf_counter() - began, 1e-9)


@contextmanager
def quiet_saving():
    """No progress bar of transformers' for each checkpoint's weights (the training bar is the one to watch)."""
    try:
        from transformers.utils import logging
    except ImportError:
        yield
        return
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def ordinary_modes(folder: Path):
    """Files as the umask makes them (transformers writes its weights through a private temporary file, 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _progress(steps, start, total, shown: bool = True):
    if not shown:
        return steps
    try:
        from tqdm import tqdm
    except ImportError:
        return steps
    return tqdm(steps, initial=start, total=total, unit="step", dynamic_ncols=True)
