"""How long a user's quantized checkpoint takes to load, how much GPU memory it takes and how fast it decodes, for the
formats users download: a synthetic checkpoint of the preset's shapes (default Qwen3.5-27B) is written in the
published on-disk layout (Hugging Face names, ~4 GB shards + model.safetensors.index.json, config.json with its
quantization_config, a byte-level tokenizer), dropped from the page cache, then loaded by the engine as a user's
download would be (`--model DIR`, mode none) and greedy-decoded twice (the second timed).

Formats: bf16 (dense, bf16 decoding), bf16-int4 (the bf16 checkpoint quantized to INT4 at load), fp8 (block-wise
e4m3, 128 x 128 scales), ct-fp8 (compressed-tensors float-quantized, llm-compressor's FP8_DYNAMIC), gptq (int4, group
128, symmetric, v1 zero points) and awq (GEMM packing, group 128, zero points). The decoder layers' and MTP's
projections are quantized, except linear_attn.in_proj_a / in_proj_b (kept dense, as Qwen3.5 quantization recipes keep
them); embeddings, head, norms, conv1d, A_log and dt_bias stay dense. Per format: checkpoint GB, write s, load s
(Engine construction: read, prepare, CUDA graphs; engine.load_times splits it), GB/s, the loading / decoding peaks
and the estimate (engine/memory.py report), decode tokens/s.

Usage (GPU, repo root; on an H200 for the 27B ~1.5-2 minutes a format, most of it writing and reading the disk:
GPTQ wrote 18.1 GB in 30 s and loaded in 30 s, FP8 30.0 GB in 45 s and 29 s, docs/benchmarks.md; free disk needed:
bf16 ~55 GB, fp8 ~30 GB, gptq / awq ~18 GB, checked before writing):
  python bench/checkpoint_loading.py --format gptq,awq,fp8
CPU check (seconds): python bench/checkpoint_loading.py --preset tiny --format bf16,fp8,gptq,awq --device cpu
JSON to --json-out (default $OUT/checkpoint_loading.json when OUT is set), rewritten after each format.
"""

import argparse
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from blockspec.models.checkpoint import FLOAT32_SUFFIXES  # noqa: E402
from blockspec.cli_common import check_output_path, write_output  # noqa: E402
from blockspec.config import PredictConfig, TargetConfig  # noqa: E402
from blockspec.engine import memory  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.errors import BlockspecError  # noqa: E402
from blockspec.models.mtp import MTPHead  # noqa: E402
from blockspec.models.qwen3_5 import TargetModel  # noqa: E402
from blockspec.quant import fp8  # noqa: E402
from blockspec.fixtures.synthetic import preset  # noqa: E402
from blockspec.fixtures.tiny import CHAT_TEMPLATE, byte_tokenizer  # noqa: E402

GROUP = 128
KEEP_DENSE = ("in_proj_a", "in_proj_b")  # 48 outputs in the 27B: Qwen3.5 quantization recipes leave them dense
NOT_CONVERTED = ["lm_head", "mtp.fc", *(f"linear_attn.{n}" for n in KEEP_DENSE)]
QUANTIZATION = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
            "modules_to_not_convert": NOT_CONVERTED},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True,
            "modules_to_not_convert": NOT_CONVERTED},
    "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
                   "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                         "strategy": "token"}}},
               "ignore": ["lm_head", "re:.*mtp.fc$", *(f"re:.*{n}$" for n in KEEP_DENSE)]},  # FP8_DYNAMIC
}
# format -> (checkpoint written, target_quantization at load, the loaded model's checkpoint_quantization)
LOADS = {"bf16": ("bf16", None, None), "bf16-int4": ("bf16", "int4", None), "fp8": ("fp8", None, "fp8"),
         "ct-fp8": ("ct-fp8", None, "fp8"), "gptq": ("gptq", None, "int4"), "awq": ("awq", None, "int4")}
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.01, "ct-fp8": 1.01, "gptq": 0.53, "awq": 0.53}  # projections + scales
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output AWQ_ORDER[i] of its 8
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def tensor_shapes(config: dict) -> list[tuple[str, tuple]]:
    """(checkpoint name, shape) of every tensor: TargetModel's unpacked parameters and the MTP head's, on meta."""
    target = TargetConfig.from_dict(config)
    with torch.device("meta"):
        model, head = TargetModel(target), MTPHead(target) if target.mtp_num_hidden_layers else None
    names = [(k if k.startswith("lm_head") else "model." + k, tuple(p.shape)) for k, p in model.named_parameters()]
    return names + ([("mtp." + k, tuple(p.shape)) for k, p in head.named_parameters()] if head is not None else [])


