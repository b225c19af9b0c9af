"""train-drafter on 1, 2, ... processes of one host (torchrun, one GPU each; gloo processes on a CPU-only machine):
the same run, the same global batch and seed, at each process count; block tokens/s, the scaling efficiency
(tokens/s per process over one process's) and how far each loss curve strays from one process's.

Every run writes into its own folder under --work (kept, so a run can be resumed or inspected); the train-drafter
flags after `--` are passed to each run as they are (its --target, --data and the training settings).

--kill-and-resume: then the run of the most processes once more, killed (SIGTERM to its process group) once a
checkpoint past half its steps is written, and resumed with --resume in one process: how far its loss curve strays
from the one-process run's (give --checkpoint-every well under half the steps).

Usage (repo root): python bench/drafter_scaling.py --nproc 1,2,8 --work DIR [--kill-and-resume] [--json-out FILE] --
  --target DIR --data PATH ... --batch-tokens 8192 --steps 200 ...
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def counts(text: str) -> list[int]:
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        sys.exit(f"--nproc: comma-separated process counts (got {text!r})")
    if not values or min(values) < 1 or values[0] != 1:
        sys.exit(f"--nproc must start with 1, the baseline (got {text!r})")
    return values


def command(processes: int, out: Path, train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            "-m", "blockspec", "train-drafter", *train_args, "--out", str(out)]


def failure_report(stderr: str) -> str:
    """The lines of a failed torchrun's stderr that name the failure: what the processes said last (a rank's error
    or abort), which comes before torchrun's own lines, then the end of torchrun's report (its separators left out:
    the lines with words in them)."""
    said = [line for line in stderr.splitlines() if any(c.isalpha() for c in line)]
    report = next((i for i, line in enumerate(said) if "distributed/elastic" in line), len(said))
    return "\n".join(said[max(0, report - 10):report] + ["(torchrun:)"] + said[max(report, len(said) - 12):])


def run(processes: int, out: Path, train_args: list[str]) -> tuple[dict, float]:
    """One train-drafter run under torchrun; its training.json and its wall time."""
    start = time.perf_counter()
    proc = subprocess.run(command(processes, out, train_args), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{processes} processes failed (exit {proc.returncode}):\n" + failure_report(proc.stderr))
    return json.loads((out / "training.json").read_text()), time.perf_counter() - start


def saved_step(out: Path) -> int:
    """The step of the checkpoint in `out` (0: none yet, or one being replaced)."""
    import torch

    try:
        return torch.load(out / "training_state.pt", weights_only=False, map_location="cpu")["step"]
    except (FileNotFoundError, RuntimeError, EOFError):
        return 0


def kill_and_resume(processes: int, out: Path, train_args: list[str], steps: int) -> dict:
    """The run in `processes` processes, killed once a checkpoint past half its steps exists, then resumed in one."""
    proc = subprocess.Popen(command(processes, out, train_args), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    while proc.poll() is None and saved_step(out) <= steps // 2:
        time.sleep(0.5)
    killed_at = saved_step(out)
    if proc.poll() is not None:
        sys.exit(f"the run to kill ended first (exit {proc.returncode}, checkpoint at step {killed_at})")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    summary, _ = run(1, out, [*train_args, "--resume"])
    return {"processes": processes, "killed_after_step": killed_at, "resumed_in": 1,
            "curve": {h["step"]: h["loss"] for h in summary["learning_curve"]}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="1,2", help="process counts, the first 1 (default 1,2)")
    p.add_argument("--work", required=True, help="a new folder: one run's output folder per process count")
    p.add_argument("--kill-and-resume", action="store_true",
                   help="then kill the run of the most processes past half its steps and resume it in one process")
    p.add_argument("--json-out", help="write the figures as JSON")
    args, train_args = p.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    if "--out" in train_args:
        sys.exit("--out is set per run (under --work); leave it out of the train-drafter flags")
    work = Path(args.work)
    work.mkdir(parents=True)
    rows = []
    for n in counts(args.nproc):
        summary, wall = run(n, work / f"nproc{n}", train_args)
        curve = {h["step"]: h["loss"] for h in summary["learning_curve"]}
        row = {"processes": n, "block_tokens_per_s": summary["training_tokens_per_s"], "wall_s": round(wall, 1),
               "final_loss": summary["learning_curve"][-1]["loss"]}
        if rows:
            base = rows[0]
            row["efficiency"] = round(row["block_tokens_per_s"] / (n * base["block_tokens_per_s"]), 3)
            row["loss_max_abs_diff"] = round(max(abs(curve[s] - base["curve"][s]) for s in curve), 4)
        rows.append({**row, "curve": curve})
        print(f"{n} processes: {row['block_tokens_per_s']:.0f} block tokens/s"
              + (f", efficiency {row['efficiency']:.1%}, loss curve within {row['loss_max_abs_diff']}"
                 if n > 1 else "") + f" ({wall:.0f} s)", flush=True)
    figures = {"runs": [{k: v for k, v in r.items() if k != "curve"} for r in rows], "train_args": train_args}
    if args.kill_and_resume:
        steps = max(rows[0]["curve"])
        resumed = kill_and_resume(rows[-1]["processes"], work / "resumed", train_args, steps)
        curve = resumed.pop("curve")
        resumed["loss_max_abs_diff"] = round(max(abs(curve[s] - rows[0]["curve"][s]) for s in curve), 4)
        figures["kill_and_resume"] = resumed
        print(f"{resumed['processes']} processes killed after step {resumed['killed_after_step']}, resumed in one: "
              f"loss curve within {resumed['loss_max_abs_diff']} of one process's", flush=True)
    print(json.dumps(figures, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
