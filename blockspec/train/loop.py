"""The optimisation every training kind shares: AdamW over fp32 master weights (bf16 autocast on CUDA), linear
warm-up then cosine decay, gradient clipping at 1, a progress bar with loss and tokens/s, checkpoints every N steps
and at the end, and `--resume` from the last one (weights, optimizer, step, history, random state)."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Callable

import torch

STATE_FILE = "training_state.pt"


def check_output(out: Path, resume: bool):
    """A run writes into a new or empty directory, or continues the one saved there (--resume)."""
    from ..errors import BlockspecError

    if out.exists() and not out.is_dir():
        raise BlockspecError(f"--out {out} exists and is not a directory")
    if resume and not (out / STATE_FILE).is_file():
        raise BlockspecError(f"--resume: {out / STATE_FILE} does not exist (nothing to resume)")
    if not resume and out.is_dir() and any(out.iterdir()):
        raise BlockspecError(f"--out {out} is not empty: choose a new directory or pass --resume")


def write_summary(out: Path, summary: dict, points: int = 100):
    """OUT/training.json: the run's summary with its learning curve (every step's figures, thinned to `points`
    rows, the last step always kept)."""
    history = summary.get("history", [])
    stride = max(1, math.ceil(len(history) / points))
    curve = history[::stride] + ([history[-1]] if history and (len(history) - 1) % stride else [])
    record = {**{k: v for k, v in summary.items() if k != "history"}, "learning_curve": curve}
    (out / "training.json").write_text(json.dumps(record, indent=2))


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


class Trainer:
    def __init__(self, module: torch.nn.Module, out: Path, lr: float, device: torch.device,
                 save_weights: Callable[[Path], None], checkpoint_every: int, seed: int):
        self.module, self.out, self.lr, self.device = module, out, lr, device
        self.save_weights, self.checkpoint_every = save_weights, checkpoint_every
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.step, self.history = 0, []
        self.rng = random.Random(seed)

    def resume(self):
        state = torch.load(self.out / STATE_FILE, weights_only=False, map_location=self.device)
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])

    def checkpoint(self):
        """The kind's own output (its weights where blockspec loads them), then the state --resume needs, each file
        replaced only once its successor is complete."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.save_weights(self.out)
        state = {"step": self.step, "module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "history": self.history, "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state()}
        torch.save(state, self.out / (STATE_FILE + ".tmp"))
        (self.out / (STATE_FILE + ".tmp")).replace(self.out / STATE_FILE)

    @torch.enable_grad()  # whatever the caller's grad mode (the target itself stays frozen)
    def fit(self, steps: int, step_loss: Callable[[random.Random], tuple[torch.Tensor, dict, int]]) -> float:
        """Run until `steps`; step_loss(rng) -> (loss, figures to record, tokens trained on). Returns tokens/s."""
        self.module.train()
        progress = _progress(range(self.step, steps), self.step, steps)
        began, tokens = time.perf_counter(), 0
        for step in progress:
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, self.lr)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                loss, figures, count = step_loss(self.rng)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            self.optimizer.step()
            tokens += count
            self.step = step + 1
            figures = {"loss": loss.item(), **{k: float(v) for k, v in figures.items()}}
            self.history.append({"step": self.step, **{k: round(v, 4) for k, v in figures.items()}})
            if hasattr(progress, "set_postfix"):
                progress.set_postfix(loss=f"{figures['loss']:.3f}",
                                     tok_s=f"{tokens / (time.perf_counter() - began):.0f}")
            if self.step % self.checkpoint_every == 0 or self.step == steps:
                self.checkpoint()
        self.module.eval()
        return tokens / max(time.perf_counter() - began, 1e-9)


def _progress(steps, start, total):
    try:
        from tqdm import tqdm
    except ImportError:
        return steps
    return tqdm(steps, initial=start, total=total, unit="step", dynamic_ncols=True)