def quantized(name: str, shape: tuple, fmt: str) -> bool:
    """Whether `name` is stored quantized in `fmt`: the decoder layers' and MTP's projections but KEEP_DENSE (int4
    also needs whole words of 8 outputs and inputs)."""
    leaf = name.rsplit(".", 2)[-2]
    return (fmt != "bf16" and name.startswith(("model.layers.", "mtp.layers.")) and "proj" in leaf
            and leaf not in KEEP_DENSE and ("fp8" in fmt or (shape[0] % 8 == 0 and shape[1] % 8 == 0)))


def random_tensor(name: str, shape: tuple, gen: torch.Generator, device) -> torch.Tensor:
    """synthetic.randomize_'s values: N(0, 1/fan_in) (embeddings N(0, 1)), zero-centred norms 0 (the DeltaNet's
    gated norm 1), decays in their usual range; output projections x 0.05 (synthetic.scale_outputs_: 64 random
    layers stay finite)."""
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape, device=device)
    if len(shape) == 1:
        return torch.zeros(shape, device=device)
    t = torch.empty(shape, device=device).normal_(0.0, 1.0 if "embed" in name else shape[-1] ** -0.5, generator=gen)
    return t.mul_(0.05) if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else t


def words(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [..., 8m] -> int32 [..., m]: value i of each eight in bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, device=codes.device)
    word = (codes.to(torch.int64).unflatten(-1, (-1, 8)) << shifts).sum(-1)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # bit 31 set: the negative int32 of the same bits


def rtn_int4(w: torch.Tensor, symmetric: bool):
    """Round-to-nearest unsigned codes u [N, K] in 0..15, fp16 scales s and zero points z [N, groups]:
    w ~ (u - z) * s per group of GROUP inputs (symmetric: z = 8, s = max|w| / 7.5)."""
    n, k = w.shape
    blocks = F.pad(w.float(), (0, -k % GROUP)).view(n, -1, GROUP)  # a partial last group padded with zeros
    if symmetric:
        scale = (blocks.abs().amax(-1) / 7.5).clamp(min=1e-5).half()
        zero = torch.full_like(scale, 8, dtype=torch.float32)
    else:
        low, high = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-5).half()
        zero = (-low / scale.float()).round().clamp(0, 15)
    codes = (blocks / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    return codes.view(n, -1)[:, :k], scale, zero


def stored(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors `fmt` stores for weight `name` (values generated in float32)."""
    if not quantized(name, tuple(w.shape), fmt):
        return {name: w if name.endswith(FLOAT32_SUFFIXES) else w.to(torch.bfloat16)}
    module = name[:-len(".weight")]
    if fmt == "fp8":
        q, scale = fp8.quantize(w)
        return {name: q, module + ".weight_scale_inv": scale}
    if fmt == "ct-fp8":  # llm-compressor's FP8_DYNAMIC: one bf16 scale per output channel
        scale = (w.abs().amax(1, keepdim=True) / fp8.FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)
        return {name: (w / scale.float()).to(fp8.FLOAT8), module + ".weight_scale": scale}
    codes, scale, zero = rtn_int4(w, symmetric=fmt == "gptq")
    if fmt == "gptq":  # qweight [K/8, N]: 8 consecutive inputs a word; v1 stores zero - 1
        return {module + ".qweight": words(codes).t(), module + ".qzeros": words((zero - 1).t()),
                module + ".scales": scale.t(),
                module + ".g_idx": torch.arange(w.shape[1], dtype=torch.int32, device=w.device) // GROUP}

    def interleaved(v):  # [R, N] -> [R, N/8], AWQ's output order within each word
        return words(v.unflatten(-1, (-1, 8))[..., AWQ_ORDER].flatten(-2))
    return {module + ".qweight": interleaved(codes.t()), module + ".qzeros": interleaved(zero.t()),
            module + ".scales": scale.t()}


def write_checkpoint(directory: Path, fmt: str, config: dict, device, shard_bytes: int, seed: int = 0) -> int:
    """Writes the checkpoint; returns its bytes. Each tensor is made on `device`, converted, and moved to the host
    at once: the device holds one weight at a time; the host one shard."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer()
    full = {"architectures": ["Qwen3_5ForCausalLM"], **config, "eos_token_id": tok.token_to_id("<|im_end|>"),
            "torch_dtype": "bfloat16"}
    if fmt in QUANTIZATION:
        full["quantization_config"] = QUANTIZATION[fmt]
    (directory / "config.json").write_text(json.dumps(full, indent=2))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))
    gen = torch.Generator(device).manual_seed(seed)
    shards, shard, weight_map = [], {}, {}

    def flush():
        if shard:
            shards.append(f"model-{len(shards) + 1:05d}.safetensors")
            save_file(shard, str(directory / shards[-1]))
            weight_map.update(dict.fromkeys(shard, shards[-1]))
            shard.clear()
    with torch.no_grad():
        for name, shape in tensor_shapes(config):
            for key, t in stored(name, random_tensor(name, shape, gen, device), fmt).items():
                shard[key] = t.contiguous().cpu()
            if sum(t.nbytes for t in shard.values()) >= shard_bytes:
                flush()
        flush()
    names = {old: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, old in enumerate(shards, 1)}
    for old, new in names.items():
        (directory / old).rename(directory / new)
    total = sum((directory / n).stat().st_size for n in names.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in weight_map.items()}}, indent=2))
    return total


