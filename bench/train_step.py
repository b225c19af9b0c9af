"""Where `blockspec train-drafter`'s step goes on a real checkpoint: the command itself (its flags after `--`, its
output in a temporary folder), run for --warmup steps, then timed over --steps more, then profiled over --profile
more (the costliest operators by GPU time, then by CPU time), none of them writing a checkpoint. A step that takes
more CPU time than GPU time is launch-bound: its cost is the host's. With --syncs (CUDA), one more step under
torch.cuda's sync debug mode: where the host waited for the device (reads back, copies from pageable memory), counted
by the line of blockspec (else torch) that asked for it.

Usage (repo root): python bench/train_step.py [--warmup 5] [--steps 10] [--profile 3] [--rows 25]
  [--attention dense|block-sparse] [--json-out FILE] -- --target DIR --data PATH ... (train-drafter's flags)
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockspec import cli  # noqa: E402
from blockspec.train import dflash2, loop  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, graph capture)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile", type=int, default=3, help="then this many steps under the profiler (0: none)")
    p.add_argument("--rows", type=int, default=25, help="operators listed in each profile table")
    p.add_argument("--attention", choices=["dense", "block-sparse"],
                   help="the step's attention: flex_attention's block mask or the dense mask (default: train-drafter's, "
                   "block-sparse on CUDA, dense on the CPU)")
    p.add_argument("--syncs", action="store_true", help="then one step under the sync debug mode (CUDA)")
    p.add_argument("--json-out", help="write the figures as JSON")
    args, flags = p.parse_known_args()
    flags = [f for f in flags if f != "--"]
    if "--out" in flags or "--steps" in flags or "--tokens" in flags:
        sys.exit("--out, --steps and --tokens are the bench's to set; leave them out of train-drafter's flags")
    if args.attention:  # the mask of every step (which is otherwise the same)
        block_sparse = args.attention == "block-sparse"
        dflash2.step_mask = lambda layout, _: layout.block_mask() if block_sparse else layout.dense_mask()
    figures = {"attention": args.attention or "train-drafter's", "train_drafter_flags": flags}
    fit = loop.Trainer.fit

    def timed_fit(self, steps, step_loss):
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        fit(self, args.warmup, step_loss)
        sync()
        # the timed steps write no checkpoint (fit writes one at its last step): the figures are the step's own
        self.checkpoint = lambda evaluate=None: None
        start = time.perf_counter()
        fit(self, args.warmup + args.steps, step_loss)
        sync()
        elapsed = (time.perf_counter() - start) / args.steps
        figures.update(step_s=round(elapsed, 4), block_tokens_per_s=round(step_tokens[0] / elapsed, 1),
                       device=str(self.device))
        print(f"{args.steps} steps after {args.warmup}: {elapsed:.4f} s a step, "
              f"{figures['block_tokens_per_s']:.0f} block tokens/s", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                fit(self, args.warmup + args.steps + args.profile, step_loss)
                sync()
            table = prof.key_averages()
            for key in (["cuda_time_total"] if self.device.type == "cuda" else []) + ["cpu_time_total"]:
                print(table.table(sort_by=key, row_limit=args.rows))
            cpu = sum(e.self_cpu_time_total for e in table) / args.profile / 1e3
            gpu = sum(e.self_device_time_total for e in table) / args.profile / 1e3
            figures.update(profiled_cpu_ms_per_step=round(cpu, 2), profiled_gpu_ms_per_step=round(gpu, 2))
            print(f"profiled: {cpu:.1f} ms of CPU, {gpu:.1f} ms of GPU a step (profiler overhead included)")
        if args.syncs and self.device.type == "cuda":
            figures["syncs_per_step"] = waits = host_waits(lambda: fit(self, self.step + 1, step_loss))
            for where, count in waits.items():
                print(f"{count:4d} host waits  {where}")
        return 0.0

    step_tokens = [0]  # the block tokens of the last step

    def counting(step_loss):
        def counted(rng):
            loss, step_figures, tokens = step_loss(rng)
            step_tokens[0] = tokens
            return loss, step_figures, tokens
        return counted

    loop.Trainer.fit = lambda self, steps, step_loss, evaluate=None, eval_every=0: timed_fit(
        self, steps, counting(step_loss))
    with tempfile.TemporaryDirectory() as out:
        total = args.warmup + args.steps + args.profile + int(args.syncs)
        code = cli.main(["train-drafter", *flags, "--out", str(Path(out) / "run"), "--steps", str(total),
                         "--eval-cuts", "0", "--checkpoint-every", str(total)])
    if code:
        sys.exit(code)
    print(json.dumps(figures, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))


def host_waits(run) -> dict:
    """{where: count} of the synchronizing CUDA calls of run() (torch.cuda.set_sync_debug_mode's warnings), each
    at the innermost line of blockspec on the Python stack (else of torch)."""
    import collections
    import traceback
    import warnings

    counts = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/blockspec/" in f.filename or "/torch/" in f.filename]
        ours = [f for f in frames if "/blockspec/" in f.filename]
        f = (ours or frames or [traceback.FrameSummary(filename, lineno, "")])[-1]
        counts[f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {(f.line or '').strip()[:80]}"] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return dict(counts.most_common())


if __name__ == "__main__":
    main()