def drop_page_cache(directory: Path) -> bool:
    """Ask the kernel to drop the checkpoint's cached pages (written back first), so the load reads the disk.
    Best effort: False when the platform lacks posix_fadvise or it fails."""
    try:
        os.sync()
        for path in directory.iterdir():
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (AttributeError, OSError):
        return False


def free_device():  # what a format left on the device goes back before the next is measured
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gb(value):
    return None if value is None else round(value / 1e9, 3)


def measure(directory: Path, fmt: str, target_quantization, args) -> dict:
    """Load as a user would (Engine with --model DIR), then two greedy generations (the second timed)."""
    settings = {"model": str(directory), "device": args.device, "mode": "none", "compute_dtype": args.dtype,
                "context_length": args.context_length, "load_progress": True}
    if target_quantization:
        settings["target_quantization"] = target_quantization
    start = time.perf_counter()
    engine = Engine(PredictConfig.build(settings, source="bench"))
    load_s = time.perf_counter() - start
    ids = engine.tokenizer.encode(PROMPT)
    warm = engine.generate(ids, args.max_tokens, stop_at_eos=False)
    timed = engine.generate(ids, args.max_tokens, stop_at_eos=False)
    report = memory.report(engine)
    loading_peak = (report.get("loading_peak") or {}).get("peak_allocated_bytes")
    row = {"checkpoint_quantization": engine.model.checkpoint_quantization,
           "target_quantization": engine.target_quantization, "load_s": round(load_s, 3),
           "load_times": engine.load_times.as_dict(), "loading_peak_allocated_gb": gb(loading_peak),
           "decoding_peak_allocated_gb": gb(report.get("peak_allocated_bytes")),
           "estimate_gb": gb((report.get("estimate") or {}).get("needed_bytes")),
           "decode_tokens_per_s": timed.stats["decode_tokens_per_s"],
           "same_tokens_twice": warm.tokens == timed.tokens, "memory": report}
    del engine, warm, timed
    free_device()
    return row


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="gptq,awq,fp8", help=f"comma-separated: {', '.join(LOADS)}")
    p.add_argument("--preset", default="qwen3.5-27b", help="synthetic preset's shapes (qwen3.5-27b or tiny)")
    p.add_argument("--dir", help="where the checkpoints are written (one folder per format; default: a temporary "
                                 "folder under /tmp), removed after each format unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--shard-gb", type=float, default=4.0, help="shard size of the checkpoints written")
    p.add_argument("--json-out", default=os.path.join(os.environ["OUT"], "checkpoint_loading.json")
                   if os.environ.get("OUT") else None)
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.format.split(",") if f.strip()]
    unknown = [f for f in args.formats if f not in LOADS]
    if unknown or not args.formats:
        raise BlockspecError(f"--format {args.format!r}: choose from {', '.join(LOADS)} (comma-separated)")
    if args.max_tokens < 2 or args.shard_gb <= 0:
        raise BlockspecError("--max-tokens must be at least 2 and --shard-gb positive")
    if args.context_length < len(PROMPT.encode()) + args.max_tokens:  # the byte-level tokenizer: a token a byte
        raise BlockspecError(f"--context-length {args.context_length} cannot hold the prompt and --max-tokens")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BlockspecError("--device cuda: no CUDA GPU is available (use --device cpu)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.config = preset(args.preset)
    if args.json_out:  # before any long work: results are never lost to a bad output path
        args.json_out = str(check_output_path("--json-out", args.json_out))
    return args


def check_disk(root: Path, args) -> None:
    """Refuse before writing anything when the checkpoints cannot fit (all of them with --keep, else the largest)."""
    shapes = tensor_shapes(args.config)
    sizes = {LOADS[f][0]: sum(math.prod(s) * (BYTES_PER_WEIGHT[LOADS[f][0]] if quantized(n, s, LOADS[f][0]) else 2)
                              for n, s in shapes) for f in args.formats}
    for fmt in sizes:
        if (root / fmt).exists():
            raise BlockspecError(f"--dir {root}: {root / fmt} exists already; remove it or choose another --dir")
    needed = sum(sizes.values()) if args.keep else max(sizes.values())
    free = shutil.disk_usage(root).free
    if needed > free:
        raise BlockspecError(f"--dir {root}: the checkpoints need ~{needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free")


def run(args) -> int:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="blockspec-ckpt-"))
    made, written, failed = [], {}, False  # made: the folders written, removed at the end (timeout too) unless --keep
    try:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BlockspecError(f"--dir {root}: {exc.strerror or exc}") from None
        check_disk(root, args)
        results = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
                   "context_length": args.context_length, "rows": []}
        print(f"{'format':10s} {'ckpt GB':>8s} {'write s':>8s} {'load s':>8s} {'GB/s':>6s} {'load peak GB':>12s} "
              f"{'estimate GB':>11s} {'tok/s':>8s}", flush=True)
        for i, fmt in enumerate(args.formats):
            kind, target_quantization, expected = LOADS[fmt]
            row = {"format": fmt, "stored_format": kind, "expected_quantization": expected}
            try:
                if kind not in written:  # bf16 and bf16-int4 share one checkpoint
                    made.append(root / kind)
                    start = time.perf_counter()
                    size = write_checkpoint(root / kind, kind, args.config, args.device, int(args.shard_gb * 1e9))
                    os.sync()  # on the disk: the write's time is the whole of it
                    written[kind] = {"checkpoint_bytes": size, "write_s": round(time.perf_counter() - start, 3),
                                     "shards": len(list((root / kind).glob("*.safetensors")))}
                    free_device()
                row.update(written[kind], page_cache_dropped=drop_page_cache(root / kind))
                row.update(measure(root / kind, fmt, target_quantization, args))
                row["gb_per_s"] = round(row["checkpoint_bytes"] / 1e9 / row["load_s"], 3)
                print(f"{fmt:10s} {row['checkpoint_bytes'] / 1e9:8.3f} {row['write_s']:8.1f} {row['load_s']:8.1f} "
                      f"{row['gb_per_s']:6.2f} {row['loading_peak_allocated_gb'] or '-':>12} "
                      f"{row['estimate_gb'] or '-':>11} {row['decode_tokens_per_s']:8.1f}", flush=True)
            except Exception as exc:  # noqa: BLE001  one format's failure (OOM, a refusal) leaves the others measured
                failed = True
                row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                print(f"{fmt:10s} failed: {row['error']}", flush=True)
                free_device()
            results["rows"].append(row)
            if args.json_out:
                write_output(args.json_out, json.dumps(results, indent=2))
            if not args.keep and kind not in {LOADS[f][0] for f in args.formats[i + 1:]}:
                shutil.rmtree(root / kind, ignore_errors=True)  # the disk is freed for the next format
    finally:
        if args.keep:
            print(f"checkpoints kept in {root}")
        else:
            for directory in made:
                shutil.rmtree(directory, ignore_errors=True)
            if not args.dir:
                shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    try:
        return run(parse_args(argv))
    except BlockspecError as exc:
        print(f"blockspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a timeout still removes the folders
    sys.exit(main())
